"""segmentation/: the ADE20K layout and its one-line errors, the training pipeline, the UperNet head's shapes and
names, the --pretrained loading rules, the confusion matrix and scores, --show-dir's pictures and mmseg's palette,
the schedule and the sampler that resumes mid-epoch (samplers.IterationSampler). Real processes (exact
distributed mIoU, resume): tests/integration/test_segmentation_runs.py."""
import json
import os
import re
import subprocess

import numpy as np
import pytest
import timm
import torch
from conftest import REPO, env
from PIL import Image

import samplers
from run import errors
from run.weights import load_backbone_weights
from segmentation import ade, miou, scenes, upernet
from segmentation import train as seg_train
from training.optim import weight_decay_groups


@pytest.fixture(scope='module')
def root(tmp_path_factory):
    return scenes.make_scenes(str(tmp_path_factory.mktemp('ade')), n_train=6, n_val=3, size=(40, 48))


def _copy(root, tmp_path):
    import shutil
    shutil.copytree(root, tmp_path / 'ade')
    return str(tmp_path / 'ade')


# --------------------------------------------------------------------------------------------------- layout
def test_the_layout_is_read_and_labels_are_reduced(root):
    pairs = ade.scan(root, 'training')
    assert len(pairs) == 6 and all(p[0].endswith('.jpg') and p[1].endswith('.png') for p in pairs)
    raw = np.asarray(Image.open(pairs[0][1]))
    _, label = ade.read_pair(*pairs[0], num_classes=5)
    assert np.array_equal(label == 255, raw == 0) and np.array_equal(label[raw > 0], raw[raw > 0] - 1)


def test_layout_errors_name_the_folder_and_the_fix(root, tmp_path):
    with pytest.raises(ade.LabelError, match=r'--data-path .*nope: no such folder; point it at the '
                                             r'ADEChallengeData2016 folder'):
        ade.scan(str(tmp_path / 'nope'), 'training')
    parent = tmp_path / 'parent'
    os.makedirs(parent)
    os.symlink(root, parent / 'ADEChallengeData2016')
    with pytest.raises(ade.LabelError, match=r'images/training: no such folder \(--data-path .*parent/'
                                             r'ADEChallengeData2016 holds it\)'):
        ade.scan(str(parent), 'training')


def test_a_missing_label_map_is_named(root, tmp_path):
    data = _copy(root, tmp_path)
    os.remove(os.path.join(data, 'annotations', 'validation', 'ADE_val_00000002.png'))
    with pytest.raises(ade.LabelError) as e:
        ade.scan(data, 'validation')
    line = str(e.value)
    assert line.startswith(os.path.join(data, 'annotations', 'validation', 'ADE_val_00000002.png') + ': missing, '
                           'the label map of ') and 'restore it from the ADE20K archive' in line and '\n' not in line


def test_a_label_map_of_another_size_and_a_label_above_the_classes_are_named(root, tmp_path):
    data = _copy(root, tmp_path)
    image, label = ade.scan(data, 'training')[1]
    Image.fromarray(np.ones((20, 24), np.uint8)).save(label)
    with pytest.raises(ade.LabelError, match=r'the label map is 24x20 but its image .* is 48x40; a label map must '
                                             r"have its image's size"):
        ade.read_pair(image, label, 5)
    Image.fromarray(np.full((40, 48), 7, np.uint8)).save(label)
    with pytest.raises(ade.LabelError, match=r'holds label 7, above the 5 classes of --num-classes 5'):
        ade.read_pair(image, label, 5)
    Image.fromarray(np.zeros((40, 48, 3), np.uint8)).save(label)
    with pytest.raises(ade.LabelError, match=r'a RGB image; label maps are single-channel'):
        ade.read_pair(image, label, 5)


def test_an_error_raised_in_a_loader_worker_keeps_its_one_line():
    wrapped = ade.LabelError('Caught LabelError in DataLoader worker process 0.\nOriginal Traceback:\n  ...\n'
                             'segmentation.ade.LabelError: x.png: missing, the label map of x.jpg')
    from training.image_folder import data_error_line
    assert data_error_line(wrapped) == 'x.png: missing, the label map of x.jpg'


# ------------------------------------------------------------------------------------------------- pipeline
def test_the_training_pipeline_is_a_function_of_seed_epoch_and_index(root):
    pipe = ade.TrainPipeline(crop=(32, 32), img_scale=(64, 32))
    data = ade.ADE20K(root, 'training', 5, pipe, seed=3)
    a, b, c = data[(0, 2)], data[(0, 2)], data[(1, 2)]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not torch.equal(a[0], c[0])
    assert a[0].shape == (3, 32, 32) and a[0].dtype == torch.float32 and a[1].shape == (32, 32)
    assert set(a[1].unique().tolist()) <= {0, 1, 2, 3, 4, 255}


def test_small_images_are_padded_with_zero_and_ignored_labels():
    pipe = ade.TrainPipeline(crop=(64, 64), img_scale=(20, 10), ratio_range=(1.0, 1.0), photometric=False)
    image, label = np.full((10, 20, 3), 200, np.uint8), np.zeros((10, 20), np.uint8)
    out, target = pipe(image, label, np.random.default_rng(0))
    assert out.shape == (3, 64, 64) and torch.all(out[:, 10:] == 0) and torch.all(target[10:] == 255)
    assert torch.all(target[:10, :20] == 0)


def test_the_crop_avoids_one_class_filling_it():
    label = np.zeros((64, 64), np.uint8)
    label[:, 48:] = 1  # a crop of 32 is all class 0 unless it reaches past column 32
    pipe = ade.TrainPipeline(crop=(32, 32))
    rng = np.random.default_rng(0)
    for _ in range(20):
        y, x = pipe.crop_origin(label, rng)
        counts = np.bincount(label[y:y + 32, x:x + 32].ravel())
        assert len(counts) == 2 and counts.max() / counts.sum() < 0.75


def test_hsv_round_trip_and_hue_range():
    """8-bit HSV keeps the hue in steps of 2 degrees, 255 / 30 of a channel at full saturation: a round trip
    comes back within half a step."""
    rgb = np.random.default_rng(0).integers(0, 256, (64, 64, 3)).astype(np.uint8)
    hsv = ade.rgb_to_hsv(rgb)
    assert hsv[..., 0].max() < 180
    back = ade.hsv_to_rgb(hsv).astype(int)
    assert np.abs(back - rgb).max() <= 5 and np.abs(back - rgb).mean() < 0.5
    assert np.array_equal(ade.hsv_to_rgb(ade.rgb_to_hsv(np.full((2, 2, 3), 77, np.uint8))), np.full((2, 2, 3), 77))


