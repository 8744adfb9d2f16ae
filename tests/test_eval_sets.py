"""main.py --eval with extra evaluation sets (--eval-sets) and ImageNet-ReaL (--real-labels)."""
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO
from PIL import Image

import datasets as D


@pytest.mark.slow
def test_eval_prints_every_set_asked_for(tmp_path):
    import timm

    import models  # noqa: F401  (registers the variants)
    classes = ["n01", "n02", "n03"]
    for split in ("train", "val"):
        for ci, c in enumerate(classes):
            for i in range(2):
                p = tmp_path / "d" / split / c / f"ILSVRC2012_val_{ci * 2 + i + 1:08d}.JPEG"
                os.makedirs(p.parent, exist_ok=True)
                Image.new("RGB", (8, 8), (ci * 80, i * 120, 200 - ci * 60)).save(p, "JPEG")
    for k in range(3):
        os.makedirs(tmp_path / "v2" / str(k))
        Image.new("RGB", (8, 8), (k * 80, 30, 0)).save(tmp_path / "v2" / str(k) / "a.png")
    real_table = [[0], [1], [1, 2], [], [2], [0, 1]]
    (tmp_path / "real.json").write_text(json.dumps(real_table))
    torch.manual_seed(0)
    model = timm.create_model("NALAFORMER_XT", num_classes=3).eval()
    torch.save({"model": model.state_dict()}, tmp_path / "ck.pth")

    cmd = [sys.executable, os.path.join(REPO, "main.py"), "--eval", "--resume", str(tmp_path / "ck.pth"),
           "--model", "NALAFORMER_XT", "--data-path", str(tmp_path / "d"), "--input-size", "32",
           "--device", "cpu", "--num-workers", "0", "--batch-size", "4",
           "--eval-sets", f"V2={tmp_path / 'v2'}", "--real-labels", str(tmp_path / "real.json")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]

    # expected figures from the same model, transforms and labels, computed here
    args = SimpleNamespace(data_set="IMNET", data_path=str(tmp_path / "d"), input_size=32)
    dv, _ = D.build_dataset(False, args)
    (_, v2), = D.build_eval_sets(SimpleNamespace(eval_sets=[str(tmp_path / "v2")], input_size=32), dv)
    with torch.no_grad():
        top1 = {name: [int(model(ds[i][0][None]).argmax()) for i in range(len(ds))]
                for name, ds in (("val", dv), ("v2", v2))}
    v2_acc = 100 * sum(p == t for p, t in zip(top1["v2"], v2.targets)) / 3
    scored = [(p, real_table[int(os.path.basename(f)[15:23]) - 1]) for p, (f, _) in zip(top1["val"], dv.samples)]
    scored = [(p, r) for p, r in scored if r]
    real_acc = 100 * sum(p in r for p, r in scored) / len(scored)
    m = re.search(r"^V2: Acc@1 ([\d.]+)% .* on 3 of 3 images$", out.stdout, re.M)
    assert m and abs(float(m.group(1)) - v2_acc) < 0.01, out.stdout[-1500:]
    m = re.search(r"^ImageNet-ReaL: Acc@1 ([\d.]+)% .* on (\d+) images", out.stdout, re.M)
    assert m and abs(float(m.group(1)) - real_acc) < 0.01 and int(m.group(2)) == len(scored), out.stdout[-1500:]

    train = [a for a in cmd if a != "--eval"]  # the extra sets are evaluation-only: refused, not ignored
    out = subprocess.run(train, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode != 0 and "add --eval" in out.stdout + out.stderr, out.stdout[-800:] + out.stderr[-800:]


def test_real_labels_on_a_set_of_other_images_is_a_flag_error(tmp_path, capsys, monkeypatch):
    """An IMNET-layout folder of other images: one line saying ReaL needs the ImageNet validation set, exit 2."""
    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    import main
    for split in ("train", "val"):
        for c in ("cat", "dog"):
            os.makedirs(tmp_path / "d" / split / c)
            Image.new("RGB", (8, 8)).save(tmp_path / "d" / split / c / "a.png")
    import timm

    import models  # noqa: F401  (registers the variants)
    ck = tmp_path / "ck.pth"
    torch.save({"model": timm.create_model("NALAFORMER_XT", num_classes=2).state_dict()}, ck)
    code = main.run(["--eval", "--resume", str(ck), "--model", "NALAFORMER_XT", "--data-path", str(tmp_path / "d"),
                     "--input-size", "32", "--device", "cpu", "--num-workers", "0", "--real-labels"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "a.png" in err[0] and "ImageNet-ReaL labels exist only for the 1000-class ImageNet validation set" in err[0]
