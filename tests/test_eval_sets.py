"""The extra evaluation sets of datasets.py (--eval-sets) and ImageNet-ReaL (--real-labels), and main.py --eval
with them."""
import json
import os
from types import SimpleNamespace

import pytest
import torch
from helpers.image_folders import assert_one_line_error, dataset_of, eval_sets_of, make_args, make_folder, save_img
from PIL import Image
from test_engine import count_host_reads
from torch.utils.data import DataLoader

import datasets as E
import engine
from training import image_folder as IF


def test_real_labels_on_a_set_of_other_images_is_a_flag_error(tmp_path, capsys, monkeypatch):
    """An IMNET-layout folder of other images: one line saying ReaL needs the ImageNet validation set, exit 2."""
    for k in ('RANK', 'WORLD_SIZE', 'SLURM_PROCID', 'SLURM_NTASKS'):
        monkeypatch.delenv(k, raising=False)
    import main
    for split in ('train', 'val'):
        for c in ('cat', 'dog'):
            os.makedirs(tmp_path / 'd' / split / c)
            Image.new('RGB', (8, 8)).save(tmp_path / 'd' / split / c / 'a.png')
    import timm

    import models  # noqa: F401  (registers the variants)
    ck = tmp_path / 'ck.pth'
    torch.save({'model': timm.create_model('NALAFORMER_XT', num_classes=2).state_dict()}, ck)
    code = main.run(['--eval', '--resume', str(ck), '--model', 'NALAFORMER_XT', '--data-path', str(tmp_path / 'd'),
                     '--input-size', '32', '--device', 'cpu', '--num-workers', '0', '--real-labels'])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert 'a.png' in err[0] and 'ImageNet-ReaL labels exist only for the 1000-class ImageNet validation set' in err[0]


# ---------------------------------------------------------------------------- evaluation sets
def test_imagenet_v2_numeric_folders_labelled_by_value(tmp_path):
    names = [f'n{i:02d}' for i in range(12)]
    root = make_folder(tmp_path / 'd', classes=names, n=1, splits=('val',))
    v2 = tmp_path / 'v2'
    for i in range(12):
        save_img(str(v2 / str(i) / 'a.png'), (i * 20, 0, 0))
    dv, nc = dataset_of(False, make_args(data_path=root))
    (name, ds), = eval_sets_of(make_args(eval_sets=[f'V2={v2}']), dv)
    assert name == 'V2' and len(ds) == 12 and nc == 12
    for path, target in ds.samples:
        assert target == int(os.path.basename(os.path.dirname(path)))
    # plain ImageFolder order would have labelled folder "10" as class 2
    assert IF.RobustImageFolder(str(v2)).class_to_idx['10'] == 2
    x, y = ds[[p for p, _ in ds.samples].index(str(v2 / '10' / 'a.png'))]
    assert y == 10 and x.shape == (3, 32, 32)


def test_eval_set_with_class_names_and_unknown_names(tmp_path):
    root = make_folder(tmp_path / 'd', classes=('a', 'b', 'c'), n=1, splits=('val',))
    dv, _ = dataset_of(False, make_args(data_path=root))
    make_folder(tmp_path / 'sub', classes=('c',), n=2, splits=('x',))
    (name, ds), = eval_sets_of(make_args(eval_sets=[str(tmp_path / 'sub' / 'x')]), dv)
    assert name == 'x' and ds.targets == [2, 2] and ds.classes == ['a', 'b', 'c']
    save_img(str(tmp_path / 'sub' / 'x' / 'zebra' / '0.png'))
    with pytest.raises(IF.DataLayoutError) as e:
        eval_sets_of(make_args(eval_sets=[str(tmp_path / 'sub' / 'x')]), dv)
    assert_one_line_error(e, 'zebra')


