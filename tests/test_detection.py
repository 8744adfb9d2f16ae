"""COCO detection: the layout and its errors, mmdet's annotation rules and pipelines, the grouped sampler, the
Mask R-CNN with mmdet's settings, pretrained loading, recipes, COCO evaluation (exact under DDP) and pictures."""
import json
import math
import os

import numpy as np
import pytest
import torch
from PIL import Image
from pycocotools import mask as mask_utils

from detection import coco, evaluate, shapes
from detection import model as dm
from run.errors import CheckpointError
from run.weights import load_backbone_weights
from training.optim import weight_decay_groups

pytestmark = pytest.mark.usefixtures('one_thread')


@pytest.fixture(scope='module')
def shapes_root(tmp_path_factory):
    return shapes.make_shapes(str(tmp_path_factory.mktemp('shapes')), n_train=16, n_val=10, seed=1)


def write_set(root, split='val2017', images=None, annotations=None, categories=None, pixels=True):
    """A COCO-layout folder with one split: `images` as (id, width, height), written as flat grey JPEGs."""
    images = [(1, 64, 48)] if images is None else images
    os.makedirs(os.path.join(root, split), exist_ok=True)
    os.makedirs(os.path.join(root, 'annotations'), exist_ok=True)
    entries = []
    for image_id, w, h in images:
        name = f'{image_id:012d}.jpg'
        if pixels:
            Image.new('RGB', (w, h), (128, 128, 128)).save(os.path.join(root, split, name))
        entries.append({'id': image_id, 'file_name': name, 'width': w, 'height': h})
    data = {'images': entries, 'annotations': annotations or [],
            'categories': categories or [{'id': 3, 'name': 'a'}, {'id': 7, 'name': 'b'}]}
    path = os.path.join(root, 'annotations', f'instances_{split}.json')
    with open(path, 'w') as f:
        json.dump(data, f)
    return path


def ann(ann_id, image_id, bbox, category=3, crowd=0, segmentation=None):
    x, y, w, h = (list(bbox) + [1, 1, 1, 1])[:4] if all(isinstance(v, (int, float)) for v in bbox) else (1, 1, 1, 1)
    segm = segmentation if segmentation is not None else [[x, y, x + w, y, x + w, y + h, x, y + h]]
    return {'id': ann_id, 'image_id': image_id, 'category_id': category, 'bbox': bbox, 'iscrowd': crowd,
            'area': w * h, 'segmentation': segm}


# --------------------------------------------------------------------------------------------------
# Layout and annotation errors: one line naming the file and the fix
# --------------------------------------------------------------------------------------------------
def one_line_error(root, split='val2017', match=None, **kwargs):
    with pytest.raises(coco.AnnotationError) as e:
        ds = coco.CocoDetection(str(root), split, **kwargs)
        ds.sample(0, True)
    assert '\n' not in str(e.value)
    if match:
        assert match in str(e.value), str(e.value)
    return str(e.value)


def test_missing_root_folder(tmp_path):
    assert '--data-path' in one_line_error(tmp_path / 'nowhere', match='no such folder')


def test_missing_split_names_the_nested_coco_folder(tmp_path):
    write_set(str(tmp_path / 'coco'))
    msg = one_line_error(tmp_path, match='val2017: no such folder')
    assert f'--data-path {tmp_path / "coco"} holds it' in msg


def test_missing_annotation_file(tmp_path):
    write_set(str(tmp_path))
    os.remove(tmp_path / 'annotations' / 'instances_val2017.json')
    one_line_error(tmp_path, match='instances_val2017.json: no such file')


@pytest.mark.parametrize('edit, match', [
    (lambda d: d.pop('annotations'), 'not a COCO instances file'),
    (lambda d: d['annotations'].append(ann(9, 999, [1, 1, 5, 5])), 'annotation 9 names image 999'),
    (lambda d: d['annotations'].append(ann(9, 1, [1, 1, 5, 5], category=4)), 'annotation 9 names category 4'),
    (lambda d: d['annotations'].append(ann(9, 1, [1, 1, 5])), 'annotation 9 has bbox [1, 1, 5]'),
    (lambda d: d['annotations'].append(ann(9, 1, [1, 1, 5, 'x'])), 'not [x, y, width, height]'),
    (lambda d: d['images'].append(dict(d['images'][0])), 'image id 1 appears twice'),
    (lambda d: d['annotations'].append(ann(9, 1, [1, 1, 5, 5], segmentation='poly')), 'neither polygons nor RLE'),
], ids=['no-annotations', 'unknown-image', 'unknown-category', 'bbox-length', 'bbox-number', 'duplicate-image',
        'segmentation-type'])
def test_inconsistent_annotation_file(tmp_path, edit, match):
    path = write_set(str(tmp_path))
    with open(path) as f:
        data = json.load(f)
    edit(data)
    with open(path, 'w') as f:
        json.dump(data, f)
    assert one_line_error(tmp_path, match=match).startswith(path)


