"""segmentation/train.py in real processes on a tiny ADE20K-layout scene set: a two-process torchrun run
stopped by SIGTERM and relaunched ends with the weights and optimizer state of an uninterrupted run, and the
mIoU of its checkpoint is the same from one process and from two (exact --dist-eval, 5 images on 2 ranks)."""
import json
import os
import re
import signal
import subprocess

import pytest
import torch
from conftest import PY, REPO, TORCHRUN, env, free_port, kill_group, load, signal_when, start_process

from segmentation import scenes

pytestmark = pytest.mark.slow  # torchrun, signals and relaunches in real processes

ARGS = ['--model', 'NALAFORMER_XT', '--num-classes', '5', '--device', 'cpu', '--iters', '6', '--batch-size', '2',
        '--crop-size', '48', '--img-scale', '96', '48', '--channels', '16', '--warmup-iters', '2', '--lr', '1e-3',
        '--eval-interval', '3', '--print-freq', '1', '--num_workers', '0', '--dist-timeout', '120']


def seg_cmd(nproc, args):
    script = os.path.join('segmentation', 'train.py')
    if nproc == 1:
        return [PY, script, *args]
    return TORCHRUN + [f'--nproc_per_node={nproc}', '--master_addr=127.0.0.1', f'--master_port={free_port()}',
                       script, *args]


def run_seg(nproc, args, timeout=240, environ=None):
    """segmentation/train.py to its end; on a timeout its process group is killed and its output shown."""
    proc = subprocess.Popen(seg_cmd(nproc, args), cwd=REPO, env=environ or env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        raise AssertionError(f'timed out after {timeout}s\nSTDOUT:\n{out[-4000:]}\nSTDERR:\n{err[-4000:]}') from None
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    return scenes.make_scenes(str(tmp_path_factory.mktemp('scenes')), n_train=8, n_val=5, size=(40, 48))


@pytest.fixture(scope='module')
def straight(data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp('straight') / 'out')
    warnings_shown = {k: v for k, v in env().items() if k != 'PYTHONWARNINGS'}  # as a user sees them
    p = run_seg(2, ARGS + ['--data-path', data, '--output_dir', out], environ=warnings_shown)
    return out, p


def test_a_stopped_and_relaunched_run_ends_with_the_weights_of_an_uninterrupted_one(data, straight, tmp_path):
    out = str(tmp_path / 'out')
    args = ARGS + ['--data-path', data, '--output_dir', out]
    stdout, stderr, _ = signal_when(start_process(seg_cmd(2, args)), r'^Iter \[2/6\]', signal.SIGTERM)
    m = re.search(r'Stopped by SIGTERM after iteration (\d)', stdout)
    assert m and int(m.group(1)) < 6, stdout[-3000:] + stderr[-3000:]
    p = run_seg(2, args)
    assert f'Resumed from {out}/checkpoint.pth: continuing at iteration {m.group(1)} of 6' in p.stdout
    a, b = load(os.path.join(straight[0], 'checkpoint.pth')), load(os.path.join(out, 'checkpoint.pth'))
    assert a['iter'] == b['iter'] == 6
    diff = [k for k in a['model'] if not torch.equal(a['model'][k], b['model'][k])]
    assert not diff, f'{len(diff)} tensors differ, e.g. {diff[:3]}'
    for sa, sb in zip(a['optimizer']['state'].values(), b['optimizer']['state'].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    digests = re.findall(r'final weights sha256: (\w+)', p.stdout + straight[1].stdout)
    assert len(set(digests)) == 1, digests


def test_the_miou_is_the_same_from_one_and_from_two_processes(data, straight):
    out, _ = straight
    logged = [json.loads(line) for line in open(os.path.join(out, 'log.txt'))]
    assert [r['iter'] for r in logged] == [3, 6] and all(r['images'] == 5 for r in logged)
    ckpt = os.path.join(out, 'checkpoint.pth')
    lines = []
    for nproc, dist in ((1, '--no-dist-eval'), (2, '--dist-eval')):
        q = run_seg(nproc, ARGS + ['--data-path', data, '--eval', '--resume', ckpt, dist, '--output_dir', out])
        lines += re.findall(r'^mIoU .*$', q.stdout, re.M)
    assert len(lines) == 2 and lines[0] == lines[1] and '(5 images, whole-image inference)' in lines[0], lines
    assert lines[0].startswith(f"mIoU {logged[-1]['mIoU']:.2f}  mAcc {logged[-1]['mAcc']:.2f}")
    evals = [json.loads(line) for line in open(os.path.join(out, 'log.txt'))][2:]
    assert len(evals) == 2 and evals[0]['eval'] == ckpt and evals[0]['mIoU'] == evals[1]['mIoU'] == logged[-1]['mIoU']



def test_ddp_gradient_layout_warnings_are_not_shown(straight):
    assert 'Grad strides do not match bucket view strides' not in straight[1].stderr
