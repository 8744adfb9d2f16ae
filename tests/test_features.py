"""Feature extraction: every timm feature class and torchvision's FX extractor give the stage maps
that feature_info describes, with the default features_only numbers."""
import os

import pytest
import timm
import torch
from helpers.reference_impl import read_keys

import models  # noqa: F401  (registers the variants)
from models.nalaformer import conv_residual_fast, to_reference_layout

KEYS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'reference', 'NALAFORMER_XT.keys.txt')
X = torch.randn(2, 3, 64, 96, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope='module')
def reference_maps():
    torch.manual_seed(0)
    model = timm.create_model('NALAFORMER_XT', features_only=True).eval()     # 'getter'
    with torch.no_grad():
        return model(X)


@pytest.mark.parametrize('feature_cls', ['getter', 'hook', 'dict', 'list', 'fx'])
def test_every_feature_cls_gives_the_maps_feature_info_claims(reference_maps, feature_cls):
    torch.manual_seed(0)                                                      # the same weights
    model = timm.create_model('NALAFORMER_XT', features_only=True, feature_cls=feature_cls).eval()
    with torch.no_grad():
        out = model(X)
    out = list(out.values()) if isinstance(out, dict) else out
    info = model.feature_info
    assert [f.shape[1] for f in out] == info.channels() == [32, 64, 128, 384]
    assert [X.shape[-1] // f.shape[-1] for f in out] == info.reduction() == [4, 8, 16, 32]
    for got, want in zip(out, reference_maps):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_torchvision_fx_feature_extractor_matches_forward_intermediates():
    from torchvision.models.feature_extraction import create_feature_extractor
    model = timm.create_model('NALAFORMER_XT').eval()
    extractor = create_feature_extractor(model, {f'layers.{i}': str(i) for i in range(4)})
    with torch.no_grad():
        got = extractor(X)
        want = model.forward_intermediates(X, intermediates_only=True)
    for i, w in enumerate(want):
        torch.testing.assert_close(got[str(i)], w, rtol=1e-4, atol=1e-5)


def test_stages_own_their_downsample_and_output_their_feature_map():
    """Stage i > 0 starts with the downsample that feeds it (stage 0 has none): its parameters and its
    hooks belong to that stage, and every stage's output is its feature map."""
    model = timm.create_model('NALAFORMER_XT').eval()
    assert isinstance(model.layers[0].downsample, torch.nn.Identity)
    for i, stage in enumerate(model.layers):
        names = [n for n, _ in stage.named_parameters()]
        assert (names[0] == 'downsample.reduction.weight') == (i > 0), i
    fired = []
    model.layers[1].downsample.register_forward_hook(lambda module, args, out: fired.append(tuple(out.shape)))
    with torch.no_grad():
        s0 = model.layers[0](model.patch_embed(X))
        assert s0.shape[1:] == (32, 16, 24) and not fired
        s1 = model.layers[1](s0)
    assert fired == [(2, 64, 8, 12)] and s1.shape[1:] == (64, 8, 12)
    assert list(to_reference_layout(model.state_dict())) == [k for k, _, _ in read_keys(KEYS)]


def test_fused_conv_residual_equals_the_residual_sum():
    conv = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
    x = torch.randn(1, 8, 5, 6)
    with torch.no_grad():
        torch.testing.assert_close(conv_residual_fast(x, conv.weight, conv.bias), x + conv(x))
