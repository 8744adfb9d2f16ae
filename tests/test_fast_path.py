"""The fast path computes the plain path's numbers: NaLa core, softmax core, block and whole model,
outputs and gradients (fp32, <= 1e-4 relative), zero handling, autocast, fvcore counts, compile."""
import math
import warnings

import pytest
import timm
import torch
import torch.nn.functional as F

import models  # noqa: F401
from models.nala import (
    RoPE,
    apply_rope,
    nala_attention_fast,
    nala_attention_plain,
    rope_phases,
    rotate,
    rotate_adjoint,
    rotate_real,
    softmax_attention_fast,
    softmax_attention_plain,
)

TOL = 1e-4


pytestmark = pytest.mark.usefixtures('one_thread')  # tests/conftest.py


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are exactly zero)."""
    scale = b.abs().max()
    diff = (a - b).abs().max()
    return 0.0 if diff == 0 else (diff / scale).item()


def run_core(fn, base, sin, cos, weight):
    x = base.clone().requires_grad_()
    q, k, v = x.unbind(-2)
    out = fn(q, k, v, sin, cos)
    (out * weight).sum().backward()
    return out.detach(), x.grad


def qkv_with_zeros(batch, heads, tokens, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(batch, heads, tokens, 3, dim, generator=gen)
    base[0, 0, 0, 0] = 0                 # a zero query
    base[0, 0, 1, 0, : dim // 2] = 0     # exact zeros inside a query
    base[0, -1, 2, 1] = 0                # a zero key
    base[-1, 0, 3, 0, 1] = 0
    return base


@pytest.mark.parametrize('batch,heads,height,width,dim', [
    (2, 1, 7, 9, 16), (3, 2, 8, 5, 32), (1, 4, 3, 11, 8), (2, 2, 14, 14, 64)])
def test_nala_fast_core_equals_plain(batch, heads, height, width, dim):
    sin, cos = RoPE(heads * dim, heads)((height, width))
    base = qkv_with_zeros(batch, heads, height * width, dim, seed=height * width)
    weight = torch.randn(batch, heads, height * width, dim, generator=torch.Generator().manual_seed(1))
    out_p, grad_p = run_core(nala_attention_plain, base, sin, cos, weight)
    out_f, grad_f = run_core(nala_attention_fast, base, sin, cos, weight)
    assert torch.isfinite(out_f).all() and torch.isfinite(grad_f).all()
    assert rel_err(out_f, out_p) <= TOL
    for i, name in enumerate('qkv'):
        assert rel_err(grad_f[..., i, :], grad_p[..., i, :]) <= TOL, name


def test_nala_fast_zero_query_row_is_finite_and_matches():
    sin, cos = RoPE(16, 1)((4, 4))
    base = torch.randn(1, 1, 16, 3, 16, generator=torch.Generator().manual_seed(3))
    base[..., 0, :] = 0                                  # every query is zero
    out_f, grad_f = run_core(nala_attention_fast, base, sin, cos, torch.ones(1, 1, 16, 16))
    out_p, grad_p = run_core(nala_attention_plain, base, sin, cos, torch.ones(1, 1, 16, 16))
    assert torch.isfinite(out_f).all() and torch.isfinite(grad_f).all()
    assert torch.equal(grad_f[..., 0, :], torch.zeros_like(grad_f[..., 0, :]))
    assert rel_err(grad_f, grad_p) <= TOL and rel_err(out_f, out_p) <= TOL


@pytest.mark.parametrize('repeat', [1, 2])
@pytest.mark.parametrize('form', ['complex', 'real'])
def test_rotate_is_rope_and_rotate_adjoint_is_its_gradient(repeat, form):
    """Both forms (eager complex, compiled real) against the plain path's apply_rope on each d-wide
    part, and against autograd through it."""
    sin, cos = RoPE(32, 2)((3, 5))
    phases = rope_phases(sin, cos, repeat)
    forward, adjoint = {'complex': (rotate, rotate_adjoint),
                        'real': (rotate_real, lambda g, p: rotate_real(g, p, conjugate=True))}[form]
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 2, 15, 16 * repeat, generator=gen, requires_grad=True)
    g = torch.randn(2, 2, 15, 16 * repeat, generator=gen)
    rope = torch.cat([apply_rope(part, sin, cos) for part in x.split(16, dim=-1)], dim=-1)
    assert rel_err(forward(x, phases), rope) <= 1e-6
    rope.backward(g)
    assert rel_err(adjoint(g, phases), x.grad) <= 1e-6
    assert not torch.allclose(adjoint(g, phases), forward(g, phases))  # the adjoint is not R itself


@pytest.mark.parametrize('kernel', [3, 5, 7])  # CPE/FFN, LePE (its weight gradient from 3x3 ones), 7x7
@pytest.mark.parametrize('channels_last', [True, False])
def test_depthwise_conv_op_equals_conv2d_with_gradients(channels_last, kernel):
    from models.ops import depthwise_conv_same
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 6, 7, 5, generator=gen)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    weight, bias = torch.randn(6, 1, kernel, kernel, generator=gen), torch.randn(6, generator=gen)
    grad = torch.randn(2, 6, 7, 5, generator=gen)
    outs = []
    for fn in (depthwise_conv_same, lambda a, w, b: F.conv2d(a, w, b, 1, kernel // 2, 1, 6)):
        leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
        out = fn(*leaves)
        out.backward(grad)
        outs.append([out.detach()] + [t.grad for t in leaves])
    for mine, ref in zip(*outs):
        assert rel_err(mine, ref) <= 1e-6
    torch.library.opcheck(depthwise_conv_same, (x, weight, bias))


def test_fused_conv_residual_keeps_the_input_dtype_under_autocast():
    """As the plain path's x + conv(x): an fp32 residual stream stays fp32, bf16 activations stay bf16."""
    from models.nalaformer import conv_residual_fast
    conv = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
    x = torch.randn(2, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        for inp in (x, x.bfloat16()):
            out, ref = conv_residual_fast(inp, conv.weight, conv.bias), inp + conv(inp)
            assert out.dtype == ref.dtype == inp.dtype
            assert rel_err(out.float(), ref.float()) <= 2e-2


def outputs_and_grads(fn, inputs, weight):
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    (out * weight).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def test_gated_norm_fast_equals_layer_norm_times_silu():
    """GatedNormFunction (LN(s) * SiLU(g), recomputed in the backward) against the plain expression: output
    and the gradients of s, g, weight and bias; a constant row of s and zeros in g included."""
    from models.nala import gated_norm_fast
    gen = torch.Generator().manual_seed(6)
    s, g = torch.randn(2, 5, 7, 24, generator=gen), torch.randn(2, 5, 7, 24, generator=gen)
    s[0, 0, 0] = 0.5
    g[1, 2, :, :5] = 0
    weight, bias = 1 + 0.1 * torch.randn(24, generator=gen), 0.1 * torch.randn(24, generator=gen)
    grad = torch.randn(2, 5, 7, 24, generator=gen)
    fast = outputs_and_grads(lambda *a: gated_norm_fast(*a, 1e-5), (s, g, weight, bias), grad)
    plain = outputs_and_grads(lambda s, g, w, b: F.layer_norm(s, (24,), w, b, 1e-5) * F.silu(g), (s, g, weight, bias),
                              grad)
    for mine, ref in zip(fast, plain):
        assert rel_err(mine, ref) <= TOL


def test_conv_ffn_fast_equals_the_plain_ffn():
    """ConvFFN on the fast path (GELU, conv and fc2 in one Function that recomputes GELU and the conv in the
    backward) against the plain path: output and every gradient; zeros in the input included."""
    from models.nalaformer import ConvFFN
    torch.manual_seed(7)
    ffn = ConvFFN(12, 40)
    x = torch.randn(2, 6, 5, 12)
    x[0, :2] = 0
    grad = torch.randn(2, 6, 5, 12)
    results = []
    for fast in (True, False):
        ffn.fast_path = fast
        ffn.zero_grad()
        results.append(outputs_and_grads(ffn, (x,), grad) + [p.grad.clone() for p in ffn.parameters()])
    for mine, ref in zip(*results):
        assert rel_err(mine, ref) <= TOL


def test_forward_creates_no_tensor_from_python_data(monkeypatch):
    """No torch.tensor / as_tensor in the forward or backward (on a GPU each is a host-to-device copy)."""
    model = timm.create_model('NALAFORMER_XT')
    x = torch.randn(2, 3, 32, 32)

    def refuse(*args, **kwargs):
        raise AssertionError('the forward made a tensor from Python data')

    for fast_path in (True, False):
        model.set_fast_path(fast_path)
        with monkeypatch.context() as patch:
            patch.setattr(torch, 'tensor', refuse)
            patch.setattr(torch, 'as_tensor', refuse)
            model(x).sum().backward()


def test_nala_fast_core_copies_no_feature_map():
    """The model passes q, k, v as head views of token-major activations (B, N, h, d strides). The
    core may copy these three inputs head-major once in the forward and once in the backward, which
    recomputes from them; everything wider must be made in a layout the batched products take as is (a
    regression here once cost a 4d-wide transposing copy per product)."""
    batch, heads, height, width, dim = 2, 2, 8, 8, 16
    tokens = height * width
    base = torch.randn(batch, tokens, 3, heads, dim)
    q, k, v = (base[:, :, i].transpose(1, 2).detach().requires_grad_() for i in range(3))
    assert not q.is_contiguous()
    sin, cos = RoPE(heads * dim, heads)((height, width))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        out = nala_attention_fast(q, k, v, sin, cos)
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))

    def inside_core(event):
        while event is not None:
            if event.name.startswith('NaLaFastFunction'):
                return True
            event = event.cpu_parent
        return False

    copied = sum(math.prod(e.input_shapes[0]) for e in prof.events()   # (B, h, ...) maps, not (N, d) tables
                 if e.name == 'aten::copy_' and e.input_shapes and e.input_shapes[0][:2] == [batch, heads]
                 and inside_core(e))
    assert 0 < copied <= 2 * 3 * batch * tokens * heads * dim, copied


