"""training/image_folder.py: class folders read by the builders (non-image files, links), undecodable images
replaced and recorded or raised, and image decoding."""
import os
import warnings

import numpy as np
import pytest
import torch
from helpers.image_folders import assert_one_line_error, dataset_of, make_args, make_folder, save_img
from PIL import Image
from torch.utils.data import DataLoader, Subset

from training import image_folder as IF


# ---------------------------------------------------------------------------- non-image files
def test_non_image_files_counted_and_warned(tmp_path):
    root = make_folder(tmp_path)
    for p in ('train/cat/readme.txt', 'train/dog/labels.csv', 'train/dog/.DS_Store'):
        with open(os.path.join(root, p), 'w') as f:
            f.write('x')
    os.makedirs(os.path.join(root, 'train', '.ipynb_checkpoints'))  # hidden: not a class
    save_img(os.path.join(root, 'train', 'cat', '.ipynb_checkpoints', '0-checkpoint.png'))
    save_img(os.path.join(root, 'train', 'cat', 'extra', 'sub.png'))  # nested images are read
    with pytest.warns(UserWarning, match=r'skipped 2 non-image file'):
        ds, nc = dataset_of(True, make_args(data_path=root))
    assert nc == 2 and len(ds) == 7 and len(ds.skipped_files) == 2
    assert all(p.endswith('.png') for p, _ in ds.samples)


# ---------------------------------------------------------------------------- bad images
def corrupt_folder(tmp_path):
    root = make_folder(tmp_path, ext='.jpg')
    trunc = os.path.join(root, 'train', 'cat', '1.jpg')
    noise = Image.frombytes('RGB', (64, 64), os.urandom(64 * 64 * 3))
    noise.save(trunc, quality=95)
    data = open(trunc, 'rb').read()
    with open(trunc, 'wb') as f:
        f.write(data[: len(data) // 2])  # truncated JPEG
    garbage = os.path.join(root, 'val', 'dog', '0.jpg')
    with open(garbage, 'wb') as f:
        f.write(b'this is not a jpeg at all')
    return root, trunc, garbage


def test_corrupt_train_image_replaced_and_reported(tmp_path):
    root, trunc, _ = corrupt_folder(tmp_path)
    ds, _ = dataset_of(True, make_args(data_path=root))
    i = [p for p, _ in ds.samples].index(trunc)
    with pytest.warns(IF.BadSampleWarning, match=trunc):
        x, y = ds[i]
    assert x.shape == (3, 32, 32) and y == ds.samples[i + 1][1]
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # second time: no new warning, still replaced
        ds[i]
    assert IF.bad_sample_paths(ds) == [trunc] and IF.bad_sample_count(Subset(ds, [0])) == 1
    assert IF.bad_sample_mask(ds).tolist() == [int(p == trunc) for p, _ in ds.samples]
    assert IF.bad_sample_count_all_ranks(ds) == 1


def _rank_finds_bad(rank, root, trunc, init_file, out):
    import torch.distributed as dist

    from run import distributed
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=2)
    ds, _ = dataset_of(True, make_args(data_path=root))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        ds[[p for p, _ in ds.samples].index(trunc)]  # both ranks load the same bad file (RA repeats)
        if rank == 1:
            ds[len(ds) - 1]  # and only rank 1 meets a second one
    out.put((rank, IF.bad_sample_count(ds), IF.bad_sample_count_all_ranks(ds)))
    distributed.destroy_process_group()


def test_bad_count_across_ranks_counts_each_file_once(tmp_path):
    import multiprocessing as mp
    root, trunc, _ = corrupt_folder(tmp_path)
    with open(os.path.join(root, 'train', 'dog', '2.jpg'), 'wb') as f:
        f.write(b'garbage')
    ctx = mp.get_context('spawn')  # fork() of the multi-threaded test process is unsafe (Python 3.12 warns)
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_finds_bad, args=(r, root, trunc, str(tmp_path / 'init'), out))
             for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert results == [(0, 1, 2), (1, 2, 2)]  # distinct files: 2, not 3


