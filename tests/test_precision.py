"""Precision under autocast (docs/method.md#precision): the attention frame computes in the autocast dtype on
both paths, with float32 kept for the normaliser and LayerNorm's statistics; AMP parity between the paths;
logits and a short training run against fp32."""
import types
import warnings

import pytest
import timm
import torch
import torch.nn.functional as F
from helpers.reference_impl import read_keys, seeded_state_dict
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import models  # noqa: F401
from models import ops
from models.nala import NaLaAttention, RoPE, SoftmaxAttention
from models.nalaformer import NaLaFormer

pytestmark = pytest.mark.usefixtures('one_thread')  # tests/conftest.py

AMP_DTYPES = [torch.bfloat16, torch.float16]
#: Relative error (Frobenius) of the logits of the name-seeded XT weights at 224 px under autocast against
#: fp32, either path. Measured 4.1e-3 to 5.8e-3 (bf16) and 5.6e-4 to 7.0e-4 (fp16) over three inputs
#: (docs/method.md#precision); the bounds leave about 2x.
LOGIT_TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1.5e-3}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


class OpLog(TorchDispatchMode):
    """Every op that runs below autograd, with its tensor inputs' and outputs' dtypes and shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.ops.append((func.__name__.split('.')[0], [(t.dtype, t.shape) for t in tensors],
                         [(t.dtype, t.shape) for t in outs]))
        return out


PRODUCT_NAMES = ('mm', 'bmm', 'addmm', 'baddbmm', 'convolution', 'depthwise_conv_same', 'scaled_dot_product')


def is_product(name: str) -> bool:
    return any(name == p or name.startswith(f'_{p}') or (p == 'scaled_dot_product' and p in name)
               for p in PRODUCT_NAMES) or name.startswith('convolution')


def attention(kind: str, fast: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    attn = (NaLaAttention if kind == 'nala' else SoftmaxAttention)(32, 2)
    attn.fast_path = fast
    return attn


def run_logged(attn: torch.nn.Module, dtype: torch.dtype) -> tuple[OpLog, torch.Tensor]:
    sin, cos = RoPE(32, 2)((6, 5))
    x = torch.randn(2, 6, 5, 32, requires_grad=True)                            # (B, H, W, C) tokens
    log = OpLog()
    with log:
        with torch.autocast('cpu', dtype=dtype):
            out = attn(x, sin, cos)
        out.float().square().sum().backward()
    return log, out


@pytest.mark.parametrize('dtype', AMP_DTYPES, ids=['bf16', 'fp16'])
@pytest.mark.parametrize('fast', [True, False], ids=['fast', 'plain'])
@pytest.mark.parametrize('kind', ['nala', 'softmax'])
def test_attention_frame_computes_in_the_autocast_dtype(kind, fast, dtype):
    """Forward and backward under CPU autocast: the products (projections, LePE, the NaLa products, SDPA,
    their gradients) run on operands of the autocast dtype; float32 products are only those with a vector
    operand (the NaLa normaliser and its gradient, O(N d) work); LayerNorm
    runs on the autocast dtype and keeps float32 statistics; the module returns the autocast dtype."""
    log, out = run_logged(attention(kind, fast), dtype)
    assert out.dtype == dtype
    products = [(name, [(d, shape) for d, shape in ins if len(shape) > 1 and not (  # matrix operands
        'scaled_dot_product' in name and d == torch.float32)])                 # but SDPA's log-sum-exp
        for name, ins, _ in log.ops if is_product(name)]
    in_dtype = [p for p in products if all(d == dtype for d, _ in p[1])]
    wide = [p for p in products if p not in in_dtype]
    assert all(d == torch.float32 for _, ins in wide for d, _ in ins), wide
    assert all(any(1 in shape[-2:] for _, shape in ins) for _, ins in wide), wide  # with a vector: O(N d)
    assert len(in_dtype) >= 8 and len(wide) >= (2 if kind == 'nala' else 0), products
    norms = [(ins, outs) for name, ins, outs in log.ops if name == 'native_layer_norm']
    assert norms and all(ins[0][0] == dtype and [o[0] for o in outs] == [dtype, torch.float32, torch.float32]
                         for ins, outs in norms), norms


def saved_bytes(fn, module: torch.nn.Module) -> dict[torch.dtype, int]:
    """Bytes of the distinct storages that autograd saves while ``fn`` runs, by dtype; ``module``'s
    parameters excluded."""
    seen = {p.untyped_storage().data_ptr() for p in module.parameters()}
    sizes = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            sizes[t.dtype] = sizes.get(t.dtype, 0) + t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


def saved_per_image(module: torch.nn.Module, dtype: torch.dtype, *args) -> dict[torch.dtype, int]:
    """What one more image adds to the bytes saved for the backward of ``module`` (tokens (B, 6, 5, C))
    under ``dtype`` autocast, by dtype: the saved activations without the tables and the weights' casts."""
    sizes = []
    for batch in (2, 3):
        x = torch.randn(batch, 6, 5, module.fc1.in_features if hasattr(module, 'fc1') else module.dim,
                        requires_grad=True)
        with torch.autocast('cpu', dtype=dtype, enabled=dtype != torch.float32):
            sizes.append(saved_bytes(lambda x=x: module(x, *args), module))
    return {d: sizes[1].get(d, 0) - sizes[0].get(d, 0) for d in sizes[1] if sizes[1].get(d, 0) - sizes[0].get(d, 0)}


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('kind', ['nala', 'softmax'])
def test_fast_attention_saves_only_the_frame_maps(kind, dtype):
    """Per image the fast frame saves, of C-channel maps in the compute dtype: its input (cast), the qkvg
    output (4), LN's input and the gated output (out_proj's input), and for softmax SDPA's rotated q, k
    and its output (3); the NaLa core adds only kv (2d x d per head) and float32 per-token values (mean K,
    the normaliser), SDPA its log-sum-exp, LN its two statistics. No float32 map under autocast."""
    heads, dim, tokens, head_dim = 2, 32, 30, 16
    size = dtype.itemsize
    stats = {'nala': heads * 2 * head_dim * 4 + heads * tokens * 4, 'softmax': heads * tokens * 4}[kind]
    stats += 2 * tokens * 4                                                     # LN's mean and 1/std
    maps = {'nala': 7, 'softmax': 10}[kind] * tokens * dim * size
    maps += {'nala': heads * 2 * head_dim * head_dim * size, 'softmax': 0}[kind]  # kv
    expected = {dtype: maps, torch.float32: stats} if dtype != torch.float32 else {dtype: maps + stats}
    assert saved_per_image(attention(kind, True), dtype, *RoPE(dim, heads)((6, 5))) == expected


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
def test_fast_ffn_saves_only_fc1_input_and_output(dtype):
    from models.nalaformer import ConvFFN
    torch.manual_seed(0)
    assert saved_per_image(ConvFFN(16, 64), dtype) == {dtype: (16 + 64) * 30 * dtype.itemsize}