# ---------------------------------------------------------------------------------------------------- model
def test_upernet_shapes_and_mmseg_names(one_thread):
    model = upernet.build_segmentor('NALAFORMER_XT', 7, channels=16)
    x = torch.randn(2, 3, 64, 96)
    logits, aux = model.train()(x)
    assert logits.shape == (2, 7, 16, 24) and aux.shape == (2, 7, 4, 6)  # stride 4; the auxiliary head: stride 16
    assert model.eval()(x).shape == (2, 7, 64, 96)
    keys = model.state_dict()
    for k in ('decode_head.psp_modules.3.1.conv.weight', 'decode_head.bottleneck.bn.running_var',
              'decode_head.lateral_convs.2.conv.weight', 'decode_head.fpn_convs.0.bn.weight',
              'decode_head.fpn_bottleneck.conv.weight', 'decode_head.conv_seg.bias',
              'auxiliary_head.convs.0.conv.weight', 'auxiliary_head.conv_seg.weight'):
        assert k in keys, k
    assert keys['decode_head.fpn_bottleneck.conv.weight'].shape == (16, 64, 3, 3)
    assert 'decode_head.conv_seg.weight' in keys and not any(k.startswith('backbone.model.head') for k in keys)
    assert upernet.build_segmentor('NALAFORMER_XT', 7, channels=16, aux=False).train()(x)[1] is None


def test_semantic_fpn_shapes_and_mmseg_names(one_thread):
    """--decoder fpn: mmseg's FPN neck (256 channels, plain convs with bias) and FPNHead (1, 1, 2 and 3 conv blocks
    for strides 4 to 32, each but stride 4's followed by a 2x upsampling), logits at stride 4, no auxiliary head
    in its recipe (one on the neck's third map when asked for)."""
    model = upernet.build_segmentor('NALAFORMER_XT', 7, channels=16, aux=False, decoder='fpn')
    x = torch.randn(2, 3, 64, 96)
    logits, aux = model.train()(x)
    assert logits.shape == (2, 7, 16, 24) and aux is None
    assert model.eval()(x).shape == (2, 7, 64, 96)
    keys = model.state_dict()
    last = model.backbone.feature_info.channels()[-1]
    assert keys['neck.lateral_convs.3.conv.weight'].shape == (256, last, 1, 1)
    assert keys['neck.fpn_convs.0.conv.bias'].shape == (256,) and 'neck.fpn_convs.0.bn.weight' not in keys
    convs = [len([m for m in head if isinstance(m, upernet.ConvModule)]) for head in model.decode_head.scale_heads]
    ups = [len([m for m in head if isinstance(m, torch.nn.Upsample)]) for head in model.decode_head.scale_heads]
    assert convs == [1, 1, 2, 3] and ups == [0, 1, 2, 3]
    assert keys['decode_head.scale_heads.3.4.conv.weight'].shape == (16, 16, 3, 3)
    assert keys['decode_head.scale_heads.0.0.conv.weight'].shape == (16, 256, 3, 3)
    with_aux = upernet.build_segmentor('NALAFORMER_XT', 7, channels=16, decoder='fpn')
    assert with_aux.train()(x)[1].shape == (2, 7, 4, 6) and with_aux.auxiliary_head.convs[0].conv.in_channels == 256
    assert model.description == 'Semantic FPN (neck 256, head 16 channels)'


