"""datasets.py: builders on tiny generated folders, layout errors, bad images, DIGITS writer."""
import json
import os
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, Subset

import datasets as D


def make_args(**kw):
    a = dict(data_set="IMNET", data_path=None, input_size=32, color_jitter=0.4,
             aa="rand-m9-mstd0.5-inc1", train_interpolation="bicubic", reprob=0.25, remode="pixel",
             recount=1, inat_category="name", strict_data=False)
    a.update(kw)
    return SimpleNamespace(**a)


def save_img(path, color=(255, 0, 0), size=6, fmt=None):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new("RGB", (size, size), color).save(path, fmt)


def make_folder(root, classes=("cat", "dog"), n=3, splits=("train", "val"), ext=".png"):
    for split in splits:
        for ci, c in enumerate(classes):
            for i in range(n):
                save_img(os.path.join(root, split, c, f"{i}{ext}"), (ci * 100, i * 40, 0))
    return str(root)


def assert_one_line_error(exc_info, *needles):
    msg = str(exc_info.value)
    assert "\n" not in msg and "expected" in msg, msg
    for s in needles:
        assert str(s) in msg, (s, msg)
    return msg


# ---------------------------------------------------------------------------- builders
def test_imagefolder_build_and_items(tmp_path):
    root = make_folder(tmp_path / "d", classes=("a", "b", "c"))
    ds, nc = D.build_dataset(True, make_args(data_path=root))
    dv, nv = D.build_dataset(False, make_args(data_path=root, input_size=40))
    assert (nc, nv, len(ds), len(dv)) == (3, 3, 9, 9)
    x, y = ds[4]
    assert x.shape == (3, 32, 32) and y == 1
    x, y = dv[8]
    assert x.shape == (3, 40, 40) and y == 2
    assert D.bad_sample_paths(ds) == [] and D.bad_sample_count(dv) == 0


def test_transforms_follow_recipe():
    from timm.data.transforms import RandomResizedCropAndInterpolation
    from torchvision import transforms as T
    ev = D.build_transform(False, make_args(input_size=224)).transforms
    assert isinstance(ev[0], T.Resize) and ev[0].size == 256
    assert ev[0].interpolation == T.InterpolationMode.BICUBIC
    assert isinstance(ev[1], T.CenterCrop) and tuple(ev[1].size) == (224, 224)
    tr = D.build_transform(True, make_args(input_size=224)).transforms
    assert isinstance(tr[0], RandomResizedCropAndInterpolation) and tr[0].scale == (0.08, 1.0)
    names = [type(t).__name__ for t in tr]
    assert "RandAugment" in names and "RandomHorizontalFlip" in names
    re = [t for t in tr if type(t).__name__ == "RandomErasing"][0]
    assert (re.probability, re.mode, re.max_count) == (0.25, "pixel", 1)
    small = D.build_transform(True, make_args(input_size=32)).transforms
    assert isinstance(small[1], T.RandomCrop) and small[1].padding == 4
    assert small[0].size == (32, 32) and "RandAugment" in [type(t).__name__ for t in small]
    ev32 = D.build_transform(False, make_args()).transforms
    assert ev32[0].size == (32, 32)  # squashed to the input size, nothing cropped (the crop is a no-op)
    dig = D.build_transform(True, make_args(input_size=64, data_set="DIGITS", aa="none")).transforms
    assert "RandomHorizontalFlip" not in [type(t).__name__ for t in dig] and dig[0].scale == (0.25, 1.0)


def _odd_images(root):
    """Camera-sized images of odd aspect ratios (noise: every interpolation difference shows)."""
    rng = np.random.default_rng(0)
    paths = []
    for i, (w, h) in enumerate([(500, 375), (333, 517), (641, 241), (257, 256)]):
        paths.append(root / f"img{i}.jpg")
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(paths[-1], quality=90)
    return paths


