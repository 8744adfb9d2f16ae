"""Feature extraction: every timm feature class and torchvision's FX extractor give the stage maps
(before each downsample) that feature_info describes, with the default features_only numbers."""
import os

import pytest
import timm
import torch
from reference_impl import read_keys

import models  # noqa: F401  (registers the variants)
from models.nalaformer import conv_residual_fast

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


def test_stage_outputs_are_pre_downsample_and_keys_keep_the_reference_layout():
    model = timm.create_model('NALAFORMER_XT').eval()
    assert list(model.state_dict()) == [k for k, _, _ in read_keys(KEYS)]
    with torch.no_grad():
        x = model.patch_embed(X)
        s0 = model.layers[0](x)
        assert s0.shape[1:] == (32, 16, 24)
        torch.testing.assert_close(model.layers[1](s0), model.layers[1].forward_blocks(model.layers[0].downsample(s0)))


def test_fused_conv_residual_equals_the_residual_sum():
    conv = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
    x = torch.randn(1, 8, 5, 6)
    with torch.no_grad():
        torch.testing.assert_close(conv_residual_fast(x, conv.weight, conv.bias), x + conv(x))