def test_annotation_file_that_is_not_json(tmp_path):
    path = write_set(str(tmp_path))
    with open(path, 'w') as f:
        f.write('{"images": [')
    one_line_error(tmp_path, match='not a JSON file')


def test_missing_image_file_is_named_with_the_count(tmp_path):
    write_set(str(tmp_path), images=[(1, 64, 48), (2, 64, 48), (3, 64, 48)])
    os.remove(tmp_path / 'val2017' / '000000000002.jpg')
    os.remove(tmp_path / 'val2017' / '000000000003.jpg')
    one_line_error(tmp_path, match='000000000002.jpg: missing (and 1 more)')


def test_image_of_another_size_than_the_file_says(tmp_path):
    write_set(str(tmp_path), images=[(1, 64, 48)])
    Image.new('RGB', (50, 48)).save(tmp_path / 'val2017' / '000000000001.jpg')
    one_line_error(tmp_path, match='the image is 50x48 but')


def test_undecodable_image(tmp_path):
    write_set(str(tmp_path))
    (tmp_path / 'val2017' / '000000000001.jpg').write_bytes(b'not a jpeg')
    one_line_error(tmp_path, match='cannot be decoded')


def test_undecodable_segmentation_names_the_annotation(tmp_path):
    write_set(str(tmp_path), annotations=[ann(5, 1, [1, 1, 9, 9], segmentation={'counts': 'zz', 'size': [3, 3]})])
    one_line_error(tmp_path, match='annotation 5')


# --------------------------------------------------------------------------------------------------
# mmdet's annotation rules
# --------------------------------------------------------------------------------------------------
def test_crowds_degenerate_boxes_and_empty_images_as_mmdet(tmp_path):
    anns = [ann(1, 1, [4, 6, 20, 10]), ann(2, 1, [30, 5, 10, 10], crowd=1),  # image 1: one object, one crowd
            ann(3, 1, [2, 2, 0.5, 9]), ann(4, 1, [70, 5, 9, 9]),  # under a pixel wide; outside the image
            ann(5, 1, [40, 30, 8, 6], category=7),
            ann(6, 3, [5, 5, 10, 10], crowd=1),  # image 3: a crowd only (mmdet keeps it, without targets)
            ann(7, 4, [1, 1, 5, 5])]  # image 4: under 32 px on its short side
    write_set(str(tmp_path), 'train2017', images=[(1, 64, 48), (2, 64, 48), (3, 64, 48), (4, 64, 20)],
              annotations=anns)
    train = coco.CocoDetection(str(tmp_path), 'train2017', pipeline=coco.TrainPipeline())
    assert train.image_ids == [1, 3]
    assert train.dropped == {'without annotations': 1, 'under 32 px': 1}
    s = train.sample(0, masks=True)
    assert s.boxes.tolist() == [[4, 6, 24, 16], [40, 30, 48, 36]]
    assert s.labels.tolist() == [1, 2] and train.label_to_category == [0, 3, 7]
    assert s.masks.shape == (2, 48, 64) and s.masks[0].sum() == 20 * 10
    crowd_only = train.sample(1, masks=True)
    assert crowd_only.boxes.shape == (0, 4) and crowd_only.masks.shape == (0, 48, 64)
    val = coco.CocoDetection(str(tmp_path), 'train2017')  # evaluation keeps every image
    assert val.image_ids == [1, 2, 3, 4]


def test_masks_from_polygons_compressed_and_uncompressed_rle():
    h, w = 20, 30
    expected = np.zeros((h, w), np.uint8)
    expected[4:12, 5:17] = 1
    rle = mask_utils.encode(np.asfortranarray(expected))
    flat = expected.flatten(order='F')
    runs = np.diff(np.concatenate([[0], np.flatnonzero(np.diff(flat)) + 1, [flat.size]])).tolist()
    for segm in ({'counts': rle['counts'].decode(), 'size': [h, w]}, {'counts': runs, 'size': [h, w]},
                 [[5, 4, 17, 4, 17, 12, 5, 12]]):
        assert np.array_equal(coco.decode_mask(segm, h, w, 'x'), expected)
    with pytest.raises(coco.AnnotationError, match='is 30x20 but its image is 31x20'):
        coco.decode_mask({'counts': rle['counts'].decode(), 'size': [h, w]}, h, 31, 'x')


def test_synthetic_set_exercises_the_filters(shapes_root):
    train = coco.CocoDetection(shapes_root, 'train2017', pipeline=coco.TrainPipeline())
    anns = train.coco.dataset['annotations']
    assert train.dropped['without annotations'] > 0 and any(a['iscrowd'] for a in anns)
    assert {type(a['segmentation']) for a in anns} == {list, dict}
    assert train.label_to_category == [0, 2, 5, 9] and train.class_names == ['rectangle', 'ellipse', 'triangle']
    assert set(train.aspect_groups()) == {0, 1}
    for i in range(len(train)):  # every shape is painted from its own mask: its box is its mask's extent
        s = train.sample(i, masks=True)
        for box, m in zip(s.boxes, s.masks):
            ys, xs = np.nonzero(m)
            assert [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1] == pytest.approx(box.tolist(), abs=1e-4)


