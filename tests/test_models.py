"""Model zoo: faithfulness to the reference, the NaLa math, and the timm API (timm's own model checks:
test_timm_contract.py)."""
import json
import math
import os

import pytest
import timm
import timm.optim
import torch
import torch.nn.functional as F
from conftest import REPO
from helpers.reference_impl import read_keys, reference_forward, seeded_state_dict

from models import VARIANTS
from models.flop_count import count_flops, count_params
from models.nala import NALA_EPS, RoPE, apply_rope, nala_attention_fast, nala_attention_plain, nala_kernel_terms
from models.nalaformer import from_reference_layout, to_reference_layout

NALA_CORES = pytest.mark.parametrize('core', [nala_attention_plain, nala_attention_fast], ids=['plain', 'fast'])

SHARED_REFERENCE = os.path.join(os.path.dirname(REPO), 'shared', 'reference')
# Copies of the reference key lists (docs/method.md#reference-test-vector), so the layout tests never depend
# on ../shared.
KEYS_DIR = os.path.join(REPO, 'tests', 'reference')


def keys_file(variant):
    return os.path.join(KEYS_DIR, f'{variant}.keys.txt')


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope='module')
def xt_seeded(tmp_path_factory):
    """The name-seeded XT weights saved as a bare reference state dict file."""
    sd = seeded_state_dict(read_keys(keys_file('NALAFORMER_XT')))
    path = tmp_path_factory.mktemp('ckpt') / 'xt_seeded.pth'
    torch.save(sd, path)
    return sd, str(path)


# ---- faithfulness -----------------------------------------------------------------------------

@pytest.mark.parametrize('variant', list(VARIANTS))
def test_state_dict_layout_matches_reference(variant):
    """In the reference layout (``to_reference_layout``) the keys, their order, shapes and dtypes are the
    reference's; ``from_reference_layout`` maps them back onto the model's own keys and order."""
    rows = read_keys(keys_file(variant))
    own = timm.create_model(variant).state_dict()
    sd = to_reference_layout(own)
    assert list(sd) == [r[0] for r in rows]
    assert list(from_reference_layout(sd)) == list(own)
    for key, shape, dtype in rows:
        assert tuple(sd[key].shape) == shape, key
        assert str(sd[key].dtype) == f'torch.{dtype}', key


def test_reference_test_vector():
    """The reference model's logits for the name-seeded XT weights (docs/method.md#reference-test-vector)."""
    candidates = [os.path.join(d, 'NALAFORMER_XT_224_logits.json') for d in (KEYS_DIR, SHARED_REFERENCE)]
    path = next((p for p in candidates if os.path.exists(p)), None)
    if path is None:
        pytest.skip('NALAFORMER_XT_224_logits.json is not shipped (looked in tests/reference and '
                    '../shared/reference); test_matches_independent_reference covers the same weights and input')
    with open(path) as f:
        data = json.load(f)
    expected = torch.tensor(data['logits'] if isinstance(data, dict) else data, dtype=torch.float32)
    sd = seeded_state_dict(read_keys(keys_file('NALAFORMER_XT')))
    model = timm.create_model('NALAFORMER_XT').eval()
    model.load_state_dict(sd, strict=True)
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(model(x), expected.reshape(2, -1)) <= 1e-4


@pytest.mark.parametrize('size', [(224, 224), (32, 32), (96, 40), (45, 77)])
@pytest.mark.parametrize('fast_path', [True, False], ids=['fast', 'plain'])
def test_matches_independent_reference(xt_seeded, size, fast_path):
    """Seeded weights loaded through timm's checkpoint_path give the reference's logits."""
    sd, path = xt_seeded
    model = timm.create_model('NALAFORMER_XT', checkpoint_path=path, fast_path=fast_path).eval()
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(model(x), reference_forward(sd, 'NALAFORMER_XT', x)) <= 1e-4