def test_the_fpn_neck_matches_torchvisions(one_thread):
    """mmseg's FPN neck (no extra levels) computes what torchvision's FeaturePyramidNetwork does with the same
    weights: 1x1 laterals, nearest top-down sums, 3x3 outputs."""
    from torchvision.ops import FeaturePyramidNetwork
    torch.manual_seed(0)
    chans = [8, 16, 24, 32]
    ours = upernet.FPN(chans, 12).eval()
    theirs = FeaturePyramidNetwork(chans, 12).eval()
    for i in range(4):
        theirs.inner_blocks[i][0].load_state_dict(ours.lateral_convs[i].conv.state_dict())
        theirs.layer_blocks[i][0].load_state_dict(ours.fpn_convs[i].conv.state_dict())
    feats = [torch.randn(1, c, 33 // 2 ** i, 41 // 2 ** i) for i, c in enumerate(chans)]
    expected = theirs({str(i): f for i, f in enumerate(feats)})
    for mine, other in zip(ours(feats), expected.values()):
        assert torch.allclose(mine, other, atol=1e-5)


def test_the_loss_averages_over_every_pixel_as_mmseg():
    logits = torch.randn(1, 3, 4, 4)
    labels = torch.randint(0, 3, (1, 4, 4))
    labels[0, 0] = 255
    loss = upernet.SegLoss(0.4).pixel_ce(logits, labels)
    per_pixel = torch.nn.functional.cross_entropy(logits, labels, ignore_index=255, reduction='sum') / 16
    assert torch.allclose(loss, per_pixel)


def test_upernet_matches_segmentation_models_pytorch_without_its_input_norms(one_thread):
    """smp's UPerNetDecoder is mmseg's UPerHead plus a LayerNorm on every input map: with those norms taken out
    and the same weights, the two fused maps agree (why segmentation/ keeps its own head: docs/segmentation.md)."""
    smp = pytest.importorskip('segmentation_models_pytorch.decoders.upernet.decoder',
                              reason='segmentation-models-pytorch is optional (requirements-optional.txt)')
    torch.manual_seed(0)
    chans = [8, 16, 24, 32]
    ours = upernet.UPerHead(chans, num_classes=3, channels=12).eval()
    theirs = smp.UPerNetDecoder([3, 0] + chans, encoder_depth=5, decoder_channels=12).eval()
    theirs.feature_norms = torch.nn.ModuleList(torch.nn.Identity() for _ in chans)
    pairs = [(ours.psp_modules[i][1], theirs.psp.blocks[i][1]) for i in range(4)]
    pairs += [(ours.bottleneck, theirs.psp.out_conv), (ours.fpn_bottleneck, theirs.fusion_block)]
    pairs += [(ours.lateral_convs[2 - i], theirs.fpn_lateral_blocks[i].conv_norm_relu) for i in range(3)]
    pairs += [(ours.fpn_convs[2 - i], theirs.fpn_conv_blocks[i]) for i in range(3)]
    for mine, other in pairs:
        convs = [m for m in other.modules() if isinstance(m, torch.nn.Conv2d)]
        bns = [m for m in other.modules() if isinstance(m, torch.nn.BatchNorm2d)]
        convs[0].load_state_dict(mine.conv.state_dict())
        bns[0].load_state_dict(mine.bn.state_dict())
    feats = [torch.randn(1, c, 32 // 2 ** i, 40 // 2 ** i) for i, c in enumerate(chans)]
    fused = ours.fpn_bottleneck(torch.cat(_levels(ours, feats), 1))
    assert torch.allclose(fused, theirs([None, None] + feats), atol=1e-5)


def _levels(head, feats):
    laterals = [conv(f) for conv, f in zip(head.lateral_convs, feats)] + [head.psp_forward(feats[-1])]
    for i in range(3, 0, -1):
        laterals[i - 1] = laterals[i - 1] + upernet.resize(laterals[i], laterals[i - 1].shape[2:])
    outs = [conv(lat) for conv, lat in zip(head.fpn_convs, laterals)] + [laterals[-1]]
    return [outs[0]] + [upernet.resize(o, outs[0].shape[2:]) for o in outs[1:]]


# --------------------------------------------------------------------------------------------- --pretrained
def load_pretrained(model, path, name):
    """--pretrained as segmentation/train.py loads it: the classification weights into the segmentor's backbone."""
    return load_backbone_weights(model.backbone, path, name, upernet.TASK)


@pytest.fixture(scope='module')
def xt_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    src = timm.create_model('NALAFORMER_XT', num_classes=10)
    ema = {k: v + 1 if v.is_floating_point() else v for k, v in src.state_dict().items()}
    path = str(tmp_path_factory.mktemp('ck') / 'cls.pth')
    torch.save({'model': src.state_dict(), 'model_ema': ema, 'epoch': 3}, path)
    return path, ema


def test_pretrained_takes_the_ema_backbone_and_drops_the_classifier(xt_checkpoint):
    path, ema = xt_checkpoint
    model = upernet.build_segmentor('NALAFORMER_XT', 5, channels=16)
    line = load_pretrained(model, path, 'NALAFORMER_XT')
    assert '(model_ema weights)' in line and 'dropped the classifier (head.bias, head.weight, norm.bias' in line
    w = 'patch_embed.proj.0.weight'
    assert torch.equal(model.state_dict()['backbone.model.' + w], ema[w])


def test_pretrained_refuses_other_weights_in_one_line(xt_checkpoint, tmp_path):
    path, ema = xt_checkpoint
    model = upernet.build_segmentor('NALAFORMER_XT', 5, channels=16)
    broken = {k: v for k, v in ema.items() if k != 'layers.1.blocks.0.attn.qkvg.weight'}
    torch.save({'model': broken}, tmp_path / 'missing.pth')
    with pytest.raises(errors.CheckpointError, match=r'does not hold NALAFORMER_XT classification weights: 1 '
                                                       r'backbone tensors missing \(e.g. layers.1.blocks.0.attn.qkvg'):
        load_pretrained(model, str(tmp_path / 'missing.pth'), 'NALAFORMER_XT')
    torch.save({'model': timm.create_model('NALAFORMER_T').state_dict()}, tmp_path / 't.pth')
    with pytest.raises(errors.CheckpointError, match=r'backbone tensors of other shapes .* pass a checkpoint or '
                                                       r'release of --model NALAFORMER_XT'):
        load_pretrained(model, str(tmp_path / 't.pth'), 'NALAFORMER_XT')
    torch.save({'model': {**ema, 'extra.weight': torch.zeros(1)}}, tmp_path / 'extra.pth')
    with pytest.raises(errors.CheckpointError, match=r"1 tensors that are not NALAFORMER_XT's \(e.g. extra.weight"):
        load_pretrained(model, str(tmp_path / 'extra.pth'), 'NALAFORMER_XT')
    torch.save({'task': 'segmentation', 'model': model.state_dict()}, tmp_path / 'seg.pth')
    with pytest.raises(errors.CheckpointError, match=r'is a segmentation checkpoint; continue it with --resume'):
        load_pretrained(model, str(tmp_path / 'seg.pth'), 'NALAFORMER_XT')


def test_weight_decay_skips_norms_and_biases():
    model = upernet.build_segmentor('NALAFORMER_XT', 5, channels=16)
    decay, no_decay = weight_decay_groups(model, 0.01)
    assert decay['weight_decay'] == 0.01 and no_decay['weight_decay'] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.ndim > 1 for p in decay['params'])
    assert {'decode_head.conv_seg.bias', 'decode_head.bottleneck.bn.weight'} <= {names[id(p)] for p in
                                                                                 no_decay['params']}


# ---------------------------------------------------------------------------------------------------- mIoU
def test_confusion_matrix_counts_every_labelled_pixel():
    g = torch.Generator().manual_seed(0)
    pred, label = torch.randint(0, 4, (3, 9, 7), generator=g), torch.randint(0, 4, (3, 9, 7), generator=g)
    label[0, :2] = 255
    m = miou.confusion_matrix(pred, label, 4)
    plain = torch.zeros(4, 4, dtype=torch.int64)
    for p, t in zip(pred.flatten().tolist(), label.flatten().tolist()):
        if t != 255:
            plain[t, p] += 1
    assert torch.equal(m, plain)
    tm = pytest.importorskip('torchmetrics.functional.classification',
                             reason='torchmetrics is optional (requirements-optional.txt)')
    assert torch.equal(m, tm.multiclass_confusion_matrix(pred, label, 4, ignore_index=255))


def test_scores_follow_mmseg():
    m = torch.tensor([[8, 2, 0], [1, 4, 0], [0, 0, 0]])  # class 2: neither labelled nor predicted
    s = miou.scores(m)
    assert s['IoU'][:2] == pytest.approx([100 * 8 / 11, 100 * 4 / 7]) and s['IoU'][2] is None
    assert s['Acc'][:2] == pytest.approx([80, 80]) and s['Acc'][2] is None
    assert s['mIoU'] == pytest.approx((800 / 11 + 400 / 7) / 2)
    assert s['mAcc'] == pytest.approx((80 + 80) / 2) and s['aAcc'] == pytest.approx(100 * 12 / 15)


def test_the_per_class_table_and_record_name_each_class():
    """mmseg's per-class table (IoU and Acc, nan for a class neither labelled nor predicted; a class predicted but
    never labelled: IoU 0, Acc nan) and log.txt's 'IoU.<name>' / 'Acc.<name>' entries."""
    m = torch.tensor([[8, 2, 0, 0], [1, 4, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0]])
    result = {**miou.scores(m), 'classes': ['wall', 'chest of drawers', 'sky', 'flag']}
    lines = miou.class_table(result).splitlines()
    assert lines[0] == 'per class results:' and lines[2].split() == ['|', 'Class', '|', 'IoU', '|', 'Acc', '|']
    cells = [[c.strip() for c in line.strip('|').split('|')] for line in lines[4:-1]]
    rows = {name: [iou, acc] for name, iou, acc in cells}
    assert rows == {'wall': ['72.73', '80.00'], 'chest of drawers': ['50.00', '66.67'], 'sky': ['nan', 'nan'],
                    'flag': ['0.00', 'nan']}
    record = miou.class_record(result)
    assert record['IoU.chest of drawers'] == pytest.approx(50) and record['IoU.sky'] is None
    assert record['IoU.flag'] == 0 and record['Acc.flag'] is None and len(record) == 8


def test_the_class_names_of_ade20k_a_classes_txt_or_generic(root, tmp_path):
    assert len(ade.CLASSES) == len(set(ade.CLASSES)) == 150
    assert (ade.CLASSES[0], ade.CLASSES[7], ade.CLASSES[44], ade.CLASSES[-1]) == ('wall', 'bed', 'chest of drawers',
                                                                                 'flag')
    assert ade.ADE20K(root, 'validation', 5).classes == scenes.CLASS_NAMES  # the scene set's classes.txt
    data = _copy(root, tmp_path)
    os.remove(os.path.join(data, 'classes.txt'))
    assert ade.class_names(data, 150) == ade.CLASSES
    assert ade.class_names(data, 3) == ('class_1', 'class_2', 'class_3')
    with open(os.path.join(data, 'classes.txt'), 'w') as f:
        f.write('a\nb\na\n')
    with pytest.raises(ade.LabelError, match=r'classes.txt: 3 names \(2 different\) for --num-classes 3; it names '
                                             r'each class once'):
        ade.class_names(data, 3)


def test_the_palette_is_mmsegs_for_ade20k_and_mmsegs_generated_one_otherwise():
    """ade.PALETTE is mmseg's ADE20KDataset.PALETTE (label k drawn PALETTE[k - 1]); another number of classes gets
    the colours mmseg's CustomDataset draws for a data set without a palette (numpy's global generator seeded 42),
    without disturbing the caller's random state; colour_labels draws a class in its colour, no class in black."""
    assert len(ade.PALETTE) == 150 and all(len(c) == 3 and all(0 <= v <= 255 for v in c) for c in ade.PALETTE)
    # mmseg's own palette gives road and skyscraper the same grey: the only repeated colour
    assert len(set(ade.PALETTE)) == 149 and ade.PALETTE[6] == ade.PALETTE[48] == (140, 140, 140)
    assert ade.PALETTE[:4] == ((120, 120, 120), (180, 120, 120), (6, 230, 230), (80, 50, 50))
    assert (ade.PALETTE[12], ade.PALETTE[-1]) == ((150, 5, 61), (92, 0, 255))  # person, flag
    assert ade.palette(150).dtype == np.uint8 and ade.palette(150).tolist() == [list(c) for c in ade.PALETTE]
    state = np.random.get_state()
    np.random.seed(42)
    mmseg_custom = np.random.randint(0, 255, size=(5, 3))
    np.random.set_state(state)
    before = np.random.random(3)
    np.random.set_state(state)
    assert ade.palette(5).tolist() == mmseg_custom.tolist() and ade.palette(5).shape == (5, 3)
    assert np.array_equal(np.random.random(3), before)
    labels = np.array([[0, 1, 4], [255, 2, 3]], np.uint8)
    colours = ade.palette(5)
    drawn = ade.colour_labels(labels, colours)
    assert drawn.dtype == np.uint8 and drawn.shape == (2, 3, 3)
    assert [drawn[0, j].tolist() for j in range(3)] == [colours[0].tolist(), colours[1].tolist(), colours[4].tolist()]
    assert drawn[1, 0].tolist() == [0, 0, 0] and drawn[1, 2].tolist() == colours[3].tolist()


def test_the_aug_test_averages_softmax_probabilities_of_each_scale_and_its_flip(one_thread):
    """mmseg's multi-scale + flip test averages probabilities, not logits: three views favouring class 1 mildly
    outvote one favouring class 0 strongly (the mean of the logits would pick class 0). The views come scale by
    scale, unflipped then flipped, the flipped view's probabilities flipped back."""
    views = iter([torch.tensor([10.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0]),
                  torch.tensor([0.0, 1.0])])
    seen = []

    def logits_of(x):
        seen.append(x)
        return next(views).view(1, 2, 1, 1).expand(1, 2, 3, 4)

    images = [torch.randn(1, 3, 3, 4), torch.randn(1, 3, 5, 6)]
    prob = miou.aug_probabilities(logits_of, images)
    assert prob.argmax(1).unique().tolist() == [1]
    assert torch.allclose(prob.sum(1), torch.ones(1, 3, 4))
    assert [torch.equal(x, e) for x, e in zip(seen, [images[0], images[0].flip(-1), images[1], images[1].flip(-1)])] \
        == [True] * 4
    model = torch.nn.Conv2d(3, 4, 3, padding=1)  # not flip-equivariant: the flip changes the logits
    x = torch.randn(1, 3, 6, 8)
    with torch.no_grad():
        got = miou.aug_probabilities(lambda t: model(t), [x])
        expected = (model(x).softmax(1) + model(x.flip(-1)).softmax(1).flip(-1)) / 2
    assert torch.allclose(got, expected, atol=1e-6) and not torch.allclose(got, model(x).softmax(1), atol=1e-3)


def test_the_aug_test_images_are_mmseg_scales_of_the_evaluation_size(root):
    """--aug-test's items: the image at each ratio (0.5 .. 1.75) of the evaluation scale (mmseg 0.x's img_ratios:
    (int(long r), int(short r)), keeping the aspect ratio); ratio 1 is the single-scale image."""
    single = ade.ADE20K(root, 'validation', 5, eval_scale=(96, 48))
    multi = ade.ADE20K(root, 'validation', 5, eval_scale=(96, 48), eval_ratios=ade.AUG_RATIOS)
    images, label, key = multi[1]
    # a 40x48 image: the short side limits, to int(48 r) rows, and the width keeps the ratio 48/40
    sizes = [(int(48 * r), int(int(48 * r) / 40 * 48 + 0.5)) for r in ade.AUG_RATIOS]
    assert [tuple(i.shape[1:]) for i in images] == sizes and ade.AUG_RATIOS == (0.5, 0.75, 1.0, 1.25, 1.5, 1.75)
    assert torch.equal(images[2], single[1][0]) and torch.equal(label, single[1][1]) and key == 1


def test_the_aug_test_evaluates_every_scale_whole_or_slide(root, one_thread):
    """The multi-scale + flip evaluation of a pointwise model is the same in whole and slide mode (crops smaller
    than the scaled images), and is reported as 6 scales + flip."""
    torch.manual_seed(0)
    model = torch.nn.Conv2d(3, 5, 1)
    data = ade.ADE20K(root, 'validation', 5, eval_scale=(96, 48), eval_ratios=ade.AUG_RATIOS)
    loader = torch.utils.data.DataLoader(data, batch_size=1)
    whole = miou.evaluate(model, loader, 5, torch.device('cpu'), print_freq=0, class_names=data.classes)
    slide = miou.evaluate(model, loader, 5, torch.device('cpu'), mode='slide', crop=24, stride=16, print_freq=0)
    assert whole['scales'] == 6 and whole['images'] == 3 and whole['classes'] == list(scenes.CLASS_NAMES)
    assert whole['mIoU'] == pytest.approx(slide['mIoU'], abs=1e-9) and slide['classes'][0] == 'class_1'
    assert miou.summary_line(whole, 'whole').endswith('(3 images, whole-image inference, 6 scales + flip)')


def test_slide_inference_of_a_pointwise_model_equals_whole(one_thread):
    model = torch.nn.Conv2d(3, 4, 1)
    x = torch.randn(1, 3, 50, 70)
    assert torch.allclose(miou.slide_logits(model, x, 4, crop=32, stride=21), model(x), atol=1e-6)


# ------------------------------------------------------------------------------------------- the schedule
def test_poly_schedule_with_linear_warmup():
    args = seg_train.get_args_parser().parse_args(['--data-path', 'x', '--iters', '1000', '--warmup-iters', '100'])
    seg_train.take_flags(args, '')
    assert seg_train.poly_lr(0, args) == pytest.approx(6e-5 * 1e-6)
    assert seg_train.poly_lr(100, args) == pytest.approx(6e-5 * 0.9)
    assert seg_train.poly_lr(50, args) == pytest.approx(6e-5 * 0.95 * (1 - 0.5 * (1 - 1e-6)))
    assert seg_train.poly_lr(999, args) == pytest.approx(6e-5 / 1000)


def test_the_sampler_resumes_inside_an_epoch_and_splits_ranks():
    full = samplers.IterationSampler(11, world=2, rank=0, batch_size=2, seed=1)
    assert full.steps == 3  # ceil(11 / 2) = 6 per rank per epoch: 3 batches of 2
    first = [k for k, _ in zip(full, range(20))]
    resumed = [k for k, _ in zip(samplers.IterationSampler(11, 2, 0, 2, 1, start=4), range(12))]
    assert resumed == first[8:20] and first[5][0] == 0 and first[6][0] == 1
    other = [k for k, _ in zip(samplers.IterationSampler(11, 2, 1, 2, 1), range(6))]
    assert {i for _, i in first[:6]} | {i for _, i in other} == set(range(11))


def test_batch_size_one_is_refused_without_sync_bn(capsys):
    with pytest.raises(SystemExit) as e:
        seg_train.run(['--data-path', 'x', '--device', 'cpu', '--batch-size', '1'])
    assert e.value.code == 2 and 'BatchNorm cannot train on; use --batch-size 2' in capsys.readouterr().err


@pytest.mark.parametrize('argv, error', [
    (['--model', 'nalaformer-t'], "unknown model 'nalaformer-t' (did you mean NALAFORMER_T?)"),
    (['--resume', '.'], '--resume .: a directory'),
])
def test_a_mistyped_model_or_a_directory_gets_the_fix(argv, error, capsys):
    with pytest.raises(SystemExit) as e:
        seg_train.run(['--data-path', 'x', '--device', 'cpu'] + argv)
    assert e.value.code == 2 and error in capsys.readouterr().err.splitlines()[-1]


def _check_sizes(argv, memory, monkeypatch):
    import cli
    monkeypatch.setattr(cli, 'device_memory', lambda device: (memory, 'the memory of a test GPU'))
    args = seg_train.get_args_parser().parse_args(['--data-path', 'x'] + argv)
    seg_train.take_flags(args, '')  # the recipe's values of the flags not given
    seg_train.check_sizes(args, torch.device('cpu'))


@pytest.mark.parametrize('argv', [[], ['--eval'], ['--eval-mode', 'slide'], ['--model', 'NALAFORMER_L', '--amp'],
                                  ['--crop-size', '640', '--img-scale', '2560', '640']])
def test_the_recipes_crops_and_scales_fit_a_16_gb_gpu(argv, monkeypatch):
    _check_sizes(argv, 16 * 2 ** 30, monkeypatch)


@pytest.mark.parametrize('argv, start, fix', [
    (['--crop-size', '100000'], '--crop-size 100000: one training batch (--batch-size 2) needs at least 30.7 TiB '
                                '(NALAFORMER_T: about 1688 bytes per pixel of each image, 2 images of 100000x100000)',
     r'--crop-size (\d+) or less'),
    (['--img-scale', '100000', '100000', '--eval'],
     '--img-scale 100000 100000: one evaluation image needs at least 1.36 TiB (NALAFORMER_T with 150 classes: about '
     '600 bytes per pixel of each image, 1 image of at least 2500000000 pixels (aspect ratio up to 4:1))',
     r'--img-scale (\d+) (\d+) or less'),
])
def test_a_crop_or_scale_that_cannot_fit_is_refused_naming_estimate_memory_and_a_fix_that_fits(argv, start, fix,
                                                                                             monkeypatch):
    with pytest.raises(seg_train.FlagError) as e:
        _check_sizes(argv, 16 * 2 ** 30, monkeypatch)
    head, use = str(e.value).split('; use ')
    assert head == start + ', more than the memory of a test GPU'
    values = re.fullmatch(fix, use).groups()
    _check_sizes(argv + [argv[0], *values], 16 * 2 ** 30, monkeypatch)


def test_train_sh_runs_dry_and_its_command_parses(tmp_path):
    p = subprocess.run(['bash', os.path.join(REPO, 'segmentation', 'train.sh'), '--eval-mode', 'slide'],
                       env={**env(), 'DRY_RUN': '1', 'PRETRAINED': 'ck.pth'}, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    words = p.stdout.strip().splitlines()[-1].split()
    args = seg_train.get_args_parser().parse_args(words[words.index('segmentation/train.py') + 1:])
    seg_train.take_flags(args, '')
    assert (args.iters, args.batch_size, args.lr, args.pretrained, args.eval_mode) == (160000, 2, 6e-5, 'ck.pth',
                                                                                      'slide')
    assert '--nproc_per_node=8' in words


def test_the_benchmark_prints_a_row_per_model(tmp_path, capsys, one_thread):
    from segmentation import upernet_benchmark
    out = tmp_path / 'b.jsonl'
    assert upernet_benchmark.main(['--models', 'NALAFORMER_XT,convnext_atto', '--size', '32', '-b', '2', '--steps', '1',
                           '--warmup', '0', '--channels', '16', '--output', str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r['model'] for r in rows] == ['NALAFORMER_XT', 'convnext_atto']
    assert all(r['peak_step_mib'] > 0 and r['img_s'] > 0 for r in rows)
    table = capsys.readouterr().out
    assert 'UperNet (16 channels) training step, batch 2, 32x32, fp32, cpu' in table and 'speed ' in table


def test_the_benchmark_times_the_pipeline(capsys):
    from segmentation import upernet_benchmark
    threads = torch.get_num_threads()
    try:
        assert upernet_benchmark.main(['--pipeline', '2']) == 0
    finally:
        torch.set_num_threads(threads)
    assert re.search(r'2 512x683 JPEGs: training pipeline [\d.]+ img/s', capsys.readouterr().out)


def test_the_benchmark_counts_macs_of_backbone_and_head(capsys, one_thread):
    """--macs: at --size² and at a rectangular --macs-size (512x2048 by default), each the fvcore count of one
    image of that height and width; Semantic FPN's too."""
    from models.flop_count import count_flops
    from segmentation import upernet_benchmark
    assert upernet_benchmark.main(['--macs', '--models', 'NALAFORMER_XT', '--size', '64', '--channels', '16',
                                   '--macs-size', '32', '96']) == 0
    out = capsys.readouterr().out
    m = re.search(r'NALAFORMER_XT: ([\d.]+) GMACs at 64x64 \(backbone ([\d.]+), UperNet head ([\d.]+)\)', out)
    assert m and float(m.group(2)) > 0 and float(m.group(3)) > 0
    m = re.search(r'NALAFORMER_XT: ([\d.]+) GMACs at 32x96 \(backbone ([\d.]+), UperNet head ([\d.]+)\)', out)
    model = upernet.build_segmentor('NALAFORMER_XT', 150, channels=16, aux=False)
    assert m and float(m.group(1)) == pytest.approx(count_flops(model, (32, 96)) / 1e9, abs=0.006)
    assert upernet_benchmark.main(['--macs', '--models', 'NALAFORMER_XT', '--size', '32', '--channels', '16',
                                   '--decoder', 'fpn', '--macs-size', '32', '64']) == 0
    assert re.search(r'NALAFORMER_XT: [\d.]+ GMACs at 32x64 \(backbone [\d.]+, Semantic FPN neck and head [\d.]+\)',
                     capsys.readouterr().out)


def test_slurm_train_sbatch_runs_the_segmentation_script():
    p = subprocess.run(['bash', os.path.join(REPO, 'slurm', 'train.sbatch')], cwd=REPO, capture_output=True, text=True,
                       env={**env(), 'DRY_RUN': '1', 'SCRIPT': 'segmentation/train.sh'}, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    srun, node = [line for line in p.stdout.splitlines() if line.startswith('+ ')]
    assert srun.endswith('segmentation/train.sh') and ' segmentation/train.py --model ' in node


def test_pretrained_takes_a_safetensors_release(xt_checkpoint, tmp_path):
    from safetensors.torch import save_file
    _, ema = xt_checkpoint
    path = str(tmp_path / 'nalaformer_xt.safetensors')
    save_file({k: v.contiguous() for k, v in ema.items()}, path)
    model = upernet.build_segmentor('NALAFORMER_XT', 5, channels=16)
    assert 'of ' + path + ' (weights); dropped the classifier' in load_pretrained(model, path, 'NALAFORMER_XT')
    w = 'layers.2.blocks.0.attn.qkvg.weight'
    assert torch.equal(model.state_dict()['backbone.model.' + w], ema[w])


def _run(argv):
    """segmentation/train.py's run() in this process, the signal handlers it installs put back."""
    import signal
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        return seg_train.run([*argv, '--device', 'cpu', '--cpu-malloc', 'system', '--num_workers', '0'])
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def test_eval_of_a_classification_checkpoint_is_one_line(root, xt_checkpoint, capsys):
    code = _run(['--eval', '--resume', xt_checkpoint[0], '--data-path', root, '--model', 'NALAFORMER_XT',
                 '--num-classes', '5', '--channels', '16'])
    err = capsys.readouterr().err
    assert code == 1 and f'error: {xt_checkpoint[0]} is not a segmentation checkpoint' in err
    assert f'--pretrained {xt_checkpoint[0]}' in err and 'Traceback' not in err


def test_eval_takes_the_flags_its_checkpoint_records_unless_given(root, tmp_path, capsys, one_thread):
    """--eval of a checkpoint without its flags scores it as a fresh evaluation with every recorded flag given
    does (the recorded size, classes, channels), says which it took in one line, names a given value that
    differs in one line, and refuses a given model flag the weights cannot load into."""
    torch.manual_seed(0)
    model = upernet.build_segmentor('NALAFORMER_XT', 5, channels=16)
    path = str(tmp_path / 'seg.pth')
    recorded = {'model': 'NALAFORMER_XT', 'num_classes': 5, 'channels': 16, 'aux_weight': 0.4, 'drop_path': None,
                'crop_size': 48, 'img_scale': (96, 48), 'ratio_range': (0.5, 2.0), 'cat_max_ratio': 0.75,
                'eval_mode': 'slide', 'slide_stride': 20}
    torch.save({'task': 'segmentation', 'model': model.state_dict(), 'iter': 3, 'args': recorded}, path)
    given = ['--model', 'NALAFORMER_XT', '--num-classes', '5', '--channels', '16', '--aux-weight', '0.4',
             '--crop-size', '48', '--img-scale', '96', '48', '--eval-mode', 'slide', '--slide-stride', '20']
    common = ['--eval', '--resume', path, '--data-path', root]
    assert _run(common + given) == 0
    fresh = capsys.readouterr().out
    assert 'as recorded in' not in fresh and 'Note:' not in fresh
    assert _run(common) == 0
    out = capsys.readouterr().out
    assert (f'--model NALAFORMER_XT --num-classes 5 --channels 16 --crop-size 48 --img-scale 96 48 --eval-mode slide '
            f'--slide-stride 20: as recorded in {path} (pass a flag to choose another value)') in out
    score = re.findall(r'^mIoU .*$', fresh, re.M)
    assert len(score) == 1 and score == re.findall(r'^mIoU .*$', out, re.M) and 'sliding-window' in score[0]
    assert _run(common + ['--img-scale', '64', '32']) == 0
    assert (f'Note: --img-scale 64 32 (the checkpoint: --img-scale 96 48): the command line differs from {path}; '
            f'using the command line') in capsys.readouterr().out
    assert _run(common + ['--channels', '32']) == 1
    assert (f'error: {path} holds a model built with --channels 16, this command passes --channels 32: leave the '
            f'flag out (the checkpoint gives it)') in capsys.readouterr().err


@pytest.mark.parametrize('flags', [[], ['--aug-test', '--eval-mode', 'slide']])
def test_show_dir_draws_each_validation_image_beside_the_prediction_the_miou_counts(root, tmp_path, capsys,
                                                                                   monkeypatch, one_thread, flags):
    """--eval --show-dir DIR writes DIR/<image stem>.png for each validation image: the image as read from disk on
    the left, on the right the prediction the confusion matrix counted (miou.evaluate's `show`, whole/slide and
    the multi-scale + flip test alike) in the palette's colours; the scores from those predictions are the ones
    printed."""
    torch.manual_seed(0)
    path = str(tmp_path / 'seg.pth')
    torch.save({'task': 'segmentation', 'model': upernet.build_segmentor('NALAFORMER_XT', 5, channels=16)
                .state_dict(), 'iter': 3, 'args': {'model': 'NALAFORMER_XT', 'num_classes': 5, 'channels': 16,
                                                   'crop_size': 24, 'img_scale': (64, 32), 'slide_stride': 16}}, path)
    predictions, original = {}, miou.evaluate

    def recording(*a, show, **k):
        def record(index, prediction):
            assert index not in predictions
            predictions[index] = prediction.clone()
            show(index, prediction)
        return original(*a, show=record, **k)

    monkeypatch.setattr(miou, 'evaluate', recording)
    show_dir = tmp_path / 'show' / 'pictures'
    assert _run(['--eval', '--resume', path, '--data-path', root, '--show-dir', str(show_dir), *flags]) == 0
    out = capsys.readouterr().out
    assert f'Pictures of the 3 images (each beside its prediction): {show_dir}' in out
    pairs = ade.scan(root, 'validation')
    assert sorted(os.listdir(show_dir)) == [os.path.basename(i)[:-4] + '.png' for i, _ in pairs]
    assert sorted(predictions) == [0, 1, 2]
    colours, matrix = ade.palette(5), torch.zeros(5, 5, dtype=torch.int64)
    for index, (image_path, label_path) in enumerate(pairs):
        picture = np.asarray(Image.open(show_dir / (os.path.basename(image_path)[:-4] + '.png')))
        with Image.open(image_path) as im:
            image = np.asarray(im.convert('RGB'))
        h, w = image.shape[:2]
        prediction = predictions[index].numpy()
        assert picture.shape == (h, 2 * w, 3) and prediction.shape == (h, w)
        assert np.array_equal(picture[:, :w], image)
        assert np.array_equal(picture[:, w:], colours[prediction])
        assert {tuple(c) for c in picture[:, w:].reshape(-1, 3)} <= {tuple(c) for c in colours.tolist()}
        matrix += miou.confusion_matrix(predictions[index], torch.from_numpy(ade.read_pair(image_path, label_path,
                                                                                          5)[1]), 5)
    s = miou.scores(matrix)
    assert f"mIoU {s['mIoU']:.2f}  mAcc {s['mAcc']:.2f}  aAcc {s['aAcc']:.2f}  (3 images" in out


def test_show_dir_needs_eval_and_a_writable_folder(root, tmp_path, capsys):
    """--show-dir without --eval is argparse's error; a --show-dir that cannot be written is one line before the
    model is built or any image evaluated, and leaves nothing behind."""
    show_dir = tmp_path / 'show'
    with pytest.raises(SystemExit) as e:
        seg_train.run(['--data-path', root, '--device', 'cpu', '--show-dir', str(show_dir)])
    assert e.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == (
        f'segmentation/train.py: error: --show-dir {show_dir}: draws the predictions of a checkpoint; use it with '
        f'--eval (training evaluations draw nothing)')
    path = str(tmp_path / 'seg.pth')
    torch.save({'task': 'segmentation', 'model': upernet.build_segmentor('NALAFORMER_XT', 5, channels=8)
                .state_dict(), 'args': {'model': 'NALAFORMER_XT', 'num_classes': 5, 'channels': 8}}, path)
    (tmp_path / 'a_file').write_text('')
    unwritable = tmp_path / 'a_file' / 'show'
    assert _run(['--eval', '--resume', path, '--data-path', root, '--show-dir', str(unwritable)]) == 1
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [f'error: --show-dir {unwritable}: cannot write there (Not a '
                                                 f'directory); choose a writable folder']
    assert 'Model:' not in captured.out and 'Test: [' not in captured.out and not show_dir.exists()


def _bad_val_label(data, pixels):
    """Replace the second validation label map by `pixels` (uint8, its image's size or not)."""
    _, label = ade.scan(data, 'validation')[1]
    Image.fromarray(pixels).save(label)
    return label


def test_a_bad_validation_label_map_ends_the_run_before_training(root, tmp_path, capsys):
    """The validation label maps are checked before the first training step, as an evaluation reads them:
    their size and classes (ade.check_labels); the run ends with the one line and leaves nothing."""
    data = _copy(root, tmp_path)
    argv = ['--data-path', data, '--model', 'NALAFORMER_XT', '--num-classes', '5', '--channels', '16', '--iters',
            '1', '--batch-size', '2', '--crop-size', '32', '--img-scale', '64', '32', '--output_dir',
            str(tmp_path / 'out')]
    for pixels, line in ((np.ones((20, 24), np.uint8), r'the label map is 24x20 but its image .* is 48x40'),
                         (np.full((40, 48), 9, np.uint8), r'holds label 9, above the 5 classes of --num-classes 5')):
        label = _bad_val_label(data, pixels)
        assert _run(argv) == 1
        captured = capsys.readouterr()
        assert re.search(f'^error: {re.escape(label)}: {line}', captured.err, re.M), captured.err
        assert 'Model:' not in captured.out and 'Iter [' not in captured.out
        assert not os.path.exists(tmp_path / 'out')
    pairs = ade.scan(root, 'validation')
    assert ade.check_labels(pairs, 5) == sum(int((ade.read_pair(*pair, 5)[1] != 255).sum()) for pair in pairs)


def test_a_validation_set_without_a_labelled_pixel_is_refused(root, tmp_path, capsys):
    data = _copy(root, tmp_path)
    for _, label in ade.scan(data, 'validation'):
        Image.fromarray(np.full((40, 48), 255 if label.endswith('1.png') else 0, np.uint8)).save(label)
    assert _run(['--data-path', data, '--model', 'NALAFORMER_XT', '--num-classes', '5', '--iters', '1']) == 1
    assert (f'error: --data-path {data}: no validation label map holds a class (every pixel is 0, "other", or 255, '
            f'both ignored), so there is no mIoU to measure') in capsys.readouterr().err


def test_training_batches_without_a_labelled_pixel_get_a_note(root, tmp_path, capsys, one_thread):
    data = _copy(root, tmp_path)
    for _, label in ade.scan(data, 'training'):
        Image.fromarray(np.zeros((40, 48), np.uint8)).save(label)
    assert _run(['--data-path', data, '--model', 'NALAFORMER_XT', '--num-classes', '5', '--channels', '8',
                 '--iters', '2', '--batch-size', '2', '--crop-size', '32', '--img-scale', '64', '32',
                 '--print-freq', '1', '--warmup-iters', '0']) == 0
    out = capsys.readouterr().out
    assert re.findall(r'^Iter \[\d/2\].*loss: (\S+)', out, re.M) == ['0.0000', '0.0000']
    notes = [line for line in out.splitlines() if 'no labelled pixel' in line]
    assert notes == ['Note: the training batches of iterations 1..1 hold no labelled pixel (every label is 0, '
                     '"other", or 255, both ignored): their loss is 0 and nothing is learnt; label maps hold the '
                     'classes as 1..5'], out


def test_a_resume_adds_the_evaluation_line_log_txt_lacks(tmp_path, capsys):
    """The segmentation run's log repair is the classification run's, keyed on the iteration: the checkpoint's
    record is added when log.txt has no line of its iteration, after a half-written last line is dropped."""
    from run.output_dir import add_missing_log_line
    log = tmp_path / 'log.txt'
    log.write_text('{"iter": 100, "mIoU": 10.0}\n{"iter": 2')
    record = {'iter': 200, 'mIoU': 20.0}
    add_missing_log_line(str(tmp_path), record, key='iter')
    assert [json.loads(line) for line in log.read_text().splitlines()] == [{'iter': 100, 'mIoU': 10.0}, record]
    out = capsys.readouterr().out
    assert 'dropped a half-written last line' in out and 'added the line of iteration 200' in out
    add_missing_log_line(str(tmp_path), record, key='iter')  # present: nothing added
    assert len(log.read_text().splitlines()) == 2 and 'Repaired' not in capsys.readouterr().out


# ------------------------------------------------------------------------------- the recipes and a run's output
def test_decoder_fpn_takes_the_semantic_fpn_recipe_and_its_checkpoint_records_it(tmp_path, capsys):
    """--decoder fpn: the schedule and head defaults of Semantic FPN's 80k recipe (a given flag wins); a checkpoint
    records the decoder, so its evaluation or resume takes it and that recipe's defaults; another given decoder is
    refused in one line."""
    from run.errors import CheckpointError
    parse = seg_train.get_args_parser().parse_args
    keys = ('decoder', 'iters', 'lr', 'weight_decay', 'power', 'warmup_iters', 'channels', 'aux_weight',
            'eval_interval', 'save_interval')
    args = parse(['--data-path', 'x'])
    seg_train.take_flags(args, '')
    assert tuple(getattr(args, k) for k in keys) == ('upernet', 160000, 6e-5, 0.01, 1.0, 1500, 512, 0.4, 16000, 16000)
    args = parse(['--data-path', 'x', '--decoder', 'fpn', '--lr', '2e-4'])
    seg_train.take_flags(args, '')
    assert tuple(getattr(args, k) for k in keys) == ('fpn', 80000, 2e-4, 1e-4, 0.9, 0, 128, 0.0, 8000, 8000)
    path = str(tmp_path / 'seg.pth')
    torch.save({'task': 'segmentation', 'args': {'decoder': 'fpn', 'model': 'NALAFORMER_XT', 'channels': 128,
                                                 'aux_weight': 0.0}}, path)
    capsys.readouterr()
    args = parse(['--data-path', 'x'])
    seg_train.take_flags(args, path)
    assert (args.decoder, args.iters, args.channels, args.power) == ('fpn', 80000, 128, 0.9)
    assert f'--decoder fpn --model NALAFORMER_XT: as recorded in {path}' in capsys.readouterr().out
    with pytest.raises(CheckpointError, match='holds a model built with --decoder fpn, this command passes '
                                              '--decoder upernet'):
        seg_train.take_flags(parse(['--data-path', 'x', '--decoder', 'upernet']), path)


def test_the_global_batch_warning_names_the_numbers_and_the_fix(monkeypatch, capsys):
    import argparse

    from run import distributed
    for world, batch, line in ((1, 2, "global batch 2 (1 process(es) x --batch-size 2) differs from the recipe's 16"
                                      ', for which its LR and schedule are set; for 16 images a step: run 8 processes '
                                      'x --batch-size 2 or --batch-size 16 on 1 process(es) (there is no gradient '
                                      'accumulation)'),
                               (4, 2, 'global batch 8 (4 process(es) x --batch-size 2)'),
                               (3, 2, 'a step: run 8 processes x --batch-size 2 (there'),
                               (8, 2, None), (1, 16, None), (2, 8, None)):
        monkeypatch.setattr(distributed, 'get_world_size', lambda w=world: w)
        seg_train.warn_global_batch(argparse.Namespace(batch_size=batch))
        out = capsys.readouterr().out
        assert (line in out and out.startswith('Warning: ')) if line else out == '', (world, batch, out)


def test_a_run_writes_args_json_the_class_tables_and_both_final_scores(root, tmp_path, capsys, one_thread):
    """A training run writes --output_dir/args.json as main.py does (the whole command line, the recipe's values
    filled in), warns that its global batch is not 16, prints mmseg's per-class table at each evaluation with the
    scene set's class names, logs each class's IoU and Acc by name, and ends with the last and the best mIoU.
    --eval --aug-test of its checkpoint logs the multi-scale + flip scores and leaves args.json alone."""
    out = tmp_path / 'out'
    argv = ['--data-path', root, '--model', 'NALAFORMER_XT', '--num-classes', '5', '--channels', '8', '--iters', '2',
            '--batch-size', '2', '--crop-size', '32', '--img-scale', '64', '32', '--eval-interval', '1',
            '--warmup-iters', '0', '--lr', '1e-3', '--output_dir', str(out)]
    assert _run(argv) == 0
    stdout = capsys.readouterr().out
    saved = json.loads((out / 'args.json').read_text())
    assert (saved['iters'], saved['decoder'], saved['power'], saved['output_dir']) == (2, 'upernet', 1.0, str(out))
    assert "Warning: global batch 2 (1 process(es) x --batch-size 2) differs from the recipe's 16" in stdout
    records = [json.loads(line) for line in (out / 'log.txt').read_text().splitlines()]
    tables = re.findall(r'^per class results:\n((?:[|+].*\n)+)Iteration (\d):', stdout, re.M)
    assert [r['iter'] for r in records] == [1, 2] and [int(i) for _, i in tables] == [1, 2]
    for (table, _), record in zip(tables, records):
        for name in scenes.CLASS_NAMES:
            iou, acc = record[f'IoU.{name}'], record[f'Acc.{name}']
            shown = ['nan' if v is None else f'{v:.2f}' for v in (iou, acc)]
            assert re.search(rf'^\| {name} +\| +{shown[0]} \| +{shown[1]} \|$', table, re.M), (name, table)
    best = max(records, key=lambda r: r['mIoU'])
    assert (f"Training done: mIoU {records[-1]['mIoU']:.2f} at the last iteration (2), best mIoU {best['mIoU']:.2f} "
            f"at iteration {best['iter']}") in stdout
    before = (out / 'args.json').read_text()
    assert _run(['--eval', '--resume', str(out / 'checkpoint.pth'), '--data-path', root, '--aug-test', '--output_dir',
                 str(out)]) == 0
    assert '(3 images, whole-image inference, 6 scales + flip)' in capsys.readouterr().out
    last = json.loads((out / 'log.txt').read_text().splitlines()[-1])
    assert last['aug_test'] is True and last['eval'] == str(out / 'checkpoint.pth') and 'IoU.checkerboard' in last
    assert (out / 'args.json').read_text() == before


def test_a_semantic_fpn_run_and_its_evaluation(root, tmp_path, capsys, one_thread):
    """--decoder fpn trains Semantic FPN with its recipe's values (args.json), and --eval of its checkpoint without
    a model flag rebuilds it from the recorded decoder and scores it as the run did."""
    out = tmp_path / 'out'
    assert _run(['--data-path', root, '--model', 'NALAFORMER_XT', '--num-classes', '5', '--decoder', 'fpn',
                 '--iters', '1', '--batch-size', '2', '--crop-size', '32', '--img-scale', '64', '32',
                 '--output_dir', str(out)]) == 0
    stdout = capsys.readouterr().out
    assert 'Model: Semantic FPN (neck 256, head 128 channels) over NALAFORMER_XT' in stdout
    saved = json.loads((out / 'args.json').read_text())
    assert (saved['decoder'], saved['lr'], saved['weight_decay'], saved['power'], saved['aux_weight']) == (
        'fpn', 1e-4, 1e-4, 0.9, 0.0)
    assert _run(['--eval', '--resume', str(out / 'checkpoint.pth'), '--data-path', root]) == 0
    evaluated = capsys.readouterr().out
    assert 'Model: Semantic FPN (neck 256, head 128 channels)' in evaluated
    assert re.findall(r'mIoU \S+  mAcc \S+  aAcc \S+', evaluated) == re.findall(r'mIoU \S+  mAcc \S+  aAcc \S+',
                                                                                stdout)