def test_gpu_region_choices_with_a_stand_in_cuda_tensor(monkeypatch):
    """No GPU here; the frame's only device-dependent choices, with a stand-in CUDA tensor: the region turns
    CUDA's autocast off, and LayerNorm gets parameters of its input's dtype (CUDA's kernel needs that and
    keeps float32 statistics itself); on a CPU it gets the float32 parameters, which keep its statistics
    float32. Everything else in the region follows the dtype of the qkvg output, as the CPU tests check."""
    regions = []
    monkeypatch.setattr(ops, 'is_fx_symbolic_tracing', lambda: False)
    monkeypatch.setattr(torch, 'autocast', lambda **kwargs: regions.append(kwargs) or 'region')
    for dtype in AMP_DTYPES:
        cuda_x = types.SimpleNamespace(device=torch.device('cuda', 0), dtype=dtype)
        assert ops.autocast_off(cuda_x) == 'region'
        weight, bias = ops.norm_params(torch.ones(4), torch.zeros(4), cuda_x)
        assert weight.dtype == bias.dtype == dtype
        weight, bias = ops.norm_params(torch.ones(4), torch.zeros(4), torch.ones(1, dtype=dtype))
        assert weight.dtype == bias.dtype == torch.float32
    assert regions == [dict(device_type='cuda', enabled=False)] * 2


@pytest.mark.parametrize('variant', ['NALAFORMER_XT', 'NALAFORMER_T', 'NALAFORMER_S', 'NALAFORMER_B', 'NALAFORMER_L'])
def test_amp_fast_path_keeps_the_residual_stream_fp32(variant):
    """Under CPU bf16 autocast, one block per stage with the variant's own layer scale: the residual
    stream is fp32 on both paths, and fast differs from plain by no more than plain from fp32."""
    from tools.amp_parity import AMP_TOLERANCE, amp_path_parity
    for row in amp_path_parity(variant):
        assert row['stream_dtypes'] == ['float32'] * 4, row
        assert row['fast_vs_plain'] <= AMP_TOLERANCE * row['plain_vs_fp32'], row
        assert row['ok']


def test_amp_parity_holds_in_fp16():
    from tools.amp_parity import amp_path_parity
    assert all(row['ok'] for row in amp_path_parity('NALAFORMER_T', dtype=torch.float16))


