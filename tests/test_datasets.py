"""datasets.py: builders on tiny generated folders, layout errors, transforms, CIFAR/iNat, DIGITS writer."""
import json
import os

import numpy as np
import pytest
import torch
from helpers.image_folders import (
    assert_one_line_error,
    dataset_of,
    device_loader_of,
    erasing_of,
    eval_sets_of,
    make_args,
    make_folder,
    save_img,
    transform_of,
)
from PIL import Image

import datasets as D
from training import image_folder as IF


# ---------------------------------------------------------------------------- builders
def test_imagefolder_build_and_items(tmp_path):
    root = make_folder(tmp_path / 'd', classes=('a', 'b', 'c'))
    ds, nc = dataset_of(True, make_args(data_path=root))
    dv, nv = dataset_of(False, make_args(data_path=root, input_size=40))
    assert (nc, nv, len(ds), len(dv)) == (3, 3, 9, 9)
    x, y = ds[4]
    assert x.shape == (3, 32, 32) and y == 1
    x, y = dv[8]
    assert x.shape == (3, 40, 40) and y == 2
    assert IF.bad_sample_paths(ds) == [] and IF.bad_sample_count(dv) == 0


def test_transforms_follow_recipe():
    from timm.data.transforms import RandomResizedCropAndInterpolation
    from torchvision import transforms as T
    ev = transform_of(False, make_args(input_size=224)).transforms
    assert isinstance(ev[0], T.Resize) and ev[0].size == 256
    assert ev[0].interpolation == T.InterpolationMode.BICUBIC
    assert isinstance(ev[1], T.CenterCrop) and tuple(ev[1].size) == (224, 224)
    tr = transform_of(True, make_args(input_size=224)).transforms
    assert isinstance(tr[0], RandomResizedCropAndInterpolation) and tr[0].scale == (0.08, 1.0)
    names = [type(t).__name__ for t in tr]
    assert 'RandAugment' in names and 'RandomHorizontalFlip' in names
    re = [t for t in tr if type(t).__name__ == 'RandomErasing'][0]
    assert (re.probability, re.mode, re.max_count) == (0.25, 'pixel', 1)
    small = transform_of(True, make_args(input_size=32)).transforms
    assert isinstance(small[1], T.RandomCrop) and small[1].padding == 4
    assert small[0].size == (32, 32) and 'RandAugment' in [type(t).__name__ for t in small]
    ev32 = transform_of(False, make_args()).transforms
    assert ev32[0].size == (32, 32)  # squashed to the input size, nothing cropped (the crop is a no-op)
    dig = transform_of(True, make_args(input_size=64, data_set='DIGITS', aa='none')).transforms
    assert 'RandomHorizontalFlip' not in [type(t).__name__ for t in dig] and dig[0].scale == (0.25, 1.0)


def _odd_images(root):
    """Camera-sized images of odd aspect ratios (noise: every interpolation difference shows)."""
    rng = np.random.default_rng(0)
    paths = []
    for i, (w, h) in enumerate([(500, 375), (333, 517), (641, 241), (257, 256)]):
        paths.append(root / f'img{i}.jpg')
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(paths[-1], quality=90)
    return paths


