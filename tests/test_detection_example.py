"""The detection-backbone example: NaLaFormer features -> FPN -> Faster / Mask R-CNN trains and predicts."""
import math

import pytest
import torch

from tools.detection_example import build_detector, synthetic_sample, train_step_and_predict


@pytest.mark.parametrize('mask', [False, True], ids=['faster_rcnn', 'mask_rcnn'])
def test_detector_trains_one_step_and_predicts(mask):
    torch.manual_seed(0)
    detector = build_detector('NALAFORMER_XT', num_classes=3, mask=mask, min_size=128, max_size=160)
    image, target = synthetic_sample(96, 128, mask=mask)
    backbone_weight = detector.backbone.body.model.patch_embed.proj[0].weight
    before = backbone_weight.detach().clone()
    result = train_step_and_predict(detector, [image], [target])
    expected = {'loss_classifier', 'loss_box_reg', 'loss_objectness', 'loss_rpn_box_reg'}
    expected |= {'loss_mask'} if mask else set()
    assert set(result['losses']) == expected and all(math.isfinite(v) for v in result['losses'].values())
    assert not torch.equal(before, backbone_weight)                      # gradients reached the backbone
    (det,) = result['detections']
    assert set(det) >= {'boxes', 'labels', 'scores'} | ({'masks'} if mask else set())
    assert det['boxes'].shape[1:] == (4,) and (det['boxes'][:, 2:] <= torch.tensor([128, 96])).all()


def test_backbone_gives_the_five_fpn_levels():
    detector = build_detector('NALAFORMER_XT', min_size=384, max_size=512).eval()
    with torch.no_grad():
        feats = detector.backbone(torch.randn(1, 3, 384, 512))
    assert list(feats) == ['0', '1', '2', '3', 'pool']
    assert [tuple(f.shape[-2:]) for f in feats.values()] == [(96, 128), (48, 64), (24, 32), (12, 16), (6, 8)]
    assert all(f.shape[1] == 256 for f in feats.values())