@pytest.mark.parametrize('variant', ['NALAFORMER_T', 'NALAFORMER_S', 'NALAFORMER_L'])
def test_other_variants_match_independent_reference(variant):
    sd = seeded_state_dict(read_keys(keys_file(variant)))
    model = timm.create_model(variant).eval()
    model.load_state_dict(sd, strict=True)
    x = torch.randn(1, 3, 64, 48, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel_err(model(x), reference_forward(sd, variant, x)) <= 1e-4


REFERENCE_FIGURES = {  # params (M), fvcore GFLOPs of the reference model at 224 (docs/method.md#variants)
    'NALAFORMER_XT': (6.14, 0.652), 'NALAFORMER_T': (15.91, 2.875), 'NALAFORMER_S': (25.65, 5.065),
    'NALAFORMER_B': (52.00, 11.792), 'NALAFORMER_L': (95.43, 17.748),
}


@pytest.mark.parametrize('variant', list(VARIANTS))
def test_params_and_fvcore_flops_match_reference(variant):
    model = timm.create_model(variant)
    params, gflops = REFERENCE_FIGURES[variant]
    assert count_params(model) / 1e6 == pytest.approx(params, abs=0.006)
    assert count_flops(model) / 1e9 == pytest.approx(gflops, rel=0.01)


# ---- the NaLa math ---------------------------------------------------------------------------

def random_qkv(batch=2, heads=2, hw=(5, 7), d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = hw[0] * hw[1]
    return [torch.randn(batch, heads, n, d, generator=g, dtype=torch.float64) for _ in range(3)]


def explicit_nala(q, k, v, sin, cos):
    """The same kernel as an explicit N x N matrix: A_ij = Q~_i.K~_j / (N (Q_i.Kbar + eps))."""
    d = q.shape[-1]
    q_feat, k_feat = nala_kernel_terms(q, k)

    def rope2(t):
        return torch.cat([apply_rope(t[..., :d], sin, cos), apply_rope(t[..., d:], sin, cos)], -1)

    n = q.shape[-2]
    denom = n * (q_feat @ k_feat.mean(-2, keepdim=True).transpose(-2, -1) + NALA_EPS)
    attn = (rope2(q_feat) @ rope2(k_feat).transpose(-2, -1)) / denom
    return attn @ v


@pytest.mark.parametrize('hw', [(1, 1), (4, 4), (5, 7), (14, 9)])
@NALA_CORES
def test_linear_time_equals_explicit_matrix(hw, core):
    q, k, v = random_qkv(hw=hw)
    sin, cos = (t.double() for t in RoPE(32, 2)(hw))
    expected = explicit_nala(q, k, v, sin, cos)
    got = core(q.float(), k.float(), v.float(), sin.float(), cos.float())
    assert rel_err(got.double(), expected) <= 1e-4


def test_rope_tables_match_reference():
    rope = RoPE(64, 4)                                    # d = 16, m = 4
    omega = 10000 ** -(torch.arange(4) / 3)
    assert torch.allclose(rope.angle, omega.repeat_interleave(2))
    sin, cos = rope((3, 5))
    row, col = 2, 3
    theta = torch.cat([row * rope.angle, col * rope.angle])
    assert torch.allclose(sin[row * 5 + col], theta.sin()) and torch.allclose(cos[row * 5 + col], theta.cos())
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert torch.equal(apply_rope(x, torch.ones(4), torch.zeros(4)), torch.tensor([-2.0, 1.0, -4.0, 3.0]))


def implied_rows(q, k):
    """NaLa attention rows without RoPE: Q_i.K_j normalised over j."""
    q_feat, k_feat = nala_kernel_terms(q, k)
    scores = q_feat @ k_feat.transpose(-2, -1)
    return scores / scores.sum(-1, keepdim=True)


def entropy(rows):
    return -(rows * torch.log(rows.clamp_min(1e-30))).sum(-1)


def test_query_norm_controls_spikiness():
    """Longer queries give spikier NaLa rows; plain ReLU linear attention cannot see the norm."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 1, 256, 16, generator=g, dtype=torch.float64)
    direction = F.normalize(torch.randn(1, 1, 64, 16, generator=g, dtype=torch.float64), dim=-1)
    nala_entropy, relu_rows = [], []
    for norm in (0.1, 0.3, 1.0, 3.0):
        rows = implied_rows(norm * direction, k)
        assert (rows >= 0).all()
        assert torch.allclose(rows.sum(-1), torch.ones(1, 1, 64, dtype=torch.float64))
        nala_entropy.append(entropy(rows).mean().item())
        relu_scores = F.relu(norm * direction) @ F.relu(k).transpose(-2, -1)
        relu_rows.append(relu_scores / relu_scores.sum(-1, keepdim=True))
    assert all(a > b for a, b in zip(nala_entropy, nala_entropy[1:])), nala_entropy
    for rows in relu_rows[1:]:
        assert torch.allclose(rows, relu_rows[0])


@NALA_CORES
def test_zero_queries_and_relu_zeros_stay_finite(core):
    q, k, v = (t.float().requires_grad_() for t in random_qkv())
    with torch.no_grad():
        q[:, :, :3] = 0                                   # whole zero query vectors
    sin, cos = RoPE(32, 2)((5, 7))
    out = core(q, k, v, sin, cos)
    assert torch.isfinite(out).all() and (out[:, :, :3] == 0).all()
    out.square().sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


def test_zero_input_image_is_finite():
    model = timm.create_model('NALAFORMER_XT', num_classes=3)
    model.patch_embed.proj[-1].bias.data.zero_()
    x = torch.zeros(2, 3, 32, 32, requires_grad=True)
    for stage in model.layers[:2]:                        # make the first blocks see all-zero queries
        for block in stage.blocks:
            block.attn.qkvg.bias.data.zero_()
    out = model(x)
    out.sum().backward()
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# ---- model behaviour -------------------------------------------------------------------------

def test_gradients_reach_every_parameter():
    # no drop path: with two images a block drops for both with a few percent chance and gets no gradient
    model = timm.create_model('NALAFORMER_XT', num_classes=5, drop_path_rate=0.0)
    model(torch.randn(2, 3, 48, 64, generator=torch.Generator().manual_seed(0))).logsumexp(-1).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


def test_batch_independence_in_eval():
    model = timm.create_model('NALAFORMER_XT', num_classes=5).eval()
    x = torch.randn(4, 3, 64, 64)
    with torch.no_grad():
        full = model(x)
        x2 = x.clone()
        x2[1:] = torch.randn(3, 3, 64, 64) * 10
        assert torch.allclose(model(x2)[0], full[0], atol=1e-5)
        assert torch.allclose(model(x[:1])[0], full[0], atol=1e-5)


@pytest.mark.parametrize('variant', list(VARIANTS))
def test_every_variant_trains_and_round_trips(variant, tmp_path):
    model = timm.create_model(variant, num_classes=7)
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 7)
    out.sum().backward()
    path = tmp_path / 'sd.pth'
    torch.save(model.state_dict(), path)
    clone = timm.create_model(variant, num_classes=7)
    clone.load_state_dict(torch.load(path, weights_only=True), strict=True)
    x = torch.randn(1, 3, 32, 32)
    model.eval(), clone.eval()
    with torch.no_grad():
        assert torch.equal(model(x), clone(x))


# ---- timm API --------------------------------------------------------------------------------

def test_create_model_kwargs_reach_the_model():
    model = timm.create_model('NALAFORMER_T', num_classes=10, drop_path_rate=0.2, in_chans=1, drop_rate=0.3)
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 10)
    assert model.patch_embed.proj[0].in_channels == 1
    rates = [getattr(b.drop_path, 'drop_prob', 0.0) for s in model.layers for b in s.blocks]
    assert rates == pytest.approx([0.2 * i / 11 for i in range(12)])  # linear over all blocks, in block order
    assert model.head_drop.p == 0.3
    assert 'nalaformer_xt' in timm.list_models('nalaformer*') and 'NALAFORMER_L' in timm.list_models('NALAFORMER*')


def test_every_row_of_the_variant_table_is_registered_under_both_names():
    """The table is the one place a variant is defined: each row is a timm model (capitals and lowercase),
    with its pretrained cfg and an entry point named after it, building the row's architecture."""
    import models.nalaformer as family
    from models.nalaformer import MODEL_NAMES, PAPER_FIGURES
    assert set(MODEL_NAMES) == set(VARIANTS) | {v.lower() for v in VARIANTS}
    assert set(timm.list_models(['NALAFORMER*', 'nalaformer*'])) == set(MODEL_NAMES)
    assert PAPER_FIGURES == {name: row['paper'] for name, row in VARIANTS.items()}
    for name in MODEL_NAMES:
        assert timm.models.get_pretrained_cfg(name).architecture == name
        assert getattr(family, name).__name__ == name
    model = timm.create_model('nalaformer_s')
    assert [len(s.blocks) for s in model.layers] == list(VARIANTS['NALAFORMER_S']['depths'])


def test_pretrained_cfg():
    model = timm.create_model('nalaformer_s')
    cfg = model.pretrained_cfg
    assert cfg['mean'] == (0.485, 0.456, 0.406) and cfg['std'] == (0.229, 0.224, 0.225)
    assert cfg['crop_pct'] == 0.875 and cfg['interpolation'] == 'bicubic' and cfg['input_size'] == (3, 224, 224)
    assert isinstance(model.get_submodule(cfg['first_conv']), torch.nn.Conv2d)
    assert model.get_submodule(cfg['classifier']) is model.get_classifier()
    data_cfg = timm.data.resolve_data_config({}, model=model)
    assert data_cfg['crop_pct'] == 0.875


def test_forward_features_head_and_classifier():
    model = timm.create_model('NALAFORMER_XT').eval()
    x = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        feats = model.forward_features(x)
        assert feats.shape == (2, 384, 2, 3)
        pre = model.forward_head(feats, pre_logits=True)
        assert pre.shape == (2, model.head_hidden_size)
        assert torch.allclose(model.get_classifier()(pre[:, :, None, None]).flatten(1), model(x), atol=1e-5)
        model.reset_classifier(3)
        assert model(x).shape == (2, 3) and model.get_classifier().out_channels == 3
        model.reset_classifier(0)
        assert torch.allclose(model(x), pre, atol=1e-5)


def saved_tensor_bytes(model, x):
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    return out, total


def test_grad_checkpointing_same_results_less_memory():
    torch.manual_seed(0)
    model = timm.create_model('NALAFORMER_XT', num_classes=4).eval()   # eval: no drop path randomness
    x = torch.randn(2, 3, 64, 64)
    out_plain, bytes_plain = saved_tensor_bytes(model, x)
    out_plain.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_grad_checkpointing(True)
    out_ckpt, bytes_ckpt = saved_tensor_bytes(model, x)
    out_ckpt.sum().backward()
    assert torch.equal(out_plain, out_ckpt)
    assert all(torch.allclose(grads[n], p.grad, rtol=1e-5, atol=1e-7) for n, p in model.named_parameters())
    assert bytes_ckpt < 0.5 * bytes_plain


def test_features_only():
    model = timm.create_model('NALAFORMER_S', features_only=True).eval()
    assert model.feature_info.channels() == [64, 128, 320, 512]
    assert model.feature_info.reduction() == [4, 8, 16, 32]
    with torch.no_grad():
        feats = model(torch.randn(1, 3, 128, 96))
    assert [tuple(f.shape) for f in feats] == [(1, 64, 32, 24), (1, 128, 16, 12), (1, 320, 8, 6), (1, 512, 4, 3)]
    partial = timm.create_model('NALAFORMER_XT', features_only=True, out_indices=(1, 2))
    assert [f.shape[1] for f in partial(torch.randn(1, 3, 64, 64))] == [64, 128]


def test_features_match_full_model():
    full = timm.create_model('NALAFORMER_XT').eval()
    feats = timm.create_model('NALAFORMER_XT', features_only=True).eval()
    inner = feats.model.state_dict()                      # the pruned backbone: no proj/norm/head
    assert set(inner) < set(full.state_dict()) and 'head.weight' not in inner
    feats.model.load_state_dict({k: v for k, v in full.state_dict().items() if k in inner}, strict=True)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.allclose(feats(x)[-1], full.forward_features(x))


def test_no_weight_decay_names_existing_parameters():
    model = timm.create_model('NALAFORMER_XT')
    names = dict(model.named_parameters())
    assert all(n in names for n in model.no_weight_decay())
    optimizer = timm.optim.create_optimizer_v2(model, 'adamw', lr=1e-3, weight_decay=0.05)
    no_decay = {id(p) for g in optimizer.param_groups if g['weight_decay'] == 0 for p in g['params']}
    assert id(model.layers[0].blocks[0].attn.qkvg.bias) in no_decay
    assert id(model.layers[0].blocks[0].attn.qkvg.weight) not in no_decay


def test_checkpoint_path_and_pretrained_file_load_training_checkpoints(xt_seeded, tmp_path):
    sd, bare_path = xt_seeded
    x = torch.randn(1, 3, 64, 64)
    expected = reference_forward(sd, 'NALAFORMER_XT', x)
    ddp = {'module.' + k: v for k, v in sd.items()}
    for i, ckpt in enumerate([{'model': sd, 'epoch': 1}, {'model': ddp}, {'model_ema': sd, 'model': ddp}]):
        path = tmp_path / f'ckpt{i}.pth'
        torch.save(ckpt, path)
        for model in (timm.create_model('NALAFORMER_XT', checkpoint_path=str(path)),
                      timm.create_model('NALAFORMER_XT', pretrained=True,
                                        pretrained_cfg_overlay=dict(file=str(path)))):
            with torch.no_grad():
                assert rel_err(model.eval()(x), expected) <= 1e-4
    head10 = timm.create_model('NALAFORMER_XT', num_classes=10)
    ckpt10 = tmp_path / 'ten_classes.pth'
    torch.save({'model': head10.state_dict(), 'model_ema': None, 'args': {'nb_classes': 10}}, ckpt10)
    for kwargs in (dict(checkpoint_path=str(ckpt10)),
                   dict(pretrained=True, pretrained_cfg_overlay=dict(file=str(ckpt10), num_classes=10))):
        loaded = timm.create_model('NALAFORMER_XT', num_classes=10, **kwargs)
        assert torch.equal(loaded.head.weight, head10.head.weight)
    new_head = timm.create_model('NALAFORMER_XT', pretrained=True, num_classes=10,
                                 pretrained_cfg_overlay=dict(file=bare_path))
    assert new_head.get_classifier().out_channels == 10
    assert torch.equal(new_head.layers[0].blocks[0].attn.qkvg.weight, sd['layers.0.blocks.0.attn.qkvg.weight'])


def test_strict_loading_names_bad_keys(xt_seeded, tmp_path):
    sd, _ = xt_seeded
    bad = dict(sd)
    bad.pop('layers.1.blocks.0.attn.ln.weight')
    bad['layers.1.blocks.0.attn.extra'] = torch.zeros(1)
    path = tmp_path / 'bad.pth'
    torch.save(bad, path)
    for kwargs in (dict(checkpoint_path=str(path)), dict(pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))):
        with pytest.raises(RuntimeError) as err:
            timm.create_model('NALAFORMER_XT', **kwargs)
        assert 'layers.1.blocks.0.attn.ln.weight' in str(err.value) and 'layers.1.blocks.0.attn.extra' in str(err.value)


def test_pretrained_without_weights_is_a_clear_error():
    with pytest.raises(ValueError, match='pretrained_cfg_overlay=dict\\(file=PATH\\)'):
        timm.create_model('NALAFORMER_T', pretrained=True)


def test_fast_path_switch_takes_a_bool():
    model = timm.create_model('NALAFORMER_XT', fast_path=False)
    with pytest.raises(ValueError, match="fast_path must be True or False, got 'plain'"):
        model.set_fast_path('plain')
    with pytest.raises(ValueError, match='fast_path must be True or False'):
        timm.create_model('NALAFORMER_XT', fast_path='fast')
    plain = model.eval()(torch.randn(1, 3, 32, 32))
    assert math.isfinite(plain.sum().item())


# ---- drop path of each variant -------------------------------------------------------------

def last_block_drop_prob(model):
    return [m.drop_prob for m in model.modules() if hasattr(m, 'drop_prob')][-1]


@pytest.mark.parametrize('variant, rate', [('NALAFORMER_XT', 0.10), ('NALAFORMER_T', 0.10), ('NALAFORMER_S', 0.15),
                                           ('NALAFORMER_B', 0.40), ('NALAFORMER_L', 0.55)])
def test_create_model_builds_the_variants_own_drop_path(variant, rate):
    assert last_block_drop_prob(timm.create_model(variant)) == pytest.approx(rate)
    assert VARIANTS[variant]['drop_path'] == rate  # the table itself is not consumed by building
    assert last_block_drop_prob(timm.create_model(variant.lower(), drop_path_rate=0.3)) == pytest.approx(0.3)


def test_stochastic_depth_draws_its_keep_mask_from_torch_rand():
    """The keep mask is torch.rand(B) < keep_prob (rescaled by 1 / keep_prob): torch.rand's stream is the
    same on every supported torch release, so seeded runs drop the same blocks on each of them."""
    from models.nalaformer import StochasticDepth
    sd = StochasticDepth(0.3).train()
    x = torch.randn(64, 2, 3, 3)
    torch.manual_seed(0)
    out = sd(x)
    torch.manual_seed(0)
    keep = (torch.rand(64) < 0.7).float().view(64, 1, 1, 1)
    assert torch.equal(out, x * (keep / 0.7)) and 0 < keep.sum() < 64
    assert torch.equal(sd.eval()(x), x)
    blocks = [m.drop_path for m in timm.create_model('NALAFORMER_XT').modules() if hasattr(m, 'drop_path')]
    assert all(isinstance(d, StochasticDepth) for d in blocks[1:]) and isinstance(blocks[0], torch.nn.Identity)