@pytest.mark.parametrize("size, crop_pct", [(224, None), (384, 1.0), (256, 0.9), (32, None)])
def test_eval_transform_equals_deits_bit_for_bit(tmp_path, size, crop_pct):
    """The eval transform (timm's, from the model's pretrained_cfg) against DeiT's hand-built one:
    Resize(int(size / crop_pct), bicubic) + CenterCrop(size), or for <= 32 px a bicubic resize to
    size x size; then ToTensor + ImageNet Normalize. crop_pct None is the model's (0.875)."""
    from torchvision import transforms as T
    bicubic = T.InterpolationMode.BICUBIC
    geometry = ([T.Resize((size, size), interpolation=bicubic)] if size <= 32 else
                [T.Resize(int(size / (crop_pct or 0.875)), interpolation=bicubic), T.CenterCrop(size)])
    reference = T.Compose(geometry + [T.ToTensor(), T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    mine = D.build_transform(False, make_args(model="NALAFORMER_T", input_size=size, eval_crop_ratio=crop_pct))
    for path in _odd_images(tmp_path):
        with Image.open(path) as im:
            img = im.convert("RGB")
        out = mine(img)
        assert out.shape == (3, size, size) and torch.equal(out, reference(img)), path


def test_data_config_is_the_models_pretrained_cfg_overridden_by_the_command_line(monkeypatch):
    import timm

    import models  # noqa: F401  (registers the variants)
    cfg = D.data_config("NALAFORMER_XT")
    assert (cfg["input_size"], cfg["crop_pct"], cfg["interpolation"]) == ((3, 224, 224), 0.875, "bicubic")
    assert D.data_config(None) == cfg  # timm's default config, the variants' too
    own = timm.create_model("NALAFORMER_XT", pretrained_cfg_overlay=dict(
        crop_pct=0.8, interpolation="bilinear", mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25)))
    cfg = D.data_config(own)
    assert (cfg["crop_pct"], cfg["interpolation"], cfg["mean"], cfg["std"]) == (
        0.8, "bilinear", (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    cfg = D.data_config(own, input_size=96, crop_pct=0.95)
    assert (cfg["input_size"], cfg["crop_pct"], cfg["interpolation"]) == ((3, 96, 96), 0.95, "bilinear")
    steps = D.eval_transform(cfg).transforms
    assert steps[0].size == 101 and tuple(steps[-1].mean.tolist()) == (0.5, 0.5, 0.5)
    # both splits take mean/std (and the eval geometry) from data_config, for args.model at args' size and crop
    seen = []
    monkeypatch.setattr(D, "data_config", lambda *a: seen.append(a) or cfg)
    for is_train in (True, False):
        steps = D.build_transform(is_train, make_args(model="M", input_size=96, eval_crop_ratio=0.95)).transforms
        assert [t for t in steps if type(t).__name__ == "Normalize"][0].mean.tolist() == [0.5, 0.5, 0.5]
    assert seen == [("M", 96, 0.95)] * 2


# ---------------------------------------------------------------------------- layout errors
def test_missing_data_path(tmp_path):
    with pytest.raises(D.DataLayoutError) as e:
        D.build_dataset(True, make_args(data_path=None))
    assert_one_line_error(e, "--data-path", "train/")
    with pytest.raises(D.DataLayoutError) as e:
        D.build_dataset(True, make_args(data_path=str(tmp_path / "nope")))
    assert_one_line_error(e, tmp_path / "nope", "does not exist")


@pytest.mark.parametrize("split", ["train", "val"])
def test_missing_split(tmp_path, split):
    root = make_folder(tmp_path, splits=({"train", "val"} - {split}))
    with pytest.raises(D.DataLayoutError) as e:
        D.build_dataset(True, make_args(data_path=root))
    assert_one_line_error(e, os.path.join(root, split), f"missing {split}/")


def test_eval_only_needs_val(tmp_path):
    root = make_folder(tmp_path, splits=("val",))
    ds, nc = D.build_dataset(False, make_args(data_path=root))
    assert len(ds) == 6 and nc == 2


def test_empty_class_folder_and_no_classes(tmp_path):
    root = make_folder(tmp_path)
    os.makedirs(os.path.join(root, "train", "zebra"))
    os.makedirs(os.path.join(root, "val", "zebra"))
    with open(os.path.join(root, "train", "zebra", "notes.txt"), "w") as f:
        f.write("not an image")
    with pytest.raises(D.DataLayoutError) as e:
        D.build_dataset(True, make_args(data_path=root))
    assert_one_line_error(e, os.path.join(root, "train", "zebra"), "empty class folder")
    empty = tmp_path / "e"
    os.makedirs(empty / "train")
    os.makedirs(empty / "val")
    with pytest.raises(D.DataLayoutError) as e:
        D.build_dataset(True, make_args(data_path=str(empty)))
    assert_one_line_error(e, empty / "train", "no class folders")


def test_val_classes_differ(tmp_path):
    root = make_folder(tmp_path)
    save_img(os.path.join(root, "val", "emu", "0.png"))
    os.rename(os.path.join(root, "val", "dog"), os.path.join(root, "val", "doge"))
    with pytest.raises(D.DataLayoutError) as e:  # checked by the training build
        D.build_dataset(True, make_args(data_path=root))
    assert_one_line_error(e, os.path.join(root, "val"), "dog", "doge", "emu")


def test_eval_build_reads_val_alone(tmp_path, monkeypatch):
    root = make_folder(tmp_path, classes=("a", "b", "c"))
    save_img(os.path.join(root, "train", "d", "0.png"))  # train/ has a 4th class: irrelevant to eval
    listed = []
    real_scandir = os.scandir

    def recording_scandir(path="."):
        listed.append(os.path.abspath(path))
        return real_scandir(path)
    monkeypatch.setattr(os, "scandir", recording_scandir)
    ds, nc = D.build_dataset(False, make_args(data_path=root))
    assert (nc, len(ds)) == (3, 9)
    train = os.path.join(os.path.abspath(root), "train")
    assert listed and not [p for p in listed if D._inside(p, train)], listed


def test_unknown_data_set():
    with pytest.raises(D.DataLayoutError) as e:
        D.build_dataset(True, make_args(data_set="MNIST"))
    assert_one_line_error(e, "MNIST", "IMNET")


def test_non_image_files_counted_and_warned(tmp_path):
    root = make_folder(tmp_path)
    for p in ("train/cat/readme.txt", "train/dog/labels.csv", "train/dog/.DS_Store"):
        with open(os.path.join(root, p), "w") as f:
            f.write("x")
    os.makedirs(os.path.join(root, "train", ".ipynb_checkpoints"))  # hidden: not a class
    save_img(os.path.join(root, "train", "cat", ".ipynb_checkpoints", "0-checkpoint.png"))
    save_img(os.path.join(root, "train", "cat", "extra", "sub.png"))  # nested images are read
    with pytest.warns(UserWarning, match=r"skipped 2 non-image file"):
        ds, nc = D.build_dataset(True, make_args(data_path=root))
    assert nc == 2 and len(ds) == 7 and len(ds.skipped_files) == 2
    assert all(p.endswith(".png") for p, _ in ds.samples)


# ---------------------------------------------------------------------------- bad images
def corrupt_folder(tmp_path):
    root = make_folder(tmp_path, ext=".jpg")
    trunc = os.path.join(root, "train", "cat", "1.jpg")
    noise = Image.frombytes("RGB", (64, 64), os.urandom(64 * 64 * 3))
    noise.save(trunc, quality=95)
    data = open(trunc, "rb").read()
    with open(trunc, "wb") as f:
        f.write(data[: len(data) // 2])  # truncated JPEG
    garbage = os.path.join(root, "val", "dog", "0.jpg")
    with open(garbage, "wb") as f:
        f.write(b"this is not a jpeg at all")
    return root, trunc, garbage


def test_corrupt_train_image_replaced_and_reported(tmp_path):
    root, trunc, _ = corrupt_folder(tmp_path)
    ds, _ = D.build_dataset(True, make_args(data_path=root))
    i = [p for p, _ in ds.samples].index(trunc)
    with pytest.warns(D.BadSampleWarning, match=trunc):
        x, y = ds[i]
    assert x.shape == (3, 32, 32) and y == ds.samples[i + 1][1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # second time: no new warning, still replaced
        ds[i]
    assert D.bad_sample_paths(ds) == [trunc] and D.bad_sample_count(Subset(ds, [0])) == 1
    assert D.bad_sample_mask(ds).tolist() == [int(p == trunc) for p, _ in ds.samples]
    assert D.bad_sample_count_all_ranks(ds) == 1


def _rank_finds_bad(rank, root, trunc, init_file, out):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    ds, _ = D.build_dataset(True, make_args(data_path=root))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds[[p for p, _ in ds.samples].index(trunc)]  # both ranks load the same bad file (RA repeats)
        if rank == 1:
            ds[len(ds) - 1]  # and only rank 1 meets a second one
    out.put((rank, D.bad_sample_count(ds), D.bad_sample_count_all_ranks(ds)))
    dist.destroy_process_group()


def test_bad_count_across_ranks_counts_each_file_once(tmp_path):
    import multiprocessing as mp
    root, trunc, _ = corrupt_folder(tmp_path)
    with open(os.path.join(root, "train", "dog", "2.jpg"), "wb") as f:
        f.write(b"garbage")
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_finds_bad, args=(r, root, trunc, str(tmp_path / "init"), out))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert sorted(out.get(timeout=5) for _ in procs) == [(0, 1, 2), (1, 2, 2)]  # distinct files: 2, not 3


def test_corrupt_image_seen_by_worker_is_visible_in_main(tmp_path):
    root, trunc, _ = corrupt_folder(tmp_path)
    ds, _ = D.build_dataset(True, make_args(data_path=root))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        n = sum(len(y) for _, y in DataLoader(ds, batch_size=2, num_workers=2))
    assert n == len(ds)
    assert D.bad_sample_paths(ds) == [trunc]


def test_strict_data_raises_naming_file(tmp_path):
    root, trunc, garbage = corrupt_folder(tmp_path)
    ds, _ = D.build_dataset(True, make_args(data_path=root, strict_data=True))
    with pytest.raises(D.BadSampleError, match=trunc):
        ds[[p for p, _ in ds.samples].index(trunc)]
    dv, _ = D.build_dataset(False, make_args(data_path=root, strict_data=True))
    with pytest.raises(D.BadSampleError, match=garbage):
        dv[[p for p, _ in dv.samples].index(garbage)]


def test_corrupt_eval_image_is_ignored_not_miscounted(tmp_path):
    root, _, garbage = corrupt_folder(tmp_path)
    dv, _ = D.build_dataset(False, make_args(data_path=root))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        targets = torch.cat([y for _, y in DataLoader(dv, batch_size=4)])
    assert len(targets) == len(dv) == 6
    assert int((targets == D.IGNORE_TARGET).sum()) == 1  # "evaluated 5 of 6"
    assert D.bad_sample_paths(dv) == [garbage]


# ---------------------------------------------------------------------------- CIFAR / INAT
def test_cifar_absent_is_clear(tmp_path):
    with pytest.raises(D.DataLayoutError) as e:
        D.build_dataset(True, make_args(data_set="CIFAR", data_path=str(tmp_path)))
    assert_one_line_error(e, tmp_path, "cifar-100-python", "CIFAR-100 not found")
    assert not os.listdir(tmp_path)  # nothing downloaded


def make_inat(root, year=2018):
    cats = [dict(id=0, name="rosa", kingdom="Plantae"), dict(id=1, name="quercus", kingdom="Plantae"),
            dict(id=2, name="apis", kingdom="Animalia")]
    json.dump(cats, open(os.path.join(root, "categories.json"), "w"))
    for split, per in (("train", 2), ("val", 1)):
        images, anns = [], []
        for cid, kd in ((2, "Animalia"), (0, "Plantae"), (1, "Plantae")):
            for k in range(per):
                iid = len(images)
                fname = f"train_val{year}/{kd}/{cid}/{split}{k}.jpg"
                save_img(os.path.join(root, fname), fmt="JPEG")
                images.append(dict(id=iid, file_name=fname))
                anns.append(dict(image_id=iid, category_id=cid))
        json.dump(dict(images=images, annotations=anns),
                  open(os.path.join(root, f"{split}{year}.json"), "w"))


def test_inat_layout_and_categories(tmp_path):
    make_inat(str(tmp_path))
    ds, nc = D.build_dataset(True, make_args(data_set="INAT", data_path=str(tmp_path)))
    assert (len(ds), nc) == (6, 3)
    assert [t for _, t in ds.samples] == [0, 0, 1, 1, 2, 2]  # DeiT order: first appearance
    dv, nk = D.build_dataset(False, make_args(data_set="INAT", data_path=str(tmp_path),
                                              inat_category="kingdom"))
    assert (len(dv), nk) == (3, 2) and [t for _, t in dv.samples] == [0, 1, 1]
    assert dv[0][0].shape == (3, 32, 32)
    with pytest.raises(D.DataLayoutError) as e:
        D.build_dataset(True, make_args(data_set="INAT19", data_path=str(tmp_path)))
    assert_one_line_error(e, "train2019.json", "missing annotation file")


# ---------------------------------------------------------------------------- DIGITS
def listing(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def test_digits_written_once_split_and_read_as_imagefolder(tmp_path):
    root = str(tmp_path / "digits")
    ds, nc = D.build_dataset(True, make_args(data_set="DIGITS", data_path=root, input_size=64))
    dv, _ = D.build_dataset(False, make_args(data_set="DIGITS", data_path=root, input_size=64))
    assert type(ds) is D.RobustImageFolder and nc == 10
    assert (len(ds), len(dv)) == (1437, 360) and len(ds) + len(dv) == 1797
    per_class = torch.bincount(torch.tensor(dv.targets), minlength=10)
    assert per_class.min() >= 35 and per_class.max() <= 37  # stratified
    assert not set(os.path.basename(p) for p, _ in ds.samples) & \
        set(os.path.basename(p) for p, _ in dv.samples)
    im = Image.open(ds.samples[0][0])
    assert im.mode == "RGB" and im.size == (32, 32)
    assert dv[0][0].shape == (3, 64, 64)
    # idempotent: a second call does not rewrite anything
    marker = os.path.join(root, D.DIGITS_MARKER)
    before = (listing(root), os.stat(marker).st_mtime_ns)
    D.prepare_digits(root)
    assert (listing(root), os.stat(marker).st_mtime_ns) == before
    # deterministic: an independent write gives the same split and the same bytes
    other = D.prepare_digits(str(tmp_path / "again"))
    assert listing(other) == before[0]
    f = os.path.join("val", "3", sorted(os.listdir(os.path.join(root, "val", "3")))[0])
    assert open(os.path.join(root, f), "rb").read() == open(os.path.join(other, f), "rb").read()
    assert [e for e in os.listdir(tmp_path) if ".tmp-" in e] == []


def test_digits_default_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert D.default_data_path("DIGITS") == os.path.join(".", "data", "digits")
    assert D.default_data_path("IMNET") is None
    written = []
    monkeypatch.setattr(D, "prepare_digits", lambda r: written.append(r) or r)
    for p in ("", None, D.DEIT_DEFAULT_DATA_PATH):
        with pytest.raises(D.DataLayoutError):  # the stub wrote nothing: layout error follows
            D.build_dataset(True, make_args(data_set="DIGITS", data_path=p))
    assert written == [os.path.join(".", "data", "digits")] * 3


def test_digits_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    root = str(tmp_path / "digits")

    def dies(dest):
        os.makedirs(os.path.join(dest, "train", "0"))
        raise KeyboardInterrupt  # killed mid-write
    monkeypatch.setattr(D, "_write_digits", dies)
    with pytest.raises(KeyboardInterrupt):
        D.prepare_digits(root)
    assert os.listdir(tmp_path) == []
    # a stale temp dir of a dead writer (kill -9) is never read and is cleaned up later
    stale = tmp_path / f".digits.tmp-{os.uname().nodename}-999999999-deadbeef"
    os.makedirs(stale / "train" / "0")
    monkeypatch.undo()
    D.prepare_digits(root)
    assert sorted(os.listdir(tmp_path)) == ["digits"]


def test_digits_foreign_nonempty_dir_is_layout_error(tmp_path):
    (tmp_path / "stuff.txt").write_text("x")
    with pytest.raises(D.DataLayoutError) as e:
        D.prepare_digits(str(tmp_path))
    assert_one_line_error(e, tmp_path, "not a digits data set")


def test_digits_concurrent_writers(tmp_path):
    import multiprocessing as mp
    root = str(tmp_path / "digits")
    procs = [mp.get_context("fork").Process(target=D.prepare_digits, args=(root,)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert sorted(os.listdir(tmp_path)) == ["digits"]  # no temp dir left behind
    files = listing(root)
    assert len([f for f in files if f.endswith(".png")]) == 1797 and D.DIGITS_MARKER in files


def test_digits_killed_writer_leaves_no_dataset(tmp_path):
    import signal
    import time
    root = str(tmp_path / "digits")
    import multiprocessing as mp
    p = mp.get_context("fork").Process(target=D.prepare_digits, args=(root,))
    p.start()
    deadline = time.time() + 60

    def pngs_in_tmp():
        tmps = [e for e in os.listdir(tmp_path) if ".tmp-" in e]
        d = os.path.join(tmp_path, tmps[0], "train", "0") if tmps else ""
        return len(os.listdir(d)) if os.path.isdir(d) else 0
    while time.time() < deadline and pngs_in_tmp() < 5:  # wait until it is mid-write
        time.sleep(0.002)
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    assert p.exitcode == -signal.SIGKILL
    assert not os.path.exists(root)  # never a half-written data set under the real name
    assert len([e for e in os.listdir(tmp_path) if ".tmp-" in e]) == 1
    D.prepare_digits(root)  # a later run writes it and removes the dead writer's leftovers
    assert sorted(os.listdir(tmp_path)) == ["digits"]
    assert len([f for f in listing(root) if f.endswith(".png")]) == 1797


def test_digits_unwritable_path_is_layout_error(tmp_path):
    (tmp_path / "afile").write_text("x")  # a file where a folder is needed: fails even as root
    bad = tmp_path / "afile" / "digits"
    with pytest.raises(D.DataLayoutError) as e:
        D.prepare_digits(str(bad))
    assert_one_line_error(e, bad, "cannot write")


def test_recipe_randaugment_survives_zero_bit_posterize():
    """At magnitude 10 PosterizeIncreasing keeps 0 bits; Pillow 13 raises for that, older Pillow gave a
    black image. The recipe's transform must give the black image, not end the run."""
    transform = D.build_transform(True, make_args(input_size=64))
    rand_augment = next(s for s in transform.transforms if hasattr(s, "ops"))
    posterize_ops = [op for op in rand_augment.ops if op.name == "PosterizeIncreasing"]
    assert posterize_ops
    img = Image.new("RGB", (8, 8), (200, 120, 40))
    for op in posterize_ops:
        op.prob, op.magnitude, op.magnitude_std = 1.0, 10, 0
        out = op(img)
        assert out.size == img.size and out.getextrema() == ((0, 0), (0, 0), (0, 0))
    op.magnitude = 0  # 4 bits kept: the image is changed only in its low bits
    assert op(img).getpixel((0, 0)) == (192, 112, 32)


# ---------------------------------------------------------------------------- links
def test_symlink_loop_in_class_folder_is_not_followed(tmp_path):
    root = make_folder(tmp_path / "d", classes=("class0", "class1"))
    loop = os.path.join(root, "train", "class0", "loop")
    os.symlink("..", loop)
    for follow in (False, True):
        with pytest.warns(UserWarning, match=r"did not follow 1 directory link") as rec:
            ds, nc = D.build_dataset(True, make_args(data_path=root, follow_links=follow))
        assert (nc, len(ds)) == (2, 6)
        assert [t for _, t in ds.samples] == [0, 0, 0, 1, 1, 1]
        msgs = [str(w.message) for w in rec if "directory link" in str(w.message)]
        assert len(msgs) == 1 and "\n" not in msgs[0] and loop in msgs[0], msgs
        assert ("loop" if follow else "--follow-links") in msgs[0]
        assert not any("non-image" in str(w.message) for w in rec)


def test_follow_links_reads_outside_folders_but_not_other_classes(tmp_path):
    root = make_folder(tmp_path / "d", classes=("class0", "class1"))
    save_img(str(tmp_path / "extra" / "e0.png"))
    save_img(str(tmp_path / "extra" / "e1.png"))
    os.symlink(str(tmp_path / "extra"), os.path.join(root, "train", "class0", "more"))
    os.symlink(os.path.join("..", "class1"), os.path.join(root, "train", "class0", "other"))
    with pytest.warns(UserWarning, match=r"did not follow 2 directory link"):
        ds, _ = D.build_dataset(True, make_args(data_path=root))
    assert len(ds) == 6
    with pytest.warns(UserWarning, match=r"did not follow 1 directory link.*other.*back into") as rec:
        ds, _ = D.build_dataset(True, make_args(data_path=root, follow_links=True))
    assert len(ds) == 8 and [t for _, t in ds.samples].count(0) == 5
    assert "more" not in " ".join(str(w.message) for w in rec)


def test_broken_class_folder_link_is_an_error(tmp_path):
    root = make_folder(tmp_path / "d")
    for split in ("train", "val"):
        os.symlink(str(tmp_path / "gone"), os.path.join(root, split, "zebra"))
    for is_train in (True, False):
        with pytest.raises(D.DataLayoutError) as e:
            D.build_dataset(is_train, make_args(data_path=root))
        assert_one_line_error(e, os.path.join(root, "train" if is_train else "val", "zebra"),
                              "broken link")


def test_class_folder_linking_to_its_split_is_an_error(tmp_path):
    root = make_folder(tmp_path / "d", splits=("val",))
    os.symlink(".", os.path.join(root, "val", "all"))
    with pytest.raises(D.DataLayoutError) as e:
        D.build_dataset(False, make_args(data_path=root))
    assert_one_line_error(e, os.path.join(root, "val", "all"), "loop")


# ---------------------------------------------------------------------------- decoding
def one_image_folder(tmp_path, name, img, **save_kw):
    path = tmp_path / "d" / "val" / "c" / name
    os.makedirs(path.parent)
    img.save(path, **save_kw)
    return D.RobustImageFolder(str(tmp_path / "d" / "val"), transform=None, is_train=False), str(path)


def pixels(ds, i=0):
    img, target = ds[i]
    assert target == 0 and img.mode == "RGB"
    return np.asarray(img).astype(int)


def test_16bit_grayscale_png_is_scaled_not_saturated(tmp_path):
    a = np.linspace(0, 65535, 64 * 64).reshape(64, 64).astype(np.uint16)
    ds, _ = one_image_folder(tmp_path, "g16.png", Image.fromarray(a))
    assert Image.open(ds.samples[0][0]).mode == "I;16"
    p = pixels(ds)
    assert (p[..., 0] == p[..., 2]).all()
    assert np.abs(p[..., 0] - a / 257.0).max() <= 0.5
    assert (p == 255).mean() < 0.01


def test_32bit_integer_tiff_is_scaled(tmp_path):
    a = np.linspace(0, 65535, 32 * 32).reshape(32, 32).astype(np.int32)
    ds, _ = one_image_folder(tmp_path, "i32.tif", Image.fromarray(a, "I"))
    assert np.abs(pixels(ds)[..., 1] - a / 257.0).max() <= 0.5


@pytest.mark.parametrize("scale", [1.0, 255.0])
def test_float_tiff_is_mapped_by_its_range(tmp_path, scale):
    a = np.linspace(0, 1, 32 * 32).reshape(32, 32).astype(np.float32)
    ds, _ = one_image_folder(tmp_path, "f.tif", Image.fromarray(a * scale, "F"))
    assert np.abs(pixels(ds)[..., 0] - a * 255).max() <= 0.5


def test_float_tiff_out_of_range_is_refused_by_name(tmp_path):
    a = np.linspace(-3, 300, 16 * 16).reshape(16, 16).astype(np.float32)
    ds, _ = one_image_folder(tmp_path, "f.tif", Image.fromarray(a, "F"))
    ds.strict = True
    with pytest.raises(D.BadSampleError, match=r"f\.tif.*float image with values in \[-3, 300\]"):
        ds[0]


def test_exif_orientation_is_applied(tmp_path):
    img = Image.new("RGB", (40, 20), (255, 0, 0))
    img.paste((0, 0, 255), (20, 0, 40, 20))  # stored: red left, blue right
    exif = Image.Exif()
    exif[0x0112] = 6  # display rotated 90 degrees clockwise
    ds, _ = one_image_folder(tmp_path, "rot.jpg", img, exif=exif, quality=95)
    p = pixels(ds)
    assert p.shape == (40, 20, 3)  # portrait once rotated
    top, bottom = p[5, 10], p[35, 10]  # clockwise: stored left (red) goes to the top
    assert top[0] > 200 and top[2] < 60 and bottom[2] > 200 and bottom[0] < 60


def test_gif_webp_read_and_animated_gif_gives_first_frame(tmp_path):
    root = make_folder(tmp_path / "d", splits=("val",), ext=".webp")
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 0, 255))]
    gif = os.path.join(root, "val", "cat", "anim.gif")
    frames[0].save(gif, save_all=True, append_images=frames[1:], duration=50)
    assert Image.open(gif).n_frames == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is skipped
        ds = D.RobustImageFolder(os.path.join(root, "val"), transform=None, is_train=False)
    assert len(ds) == 7 and ds.skipped_files == []
    i = [p for p, _ in ds.samples].index(gif)
    r, _, b = np.asarray(ds[i][0])[4, 4]
    assert r > 200 and b < 60
    assert {".gif", ".webp", ".png", ".jpg", ".tif"} <= set(D.IMAGE_EXTENSIONS)


# ---------------------------------------------------------------------------- evaluation sets
def test_imagenet_v2_numeric_folders_labelled_by_value(tmp_path):
    names = [f"n{i:02d}" for i in range(12)]
    root = make_folder(tmp_path / "d", classes=names, n=1, splits=("val",))
    v2 = tmp_path / "v2"
    for i in range(12):
        save_img(str(v2 / str(i) / "a.png"), (i * 20, 0, 0))
    dv, nc = D.build_dataset(False, make_args(data_path=root))
    (name, ds), = D.build_eval_sets(make_args(eval_sets=[f"V2={v2}"]), dv)
    assert name == "V2" and len(ds) == 12 and nc == 12
    for path, target in ds.samples:
        assert target == int(os.path.basename(os.path.dirname(path)))
    # plain ImageFolder order would have labelled folder "10" as class 2
    assert D.RobustImageFolder(str(v2)).class_to_idx["10"] == 2
    x, y = ds[[p for p, _ in ds.samples].index(str(v2 / "10" / "a.png"))]
    assert y == 10 and x.shape == (3, 32, 32)


def test_eval_set_with_class_names_and_unknown_names(tmp_path):
    root = make_folder(tmp_path / "d", classes=("a", "b", "c"), n=1, splits=("val",))
    dv, _ = D.build_dataset(False, make_args(data_path=root))
    make_folder(tmp_path / "sub", classes=("c",), n=2, splits=("x",))
    (name, ds), = D.build_eval_sets(make_args(eval_sets=[str(tmp_path / "sub" / "x")]), dv)
    assert name == "x" and ds.targets == [2, 2] and ds.classes == ["a", "b", "c"]
    save_img(str(tmp_path / "sub" / "x" / "zebra" / "0.png"))
    with pytest.raises(D.DataLayoutError) as e:
        D.build_eval_sets(make_args(eval_sets=[str(tmp_path / "sub" / "x")]), dv)
    assert_one_line_error(e, "zebra")


def make_flat_val(root, labels, label_file="val_labels.txt", header="", ext=True):
    os.makedirs(os.path.join(root, "val"), exist_ok=True)
    lines = [header] if header else []
    for i, lab in enumerate(labels):
        fname = f"ILSVRC2012_val_{i + 1:08d}.JPEG"
        save_img(os.path.join(root, "val", fname), (i * 30, 0, 0), fmt="JPEG")
        sep = "," if label_file.endswith(".csv") else " "
        lines.append(f"{fname if ext else os.path.splitext(fname)[0]}{sep}{lab}"
                     + (" 1 2 3 4" if sep == "," else ""))
    where = root if label_file == "LOC_val_solution.csv" else os.path.join(root, "val")
    with open(os.path.join(where, label_file), "w") as f:
        f.write("\n".join(lines) + "\n")


@pytest.mark.parametrize("label_file,header,ext", [("val_labels.txt", "", True),
                                                   ("LOC_val_solution.csv", "ImageId,PredictionString", False)])
def test_flat_val_with_label_file(tmp_path, label_file, header, ext):
    root = make_folder(tmp_path / "d", classes=("n01", "n02", "n03"), n=1, splits=("train",))
    make_flat_val(root, ["n02", "n01", "n03", "n02"], label_file, header, ext)
    dv, nc = D.build_dataset(False, make_args(data_path=root))
    assert nc == 3 and len(dv) == 4 and dv.targets == [1, 0, 2, 1]
    x, y = dv[2]
    assert x.shape == (3, 32, 32) and y == 2
    D.build_dataset(True, make_args(data_path=root))  # train classes == val labels: accepted


def test_flat_val_errors(tmp_path):
    root = make_folder(tmp_path / "d", classes=("n01", "n02", "n03"), n=1, splits=("train",))
    make_flat_val(root, ["n02", "n01"])
    with pytest.raises(D.DataLayoutError) as e:  # n03 never appears in val
        D.build_dataset(True, make_args(data_path=root))
    assert_one_line_error(e, "n03", "missing from val/")
    save_img(os.path.join(root, "val", "extra.png"))
    with pytest.raises(D.DataLayoutError) as e:
        D.build_dataset(False, make_args(data_path=root))
    assert_one_line_error(e, "extra.png", "no label")
    os.remove(os.path.join(root, "val", "extra.png"))
    os.remove(os.path.join(root, "val", "ILSVRC2012_val_00000001.JPEG"))
    with pytest.raises(D.DataLayoutError) as e:
        D.build_dataset(False, make_args(data_path=root))
    assert_one_line_error(e, "val_labels.txt", "ILSVRC2012_val_00000001.JPEG", "not found")
    os.remove(os.path.join(root, "val", "val_labels.txt"))
    with pytest.raises(D.DataLayoutError) as e:
        D.build_dataset(False, make_args(data_path=root))
    assert_one_line_error(e, os.path.join(root, "val"), "no class folders and no label file", "val_labels.txt")


class ColourToClass(torch.nn.Module):
    """Predicts, for each of the known images (by their mean pixel), a fixed class."""

    def __init__(self, means, preds, n_classes):
        super().__init__()
        self.means, self.preds, self.n = torch.tensor(means), preds, n_classes

    def forward(self, x):
        out = torch.arange(self.n).float().repeat(x.shape[0], 1) * 0.01  # then prefers 9, 8, 7, 6
        for b, m in enumerate(x.mean((1, 2, 3))):
            out[b, self.preds[int((self.means - m).abs().argmin())]] = 1.0
        return out


def test_real_labels_scoring(tmp_path):
    root = tmp_path / "d"
    for i, c in enumerate(["n0", "n1", "n2", "n1"]):
        save_img(str(root / "val" / c / f"ILSVRC2012_val_{i + 1:08d}.JPEG"), (i * 60, 0, 0), fmt="JPEG")
    real = tmp_path / "real.json"
    real.write_text(json.dumps([[0], [1, 2], [], [2, 9]]))
    dv, _ = D.build_dataset(False, make_args(data_path=str(root)))
    order = [int(os.path.basename(p)[15:23]) - 1 for p, _ in dv.samples]  # file number of each sample
    preds_by_file = [0, 2, 1, 0]  # hit, hit (2 in [1, 2]), unlabelled, top-1 miss but top-5 hit
    means = [float(dv[i][0].mean()) for i in range(len(dv))]
    model = ColourToClass(means, [preds_by_file[f] for f in order], 10)
    with pytest.raises(D.DataLayoutError) as e:  # label 9 with 3 classes
        D.RealLabels(dv, str(real))
    assert_one_line_error(e, "real.json", "ReaL label 9", "has 3 classes")
    dv.classes = [f"n{i}" for i in range(10)]  # as for a 10-class model, so that top-5 differs from top-1
    labels = D.RealLabels(dv, str(real))
    loader = DataLoader(D.WithIndex(dv), batch_size=3)
    stats = D.evaluate_real(loader, model, labels)
    assert stats["n"] == 3 and abs(stats["acc1"] - 100 * 2 / 3) < 1e-9 and stats["acc5"] == 100.0
    with pytest.raises(D.DataLayoutError) as e:  # timm's labels need the 1000 ImageNet classes
        D.RealLabels(dv)
    assert_one_line_error(e, "imagenet_real_labels.json", "has 10 classes")
    dv.classes = [f"n{i:04d}" for i in range(1000)]
    bundled = D.RealLabels(dv)
    import pkgutil
    table = json.loads(pkgutil.get_data("timm.data", "_info/imagenet_real_labels.json"))
    assert len(table) == 50000 and bundled.labels == [table[f] for f in order]


def test_real_labels_need_imagenet_file_names(tmp_path):
    root = make_folder(tmp_path / "d", splits=("val",))
    dv, _ = D.build_dataset(False, make_args(data_path=root))
    with pytest.raises(D.DataLayoutError) as e:
        D.RealLabels(dv)
    assert_one_line_error(e, "0.png", "ILSVRC2012_val_", "1000-class ImageNet validation set", "drop --real-labels")
