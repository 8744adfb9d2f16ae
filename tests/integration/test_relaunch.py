"""Relaunches in real processes: a second job beside a torchrun job in the same --output_dir, a resume after
a class folder was renamed, a two-process mid-epoch stop resumed on one process (the weights of an uninterrupted
run, up to rounding, where nothing is random), torchrun --max-restarts restarting a killed worker (the weights of
an uninterrupted run), a killed data-loader worker."""
import json
import os
import re
import signal
import subprocess
import time

import pytest
import torch
from conftest import (
    BASE,
    PY,
    REPO,
    TORCHRUN,
    assert_same_weights,
    env,
    error_line,
    free_port,
    kill_group,
    load,
    run_main,
    signal_when,
    start_process,
)
from helpers.cluster import children
from helpers.image_folders import make_imagefolder

pytestmark = pytest.mark.slow  # torchrun, signals and kills in real processes


def wait_for_line(proc, pattern, seen, timeout=180):
    t0 = time.time()
    for line in proc.stdout:
        seen.append(line)
        if re.search(pattern, line):
            return
        assert time.time() - t0 < timeout, ''.join(seen)[-3000:]
    raise AssertionError(f'no line matched {pattern}:\n' + ''.join(seen)[-3000:] + proc.stderr.read()[-3000:])


def test_a_second_job_is_refused_while_a_torchrun_job_holds_the_dir(data, tmp_path):
    out = str(tmp_path / 'out')
    args = BASE[:-1] + ['3', '--batch-size', '2', '--num_workers', '0', '--data-path', data, '--output_dir', out]
    first = start_process(TORCHRUN + ['--nproc_per_node=2', '--master_addr=127.0.0.1', f'--master_port={free_port()}',
                                      'main.py'] + args)
    try:
        seen = []
        wait_for_line(first, r'Start training', seen)
        rank0 = children(first.pid, RANK=0)
        second = run_main(args + ['--seed', '1'], check=False)  # a double-submitted job
        line = error_line(second)
        assert f'--output_dir {out} is in use by another run (PID {rank0[0]} on host' in line, line
        assert first.poll() is None  # the first job runs on
    finally:
        kill_group(first)  # kill -9: the OS releases the lock
        first.communicate()
    p = run_main(BASE[:-1] + ['1', '--num_workers', '0', '--data-path', data, '--output_dir', out])
    assert 'in use' not in p.stdout + p.stderr


def test_renamed_class_folder_stops_the_resume(tmp_path):
    root = make_imagefolder(tmp_path / 'data')
    out = str(tmp_path / 'out')
    args = BASE[:-1] + ['1', '--num_workers', '0', '--data-path', root, '--output_dir', out]
    run_main(args)
    for split in ('train', 'val'):
        os.rename(os.path.join(root, split, 'c0'), os.path.join(root, split, 'c9'))  # mv train/a train/d
    before = open(os.path.join(out, 'checkpoint.pth'), 'rb').read()
    p = run_main(BASE + ['--num_workers', '0', '--data-path', root, '--output_dir', out], check=False)
    line = error_line(p)
    assert "class 0 is 'c0' in the checkpoint but 'c1' in the data" in line and '--finetune' in line, line
    assert open(os.path.join(out, 'checkpoint.pth'), 'rb').read() == before


FIXED_TRANSFORM = """
import sys
import datasets, main
evaluation = datasets.build_transform
# the training transform without its random crop, flip and RandAugment: the evaluation transform
datasets.build_transform = lambda train, cfg, augment=None, data_set='', uint8=False: evaluation(False, cfg,
                                                                                              uint8=uint8)
sys.exit(main.run(sys.argv[1:]))
"""


def _weights(ck):
    return torch.cat([v.flatten().double() for v in ck['model'].values() if v.is_floating_point()])