# ---------------------------------------------------------------------------- ImageNet-ReaL
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
    root = tmp_path / 'd'
    for i, c in enumerate(['n0', 'n1', 'n2', 'n1']):
        save_img(str(root / 'val' / c / f'ILSVRC2012_val_{i + 1:08d}.JPEG'), (i * 60, 0, 0), fmt='JPEG')
    real = tmp_path / 'real.json'
    real.write_text(json.dumps([[0], [1, 2], [], [2, 9]]))
    dv, _ = dataset_of(False, make_args(data_path=str(root)))
    order = [int(os.path.basename(p)[15:23]) - 1 for p, _ in dv.samples]  # file number of each sample
    preds_by_file = [0, 2, 1, 0]  # hit, hit (2 in [1, 2]), unlabelled, top-1 miss but top-5 hit
    means = [float(dv[i][0].mean()) for i in range(len(dv))]
    model = ColourToClass(means, [preds_by_file[f] for f in order], 10)
    with pytest.raises(IF.DataLayoutError) as e:  # label 9 with 3 classes
        E.RealLabels(dv, str(real))
    assert_one_line_error(e, 'real.json', 'ReaL label 9', 'has 3 classes')
    dv.classes = [f'n{i}' for i in range(10)]  # as for a 10-class model, so that top-5 differs from top-1
    labels = E.RealLabels(dv, str(real))
    loader = DataLoader(E.WithIndex(dv), batch_size=3)
    stats = engine.evaluate(loader, model, 'cpu', real=labels)['real']
    assert stats['n'] == 3 and abs(stats['acc1'] - 100 * 2 / 3) < 1e-9 and stats['acc5'] == 100.0
    with pytest.raises(IF.DataLayoutError) as e:  # timm's labels need the 1000 ImageNet classes
        E.RealLabels(dv)
    assert_one_line_error(e, 'imagenet_real_labels.json', 'has 10 classes')
    dv.classes = [f'n{i:04d}' for i in range(1000)]
    bundled = E.RealLabels(dv)
    import pkgutil
    table = json.loads(pkgutil.get_data('timm.data', '_info/imagenet_real_labels.json'))
    assert len(table) == 50000 and bundled.labels == [table[f] for f in order]


def test_real_labels_need_imagenet_file_names(tmp_path):
    root = make_folder(tmp_path / 'd', splits=('val',))
    dv, _ = dataset_of(False, make_args(data_path=root))
    with pytest.raises(IF.DataLayoutError) as e:
        E.RealLabels(dv)
    assert_one_line_error(e, '0.png', 'ILSVRC2012_val_', '1000-class ImageNet validation set', 'drop --real-labels')


class _Batches(list):
    batch_size = 4


def test_real_labels_are_scored_on_the_device_with_no_extra_host_read(tmp_path, monkeypatch):
    """ReaL counts ride along the validation pass: the same predictions, no host read per batch."""
    table = [[i % 5] if i % 4 else ([] if i % 8 else [1, 3]) for i in range(24)]
    (tmp_path / 'real.json').write_text(json.dumps(table))
    files = SimpleNamespace(samples=[(f'ILSVRC2012_val_{i + 1:08d}.JPEG', 0) for i in range(24)],
                            classes=[str(c) for c in range(5)])
    real = E.RealLabels(files, str(tmp_path / 'real.json'))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(2, 5))
    x, y = torch.randn(24, 2, 1, 1), torch.randint(0, 5, (24,))
    y[6] = IF.IGNORE_TARGET  # undecodable: not scored either
    idx = torch.arange(24)
    reads = []
    for with_real in (False, True):
        batches = _Batches([(x[i:i + 4], y[i:i + 4], idx[i:i + 4]) if with_real else (x[i:i + 4], y[i:i + 4])
                            for i in range(0, 24, 4)])
        calls = count_host_reads(monkeypatch)
        stats = engine.evaluate(batches, model, 'cpu', print_freq=1000, real=real if with_real else None)
        monkeypatch.undo()
        reads.append(len(calls))
    assert reads[0] == reads[1], reads
    with torch.no_grad():
        top = model(x).topk(5, dim=1).indices.tolist()
    scored = [(t, table[i]) for i, t in enumerate(top) if table[i] and i != 6]
    assert stats['real']['n'] == len(scored)
    assert stats['real']['acc1'] == pytest.approx(100 * sum(t[0] in r for t, r in scored) / len(scored))
    assert stats['real']['acc5'] == pytest.approx(100 * sum(any(p in r for p in t) for t, r in scored) / len(scored))
    assert stats['n'] == 23 and stats['seen'] == 24