def test_corrupt_image_seen_by_worker_is_visible_in_main(tmp_path):
    root, trunc, _ = corrupt_folder(tmp_path)
    ds, _ = dataset_of(True, make_args(data_path=root))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        n = sum(len(y) for _, y in DataLoader(ds, batch_size=2, num_workers=2))
    assert n == len(ds)
    assert IF.bad_sample_paths(ds) == [trunc]


def test_strict_data_raises_naming_file(tmp_path):
    root, trunc, garbage = corrupt_folder(tmp_path)
    ds, _ = dataset_of(True, make_args(data_path=root, strict_data=True))
    with pytest.raises(IF.BadSampleError, match=trunc):
        ds[[p for p, _ in ds.samples].index(trunc)]
    dv, _ = dataset_of(False, make_args(data_path=root, strict_data=True))
    with pytest.raises(IF.BadSampleError, match=garbage):
        dv[[p for p, _ in dv.samples].index(garbage)]


def test_corrupt_eval_image_is_ignored_not_miscounted(tmp_path):
    root, _, garbage = corrupt_folder(tmp_path)
    dv, _ = dataset_of(False, make_args(data_path=root))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        targets = torch.cat([y for _, y in DataLoader(dv, batch_size=4)])
    assert len(targets) == len(dv) == 6
    assert int((targets == IF.IGNORE_TARGET).sum()) == 1  # "evaluated 5 of 6"
    assert IF.bad_sample_paths(dv) == [garbage]


# ---------------------------------------------------------------------------- links
def test_symlink_loop_in_class_folder_is_not_followed(tmp_path):
    root = make_folder(tmp_path / 'd', classes=('class0', 'class1'))
    loop = os.path.join(root, 'train', 'class0', 'loop')
    os.symlink('..', loop)
    for follow in (False, True):
        with pytest.warns(UserWarning, match=r'did not follow 1 directory link') as rec:
            ds, nc = dataset_of(True, make_args(data_path=root, follow_links=follow))
        assert (nc, len(ds)) == (2, 6)
        assert [t for _, t in ds.samples] == [0, 0, 0, 1, 1, 1]
        msgs = [str(w.message) for w in rec if 'directory link' in str(w.message)]
        assert len(msgs) == 1 and '\n' not in msgs[0] and loop in msgs[0], msgs
        assert ('loop' if follow else '--follow-links') in msgs[0]
        assert not any('non-image' in str(w.message) for w in rec)


def test_follow_links_reads_outside_folders_but_not_other_classes(tmp_path):
    root = make_folder(tmp_path / 'd', classes=('class0', 'class1'))
    save_img(str(tmp_path / 'extra' / 'e0.png'))
    save_img(str(tmp_path / 'extra' / 'e1.png'))
    os.symlink(str(tmp_path / 'extra'), os.path.join(root, 'train', 'class0', 'more'))
    os.symlink(os.path.join('..', 'class1'), os.path.join(root, 'train', 'class0', 'other'))
    with pytest.warns(UserWarning, match=r'did not follow 2 directory link'):
        ds, _ = dataset_of(True, make_args(data_path=root))
    assert len(ds) == 6
    with pytest.warns(UserWarning, match=r'did not follow 1 directory link.*other.*back into') as rec:
        ds, _ = dataset_of(True, make_args(data_path=root, follow_links=True))
    assert len(ds) == 8 and [t for _, t in ds.samples].count(0) == 5
    assert 'more' not in ' '.join(str(w.message) for w in rec)


def test_broken_class_folder_link_is_an_error(tmp_path):
    root = make_folder(tmp_path / 'd')
    for split in ('train', 'val'):
        os.symlink(str(tmp_path / 'gone'), os.path.join(root, split, 'zebra'))
    for is_train in (True, False):
        with pytest.raises(IF.DataLayoutError) as e:
            dataset_of(is_train, make_args(data_path=root))
        assert_one_line_error(e, os.path.join(root, 'train' if is_train else 'val', 'zebra'),
                              'broken link')


def test_class_folder_linking_to_its_split_is_an_error(tmp_path):
    root = make_folder(tmp_path / 'd', splits=('val',))
    os.symlink('.', os.path.join(root, 'val', 'all'))
    with pytest.raises(IF.DataLayoutError) as e:
        dataset_of(False, make_args(data_path=root))
    assert_one_line_error(e, os.path.join(root, 'val', 'all'), 'loop')