def test_a_two_process_run_stopped_inside_an_epoch_ends_on_one_process_as_uninterrupted(data, tmp_path):
    """A 2-process run stopped inside epoch 1 and relaunched on 1 process with the same global batch (--accum-steps
    2): the epoch continues after the images the stop had reached, so every optimizer step takes the images of
    the uninterrupted run, at its LR and EMA decay. Where nothing is drawn at random (a fixed training transform,
    no Mixup, CutMix or erasing) and every image is normalised alone (BatchNorm in eval mode: --no-train-mode),
    the final weights are the uninterrupted run's up to the floating-point order of the gradient sums."""
    script = tmp_path / 'fixed_transform.py'
    script.write_text(FIXED_TRANSFORM)
    args = BASE[:-1] + ['2', '--batch-size', '2', '--num_workers', '0', '--data-path', data, '--no-train-mode',
                        '--mixup', '0', '--cutmix', '0', '--reprob', '0', '--dist-timeout', '120']
    two = TORCHRUN + ['--nproc_per_node=2', '--master_addr=127.0.0.1']
    e = {**env(), 'PYTHONPATH': REPO}
    ref, out = str(tmp_path / 'ref'), str(tmp_path / 'out')
    p = subprocess.run(two + [f'--master_port={free_port()}', str(script)] + args + ['--output_dir', ref], cwd=REPO,
                       env=e, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    proc = subprocess.Popen(two + [f'--master_port={free_port()}', str(script)] + args + ['--output_dir', out],
                            cwd=REPO, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    stdout, stderr, _ = signal_when(proc, r'Epoch: \[1\] \[ ?1/', signal.SIGTERM)
    m = re.search(r'Stopped by SIGTERM at epoch 1 step (\d+)', stdout)
    assert m, stdout[-3000:] + stderr[-3000:]
    stopped = load(os.path.join(out, 'checkpoint.pth'))
    p = subprocess.run([PY, str(script)] + args + ['--accum-steps', '2', '--output_dir', out], cwd=REPO, env=e,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    a, b = load(os.path.join(ref, 'checkpoint.pth')), load(os.path.join(out, 'checkpoint.pth'))
    # the weights moved on after the stop; they end where the uninterrupted run's did, up to rounding
    moved, apart = (_weights(a) - _weights(stopped)).norm(), (_weights(a) - _weights(b)).norm()
    assert apart < 0.05 * moved, (float(apart), float(moved))
    logs = [[json.loads(x) for x in open(os.path.join(d, 'log.txt'))] for d in (ref, out)]
    assert [x['epoch'] for x in logs[1]] == [0, 1]
    assert logs[1][1]['train_loss'] == pytest.approx(logs[0][1]['train_loss'], rel=1e-3)  # both processes' losses
    step = int(m.group(1))  # of batches of 2 on each of 2 processes: one process of batches of 2 is at twice that
    assert (f'stopped inside epoch 1 at step {step}, and the number of processes changed (2 -> 1), --accum-steps '
            f'changed (1 -> 2) since then: the epoch continues at step {2 * step} of this run') in p.stdout, \
        [x for x in p.stdout.splitlines() if 'Note' in x]


RESTART = BASE + ['--batch-size', '2', '--num_workers', '0', '--dist-timeout', '60']


@pytest.fixture(scope='module')
def uninterrupted(data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp('ref') / 'out')
    run_main(RESTART + ['--data-path', data, '--output_dir', out], nproc=2)
    return load(os.path.join(out, 'checkpoint.pth'))


@pytest.mark.parametrize('kill_at', ['first checkpoint', 'epoch 1 step 1', 'first checkpoint, again'])
def test_torchrun_restarts_a_killed_worker_and_the_run_ends_with_the_same_weights(data, tmp_path, uninterrupted,
                                                                                   kill_at):
    """The restarted workers join through torchrun's store, which still holds the failed attempt's keys:
    timing-dependent, so the kill comes at two moments, one of them twice."""
    out = str(tmp_path / 'out')
    cmd = TORCHRUN + ['--nproc_per_node=2', '--max-restarts=1', '--master_addr=127.0.0.1',
                      f'--master_port={free_port()}', 'main.py'] + RESTART + ['--data-path', data, '--output_dir', out]
    proc = start_process(cmd)
    seen = []
    try:
        if kill_at.startswith('first checkpoint'):
            wait_for_line(proc, r'^Max accuracy', seen)
            t0 = time.time()
            while not os.path.exists(os.path.join(out, 'checkpoint.pth')):
                assert time.time() - t0 < 60
                time.sleep(0.05)
        else:
            wait_for_line(proc, r'Epoch: \[1\] \[ ?1/', seen)
        rank1 = children(proc.pid, RANK=1)
        assert len(rank1) == 1
        os.kill(rank1[0], signal.SIGKILL)
        rest, err = proc.communicate(timeout=400)
    finally:
        kill_group(proc)
    stdout = ''.join(seen) + rest
    assert proc.returncode == 0, stdout[-3000:] + err[-4000:]
    assert 'Resumed from' in stdout, stdout[-3000:]
    assert_same_weights(uninterrupted, load(os.path.join(out, 'checkpoint.pth')))


def test_a_killed_loader_worker_ends_in_one_line(data, tmp_path):
    args = BASE[:-1] + ['1', '--batch-size', '2', '--num_workers', '1', '--data-path', data,
                        '--output_dir', str(tmp_path / 'out')]
    proc = start_process([PY, 'main.py'] + args)
    seen = []
    try:
        wait_for_line(proc, r'Epoch: \[0\] \[ ?1/', seen)
        workers = children(proc.pid)
        assert workers
        for pid in workers:
            os.kill(pid, signal.SIGKILL)  # as the out-of-memory killer does
        _, err = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    p = subprocess.CompletedProcess(proc.args, proc.returncode, '', err)
    line = error_line(p)
    assert re.search(r'a data-loader worker \(pid (\d+)\) (was killed by signal|exited unexpectedly)', line), line
    assert int(re.search(r'pid (\d+)', line).group(1)) in workers
    assert '--num_workers (now 1)' in line and 'the same command resumes' in line