@pytest.mark.parametrize('size, crop_pct', [(224, None), (384, 1.0), (256, 0.9), (32, None)])
def test_eval_transform_equals_deits_bit_for_bit(tmp_path, size, crop_pct):
    """The eval transform (timm's, from the model's pretrained_cfg) against DeiT's hand-built one:
    Resize(int(size / crop_pct), bicubic) + CenterCrop(size), or for <= 32 px a bicubic resize to
    size x size; then ToTensor + ImageNet Normalize. crop_pct None is the model's (0.875)."""
    from torchvision import transforms as T
    bicubic = T.InterpolationMode.BICUBIC
    geometry = ([T.Resize((size, size), interpolation=bicubic)] if size <= 32 else
                [T.Resize(int(size / (crop_pct or 0.875)), interpolation=bicubic), T.CenterCrop(size)])
    reference = T.Compose(geometry + [T.ToTensor(), T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    mine = transform_of(False, make_args(model='NALAFORMER_T', input_size=size, eval_crop_ratio=crop_pct))
    for path in _odd_images(tmp_path):
        with Image.open(path) as im:
            img = im.convert('RGB')
        out = mine(img)
        assert out.shape == (3, size, size) and torch.equal(out, reference(img)), path


def test_data_config_is_the_models_pretrained_cfg_overridden_by_the_command_line(monkeypatch):
    import timm

    import models  # noqa: F401  (registers the variants)
    cfg = D.data_config('NALAFORMER_XT')
    assert (cfg['input_size'], cfg['crop_pct'], cfg['interpolation']) == ((3, 224, 224), 0.875, 'bicubic')
    assert D.data_config(None) == cfg  # timm's default config, the variants' too
    own = timm.create_model('NALAFORMER_XT', pretrained_cfg_overlay=dict(
        crop_pct=0.8, interpolation='bilinear', mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25)))
    cfg = D.data_config(own)
    assert (cfg['crop_pct'], cfg['interpolation'], cfg['mean'], cfg['std']) == (
        0.8, 'bilinear', (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    cfg = D.data_config(own, input_size=96, crop_pct=0.95)
    assert (cfg['input_size'], cfg['crop_pct'], cfg['interpolation']) == ((3, 96, 96), 0.95, 'bilinear')
    steps = D.eval_transform(cfg).transforms
    assert steps[0].size == 101 and tuple(steps[-1].mean.tolist()) == (0.5, 0.5, 0.5)
    # both splits take mean/std (and the eval geometry) from data_config, for args.model at args' size and crop
    seen = []
    monkeypatch.setattr(D, 'data_config', lambda *a: seen.append(a) or cfg)
    for is_train in (True, False):
        steps = transform_of(is_train, make_args(model='M', input_size=96, eval_crop_ratio=0.95)).transforms
        assert [t for t in steps if type(t).__name__ == 'Normalize'][0].mean.tolist() == [0.5, 0.5, 0.5]
    assert seen == [('M', 96, 0.95)] * 2


# ---------------------------------------------------------------------------- layout errors
def test_missing_data_path(tmp_path):
    with pytest.raises(IF.DataLayoutError) as e:
        dataset_of(True, make_args(data_path=None))
    assert_one_line_error(e, '--data-path', 'train/')
    with pytest.raises(IF.DataLayoutError) as e:
        dataset_of(True, make_args(data_path=str(tmp_path / 'nope')))
    assert_one_line_error(e, tmp_path / 'nope', 'does not exist')


@pytest.mark.parametrize('split', ['train', 'val'])
def test_missing_split(tmp_path, split):
    root = make_folder(tmp_path, splits=({'train', 'val'} - {split}))
    with pytest.raises(IF.DataLayoutError) as e:
        dataset_of(True, make_args(data_path=root))
    assert_one_line_error(e, os.path.join(root, split), f'missing {split}/')


@pytest.mark.parametrize('split, is_train', [('train', True), ('val', False), ('val', True)])
def test_a_data_path_at_a_split_names_the_folder_that_holds_both(tmp_path, split, is_train):
    root = make_folder(tmp_path)
    with pytest.raises(IF.DataLayoutError) as e:
        dataset_of(is_train, make_args(data_path=os.path.join(root, split)))
    assert str(e.value) == (f'{os.path.join(root, split)}: holds class folders, not train/ and val/: it is a split of '
                            f'{root}, which holds both; pass --data-path {root}')
    os.rename(os.path.join(root, 'val'), os.path.join(root, 'valid'))  # the parent lacks val/: the usual line
    with pytest.raises(IF.DataLayoutError) as e:
        dataset_of(True, make_args(data_path=os.path.join(root, 'train')))
    assert_one_line_error(e, os.path.join(root, 'train', 'train'), 'missing train/')


def test_eval_only_needs_val(tmp_path):
    root = make_folder(tmp_path, splits=('val',))
    ds, nc = dataset_of(False, make_args(data_path=root))
    assert len(ds) == 6 and nc == 2


def test_empty_class_folder_and_no_classes(tmp_path):
    root = make_folder(tmp_path)
    os.makedirs(os.path.join(root, 'train', 'zebra'))
    os.makedirs(os.path.join(root, 'val', 'zebra'))
    with open(os.path.join(root, 'train', 'zebra', 'notes.txt'), 'w') as f:
        f.write('not an image')
    with pytest.raises(IF.DataLayoutError) as e:
        dataset_of(True, make_args(data_path=root))
    assert_one_line_error(e, os.path.join(root, 'train', 'zebra'), 'empty class folder')
    empty = tmp_path / 'e'
    os.makedirs(empty / 'train')
    os.makedirs(empty / 'val')
    with pytest.raises(IF.DataLayoutError) as e:
        dataset_of(True, make_args(data_path=str(empty)))
    assert_one_line_error(e, empty / 'train', 'no class folders')


def test_val_classes_differ(tmp_path):
    root = make_folder(tmp_path)
    save_img(os.path.join(root, 'val', 'emu', '0.png'))
    os.rename(os.path.join(root, 'val', 'dog'), os.path.join(root, 'val', 'doge'))
    with pytest.raises(IF.DataLayoutError) as e:  # checked by the training build
        dataset_of(True, make_args(data_path=root))
    assert_one_line_error(e, os.path.join(root, 'val'), 'dog', 'doge', 'emu')


def test_eval_build_reads_val_alone(tmp_path, monkeypatch):
    root = make_folder(tmp_path, classes=('a', 'b', 'c'))
    save_img(os.path.join(root, 'train', 'd', '0.png'))  # train/ has a 4th class: irrelevant to eval
    listed = []
    real_scandir = os.scandir

    def recording_scandir(path='.'):
        listed.append(os.path.abspath(path))
        return real_scandir(path)
    monkeypatch.setattr(os, 'scandir', recording_scandir)
    ds, nc = dataset_of(False, make_args(data_path=root))
    assert (nc, len(ds)) == (3, 9)
    train = os.path.join(os.path.abspath(root), 'train')
    assert listed and not [p for p in listed if IF._inside(p, train)], listed


def test_unknown_data_set():
    with pytest.raises(IF.DataLayoutError) as e:
        dataset_of(True, make_args(data_set='MNIST'))
    assert_one_line_error(e, 'MNIST', 'IMNET')



# ---------------------------------------------------------------------------- CIFAR / INAT
def test_cifar_absent_is_clear(tmp_path):
    with pytest.raises(IF.DataLayoutError) as e:
        dataset_of(True, make_args(data_set='CIFAR', data_path=str(tmp_path)))
    assert_one_line_error(e, tmp_path, 'cifar-100-python', 'CIFAR-100 not found')
    assert not os.listdir(tmp_path)  # nothing downloaded


def make_inat(root, year=2018):
    cats = [dict(id=0, name='rosa', kingdom='Plantae'), dict(id=1, name='quercus', kingdom='Plantae'),
            dict(id=2, name='apis', kingdom='Animalia')]
    json.dump(cats, open(os.path.join(root, 'categories.json'), 'w'))
    for split, per in (('train', 2), ('val', 1)):
        images, anns = [], []
        for cid, kd in ((2, 'Animalia'), (0, 'Plantae'), (1, 'Plantae')):
            for k in range(per):
                iid = len(images)
                fname = f'train_val{year}/{kd}/{cid}/{split}{k}.jpg'
                save_img(os.path.join(root, fname), fmt='JPEG')
                images.append(dict(id=iid, file_name=fname))
                anns.append(dict(image_id=iid, category_id=cid))
        json.dump(dict(images=images, annotations=anns),
                  open(os.path.join(root, f'{split}{year}.json'), 'w'))


def test_inat_layout_and_categories(tmp_path):
    make_inat(str(tmp_path))
    ds, nc = dataset_of(True, make_args(data_set='INAT', data_path=str(tmp_path)))
    assert (len(ds), nc) == (6, 3)
    assert [t for _, t in ds.samples] == [0, 0, 1, 1, 2, 2]  # DeiT order: first appearance
    dv, nk = dataset_of(False, make_args(data_set='INAT', data_path=str(tmp_path),
                                              inat_category='kingdom'))
    assert (len(dv), nk) == (3, 2) and [t for _, t in dv.samples] == [0, 1, 1]
    assert dv[0][0].shape == (3, 32, 32)
    with pytest.raises(IF.DataLayoutError) as e:
        dataset_of(True, make_args(data_set='INAT19', data_path=str(tmp_path)))
    assert_one_line_error(e, 'train2019.json', 'missing annotation file')


# ---------------------------------------------------------------------------- DIGITS
def listing(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def test_digits_written_once_split_and_read_as_imagefolder(tmp_path, capsys):
    root = str(tmp_path / 'digits')
    ds, nc = dataset_of(True, make_args(data_set='DIGITS', data_path=root, input_size=64))
    dv, _ = dataset_of(False, make_args(data_set='DIGITS', data_path=root, input_size=64))
    # where they go is said once, when they are written
    assert capsys.readouterr().out.splitlines() == [
        f"DIGITS: wrote scikit-learn's digits (8x8 images upscaled to 32 px) into {root} (--data-path sets where; "
        f'later runs read them from there)']
    assert type(ds) is IF.RobustImageFolder and nc == 10
    assert (len(ds), len(dv)) == (1437, 360) and len(ds) + len(dv) == 1797
    per_class = torch.bincount(torch.tensor(dv.targets), minlength=10)
    assert per_class.min() >= 35 and per_class.max() <= 37  # stratified
    assert not set(os.path.basename(p) for p, _ in ds.samples) & \
        set(os.path.basename(p) for p, _ in dv.samples)
    im = Image.open(ds.samples[0][0])
    assert im.mode == 'RGB' and im.size == (32, 32)
    assert dv[0][0].shape == (3, 64, 64)
    # idempotent: a second call does not rewrite anything
    marker = os.path.join(root, D.DIGITS_MARKER)
    before = (listing(root), os.stat(marker).st_mtime_ns)
    D.prepare_digits(root)
    assert (listing(root), os.stat(marker).st_mtime_ns) == before
    # deterministic: an independent write gives the same split and the same bytes
    other = D.prepare_digits(str(tmp_path / 'again'))
    assert listing(other) == before[0]
    f = os.path.join('val', '3', sorted(os.listdir(os.path.join(root, 'val', '3')))[0])
    assert open(os.path.join(root, f), 'rb').read() == open(os.path.join(other, f), 'rb').read()
    assert [e for e in os.listdir(tmp_path) if '.tmp-' in e] == []


def test_digits_default_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert D.default_data_path('DIGITS') == os.path.join('.', 'data', 'digits')
    assert D.default_data_path('IMNET') is None
    written = []
    monkeypatch.setattr(D, 'prepare_digits', lambda r: written.append(r) or r)
    for p in ('', None, D.DEIT_DEFAULT_DATA_PATH):
        with pytest.raises(IF.DataLayoutError):  # the stub wrote nothing: layout error follows
            dataset_of(True, make_args(data_set='DIGITS', data_path=p))
    assert written == [os.path.join('.', 'data', 'digits')] * 3


def test_digits_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    root = str(tmp_path / 'digits')

    def dies(dest):
        os.makedirs(os.path.join(dest, 'train', '0'))
        raise KeyboardInterrupt  # killed mid-write
    monkeypatch.setattr(D, '_write_digits', dies)
    with pytest.raises(KeyboardInterrupt):
        D.prepare_digits(root)
    assert os.listdir(tmp_path) == []
    # a stale temp dir of a dead writer (kill -9) is never read and is cleaned up later
    stale = tmp_path / f'.digits.tmp-{os.uname().nodename}-999999999-deadbeef'
    os.makedirs(stale / 'train' / '0')
    monkeypatch.undo()
    D.prepare_digits(root)
    assert sorted(os.listdir(tmp_path)) == ['digits']


def test_digits_foreign_nonempty_dir_is_layout_error(tmp_path):
    (tmp_path / 'stuff.txt').write_text('x')
    with pytest.raises(IF.DataLayoutError) as e:
        D.prepare_digits(str(tmp_path))
    assert_one_line_error(e, tmp_path, 'not a digits data set')


def test_digits_concurrent_writers(tmp_path):
    import multiprocessing as mp
    root = str(tmp_path / 'digits')
    procs = [mp.get_context('fork').Process(target=D.prepare_digits, args=(root,)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert sorted(os.listdir(tmp_path)) == ['digits']  # no temp dir left behind
    files = listing(root)
    assert len([f for f in files if f.endswith('.png')]) == 1797 and D.DIGITS_MARKER in files


def test_digits_killed_writer_leaves_no_dataset(tmp_path):
    import signal
    import time
    root = str(tmp_path / 'digits')
    import multiprocessing as mp
    p = mp.get_context('fork').Process(target=D.prepare_digits, args=(root,))
    p.start()
    deadline = time.time() + 60

    def pngs_in_tmp():
        tmps = [e for e in os.listdir(tmp_path) if '.tmp-' in e]
        d = os.path.join(tmp_path, tmps[0], 'train', '0') if tmps else ''
        return len(os.listdir(d)) if os.path.isdir(d) else 0
    while time.time() < deadline and pngs_in_tmp() < 5:  # wait until it is mid-write
        time.sleep(0.002)
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    assert p.exitcode == -signal.SIGKILL
    assert not os.path.exists(root)  # never a half-written data set under the real name
    assert len([e for e in os.listdir(tmp_path) if '.tmp-' in e]) == 1
    D.prepare_digits(root)  # a later run writes it and removes the dead writer's leftovers
    assert sorted(os.listdir(tmp_path)) == ['digits']
    assert len([f for f in listing(root) if f.endswith('.png')]) == 1797


def test_digits_unwritable_path_is_layout_error(tmp_path):
    (tmp_path / 'afile').write_text('x')  # a file where a folder is needed: fails even as root
    bad = tmp_path / 'afile' / 'digits'
    with pytest.raises(IF.DataLayoutError) as e:
        D.prepare_digits(str(bad))
    assert_one_line_error(e, bad, 'cannot write')


def test_recipe_randaugment_survives_zero_bit_posterize():
    """At magnitude 10 PosterizeIncreasing keeps 0 bits; Pillow 13 raises for that, older Pillow gave a
    black image. The recipe's transform must give the black image, not end the run."""
    transform = transform_of(True, make_args(input_size=64))
    rand_augment = next(s for s in transform.transforms if hasattr(s, 'ops'))
    posterize_ops = [op for op in rand_augment.ops if op.name == 'PosterizeIncreasing']
    assert posterize_ops
    img = Image.new('RGB', (8, 8), (200, 120, 40))
    for op in posterize_ops:
        op.prob, op.magnitude, op.magnitude_std = 1.0, 10, 0
        out = op(img)
        assert out.size == img.size and out.getextrema() == ((0, 0), (0, 0), (0, 0))
    op.magnitude = 0  # 4 bits kept: the image is changed only in its low bits
    assert op(img).getpixel((0, 0)) == (192, 112, 32)


# ---------------------------------------------------------------------------- flat val/ with a label file
def make_flat_val(root, labels, label_file='val_labels.txt', header='', ext=True):
    os.makedirs(os.path.join(root, 'val'), exist_ok=True)
    lines = [header] if header else []
    for i, lab in enumerate(labels):
        fname = f'ILSVRC2012_val_{i + 1:08d}.JPEG'
        save_img(os.path.join(root, 'val', fname), (i * 30, 0, 0), fmt='JPEG')
        sep = ',' if label_file.endswith('.csv') else ' '
        lines.append(f'{fname if ext else os.path.splitext(fname)[0]}{sep}{lab}'
                     + (' 1 2 3 4' if sep == ',' else ''))
    where = root if label_file == 'LOC_val_solution.csv' else os.path.join(root, 'val')
    with open(os.path.join(where, label_file), 'w') as f:
        f.write('\n'.join(lines) + '\n')


@pytest.mark.parametrize('label_file,header,ext', [('val_labels.txt', '', True),
                                                   ('LOC_val_solution.csv', 'ImageId,PredictionString', False)])
def test_flat_val_with_label_file(tmp_path, label_file, header, ext):
    root = make_folder(tmp_path / 'd', classes=('n01', 'n02', 'n03'), n=1, splits=('train',))
    make_flat_val(root, ['n02', 'n01', 'n03', 'n02'], label_file, header, ext)
    dv, nc = dataset_of(False, make_args(data_path=root))
    assert nc == 3 and len(dv) == 4 and dv.targets == [1, 0, 2, 1]
    x, y = dv[2]
    assert x.shape == (3, 32, 32) and y == 2
    dataset_of(True, make_args(data_path=root))  # train classes == val labels: accepted


def test_flat_val_errors(tmp_path):
    root = make_folder(tmp_path / 'd', classes=('n01', 'n02', 'n03'), n=1, splits=('train',))
    make_flat_val(root, ['n02', 'n01'])
    with pytest.raises(IF.DataLayoutError) as e:  # n03 never appears in val
        dataset_of(True, make_args(data_path=root))
    assert_one_line_error(e, 'n03', 'missing from val/')
    save_img(os.path.join(root, 'val', 'extra.png'))
    with pytest.raises(IF.DataLayoutError) as e:
        dataset_of(False, make_args(data_path=root))
    assert_one_line_error(e, 'extra.png', 'no label')
    os.remove(os.path.join(root, 'val', 'extra.png'))
    os.remove(os.path.join(root, 'val', 'ILSVRC2012_val_00000001.JPEG'))
    with pytest.raises(IF.DataLayoutError) as e:
        dataset_of(False, make_args(data_path=root))
    assert_one_line_error(e, 'val_labels.txt', 'ILSVRC2012_val_00000001.JPEG', 'not found')
    os.remove(os.path.join(root, 'val', 'val_labels.txt'))
    with pytest.raises(IF.DataLayoutError) as e:
        dataset_of(False, make_args(data_path=root))
    assert_one_line_error(e, os.path.join(root, 'val'), 'no class folders and no label file', 'val_labels.txt')


# ---------------------------------------------------------------------------- uint8 batches, normalised on the device
def _seeded(transform, img, seed):
    """`transform(img)` with every generator a transform may draw from seeded with `seed`."""
    import random
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return transform(img)


@pytest.mark.parametrize('is_train', [True, False])
def test_uint8_batches_normalised_by_the_device_loader_equal_the_cpu_transform(tmp_path, is_train):
    """The uint8 transform and DeviceLoader's normalisation give the CPU transform's values bit for bit, for
    the same crop (the same random draws): the recipe's augmentations, random erasing left out."""
    args = make_args(model='NALAFORMER_T', input_size=48, reprob=0.0)
    cpu, uint8 = transform_of(is_train, args), transform_of(is_train, args, uint8=True)
    images = []
    for path in _odd_images(tmp_path):
        with Image.open(path) as im:
            images.append(im.convert('RGB'))
    want = torch.stack([_seeded(cpu, img, i) for i, img in enumerate(images)])
    crops = torch.stack([_seeded(uint8, img, i) for i, img in enumerate(images)])
    assert crops.dtype == torch.uint8
    batch = [(crops, torch.tensor([0, -100, 2, 1]), torch.arange(4))]  # an undecodable image's target, ReaL indices
    (got, target, index), = list(device_loader_of(batch, args, 'cpu'))
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert target.tolist() == [0, -100, 2, 1] and index.tolist() == [0, 1, 2, 3]
    with pytest.raises(TypeError, match='uint8'):
        list(device_loader_of([(want, target)], args, 'cpu'))


def test_random_erasing_on_the_device_has_the_cpu_transforms_distribution():
    """The recipe's random erasing (--reprob 0.25, pixel mode, one box) on a normalised batch erases as the
    CPU transform's last step does, image by image: the same share of images, the same distribution of box
    areas and aspect ratios, normal noise in the boxes (two-sample Kolmogorov-Smirnov tests)."""
    from scipy.stats import ks_2samp
    args = make_args(input_size=32)
    cpu = [t for t in transform_of(True, args).transforms if type(t).__name__ == 'RandomErasing'][0]
    device = erasing_of(args, 'cpu')
    assert erasing_of(make_args(reprob=0.0), 'cpu') is None
    n = 3000
    torch.manual_seed(0)
    import random
    random.seed(0)
    one_by_one = torch.stack([cpu(img) for img in torch.full((n, 3, 32, 32), 7.0)])
    batch = device(torch.full((n, 3, 32, 32), 7.0))

    def boxes(x):
        erased = x != 7.0
        rows, cols = erased.any(1).any(2), erased.any(1).any(1)
        hit = erased.flatten(1).any(1)
        h, w = rows.sum(1)[hit].double(), cols.sum(1)[hit].double()
        return hit.double().mean().item(), (h * w / 32 ** 2).numpy(), (h / w).log().numpy(), x[erased]
    share_cpu, area_cpu, aspect_cpu, noise_cpu = boxes(one_by_one)
    share_dev, area_dev, aspect_dev, noise_dev = boxes(batch)
    assert abs(share_cpu - 0.25) < 0.03 and abs(share_dev - 0.25) < 0.03
    assert ks_2samp(area_cpu, area_dev).pvalue > 0.01 and ks_2samp(aspect_cpu, aspect_dev).pvalue > 0.01
    assert abs(noise_dev.mean()) < 0.01 and abs(noise_dev.std() - 1) < 0.01
    assert ks_2samp(noise_cpu[:20000].numpy(), noise_dev[:20000].numpy()).pvalue > 0.01


def test_data_sets_built_for_the_device_loader_give_uint8_crops(tmp_path):
    """main.py builds every data set with uint8=True: image folders (both splits), iNaturalist and the extra
    evaluation sets hand over uint8 crops of the input size; the targets are as with the float transform."""
    root = make_folder(tmp_path / 'd', classes=('a', 'b', 'c'))
    make_inat(str(tmp_path))
    args = make_args(data_path=root, eval_sets=[os.path.join(root, 'val')])
    built = [dataset_of(True, args, uint8=True)[0], dataset_of(False, args, uint8=True)[0],
             dataset_of(True, make_args(data_set='INAT', data_path=str(tmp_path)), uint8=True)[0]]
    built.append(eval_sets_of(args, built[1], uint8=True)[0][1])
    for ds in built:
        x, y = ds[len(ds) - 1]
        assert x.dtype == torch.uint8 and x.shape == (3, 32, 32) and y == ds.samples[-1][1]
