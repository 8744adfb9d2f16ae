"""Faults of real main.py processes: a bad checkpoint, failing and killed writes, preemption by
SIGINT/SIGTERM with exact resume (plain process, torchrun, gradient accumulation), signals during
evaluation, non-finite loss (also on one rank's micro-batch under accumulation), a dead rank, dist-eval with
fewer images than processes, stop signals reaching spawned data-loader workers."""
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import time

import pytest
import torch
from conftest import (
    BASE,
    LAUNCH,
    PY,
    REPO,
    TORCHRUN,
    accuracy_line,
    assert_same_weights,
    build_xt,
    env,
    error_line,
    free_port,
    kill_group,
    load,
    run_main,
    signal_when,
    start_process,
)
from helpers.image_folders import make_imagefolder

from run import checkpoint, output_dir, process
from training import loaders

pytestmark = pytest.mark.slow  # main.py and data-loader workers in real processes, signals and kills

# ------------------------------------------------------------------------------------------ checkpoints


def test_bad_checkpoint_ends_in_one_line_and_non_zero_exit(data, tmp_path):
    bad = tmp_path / 'bad.pth'
    bad.write_bytes(b'\x00garbage' * 10)
    p = run_main(['--model', 'NALAFORMER_XT', '--input-size', '32', '--device', 'cpu', '--num_workers', '0',
                  '--no-flops', '--eval', '--resume', str(bad), '--data-path', data], check=False)
    assert 'is not a PyTorch checkpoint' in error_line(p, only=False)


@pytest.fixture(scope='module')
def one_epoch(data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp('f1') / 'out')
    run_main(BASE[:-1] + ['1', '--data-path', data, '--output_dir', out])
    return out


def _limit_file_size(nbytes):
    def pre():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return pre


def test_failing_checkpoint_write_reports_path_and_keeps_previous(one_epoch, data, tmp_path):
    out = str(tmp_path / 'out')
    shutil.copytree(one_epoch, out)
    ck = os.path.join(out, 'checkpoint.pth')
    before = open(ck, 'rb').read()
    # a "full disk": no file may grow beyond 1 MB, the checkpoint needs ~60 MB
    p = run_main(BASE + ['--data-path', data, '--output_dir', out], check=False,
                 preexec_fn=_limit_file_size(1 << 20))
    line = error_line(p, only=False)
    assert f'could not write checkpoint {ck}' in line and 'previous checkpoint.pth' in line
    assert open(ck, 'rb').read() == before
    assert not [f for f in os.listdir(out) if f.startswith(checkpoint.TMP_PREFIX)]