@pytest.mark.parametrize('heads,height,width,dim', [(1, 5, 7, 16), (3, 6, 4, 32)])
def test_softmax_fast_core_equals_plain(heads, height, width, dim):
    sin, cos = RoPE(heads * dim, heads)((height, width))
    base = torch.randn(2, heads, height * width, 3, dim, generator=torch.Generator().manual_seed(5))
    weight = torch.randn(2, heads, height * width, dim)
    out_p, grad_p = run_core(softmax_attention_plain, base, sin, cos, weight)
    out_f, grad_f = run_core(softmax_attention_fast, base, sin, cos, weight)
    assert rel_err(out_f, out_p) <= TOL and rel_err(grad_f, grad_p) <= TOL


def model_pass(model, x, fast_path, train_bn=False):
    model.set_fast_path(fast_path)
    model.train(train_bn)
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = model(x)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize('name,size', [('NALAFORMER_XT', (48, 64)), ('NALAFORMER_T', (64, 40)),
                                       ('NALAFORMER_XT', (72, 40))])
def test_model_fast_equals_plain_outputs_and_every_gradient(name, size):
    torch.manual_seed(0)
    # layer scales away from 1 and random norms so that every parameter matters
    # no stochastic depth: the two training-mode passes below must see the same network
    model = timm.create_model(name, num_classes=7, layer_scale_init=(0.7, 0.5, 0.3, 0.2), drop_path_rate=0.0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.ndim == 1 and ('norm' in n or n.endswith('ln.weight')):
                p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(2, 3, *size)
    # eval-mode BN: a bias in front of a training-mode BN has a zero gradient, i.e. pure noise
    out_p, xg_p, grads_p = model_pass(model, x, False)
    out_f, xg_f, grads_f = model_pass(model, x, True)
    assert rel_err(out_f, out_p) <= TOL
    assert rel_err(xg_f, xg_p) <= TOL
    assert grads_p.keys() == grads_f.keys()
    worst = max((rel_err(grads_f[n], grads_p[n]), n) for n in grads_p)
    assert worst[0] <= TOL, worst
    # training-mode BN: outputs still agree
    out_p, _, _ = model_pass(model, x, False, train_bn=True)
    out_f, _, _ = model_pass(model, x, True, train_bn=True)
    assert rel_err(out_f, out_p) <= TOL


def record_slices(monkeypatch) -> list:
    """Give batch slicing a 1-byte budget (one image per slice) and record the batch of every block run."""
    from models import nalaformer
    monkeypatch.setattr(nalaformer, 'BATCH_SLICE_BYTES', 1)
    calls = []
    run_blocks = nalaformer.NaLaStage._run_blocks
    monkeypatch.setattr(nalaformer.NaLaStage, '_run_blocks',
                        lambda self, part, sin, cos: calls.append(part.shape[0]) or run_blocks(self, part, sin, cos))
    return calls


def test_batch_slices_give_the_plain_numbers(monkeypatch):
    """With a byte budget below one image, every stage runs its blocks image by image; outputs and
    every gradient still equal the plain path's, and the stage calls its blocks once per image."""
    torch.manual_seed(0)
    model = timm.create_model('NALAFORMER_XT', num_classes=7, layer_scale_init=(0.7, 0.5, 0.3, 0.2))
    x = torch.randn(3, 3, 48, 40)
    out_p, xg_p, grads_p = model_pass(model, x, False)
    calls = record_slices(monkeypatch)
    out_f, xg_f, grads_f = model_pass(model, x, True)
    assert calls == [1] * 3 * len(model.layers)
    assert rel_err(out_f, out_p) <= TOL and rel_err(xg_f, xg_p) <= TOL
    assert max(rel_err(grads_f[n], grads_p[n]) for n in grads_p) <= TOL


def test_batch_slices_follow_the_budget(monkeypatch):
    from models import nalaformer
    x = torch.randn(8, 32, 16, 16)                                 # XT's stage 0: C = 32, widest activation 4C
    per_image = 32 * 16 * 16 * 4 * 4
    monkeypatch.setattr(nalaformer, 'BATCH_SLICE_BYTES', 3 * per_image)
    assert [p.shape[0] for p in nalaformer.batch_slices(x, 4)] == [3, 3, 2]
    assert [p.shape[0] for p in nalaformer.batch_slices(x[:1], 4)] == [1]
    assert [p.shape[0] for p in nalaformer.batch_slices(x[:3], 4)] == [3]
    monkeypatch.setattr(nalaformer, 'BATCH_SLICE_BYTES', 0)
    assert [p.shape[0] for p in nalaformer.batch_slices(x, 4)] == [8]


@pytest.mark.parametrize('fast_path', [True, False], ids=['fast', 'plain'])
def test_batch_slicing_is_its_own_switch_and_changes_no_number(monkeypatch, fast_path):
    """Sliced and unsliced runs give the same outputs and gradients on either path; fast_path does not
    switch slicing, set_batch_slicing(False) does."""
    torch.manual_seed(0)
    model = timm.create_model('NALAFORMER_XT', num_classes=7, layer_scale_init=(0.7, 0.5, 0.3, 0.2),
                              drop_path_rate=0.0)
    x = torch.randn(3, 3, 48, 40)
    calls = record_slices(monkeypatch)
    out_s, xg_s, grads_s = model_pass(model, x, fast_path)
    assert calls == [1] * 3 * len(model.layers)
    calls.clear()
    model.set_batch_slicing(False)
    out_w, xg_w, grads_w = model_pass(model, x, fast_path)
    assert calls == [3] * len(model.layers)
    assert rel_err(out_s, out_w) <= TOL and rel_err(xg_s, xg_w) <= TOL
    assert max(rel_err(grads_s[n], grads_w[n]) for n in grads_w) <= TOL
    with pytest.raises(ValueError, match='batch slicing must be True or False'):
        model.set_batch_slicing('no')


def test_batch_slice_bytes_comes_from_the_environment(monkeypatch):
    from models import nalaformer
    monkeypatch.setenv('NALAFORMER_BATCH_SLICE_BYTES', '0')
    assert nalaformer._batch_slice_bytes_from_env(123) == 0
    monkeypatch.delenv('NALAFORMER_BATCH_SLICE_BYTES')
    assert nalaformer._batch_slice_bytes_from_env(123) == 123
    monkeypatch.setenv('NALAFORMER_BATCH_SLICE_BYTES', '16MB')
    with pytest.raises(ValueError, match="NALAFORMER_BATCH_SLICE_BYTES must be a whole number of bytes.*'16MB'"):
        nalaformer._batch_slice_bytes_from_env(123)


def fast_path_flags(model):
    return {(type(m).__name__, m.fast_path) for m in model.modules() if hasattr(m, 'fast_path')}


def test_fast_path_is_default_and_switches_every_layer():
    layers = {'NaLaFormer', 'PatchEmbed', 'NaLaStage', 'NaLaBlock', 'NaLaAttention', 'SoftmaxAttention', 'ConvFFN'}
    model = timm.create_model('NALAFORMER_XT')
    plain = timm.create_model('NALAFORMER_XT', fast_path=False)
    assert fast_path_flags(model) == {(name, True) for name in layers}
    assert fast_path_flags(plain) == {(name, False) for name in layers}
    model.set_fast_path(False)
    assert fast_path_flags(model) == fast_path_flags(plain)
    model.set_fast_path()
    assert fast_path_flags(model) == {(name, True) for name in layers}
    with pytest.raises(ValueError, match='fast_path must be True or False'):
        model.set_fast_path('plain')
    assert list(model.state_dict()) == list(plain.state_dict())


def test_each_path_runs_its_own_cores_and_convs(monkeypatch):
    """The fast path runs the fast attention cores and the custom depthwise op, the plain path neither
    (so that comparing the two compares different code)."""
    from models import nala, nalaformer
    calls = []

    def spy(fn, tag):
        def call(*args):
            calls.append(tag)
            return fn(*args)
        return call

    for kind in ('nala', 'softmax'):
        for path in ('plain', 'fast'):
            name = f'{kind}_attention_{path}'
            monkeypatch.setattr(nala, name, spy(getattr(nala, name), name))
    for module in (nala, nalaformer):
        monkeypatch.setattr(module, 'depthwise_conv_same', spy(module.depthwise_conv_same, 'depthwise_conv_same'))
    model = timm.create_model('NALAFORMER_XT').eval()
    x = torch.randn(1, 3, 32, 32)
    for fast_path in (True, False):
        calls.clear()
        model.set_fast_path(fast_path)
        with torch.no_grad():
            model(x)
        path = 'fast' if fast_path else 'plain'
        # per block: one attention core; the custom op for both CPEs, LePE and the FFN's conv
        assert sorted(set(calls) - {'depthwise_conv_same'}) == [f'nala_attention_{path}', f'softmax_attention_{path}']
        assert len(calls) == 8 + (4 * 8 if fast_path else 0)


def test_analysis_hooks_see_the_fast_path():
    """attn.qkvg output, num_heads, head_dim and stage.RoPE((H, W)) keep their meaning."""
    model = timm.create_model('NALAFORMER_XT').eval()
    seen = []
    attn = model.layers[1].blocks[0].attn
    handle = attn.qkvg.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with torch.no_grad():
        model(torch.randn(1, 3, 64, 96))
    handle.remove()
    assert seen == [torch.Size([1, 8, 12, 4 * attn.num_heads * attn.head_dim])]
    sin, cos = model.layers[1].RoPE((8, 12))
    assert sin.shape == cos.shape == (96, attn.head_dim)


def test_fvcore_counts_are_identical():
    from models.flop_count import count_flops
    model = timm.create_model('NALAFORMER_XT')
    fast = count_flops(model, (3, 64, 96))
    model.set_fast_path(False)
    assert count_flops(model, (3, 64, 96)) == fast


def test_grad_checkpointing_and_layouts_give_the_same_numbers():
    torch.manual_seed(0)
    model = timm.create_model('NALAFORMER_XT', num_classes=5).eval()
    x = torch.randn(2, 3, 32, 48)
    out, xg, grads = model_pass(model, x, True)
    model.set_grad_checkpointing(True)
    out_c, xg_c, grads_c = model_pass(model, x.contiguous(memory_format=torch.channels_last), True)
    assert rel_err(out_c, out) <= TOL and rel_err(xg_c, xg) <= TOL
    assert max(rel_err(grads_c[n], grads[n]) for n in grads) <= TOL


def test_no_graph_breaks_under_torch_compile():
    import torch._dynamo as dynamo
    dynamo.reset()
    model = timm.create_model('NALAFORMER_XT', num_classes=5)
    x = torch.randn(2, 3, 32, 48)
    with warnings.catch_warnings():
        warnings.simplefilter('error', DeprecationWarning)
        # torch 2.4's Dynamo instantiates autograd Functions itself and warns about it (not our code)
        warnings.filterwarnings('ignore', '.*should not be instantiated', DeprecationWarning)
        explanation = dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    dynamo.reset()


def test_compiled_graphs_hold_no_complex_tensors():
    """Inductor cannot generate code for complex tensors (it warns and falls back), so under
    torch.compile the rotations must run in real arithmetic, in the forward and the backward graph."""
    import torch._dynamo as dynamo
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    dtypes = set()

    def record(graph_module, example_inputs):
        for node in graph_module.graph.nodes:
            value = node.meta.get('val')
            if isinstance(value, torch.Tensor):
                dtypes.add(value.dtype)
        return make_boxed_func(graph_module.forward)

    dynamo.reset()
    model = timm.create_model('NALAFORMER_XT', num_classes=5, drop_path_rate=0.0)  # same network in both passes
    x = torch.randn(2, 3, 32, 48)
    out = torch.compile(model, backend=aot_autograd(fw_compiler=record, bw_compiler=record))(x)
    out.sum().backward()
    dynamo.reset()
    assert torch.float32 in dtypes and not any(dtype.is_complex for dtype in dtypes), dtypes
    assert rel_err(out, model(x)) <= TOL


@pytest.mark.parametrize('name', ['NALAFORMER_XT', 'NALAFORMER_T'])
def test_model_fast_inference_equals_plain(name, monkeypatch):
    """No-grad eval forward, channels-last stem and batch slices included: the plain path's outputs."""
    from models import nalaformer
    monkeypatch.setattr(nalaformer, 'BATCH_SLICE_BYTES', 1)
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=7, layer_scale_init=(0.7, 0.5, 0.3, 0.2)).eval()
    x = torch.randn(3, 3, 64, 48)
    with torch.no_grad():
        fast = model(x)
        model.set_fast_path(False)
        plain = model(x)
    assert rel_err(fast, plain) <= TOL