# ---------------------------------------------------------------------------- decoding
def one_image_folder(tmp_path, name, img, **save_kw):
    path = tmp_path / 'd' / 'val' / 'c' / name
    os.makedirs(path.parent)
    img.save(path, **save_kw)
    return IF.RobustImageFolder(str(tmp_path / 'd' / 'val'), transform=None, is_train=False), str(path)


def pixels(ds, i=0):
    img, target = ds[i]
    assert target == 0 and img.mode == 'RGB'
    return np.asarray(img).astype(int)


def test_16bit_grayscale_png_is_scaled_not_saturated(tmp_path):
    a = np.linspace(0, 65535, 64 * 64).reshape(64, 64).astype(np.uint16)
    ds, _ = one_image_folder(tmp_path, 'g16.png', Image.fromarray(a))
    assert Image.open(ds.samples[0][0]).mode == 'I;16'
    p = pixels(ds)
    assert (p[..., 0] == p[..., 2]).all()
    assert np.abs(p[..., 0] - a / 257.0).max() <= 0.5
    assert (p == 255).mean() < 0.01


def test_32bit_integer_tiff_is_scaled(tmp_path):
    a = np.linspace(0, 65535, 32 * 32).reshape(32, 32).astype(np.int32)
    ds, _ = one_image_folder(tmp_path, 'i32.tif', Image.fromarray(a, 'I'))
    assert np.abs(pixels(ds)[..., 1] - a / 257.0).max() <= 0.5


@pytest.mark.parametrize('scale', [1.0, 255.0])
def test_float_tiff_is_mapped_by_its_range(tmp_path, scale):
    a = np.linspace(0, 1, 32 * 32).reshape(32, 32).astype(np.float32)
    ds, _ = one_image_folder(tmp_path, 'f.tif', Image.fromarray(a * scale, 'F'))
    assert np.abs(pixels(ds)[..., 0] - a * 255).max() <= 0.5


def test_float_tiff_out_of_range_is_refused_by_name(tmp_path):
    a = np.linspace(-3, 300, 16 * 16).reshape(16, 16).astype(np.float32)
    ds, _ = one_image_folder(tmp_path, 'f.tif', Image.fromarray(a, 'F'))
    ds.strict = True
    with pytest.raises(IF.BadSampleError, match=r'f\.tif.*float image with values in \[-3, 300\]'):
        ds[0]


def test_exif_orientation_is_applied(tmp_path):
    img = Image.new('RGB', (40, 20), (255, 0, 0))
    img.paste((0, 0, 255), (20, 0, 40, 20))  # stored: red left, blue right
    exif = Image.Exif()
    exif[0x0112] = 6  # display rotated 90 degrees clockwise
    ds, _ = one_image_folder(tmp_path, 'rot.jpg', img, exif=exif, quality=95)
    p = pixels(ds)
    assert p.shape == (40, 20, 3)  # portrait once rotated
    top, bottom = p[5, 10], p[35, 10]  # clockwise: stored left (red) goes to the top
    assert top[0] > 200 and top[2] < 60 and bottom[2] > 200 and bottom[0] < 60


def test_gif_webp_read_and_animated_gif_gives_first_frame(tmp_path):
    root = make_folder(tmp_path / 'd', splits=('val',), ext='.webp')
    frames = [Image.new('RGB', (8, 8), c) for c in ((255, 0, 0), (0, 0, 255))]
    gif = os.path.join(root, 'val', 'cat', 'anim.gif')
    frames[0].save(gif, save_all=True, append_images=frames[1:], duration=50)
    assert Image.open(gif).n_frames == 2
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # nothing is skipped
        ds = IF.RobustImageFolder(os.path.join(root, 'val'), transform=None, is_train=False)
    assert len(ds) == 7 and ds.skipped_files == []
    i = [p for p, _ in ds.samples].index(gif)
    r, _, b = np.asarray(ds[i][0])[4, 4]
    assert r > 200 and b < 60
    assert {'.gif', '.webp', '.png', '.jpg', '.tif'} <= set(IF.IMAGE_EXTENSIONS)