def test_kill_9_during_writes_leaves_a_loadable_checkpoint(tmp_path):
    script = (
        'import sys, torch\n'
        'from run import checkpoint\n'
        'state = {"model": {"w%d" % i: torch.randn(256, 256) for i in range(16)}}\n'
        'print("ready", flush=True)\n'
        'e = 0\n'
        'while True:\n'
        '    state["epoch"] = e; checkpoint.save_atomic(state, sys.argv[1]); e += 1\n')
    path = tmp_path / 'checkpoint.pth'
    for delay in (0.3, 0.77):
        proc = subprocess.Popen([PY, '-c', script, str(path)], cwd=REPO, env=env(), stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == 'ready'
        time.sleep(delay)
        proc.kill()
        proc.wait()
        ck = load(path)  # whatever moment the kill hit, the file is a complete checkpoint
        assert ck['model']['w15'].shape == (256, 256)
        checkpoint.remove_stale_tmp(str(tmp_path))
        assert os.listdir(tmp_path) == ['checkpoint.pth']


# ------------------------------------------------------------------------------------------ preemption


STOP = BASE[:-1] + ['1', '--batch-size', '2']  # one epoch of 12 steps: room for a stop in the middle


def test_sigint_stops_at_a_step_and_resume_is_exact(data, tmp_path):
    ref = str(tmp_path / 'ref')
    run_main(STOP + ['--data-path', data, '--output_dir', ref])
    out = str(tmp_path / 'out')
    cmd = [PY, 'main.py'] + STOP + ['--data-path', data, '--output_dir', out]
    stdout, stderr, waited = signal_when(start_process(cmd), r'Epoch: \[0\] \[ ?2/', signal.SIGINT)
    assert 'Traceback' not in stderr, stderr[-3000:]
    m = re.search(r'Stopped by SIGINT at epoch 0 step (\d+)', stdout)
    assert m, stdout[-3000:] + stderr[-3000:]
    assert waited < 30
    ck = load(os.path.join(out, 'checkpoint.pth'))
    assert ck['epoch'] == 0 and ck['step'] == int(m.group(1))
    p = run_main(STOP + ['--data-path', data, '--output_dir', out])  # the same command again
    assert f'continuing at epoch 0 step {m.group(1)}' in p.stdout
    assert_same_weights(load(os.path.join(ref, 'checkpoint.pth')), load(os.path.join(out, 'checkpoint.pth')))


def test_sigterm_under_torchrun_stops_all_ranks_and_resume_is_exact(data, tmp_path):
    args = BASE[:-1] + ['1', '--batch-size', '2', '--num_workers', '0', '--data-path', data]
    ref = str(tmp_path / 'ref')
    p_ref = run_main(args + ['--output_dir', ref], nproc=2)
    digest = set(re.findall(r'final weights sha256: (\w+)', p_ref.stdout + p_ref.stderr))
    assert len(digest) == 1
    out = str(tmp_path / 'out')
    cmd = TORCHRUN + ['--nproc_per_node=2', '--master_addr=127.0.0.1', f'--master_port={free_port()}', 'main.py'] \
        + args + ['--output_dir', out]
    stdout, stderr, waited = signal_when(start_process(cmd), r'Epoch: \[0\] \[1/', signal.SIGTERM)
    assert waited < 40
    m = re.search(r'Stopped by SIGTERM at epoch 0 step (\d+)', stdout)
    assert m, stdout[-3000:] + stderr[-3000:]
    ck = load(os.path.join(out, 'checkpoint.pth'))
    assert ck['step'] == int(m.group(1)) and len(ck['rng_state']) == 2
    p = run_main(args + ['--output_dir', out], nproc=2)
    assert f'continuing at epoch 0 step {m.group(1)}' in p.stdout
    assert set(re.findall(r'final weights sha256: (\w+)', p.stdout + p.stderr)) == digest
    assert_same_weights(load(os.path.join(ref, 'checkpoint.pth')), load(os.path.join(out, 'checkpoint.pth')))


# ------------------------------------------------------------------------------------------ numerics
def test_non_finite_loss_stops_with_epoch_and_step_and_keeps_last_checkpoint(data, tmp_path):
    out = str(tmp_path / 'out')
    # epoch 0 at a harmless warmup LR, epoch 1 at an absurd LR under fp16: the loss blows up. The first steps of
    # epoch 0 may overflow while GradScaler lowers its initial scale (2^16): those are counted too, so the limit
    # leaves room for them
    args = ['--model', 'NALAFORMER_XT', '--input-size', '32', '--batch-size', '4', '--device', 'cpu',
            '--num_workers', '0', '--no-flops', '--amp', 'fp16', '--unscale-lr', '--lr', '1e6',
            '--warmup-epochs', '1', '--epochs', '2', '--max-bad-steps', '4', '--mixup', '0', '--cutmix', '0',
            '--data-path', data, '--output_dir', out]
    p = run_main(args, check=False)
    line = error_line(p, only=False)
    assert re.search(r'non-finite (loss|gradients) .*at epoch 1 step \d+', line), line
    assert '--max-bad-steps 4' in line
    ck = load(os.path.join(out, 'checkpoint.pth'))
    assert ck['epoch'] == 0 and all(torch.isfinite(v).all() for v in ck['model'].values() if v.is_floating_point())


# ------------------------------------------------------------------------------------------ distributed
def test_a_dead_rank_makes_the_other_exit_with_a_clear_message(data, tmp_path):
    port = free_port()
    args = [PY, 'main.py'] + BASE[:-1] + ['3', '--batch-size', '2', '--num_workers', '0', '--data-path', data,
                                          '--dist-timeout', '60']
    procs = []
    for rank in (0, 1):
        e = env()
        # launched the way SLURM's srun does it: SLURM_* variables only (MASTER_* as an sbatch script sets them)
        e.update(SLURM_PROCID=str(rank), SLURM_NTASKS='2', SLURM_LOCALID=str(rank), SLURM_JOB_NODELIST='localhost',
                 MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
        procs.append(subprocess.Popen(args, cwd=REPO, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True))
    try:
        seen = []
        for line in procs[0].stdout:
            seen.append(line)
            if re.search(r'Epoch: \[0\] \[ ?1/', line):
                break
        procs[1].kill()  # kill -9 rank 1 in the middle of training
        t0 = time.time()
        _, err = procs[0].communicate(timeout=120)
        procs[1].wait()
    finally:
        for p in procs:
            kill_group(p)
    assert any('Launcher: slurm, 2 process(es), backend gloo' in line for line in seen), ''.join(seen)[-2000:]
    assert time.time() - t0 < 70
    assert procs[0].returncode != 0
    assert 'Traceback' not in err, err[-3000:]
    assert re.search(r'\[rank 0\] error: lost contact with the other processes', err), err[-3000:]


def test_dist_eval_with_fewer_images_than_processes_is_exact(tmp_path):
    data = make_imagefolder(tmp_path / 'd', classes=2, n_train=1, n_val=1)  # 2 val images, 3 processes
    ck = tmp_path / 'm.pth'
    torch.manual_seed(0)
    torch.save({'model': build_xt(2).state_dict()}, ck)
    ev = ['--model', 'NALAFORMER_XT', '--input-size', '32', '--batch-size', '4', '--device', 'cpu',
          '--num_workers', '0', '--no-flops', '--eval', '--resume', str(ck), '--data-path', data, '--dist-eval']
    single, multi = run_main(ev), run_main(ev, nproc=3, launcher=LAUNCH)
    assert 'Launcher: torchrun, 3 process(es)' in multi.stdout  # env:// variables of launch --use_env
    assert accuracy_line(multi.stdout) == accuracy_line(single.stdout)
    assert 'on the 2 test images' in accuracy_line(multi.stdout)[0]


# ---------------------------------------------------------------- preemption with gradient accumulation
def test_a_stop_with_accumulation_lands_on_a_window_boundary_and_resumes_exactly(tmp_path):
    root = make_imagefolder(tmp_path / 'data')
    args = BASE[:-1] + ['1', '--batch-size', '2', '--accum-steps', '3', '--data-path', root]  # 12 steps, 4 windows
    ref = str(tmp_path / 'ref')
    run_main(args + ['--output_dir', ref])
    out = str(tmp_path / 'out')
    stdout, stderr, _ = signal_when(start_process([PY, 'main.py'] + args + ['--output_dir', out]),
                                     r'Epoch: \[0\] \[ ?1/', signal.SIGINT)
    m = re.search(r'Stopped by SIGINT at epoch 0 step (\d+)', stdout)
    assert m, stdout[-3000:] + stderr[-3000:]
    assert int(m.group(1)) % 3 == 0
    run_main(args + ['--output_dir', out])
    assert_same_weights(load(os.path.join(ref, 'checkpoint.pth')), load(os.path.join(out, 'checkpoint.pth')))


# ---------------------------------------------------------------------------- signals during evaluation
SIG_RUN = ['--model', 'NALAFORMER_XT', '--input-size', '32', '--batch-size', '4', '--device', 'cpu',
           '--num_workers', '0', '--no-flops', '--unscale-lr', '--lr', '2e-3', '--warmup-epochs', '0', '--epochs', '1',
           '--mixup', '0', '--cutmix', '0', '--no-model-ema']


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """A finished 1-epoch run whose validation set is long enough (300 images, one per batch) to signal."""
    data = make_imagefolder(tmp_path_factory.mktemp('sig'), n_train=4, n_val=100)
    out = str(tmp_path_factory.mktemp('sigrun') / 'out')
    run_main(SIG_RUN + ['--data-path', data, '--output_dir', out])
    return data, out


@pytest.mark.parametrize('mode, sig', [('eval', signal.SIGTERM), ('nothing-to-train', signal.SIGINT)])
def test_signal_stops_evaluation_at_the_next_batch(trained, mode, sig, tmp_path):
    data, out = trained
    flags = ['--batch-size', '1', '--print-freq', '1', '--data-path', data]
    if mode == 'eval':
        cmd = [PY, 'main.py'] + SIG_RUN + flags + ['--eval', '--resume', os.path.join(out, 'checkpoint.pth')]
    else:  # the same command again after the last epoch: the checkpoint is evaluated
        shutil.copytree(out, tmp_path / 'out')
        cmd = [PY, 'main.py'] + SIG_RUN + flags + ['--output_dir', str(tmp_path / 'out')]
    proc = start_process(cmd)
    stdout, stderr, waited = signal_when(proc, r'Test: \[ *2/300\]', sig)
    assert proc.returncode == 128 + sig, stdout[-2000:] + stderr[-2000:]
    assert 'Traceback' not in stderr, stderr[-3000:]
    m = re.search(rf'Evaluation stopped by {sig.name} after (\d+) of 300 images', stdout)
    assert m and int(m.group(1)) < 300, stdout[-3000:]
    assert 'Accuracy of the network' not in stdout
    assert waited < 30


def test_an_epoch_whose_evaluation_a_stop_cut_short_is_evaluated_on_resume(tmp_path):
    """SIGINT right after an epoch's last step cuts its evaluation short: the epoch is saved without its accuracy.
    The same command evaluates it first, with the weights it ended with (EMA included): log.txt, best.pth, the
    best accuracy and the final weights equal an uninterrupted run's. Stopped so in both epochs: once with an
    epoch left to train after the evaluation, once with none."""
    data = make_imagefolder(tmp_path / 'data', n_val=40)  # 120 validation images: time for the signal to land
    # an EMA that follows the weights closely, so that epoch 1 can improve on epoch 0
    args = BASE + ['--warmup-epochs', '0', '--model-ema-decay', '0.5', '--num_workers', '0', '--data-path', data]
    ref, out = tmp_path / 'ref', tmp_path / 'out'
    uninterrupted = run_main(args + ['--output_dir', str(ref)])
    cmd = [PY, 'main.py'] + args + ['--output_dir', str(out)]
    said = []
    for epoch in (0, 1):
        stdout, stderr, _ = signal_when(start_process(cmd), rf'Epoch: \[{epoch}\] Total time', signal.SIGINT)
        assert f'Evaluation of epoch {epoch} interrupted by SIGINT' in stdout, stdout[-3000:] + stderr[-3000:]
        assert 'test_acc1' not in load(out / 'checkpoint.pth')['log']
        said.append(stdout)
    said.append(run_main(args + ['--output_dir', str(out)]).stdout)  # the same command again: nothing to train
    assert [json.loads(x) for x in open(out / 'log.txt')] == [json.loads(x) for x in open(ref / 'log.txt')]
    for name in ('best.pth', 'checkpoint.pth'):
        a, b = load(ref / name), load(out / name)
        for key in ('epoch', 'max_accuracy', 'best_epoch', 'best_weights', 'best_acc1', 'acc1', 'files'):
            assert a[key] == b[key], (name, key, a[key], b[key])
        assert_same_weights(a, b)
    final = [x for x in uninterrupted.stdout.splitlines() if x.startswith('Final top-1')]
    assert final and final == [x for x in said[-1].splitlines() if x.startswith('Final top-1')]
    assert 'Epoch 0 was saved without its accuracy' in said[1] and 'Epoch 1 was saved without' in said[2]
    assert 'Nothing to train' not in said[2]


# ---------------------------------------------------------------------------- killed between the writes
def test_killed_between_the_writes_then_resumed(data, tmp_path):
    """The process dies right after checkpoint.pth of epoch 0 (always a new best) is renamed into place:
    best.pth and the log line of epoch 0 are missing. The same command repairs both."""
    out = tmp_path / 'out'
    args = BASE[:-1] + ['1', '--data-path', data, '--output_dir', str(out), '--no-model-ema']
    script = tmp_path / 'inject.py'
    script.write_text(
        'import os, sys, main\n'
        'from run import checkpoint\n'
        'real = checkpoint.save_atomic\n'
        'def save(state, path):\n'
        '    real(state, path)\n'
        '    if path.endswith("checkpoint.pth"):\n'
        '        os._exit(9)\n'
        'checkpoint.save_atomic = save\n'
        'sys.exit(main.run(sys.argv[1:]))\n')
    p = subprocess.run([PY, str(script)] + args, cwd=REPO, env={**env(), 'PYTHONPATH': REPO}, capture_output=True,
                       text=True, timeout=240)
    assert p.returncode == 9, p.stderr[-2000:]
    ck = torch.load(out / 'checkpoint.pth', weights_only=True)
    assert ck['epoch'] == 0 and ck['files'] == ['checkpoint.pth', 'best.pth'] and ck['best_epoch'] == 0
    assert sorted(f for f in os.listdir(out) if f != output_dir.LOCK_NAME) == ['args.json', 'checkpoint.pth']
    p = run_main(args)  # the same command: nothing left to train, the state is repaired
    assert re.search(r'Repaired \S+best\.pth: it was missing', p.stdout), p.stdout[-3000:]
    assert 'added the line of epoch 0' in p.stdout
    assert (out / 'best.pth').read_bytes() == (out / 'checkpoint.pth').read_bytes()
    assert [json.loads(x) for x in open(out / 'log.txt')] == [ck['log']]


# --------------------------------------------------- a non-finite micro-batch on one rank under accumulation
def test_a_non_finite_micro_batch_on_one_rank_is_skipped_by_all_ranks_in_step(data, tmp_path):
    """Every rank runs the same backward passes (SyncBatchNorm's backward is a collective even under
    no_sync()): every micro-batch's, rank 1's NaN one too; the NaN makes both ranks skip the window's
    optimizer step, and both end with the same weights."""
    args = BASE[:-1] + ['1', '--batch-size', '2', '--accum-steps', '2', '--num_workers', '0', '--no-model-ema',
                        '--data-path', data, '--dist-timeout', '60']
    cmd = TORCHRUN + ['--nproc_per_node=2', '--master_addr=127.0.0.1', f'--master_port={free_port()}',
                      '-m', 'tests.helpers.nan_micro_batch']  # main.py, rank 1's first loss NaN
    proc = subprocess.Popen(cmd + args, cwd=REPO, env={**env(), 'PYTHONPATH': REPO}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    counts = dict(re.findall(r'\[rank (\d)\] backward passes: (\d+ of \d+)', err))
    assert set(counts) == {'0', '1'}, err[-3000:]
    assert counts['0'] == counts['1'], counts
    done, total = map(int, counts['0'].split(' of '))
    assert done == total  # the bad window's micro-batches ran their backward on both ranks
    assert 'non-finite loss (nan) at epoch 0 step 1; step skipped' in err
    assert 'non-finite loss (on another rank) at epoch 0 step 1; step skipped' in err
    digests = re.findall(r'\[rank \d\] final weights sha256: (\w+)', out + err)
    assert len(digests) == 2 and len(set(digests)) == 1, out[-2000:]


# ------------------------------------------------------- stop signals reach data-loader workers too
SPAWNED_WORKERS = """
import multiprocessing, sys
import main
if __name__ == "__main__":  # spawned workers import this file again
    multiprocessing.set_start_method("spawn", force=True)  # fresh workers: no handler inherited from main.py
    sys.exit(main.run(sys.argv[1:]))
"""


def test_usr1_to_every_process_with_spawned_workers_saves_and_resumes(data, tmp_path):
    """SLURM's `scancel --signal=USR1` reaches every process of the job, data-loader workers included; workers
    started by spawn or forkserver (Python 3.14's default) inherit no handler, so they must ignore it
    themselves instead of dying and taking the run with them."""
    script = tmp_path / 'spawned.py'
    script.write_text(SPAWNED_WORKERS)
    out = str(tmp_path / 'out')
    cmd = [PY, str(script)] + BASE[:-1] + ['1', '--num_workers', '1', '--data-path', data, '--output_dir', out]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**env(), 'PYTHONPATH': REPO}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if re.search(r'Epoch: \[0\] \[ ?1/', line):
                os.killpg(proc.pid, signal.SIGUSR1)  # the whole process group, workers included
                break
        rest, err = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    stdout = ''.join(seen) + rest
    assert proc.returncode == 128 + signal.SIGUSR1, stdout[-2000:] + err[-3000:]
    assert re.search(r'Stopped by SIGUSR1 at epoch 0 step \d+', stdout), stdout[-2000:]
    p = subprocess.run(cmd, cwd=REPO, env={**env(), 'PYTHONPATH': REPO}, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert re.search(r'Resuming epoch 0 at step \d+', p.stdout), p.stdout[-2000:]


def stop_signals_held_off():
    """For each stop signal: does this process hold it back (blocked) or ignore it?"""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    return [s in blocked or signal.getsignal(s) == signal.SIG_IGN for s in process.STOP_SIGNALS]


class SignalState(torch.utils.data.Dataset):
    """One item: whether the worker that loads it held off the stop signals when it unpickled this data set
    (a spawned worker does that right after importing torch, before `worker_init_fn`) and when loading."""

    def __init__(self):
        self.at_birth = None  # set where it is unpickled

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.at_birth = stop_signals_held_off()

    def __len__(self):
        return 1

    def __getitem__(self, i):
        return torch.tensor([self.at_birth, stop_signals_held_off()])


def test_spawned_workers_ignore_the_stop_signals_from_birth():
    """A spawned worker spends seconds importing torch before `worker_init_fn` runs: a stop signal must not
    kill it in that window either. The main process gets its signal mask back afterwards."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    loader = loaders.DataLoader(SignalState(), num_workers=1, multiprocessing_context='spawn',
                              worker_init_fn=process.worker_init_fn)
    (state,) = list(loader)
    at_birth, loading = state.tolist()[0]
    assert at_birth[process.STOP_SIGNALS.index(signal.SIGUSR1)]  # what SLURM's requeue sends to every process
    assert all(loading)
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