# --------------------------------------------------------------------------------------------------
# Transforms
# --------------------------------------------------------------------------------------------------
def rect_sample(h, w, boxes):
    masks = np.zeros((len(boxes), h, w), np.uint8)
    for m, (x0, y0, x1, y1) in zip(masks, boxes):
        m[y0:y1, x0:x1] = 1
    return coco.Sample(np.random.default_rng(0).integers(0, 255, (h, w, 3), dtype=np.uint8),
                       np.array(boxes, np.float32).reshape(-1, 4), np.arange(1, len(boxes) + 1), masks)


def mask_extent(m):
    ys, xs = np.nonzero(m)
    return [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]


def test_flip_moves_boxes_with_masks():
    s = rect_sample(40, 50, [(2, 3, 12, 20), (30, 10, 50, 40)])
    image = s.image.copy()
    coco.flip(s)
    assert s.boxes.tolist() == [[38, 3, 48, 20], [0, 10, 20, 40]]
    assert [mask_extent(m) for m in s.masks] == s.boxes.tolist()
    assert np.array_equal(s.image, image[:, ::-1])


def test_rescale_keeps_ratio_caps_the_long_side_and_scales_boxes():
    s = rect_sample(40, 50, [(2, 3, 12, 20)])
    coco.rescale(s, short=80, max_size=1333)  # x2
    assert s.image.shape == (80, 100, 3) and s.masks.shape == (1, 80, 100)
    assert s.boxes.tolist() == [[4, 6, 24, 40]] and mask_extent(s.masks[0]) == [4, 6, 24, 40]
    s = rect_sample(480, 640, [])
    coco.rescale(s, short=800, max_size=1333)  # mmcv's rescale_size: 640x480 -> 1067x800
    assert s.image.shape[:2] == (800, 1067)
    s = rect_sample(100, 400, [(0, 0, 400, 100)])
    coco.rescale(s, short=800, max_size=1333)  # the long side would pass 1333
    assert s.image.shape[:2] == (333, 1333) and s.boxes.tolist() == [[0, 0, 1333, 333]]


def test_crop_clips_boxes_drops_empty_ones_and_keeps_a_negative_crop():
    s = rect_sample(100, 100, [(10, 10, 30, 30), (60, 60, 95, 95)])
    rng = np.random.default_rng(3)
    coco.random_crop(s, (40, 60), rng)
    h, w = s.image.shape[:2]
    assert 40 <= h <= 60 and 40 <= w <= 60 and s.masks.shape[1:] == (h, w)
    assert ((s.boxes[:, 2] > s.boxes[:, 0]) & (s.boxes[:, 3] > s.boxes[:, 1])).all()
    assert [mask_extent(m) for m in s.masks] == s.boxes.tolist() and len(s.labels) == len(s.boxes)
    negatives = 0
    for seed in range(40):
        s = rect_sample(100, 100, [(0, 0, 8, 8)])
        coco.random_crop(s, (20, 30), np.random.default_rng(seed))
        negatives += len(s.boxes) == 0
        assert len(s.masks) == len(s.boxes) == len(s.labels)
    assert negatives > 0  # allow_negative_crop: a crop without objects is still a sample


@pytest.mark.parametrize('pipeline, tolerance', [
    (coco.TrainPipeline(scales=(64, 80), max_size=120, crop_scales=(48, 56), crop_range=(40, 50)), 2.7),
    (coco.TrainPipeline(scales=(72,), max_size=120, crop_scales=()), 1)], ids=['multiscale-crop', 'single-scale'])
def test_pipeline_keeps_boxes_on_their_masks(pipeline, tolerance):
    sizes = set()
    for seed in range(30):
        s = rect_sample(60, 90, [(5, 5, 30, 25), (40, 20, 85, 55), (10, 40, 20, 58)])
        s = pipeline(s, np.random.default_rng(seed))
        h, w = s.image.shape[:2]
        sizes.add(min(h, w))
        assert s.masks.shape[1:] == (h, w)
        assert min(h, w) in pipeline.scales or max(h, w) == pipeline.max_size
        for box, m in zip(s.boxes, s.masks):  # nearest-neighbour masks: within a pixel per resize of the box
            assert np.abs(np.array(mask_extent(m)) - box).max() <= tolerance
    assert sizes <= set(pipeline.scales) | {int(pipeline.max_size * 60 / 90 + 0.5)}


