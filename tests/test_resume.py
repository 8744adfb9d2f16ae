"""One resume path for every task: classification (main.py) and segmentation (segmentation/train.py) resume through
the same functions of run/resume.py, and checkpoints of both kept as files (tests/fixtures/, written by earlier
code: the format on disk, not the code under test) resume and train on."""
import collections
import json
import os
import shutil

import pytest
import torch
from conftest import REPO
from helpers.image_folders import make_imagefolder

import main
from run import resume
from segmentation import scenes
from segmentation import train as seg_train

FIXTURES = os.path.join(REPO, 'tests', 'fixtures')
#: the steps a resume of any task takes through run/resume.py (output_dir.repair_after_resume as resume imports it)
SHARED = ('load_agreed', 'changed_flags', 'note_changes', 'rank_rng_state', 'repair_after_resume')


@pytest.fixture
def shared_calls(monkeypatch):
    """The shared steps, each wrapped to count its calls (and then run as it is)."""
    calls = collections.Counter()

    def counting(name, real):
        def counted(*a, **kw):
            calls[name] += 1
            return real(*a, **kw)
        return counted
    for name in SHARED:
        monkeypatch.setattr(resume, name, counting(name, getattr(resume, name)))
    return calls


def _run_dir(tmp_path, fixture):
    out = tmp_path / 'out'
    out.mkdir(parents=True)
    shutil.copy(os.path.join(FIXTURES, fixture), out / 'checkpoint.pth')
    return out


def _log(out):
    with open(out / 'log.txt') as f:
        return [json.loads(line) for line in f]


def resume_classification(tmp_path, capsys):
    """The classification checkpoint (test_efficientnet, 1 of 1 epochs done, 3 classes of 8 training images) resumed
    by the same command with --epochs 2: (its output, its run directory)."""
    out = _run_dir(tmp_path, 'classification_checkpoint.pth')
    data = make_imagefolder(tmp_path / 'tiny')
    code = main.run(['--model', 'test_efficientnet', '--input-size', '32', '--batch-size', '4', '--device', 'cpu',
                     '--num_workers', '0', '--no-flops', '--epochs', '2', '--data-path', data,
                     '--output_dir', str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    return printed, out


def resume_segmentation(tmp_path, capsys):
    """The segmentation checkpoint (UperNet over test_convnext, stopped after iteration 4 of 6) resumed by the same
    command: (its output, its run directory)."""
    out = _run_dir(tmp_path, 'segmentation_checkpoint.pth')
    data = scenes.make_scenes(str(tmp_path / 'scenes'), n_train=8, n_val=4)
    code = seg_train.run(['--iters', '6', '--batch-size', '2', '--lr', '0.001', '--warmup-iters', '1',
                          '--eval-interval', '2', '--device', 'cpu', '--num_workers', '0', '--data-path', data,
                          '--output_dir', str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    return printed, out


def test_classification_and_segmentation_resume_through_the_same_functions(tmp_path, capsys, shared_calls,
                                                                          one_thread):
    resume_classification(tmp_path / 'cls', capsys)
    classification = dict(shared_calls)
    shared_calls.clear()
    resume_segmentation(tmp_path / 'seg', capsys)
    assert set(classification) == set(shared_calls) == set(SHARED), (classification, dict(shared_calls))


def test_a_classification_checkpoint_written_before_resumes_and_trains_on(tmp_path, capsys, one_thread):
    printed, out = resume_classification(tmp_path, capsys)
    ck = str(out / 'checkpoint.pth')
    assert f'Resumed from {ck}: continuing at epoch 1, best accuracy so far 20.00%' in printed
    assert f'Repaired {out / "best.pth"}: it was missing' in printed  # the other name it was saved under
    assert 'Note: changed since the checkpoint: --epochs 1 -> 2; following the command line' in printed
    after = torch.load(ck, weights_only=True)
    assert after['epoch'] == 1 and after['args']['epochs'] == 2 and after['classes'] == ['c0', 'c1', 'c2']
    assert [r['epoch'] for r in _log(out)] == [0, 1]  # epoch 0's line from the checkpoint, then the new one


def test_a_segmentation_checkpoint_written_before_resumes_and_trains_on(tmp_path, capsys, one_thread):
    printed, out = resume_segmentation(tmp_path, capsys)
    ck = str(out / 'checkpoint.pth')
    assert f'Resumed from {ck}: continuing at iteration 4 of 6' in printed
    assert 'Training done: mIoU' in printed
    after = torch.load(ck, weights_only=True)
    assert after['iter'] == 6 and after['task'] == 'segmentation' and not after['eval_due']
    assert [r['iter'] for r in _log(out)] == [6]