@pytest.mark.parametrize('dtype,loss_scale', [(torch.bfloat16, 1.0), (torch.float16, 256.0)], ids=['bf16', 'fp16'])
def test_gradients_under_autocast_follow_the_amp_parity_rule(dtype, loss_scale):
    """Every parameter's gradient of a small XT under autocast, all of them as one vector: the fast path is no
    further from the fp32 gradients than the plain path (AMP_TOLERANCE). The two paths round differently, so
    their distance from each other is up to about sqrt(2) times either one's from fp32 where the CPU computes
    in fp16 natively (AVX512-FP16); their distance from fp32 is the precision a user gets. fp16 with a loss
    scale, as GradScaler trains it: without one, gradients this small underflow fp16 on either path."""
    from tools.amp_parity import AMP_TOLERANCE
    torch.manual_seed(0)
    model = timm.create_model('NALAFORMER_XT', num_classes=7, drop_path_rate=0.0,
                              layer_scale_init=(0.7, 0.5, 0.3, 0.2))
    x = torch.randn(2, 3, 64, 48)

    def gradients(fast: bool, amp: torch.dtype | None) -> torch.Tensor:
        model.set_fast_path(fast)
        model.zero_grad()
        with torch.autocast('cpu', dtype=amp or dtype, enabled=amp is not None):
            out = model(x)
        (out.float() * torch.linspace(-1, 1, 7) * loss_scale).sum().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()]) / loss_scale

    ref, plain, fast = gradients(False, None), gradients(False, dtype), gradients(True, dtype)
    assert torch.isfinite(fast).all()
    assert rel_err(fast, ref) <= AMP_TOLERANCE * rel_err(plain, ref), (rel_err(fast, ref), rel_err(plain, ref))


@pytest.fixture(scope='module')
def seeded_xt():
    model = timm.create_model('NALAFORMER_XT').eval()
    model.load_state_dict(seeded_state_dict(read_keys('tests/reference/NALAFORMER_XT.keys.txt')))
    return model


@pytest.mark.parametrize('dtype', AMP_DTYPES, ids=['bf16', 'fp16'])
def test_logits_under_autocast_stay_within_the_documented_tolerance(seeded_xt, dtype):
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        seeded_xt.set_fast_path(True)
        ref = seeded_xt(x)
        for fast in (True, False):
            seeded_xt.set_fast_path(fast)
            with torch.autocast('cpu', dtype=dtype):
                out = seeded_xt(x)
            assert torch.isfinite(out).all()
            assert rel_err(out, ref) <= LOGIT_TOLERANCE[dtype], (fast, rel_err(out, ref))
            assert torch.equal(out.argmax(-1), ref.argmax(-1))


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The embedded digits of the DIGITS data set (sklearn's), 32 px, 3 channels, standardised."""
    from sklearn.datasets import load_digits
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32)[:, None] / 16
    x = F.interpolate(x, size=32, mode='bicubic', align_corners=False).expand(-1, 3, -1, -1)
    return (x - x.mean()) / x.std(), torch.tensor(data.target)


def loss_curve(x, y, seed: int, dtype: torch.dtype | None, steps: int = 30, batch: int = 32) -> torch.Tensor:
    """Per-step training losses of a tiny NaLaFormer (AdamW), mean per 10 steps."""
    torch.manual_seed(seed)
    model = NaLaFormer(num_classes=10, embed_dims=(16, 32, 32, 32), depths=(1, 1, 1, 1), num_heads=(1, 1, 2, 2),
                       mlp_ratio=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    order = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, len(y), (batch,), generator=order)
        with torch.autocast('cpu', dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = F.cross_entropy(model(x[idx]), y[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return torch.tensor(losses).unflatten(0, (-1, 10)).mean(1)


def test_bf16_training_loss_follows_fp32_within_seed_noise():
    """30 steps on the digits from one initialisation and batch order, fp32 and bf16 autocast: the bf16
    curve (means of 10 steps) stays closer to the fp32 one than fp32 with another seed does, and both learn."""
    x, y = digits()
    with warnings.catch_warnings():
        warnings.simplefilter('error')                                         # no autocast or dtype warnings
        fp32, bf16 = loss_curve(x, y, 0, None), loss_curve(x, y, 0, torch.bfloat16)
    other_seed = loss_curve(x, y, 1, None)
    assert bf16[-1] < 0.4 * bf16[0] and fp32[-1] < 0.4 * fp32[0]
    seed_noise = (fp32 - other_seed)[1:].abs().max()
    assert (bf16 - fp32)[1:].abs().max() <= seed_noise, (fp32, bf16, other_seed)