def test_training_items_are_seeded_by_epoch_and_index(shapes_root):
    train = coco.CocoDetection(shapes_root, 'train2017', pipeline=coco.TrainPipeline(scales=(64, 96), max_size=160,
                                                                                     crop_scales=(48,),
                                                                                     crop_range=(40, 48)))
    a, b = train[(3, 2)], train[(3, 2)]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1]['boxes'], b[1]['boxes'])
    assert a[0].dtype == torch.uint8 and a[1]['masks'].shape[1:] == a[0].shape[1:]
    others = [train[(e, 2)][0] for e in range(4, 8)]
    assert any(o.shape != a[0].shape or not torch.equal(o, a[0]) for o in others)


def test_evaluation_items_fit_the_test_scale(shapes_root):
    val = coco.CocoDetection(shapes_root, 'val2017', test_scale=(1333, 800))
    image, target = val[0]
    info = val.coco.imgs[target['image_id']]
    h, w = target['orig_size']
    assert (h, w) == (info['height'], info['width'])
    assert min(image.shape[1:]) == 800 or max(image.shape[1:]) == 1333


# --------------------------------------------------------------------------------------------------
# The grouped batch sampler
# --------------------------------------------------------------------------------------------------
def mmdet_group_batches(groups, batch_size, world, rank, seed, epoch):
    """mmdet's DistributedGroupSampler written out as its loops, for comparison."""
    g = torch.Generator()
    g.manual_seed(epoch + seed)
    indices = []
    for flag in sorted(set(groups)):
        indice = [i for i, f in enumerate(groups) if f == flag]
        indice = [indice[j] for j in torch.randperm(len(indice), generator=g).tolist()]
        extra = math.ceil(len(indice) / batch_size / world) * batch_size * world - len(indice)
        tmp = list(indice)
        for _ in range(extra // len(tmp)):
            indice.extend(tmp)
        indice.extend(tmp[:extra % len(tmp)])
        indices.extend(indice)
    indices = [indices[j] for i in torch.randperm(len(indices) // batch_size, generator=g).tolist()
               for j in range(i * batch_size, (i + 1) * batch_size)]
    per_rank = len(indices) // world
    mine = indices[per_rank * rank:per_rank * (rank + 1)]
    return [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]


@pytest.mark.parametrize('world', [1, 2, 3])
def test_grouped_sampler_is_mmdets_order(world):
    groups = [int(v) for v in np.random.default_rng(0).random(23) > 0.35]
    for rank in range(world):
        s = coco.GroupedBatchSampler(groups, 2, world, rank, seed=5, end=None)
        for epoch in (0, 1):
            assert s.epoch_batches(epoch) == mmdet_group_batches(groups, 2, world, rank, 5, epoch)


def test_grouped_sampler_batches_one_group_and_covers_every_image():
    groups = [0] * 7 + [1] * 12
    batches = [coco.GroupedBatchSampler(groups, 3, 2, r, seed=1).epoch_batches(4) for r in range(2)]
    assert len(batches[0]) == len(batches[1]) == coco.GroupedBatchSampler(groups, 3, 2, 0).steps == 4
    for b in batches[0] + batches[1]:
        assert len(b) == 3 and len({groups[i] for i in b}) == 1
    assert {i for part in batches for b in part for i in b} == set(range(19))
    assert batches[0] != coco.GroupedBatchSampler(groups, 3, 2, 0, seed=1).epoch_batches(5)


def test_grouped_sampler_resumes_inside_an_epoch():
    groups = [0, 1] * 9
    full = list(coco.GroupedBatchSampler(groups, 2, 1, 0, seed=3, start=0, end=25))
    steps = coco.GroupedBatchSampler(groups, 2, 1, 0).steps
    assert len(full) == 25 and steps == 10
    for start in (0, 7, 10, 13):
        resumed = list(coco.GroupedBatchSampler(groups, 2, 1, 0, seed=3, start=start, end=25))
        assert resumed == full[start:]
        assert resumed[0][0][0] == start // steps  # keyed by the epoch of iteration `start`


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------
SMALL_HEADS = dm.Heads(fpn_channels=32, box_fc=64, mask_channels=16, mask_convs=2)


@pytest.fixture(scope='module')
def xt_detector():
    """Mask R-CNN over NALAFORMER_XT with narrow heads (the mmdet settings are those of the full width)."""
    torch.manual_seed(0)
    return dm.build_detector('NALAFORMER_XT', 2, mask=True, heads=SMALL_HEADS)


def test_detector_has_mmdets_settings():
    d = dm.build_detector('NALAFORMER_XT', 2, mask=True)
    assert d.rpn._pre_nms_top_n == {'training': 2000, 'testing': 1000}
    assert d.rpn._post_nms_top_n == {'training': 1000, 'testing': 1000}
    assert d.rpn.nms_thresh == 0.7 and d.rpn.fg_bg_sampler.batch_size_per_image == 256
    assert (d.rpn.proposal_matcher.high_threshold, d.rpn.proposal_matcher.low_threshold,
            d.rpn.proposal_matcher.min_pos_iou) == (0.7, 0.3, 0.3)
    r = d.roi_heads
    assert (r.box_roi_pool.aligned, r.box_roi_pool.sampling_ratio, r.box_roi_pool.output_size) == (True, 0, 7)
    assert (r.mask_roi_pool.aligned, r.mask_roi_pool.sampling_ratio, r.mask_roi_pool.output_size) == (True, 0, 14)
    assert (r.fg_bg_sampler.batch_size_per_image, r.fg_bg_sampler.positive_fraction) == (512, 0.25)
    assert (r.score_thresh, r.nms_thresh, r.detections_per_img) == (0.05, 0.5, 100)
    assert r.box_coder.weights == (10.0, 10.0, 5.0, 5.0) and r.box_head.fc6.out_features == 1024
    assert d.backbone.out_channels == 256 and len(r.mask_head) == 4
    assert isinstance(d.backbone.norms[0], dm.LayerNorm2d)


def tiny_batch(mask=True):
    images, targets = [], []
    for h, w in ((64, 96), (96, 64)):
        images.append(torch.randint(0, 256, (3, h, w), dtype=torch.uint8))
        boxes = torch.tensor([[4.0, 6.0, 40.0, 50.0], [30.0, 20.0, 60.0, 60.0]])
        t = {'boxes': boxes, 'labels': torch.tensor([1, 2])}
        if mask:
            m = torch.zeros(2, h, w, dtype=torch.uint8)
            for k, (x0, y0, x1, y1) in enumerate(boxes.int().tolist()):
                m[k, y0:y1, x0:x1] = 1
            t['masks'] = m
        targets.append(t)
    return images, targets


def test_mask_rcnn_trains_and_predicts_at_the_original_size(xt_detector):
    d = xt_detector
    images, targets = tiny_batch()
    d.train()
    losses = d(images, targets)
    assert set(losses) == {'loss_objectness', 'loss_rpn_box_reg', 'loss_classifier', 'loss_box_reg', 'loss_mask'}
    assert all(torch.isfinite(v) for v in losses.values())
    d.zero_grad()
    sum(losses.values()).backward()
    assert d.backbone.body.model.patch_embed.proj[0].weight.grad.abs().sum() > 0
    d.eval()
    with torch.no_grad():
        out = d(images, original_sizes=[(128, 192), (192, 128)])
        same = d(images)
    assert out[0]['masks'].shape[1:] == (128, 192) and out[0]['masks'].dtype == torch.bool
    assert same[1]['masks'].shape[1:] == (96, 64)
    assert torch.allclose(out[0]['boxes'], same[0]['boxes'] * 2)  # rescaled to the original size


def test_faster_rcnn_without_mask():
    torch.manual_seed(0)
    d = dm.build_detector('NALAFORMER_XT', 2, mask=False, heads=SMALL_HEADS)
    images, targets = tiny_batch(mask=False)
    d.train()
    assert 'loss_mask' not in d(images, targets) and not d.roi_heads.has_mask()
    d.eval()
    with torch.no_grad():
        assert 'masks' not in d(images)[0]


def test_box_losses_are_l1_over_the_sampled_rois():
    logits = torch.randn(5, 3)
    deltas = torch.randn(5, 12)
    labels = [torch.tensor([0, 2, 1]), torch.tensor([1, 0])]
    targets = [torch.randn(3, 4), torch.randn(2, 4)]
    ce, l1 = dm.box_losses(logits, deltas, labels, targets)
    lab, tg, d = torch.cat(labels), torch.cat(targets), deltas.view(5, 3, 4)
    expected = sum((d[i, lab[i]] - tg[i]).abs().sum() for i in range(5) if lab[i] > 0) / 5
    assert torch.allclose(l1, expected) and torch.allclose(ce, torch.nn.functional.cross_entropy(logits, lab))


def test_rpn_loss_is_l1():
    d = dm.build_detector('NALAFORMER_XT', 2, mask=False, heads=dm.Heads(rpn_batch=8))
    labels = [torch.tensor([1.0, 0.0, -1.0, 1.0, 0.0, 0.0])]
    targets = [torch.randn(6, 4)]
    pred = torch.randn(6, 4)
    torch.manual_seed(0)
    _, box = d.rpn.compute_loss(torch.randn(6, 1), pred, labels, targets)
    pos = [0, 3]
    expected = (pred[pos] - targets[0][pos]).abs().sum() / 5  # 2 positives + 3 negatives sampled
    assert torch.allclose(box, expected)


def test_roi_align_levels_and_alignment():
    pool = dm.MultiLevelRoIAlign(2)
    sides = torch.tensor([50.0, 111.0, 113.0, 224.0, 447.0, 449.0, 2000.0])
    boxes = torch.stack([torch.zeros(7), torch.zeros(7), sides, sides], 1)
    assert pool.levels(boxes).tolist() == [0, 0, 1, 2, 2, 3, 3]  # mmdet: floor(log2(side / 56 + 1e-6))
    feats = {str(i): torch.arange(64.0).view(1, 1, 8, 8).repeat(1, 2, 1, 1) for i in range(4)}
    box = torch.tensor([[4.0, 4.0, 20.0, 20.0]])
    out = pool(feats, [box], [(32, 32)])
    from torchvision.ops import roi_align
    rois = torch.tensor([[0.0, 4.0, 4.0, 20.0, 20.0]])
    assert torch.allclose(out, roi_align(feats['0'], rois, 2, 0.25, 0, aligned=True))
    assert not torch.allclose(out, roi_align(feats['0'], rois, 2, 0.25, 0, aligned=False))


def test_matcher_low_quality_rule_is_mmdets():
    m = dm.MaxIoUMatcher(0.7, 0.3, min_pos_iou=0.3)
    iou = torch.tensor([[0.25, 0.1, 0.0, 0.0],   # gt 0: best 0.25 < 0.3: no low-quality match
                        [0.0, 0.4, 0.4, 0.1],    # gt 1: best 0.4 (a tie): both predictions
                        [0.0, 0.0, 0.4, 0.8]])   # gt 2: 0.8 matches; also claims prediction 2 (best? no: 0.8)
    matches = m(iou)
    assert matches.tolist() == [-1, 1, 1, 2]
    iou = torch.tensor([[0.5, 0.0], [0.5, 0.1]])  # two gts claim prediction 0: the later one, as mmdet's loop
    assert dm.MaxIoUMatcher(0.7, 0.3, 0.3)(iou).tolist()[0] == 1


def test_anchors_are_mmdets():
    a = dm.Anchors()
    base = a.cell_anchors[0]
    assert torch.allclose(base[0], torch.tensor([-22.6274, -11.3137, 22.6274, 11.3137]), atol=1e-4)  # not rounded
    from torchvision.models.detection.image_list import ImageList
    images = ImageList(torch.zeros(1, 3, 800, 1344), [(800, 1344)])
    maps = [torch.zeros(1, 1, 800 // s, 1344 // s) for s in (4, 8, 16, 32)] + [torch.zeros(1, 1, 13, 21)]
    anchors = a(images, maps)[0]
    last = anchors[-13 * 21 * 3:].view(13, 21, 3, 4)
    assert torch.allclose(last[0, 1, 1] - last[0, 0, 1], torch.tensor([64.0, 0, 64, 0]))  # 64, not 1344 // 21


def test_paste_masks_fills_the_pixels_whose_centres_are_in_the_box():
    box = torch.tensor([[10.2, 20.7, 50.4, 40.1]])
    pasted = dm.paste_masks(torch.ones(1, 28, 28), box, (64, 64))
    ys, xs = torch.meshgrid(torch.arange(64) + 0.5, torch.arange(64) + 0.5, indexing='ij')
    inside = (xs > 10.2) & (xs < 50.4) & (ys > 20.7) & (ys < 40.1)
    assert torch.equal(pasted[0], inside)


def test_output_norm_per_backbone():
    assert isinstance(dm.build_backbone('NALAFORMER_XT', 32).norms[3], dm.LayerNorm2d)
    assert isinstance(dm.build_backbone('pvt_v2_b0', 32).norms[3], torch.nn.Identity)  # stages end in a LayerNorm


def test_swin_builds_for_detection_sizes():
    b = dm.build_backbone('swin_tiny_patch4_window7_224', 32).eval()
    with torch.no_grad():
        out = b(torch.zeros(1, 3, 96, 160))
    assert [tuple(v.shape[-2:]) for v in out.values()] == [(24, 40), (12, 20), (6, 10), (3, 5), (2, 3)]


def test_pretrained_loads_the_ema_backbone_strictly(tmp_path, xt_detector):
    import timm
    torch.manual_seed(1)
    cls = timm.create_model('NALAFORMER_XT', num_classes=10)
    ema = {k: v + 1 if v.is_floating_point() else v for k, v in cls.state_dict().items()}
    path = str(tmp_path / 'cls.pth')
    torch.save({'model': cls.state_dict(), 'model_ema': ema}, path)
    line = load_backbone_weights(xt_detector.backbone.body, path, 'NALAFORMER_XT', 'detection')
    assert 'model_ema' in line and 'dropped the classifier' in line
    w = xt_detector.backbone.body.model.patch_embed.proj[0].weight
    assert torch.equal(w, ema['patch_embed.proj.0.weight'])
    del ema['patch_embed.proj.0.weight']
    torch.save({'model_ema': ema}, path)
    with pytest.raises(CheckpointError, match='backbone tensors missing'):
        load_backbone_weights(xt_detector.backbone.body, path, 'NALAFORMER_XT', 'detection')


def test_param_groups_skip_norms_and_biases(xt_detector):
    groups = weight_decay_groups(xt_detector, 0.05)
    decay, no_decay = ({id(p) for p in g['params']} for g in groups)
    d = xt_detector
    assert id(d.backbone.norms[0].weight) in no_decay and id(d.backbone.fpn.inner_blocks[0][0].bias) in no_decay
    assert id(d.backbone.fpn.inner_blocks[0][0].weight) in decay and id(d.roi_heads.box_head.fc6.weight) in decay
    assert len(decay) + len(no_decay) == len(list(d.parameters()))
    assert groups[1]['weight_decay'] == 0 and groups[0]['weight_decay'] == 0.05
    everything = weight_decay_groups(d, 1e-4, decay_all=True)
    assert len(everything[0]['params']) == len(list(d.parameters())) and not everything[1]['params']


def test_recipes():
    r = dm.RECIPES
    assert (r['1x'].lr, r['1x'].weight_decay, r['1x'].epochs, r['1x'].lr_steps) == (1e-4, 0.05, 12, (8, 11))
    assert (r['pvt-1x'].lr, r['pvt-1x'].weight_decay, r['pvt-1x'].pipeline.scales, r['pvt-1x'].pipeline.crop_scales) \
        == (2e-4, 1e-4, (800,), ())
    assert (r['3x'].epochs, r['3x'].lr_steps, r['3x'].pipeline) == (36, (27, 33), r['1x'].pipeline)
    assert r['1x'].pipeline.scales == tuple(range(480, 801, 32)) and r['1x'].pipeline.crop_range == (384, 600)
    assert all(x.batch_size == 16 and x.warmup_iters == 500 and x.warmup_ratio == 0.001 and x.heads == dm.Heads()
               for name, x in r.items() if name != 'demo')
    assert (r['demo'].heads, r['demo'].batch_size, r['demo'].per_process) == (dm.DEMO_HEADS, 4, 4)


def test_lr_steps_by_epoch_and_warms_up_by_iteration():
    r = dm.RECIPES['1x']
    assert dm.step_lr(0, 100, r) == pytest.approx(1e-7)
    assert dm.step_lr(250, 100, r) == pytest.approx(1e-4 * (1 - 0.5 * 0.999))
    assert dm.step_lr(500, 100, r) == dm.step_lr(799, 100, r) == pytest.approx(1e-4)
    assert dm.step_lr(800, 100, r) == pytest.approx(1e-5) and dm.step_lr(1099, 100, r) == pytest.approx(1e-5)
    assert dm.step_lr(1100, 100, r) == pytest.approx(1e-6)


def test_flops_count_the_heads_on_1000_proposals_and_100_masks():
    torch.manual_seed(0)
    d = dm.build_detector('NALAFORMER_XT', 3, heads=SMALL_HEADS)
    from models.flop_count import count_flops
    flops = dm.count_detector_flops(d, (64, 96))
    fewer = count_flops(dm.FlopsForward(d, proposals=30, masks=4), (64, 96))
    per_roi = 32 * 49 * 64 + 64 * 64 + 64 * 4 + 64 * 16  # fc6, fc7, class scores, class-specific deltas
    per_mask = 196 * 9 * (32 * 16 + 16 * 16) + 196 * 16 * 16 * 4 + 784 * 16 * 4  # 2 convs, deconv, logits
    assert flops['total'] - fewer == 970 * per_roi + 96 * per_mask
    assert flops['total'] > flops['backbone'] > 0


# --------------------------------------------------------------------------------------------------
# COCO evaluation
# --------------------------------------------------------------------------------------------------
def ground_truth_detections(val, image_id, keep=None):
    """The non-crowd annotations of an image as detections (original coordinates, score 1)."""
    info = val.coco.imgs[image_id]
    anns = [a for a in val.coco.imgToAnns.get(image_id, []) if not a['iscrowd']]
    if keep is not None:
        anns = anns[:keep]
    boxes = torch.tensor([[a['bbox'][0], a['bbox'][1], a['bbox'][0] + a['bbox'][2], a['bbox'][1] + a['bbox'][3]]
                          for a in anns]).reshape(-1, 4)
    masks = [coco.decode_mask(a['segmentation'], info['height'], info['width'], '') for a in anns]
    masks = np.stack(masks) if masks else np.zeros((0, info['height'], info['width']), np.uint8)
    labels = torch.tensor([val.cat_to_label[a['category_id']] for a in anns], dtype=torch.int64)
    return {'boxes': boxes, 'labels': labels, 'scores': torch.ones(len(anns)), 'masks': torch.from_numpy(masks).bool()}


def test_ground_truth_as_prediction_gives_ap_100(shapes_root):
    val = coco.CocoDetection(shapes_root, 'val2017')
    bbox, segm = [], []
    for image_id in val.image_ids:
        b, s = evaluate.coco_results(ground_truth_detections(val, image_id), image_id, val.label_to_category)
        bbox += b
        segm += s
    result = evaluate.score(val.coco, bbox, segm)
    assert result['box_AP'] == pytest.approx(100) and result['mask_AP'] == pytest.approx(100)
    assert result['box_AP50'] == pytest.approx(100) and len(result['lines']) == 26
    assert evaluate.summary_line(result) == 'box AP 100.0  mask AP 100.0'
    half = evaluate.score(val.coco, bbox[::2], segm[::2])
    assert half['box_AP'] < 90 and half['mask_AP'] < 90
    none = evaluate.score(val.coco, [], [])
    assert none['box_AP'] == 0 and none['mask_AP'] == 0


class GroundTruthModel(torch.nn.Module):
    """Answers each image with its ground truth, jittered by a fixed amount per image and with a false positive:
    an AP neither 0 nor 100 that depends on every image's predictions."""

    def __init__(self, val):
        super().__init__()
        self.val = val
        self.by_size = {}
        self.queue = list(val.image_ids)

    def forward(self, images, original_sizes):
        out = []
        for _ in images:
            image_id = self.queue.pop(0)
            det = ground_truth_detections(self.val, image_id)
            g = torch.Generator().manual_seed(image_id)
            det['boxes'] = det['boxes'] + torch.randn(det['boxes'].shape, generator=g) * 3
            det['scores'] = torch.rand(len(det['scores']), generator=g)
            h, w = original_sizes[len(out)]
            det['boxes'] = torch.cat([det['boxes'], torch.tensor([[0.0, 0.0, w / 2, h / 2]])])
            det['scores'] = torch.cat([det['scores'], torch.tensor([0.9])])
            det['labels'] = torch.cat([det['labels'], torch.tensor([1])])
            det['masks'] = torch.cat([det['masks'], torch.ones(1, h, w, dtype=torch.bool)])
            out.append(det)
        return out


def evaluate_shard(root, world, rank):
    """evaluate() of GroundTruthModel on this rank's share of the validation images."""
    from torch.utils.data import DataLoader

    from samplers import DistributedEvalSampler
    val = coco.CocoDetection(root, 'val2017', test_scale=(96, 64))
    sampler = DistributedEvalSampler(val, world, rank)
    model = GroundTruthModel(val)
    model.queue = [val.image_ids[i] for i in sampler]
    loader = DataLoader(val, batch_size=2, sampler=sampler, collate_fn=coco.collate)
    return evaluate.evaluate(model, loader, val.coco, val.label_to_category, torch.device('cpu'), print_freq=0)


def test_evaluate_scores_the_loader_path(shapes_root):
    result = evaluate_shard(shapes_root, 1, 0)
    assert 20 < result['box_AP'] < 95 and 20 < result['mask_AP'] < 95
    assert result['images'] == 10 and not result['aborted']


def test_an_image_scored_twice_is_an_error(shapes_root):
    from torch.utils.data import DataLoader
    val = coco.CocoDetection(shapes_root, 'val2017', test_scale=(96, 64))
    model = GroundTruthModel(val)
    model.queue = [val.image_ids[0]] * 2
    loader = DataLoader(val, batch_size=1, sampler=[0, 0], collate_fn=coco.collate)
    with pytest.raises(Exception, match='scored 1 images twice'):
        evaluate.evaluate(model, loader, val.coco, val.label_to_category, torch.device('cpu'), print_freq=0)


def _rank_evaluates(rank, root, init_file, out):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=2)
    result = evaluate_shard(root, 2, rank)
    out.put((rank, {k: v for k, v in result.items() if k != 'lines'}, result['lines']))
    out.close()
    out.join_thread()  # the result is in the pipe before the process group is torn down
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_give_the_same_ap_as_one(shapes_root, tmp_path):
    import multiprocessing as mp
    one = evaluate_shard(shapes_root, 1, 0)
    ctx = mp.get_context('spawn')  # a fork of the test process would inherit the locks its threads hold
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_evaluates, args=(r, shapes_root, str(tmp_path / 'init'), out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0]
    expected = {k: v for k, v in one.items() if k != 'lines'}
    for _, result, lines in results:  # every rank returns rank 0's figures
        assert result == expected and lines == one['lines']


# --------------------------------------------------------------------------------------------------
# Pictures
# --------------------------------------------------------------------------------------------------
def test_drawing_marks_the_boxes_and_masks(tmp_path):
    image = np.full((60, 80, 3), 100, np.uint8)
    path = str(tmp_path / 'image.png')
    Image.fromarray(image).save(path)
    masks = torch.zeros(2, 60, 80, dtype=torch.bool)
    masks[0, 30:50, 20:40] = True
    det = {'boxes': torch.tensor([[10.0, 25.0, 50.0, 55.0], [60.0, 5.0, 75.0, 20.0]]), 'labels': torch.tensor([1, 2]),
           'scores': torch.tensor([0.9, 0.1]), 'masks': masks}
    out = str(tmp_path / 'drawn.png')
    evaluate.save_detections(out, path, det, ['a', 'b'], score_thr=0.3)
    drawn = np.asarray(Image.open(out))
    assert drawn.shape == image.shape
    assert (drawn[55, 10:51] != 100).any(axis=-1).all()  # the bottom edge of the kept box
    assert (drawn[40, 25] != 100).any()  # its mask, blended
    assert (drawn[5:21, 60:76] == 100).all()  # the low-scoring detection is not drawn
