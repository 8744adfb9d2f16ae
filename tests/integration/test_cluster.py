"""The cluster path for real, on one machine (tests/helpers/cluster.py): slurm/train.sbatch under a fake SLURM
saving and requeueing on its warning signal, two torchrun "nodes" on 127.0.0.1 (c10d rendezvous, one CPU process each)
restarting together after a worker is killed, node-local output directories that do not hold the same
checkpoint, a stop signal to one worker under --max-restarts, and a log.txt that rank 0 cannot write.

Every run is NALAFORMER_XT at 32 px for 2 epochs of 6 steps (2 processes, batch 2); the runs that must end
with the weights of an uninterrupted run compare against one reference run of pretrain.sh."""
import os
import re
import shutil
import signal
import sys
import time

import pytest
from conftest import BASE, PY, REPO, TORCHRUN, assert_same_weights, free_port, load, run_main
from helpers.cluster import (
    FakeSlurm,
    children,
    finish,
    kill_session,
    rank_errors,
    start_node,
    torchrun_node,
    wait_for,
)

pytestmark = pytest.mark.slow  # torchrun, SLURM's scripts and signals in real processes

SBATCH = os.path.join(REPO, 'slurm', 'train.sbatch')
PRETRAIN = os.path.join(REPO, 'pretrain.sh')
# pretrain.sh's recipe, made small; extra flags come last and override the recipe's
RECIPE = dict(MODEL='NALAFORMER_XT', BATCH='2', AMP='none', PYTHON=PY)
SMALL = ['--input-size', '32', '--epochs', '2', '--device', 'cpu', '--no-flops', '--print-freq', '1', '--unscale-lr',
         '--lr', '2e-3', '--warmup-epochs', '1', '--dist-timeout', '120']


@pytest.fixture(scope='module')
def reference(data, tmp_path_factory):
    """The uninterrupted run: pretrain.sh, one node, 2 processes, 1 loader worker each."""
    out = tmp_path_factory.mktemp('reference') / 'out'
    log = out.parent / 'run.log'
    proc = start_node(['bash', PRETRAIN, *SMALL, '--num_workers', '1'], log, **RECIPE, DATA=data, OUTPUT=str(out),
                      NPROC='2', MASTER_PORT=str(free_port()))
    assert finish([proc], timeout=400) == [0], log.read_text()[-3000:]
    return out


# ------------------------------------------------------------------------------------------ SLURM requeue
@pytest.mark.min_stack  # `make test-min` runs it on the oldest supported torch as well
def test_slurm_warning_saves_mid_epoch_requeues_and_the_job_ends_with_the_uninterrupted_weights(
        data, reference, tmp_path):
    """USR1 reaches the batch shell, whose trap signals every process of the step (torchrun, its workers, their
    loader workers): the workers stop together and save, torchrun ignores the signal and ends when they do (no
    restart despite MAX_RESTARTS=1, no step torn down), then the job is requeued and resumes at that step."""
    slurm = FakeSlurm(tmp_path / 'slurm')
    out, logs = tmp_path / 'out', [tmp_path / 'job.log', tmp_path / 'requeued.log']
    job = dict(RECIPE, DATA=data, OUTPUT=str(out), NPROC='2', MAX_RESTARTS='1', MASTER_PORT=str(free_port()))
    options = ['--cpus-per-task=2']  # the loader default below must not depend on this machine's CPU count
    proc = slurm.sbatch(SBATCH, *SMALL, options=options, log=logs[0], **job)
    try:
        wait_for(r'Epoch: \[0\] \[ ?0/6\]', logs[:1], procs=[proc])  # early: the stop must land inside the epoch
        slurm.warn(proc, SBATCH)  # the time limit is near
        assert finish([proc]) == [0], logs[0].read_text()[-3000:]
    finally:
        kill_session(proc)
    text = logs[0].read_text()
    stopped = re.search(r'Stopped by SIGUSR1 at epoch 0 step (\d+)', text)
    assert stopped, text[-3000:]
    calls = slurm.calls()
    assert 'scancel --signal=USR1 42' in calls and calls[-1] == 'scontrol requeue 42', calls
    assert [c for c in calls if c.startswith('srun')] == [  # torchrun lived through USR1 and ended with its workers
        c for c in calls if c.startswith('srun --kill-on-bad-exit=1 --nodes=1 --ntasks-per-node=1 --cpus-per-task=2 ')
    ] + ['srun: task exit 0'], calls
    assert text.count('Launcher: torchrun') == 1  # and did not restart them
    # the step's 2 CPUs shared by its 2 processes (srun gave it the job's --cpus-per-task)
    assert ('Data loader: 1 workers per process (the default: 1 CPU(s) per process (the 2 CPUs of this process '
            'shared by the 2 processes on this node)') in text
    assert load(out / 'checkpoint.pth')['step'] == int(stopped.group(1))

    proc = slurm.sbatch(SBATCH, *SMALL, options=options, log=logs[1], job=42, restarts=1, **job)  # requeued
    assert finish([proc], timeout=400) == [0], logs[1].read_text()[-3000:]
    assert f'continuing at epoch 0 step {stopped.group(1)}' in logs[1].read_text()
    assert_same_weights(load(reference / 'checkpoint.pth'), load(out / 'checkpoint.pth'))


# ------------------------------------------------------------------------------------------ two nodes
def two_nodes(tmp_path, port, out, **environ):
    """pretrain.sh on two "nodes" of one process each (c10d rendezvous at 127.0.0.1:port)."""
    logs = [tmp_path / 'node0.log', tmp_path / 'node1.log']
    procs = [start_node(['bash', PRETRAIN, *SMALL, '--num_workers', '1'], logs[i], **RECIPE, OUTPUT=str(out),
                        NNODES='2', NODE_RANK=str(i), NPROC='1', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port),
                        **environ) for i in (0, 1)]
    return procs, logs


def test_a_worker_killed_on_node_1_restarts_both_nodes_and_the_run_ends_with_the_uninterrupted_weights(
        data, reference, tmp_path):
    out = tmp_path / 'out'
    procs, logs = two_nodes(tmp_path, free_port(), out, DATA=data, MAX_RESTARTS='1')
    try:
        wait_for(r'Epoch: \[1\] \[ ?1/6\]', logs, procs=procs)
        worker = children(procs[1].pid)  # pretrain.sh became torchrun: its child is node 1's worker
        assert len(worker) == 1
        os.kill(worker[0], signal.SIGKILL)
        codes = finish(procs, timeout=400)
    finally:
        for p in procs:
            kill_session(p)
    text = ''.join(log.read_text() for log in logs)
    assert codes == [0, 0], text[-4000:]
    assert text.count('Launcher: torchrun, 2 process(es)') == 2  # rank 0's line, once per attempt
    assert 'Resumed from' in text and 'continuing at epoch 1' in text
    assert_same_weights(load(reference / 'checkpoint.pth'), load(out / 'checkpoint.pth'))


def test_a_rank_that_does_not_see_the_resumed_checkpoint_stops_every_rank_in_one_line(data, reference, tmp_path):
    """Node-local output directories (the same relative --output_dir from each node's own directory): node 0's
    holds a checkpoint, node 1's does not. Whichever node the rendezvous makes rank 0, every rank ends with one
    line within seconds instead of training on from different states."""
    nodes = [tmp_path / 'node0', tmp_path / 'node1']
    for node in nodes:
        (node / 'out').mkdir(parents=True)
    shutil.copy(reference / 'checkpoint.pth', nodes[0] / 'out')
    port, logs = free_port(), [tmp_path / 'node0.log', tmp_path / 'node1.log']
    args = BASE + ['--batch-size', '2', '--num_workers', '0', '--data-path', data, '--output_dir', 'out',
                   '--dist-timeout', '120']
    procs = [torchrun_node(port, 2, 1, args, logs[i], cwd=str(nodes[i])) for i in (0, 1)]
    try:
        wait_for(r'^\[rank \d\] error: ', logs, timeout=240)
        t_error = time.time()
        codes = finish(procs, timeout=120)
        waited = time.time() - t_error
    finally:
        for p in procs:
            kill_session(p)
    text = ''.join(log.read_text() for log in logs)
    assert all(code != 0 for code in codes), text[-4000:]
    assert waited < 30, waited
    errors = rank_errors(text)
    assert sorted(errors) == [0, 1] and all(len(lines) == 1 for lines in errors.values()), text[-4000:]
    assert all('out/checkpoint.pth' in lines[0] and 'every node must see the same --output_dir' in lines[0]
               for lines in errors.values()), errors
    assert 'lost contact' not in text and 'Start training' not in text


# ------------------------------------------------------------------------------------------ one torchrun
def test_sigterm_to_one_worker_under_max_restarts_stops_the_group_without_a_restart(data, tmp_path):
    out, log = tmp_path / 'out', tmp_path / 'run.log'
    cmd = TORCHRUN + ['--nproc_per_node=2', '--max-restarts=1', '--master_addr=127.0.0.1',
                      f'--master_port={free_port()}', 'main.py'] + BASE + [
        '--batch-size', '2', '--num_workers', '0', '--data-path', data, '--output_dir', str(out)]
    proc = start_node(cmd, log)
    try:
        wait_for(r'Epoch: \[0\] \[ ?1/6\]', [log], procs=[proc])
        os.kill(children(proc.pid, RANK=1)[0], signal.SIGTERM)
        codes = finish([proc])
    finally:
        kill_session(proc)
    text = log.read_text()
    stopped = re.search(r'Stopped by a stop signal on another rank at epoch 0 step (\d+)', text)
    assert codes == [0] and stopped, text[-3000:]
    assert text.count('Launcher: torchrun') == 1 and 'Resumed from' not in text  # not turned into a restart
    assert load(out / 'checkpoint.pth')['step'] == int(stopped.group(1))


def test_a_log_txt_rank_0_cannot_write_stops_every_rank_in_one_line(data, tmp_path):
    out = tmp_path / 'out'
    (out / 'log.txt').mkdir(parents=True)
    p = run_main(BASE[:-1] + ['1', '--batch-size', '2', '--num_workers', '0', '--data-path', data,
                              '--output_dir', str(out)], nproc=2, check=False)
    line = (f'could not append to {out}/log.txt: Is a directory; the checkpoint of epoch 0 holds the line, it is '
            f'added when the run resumes')
    assert p.returncode == 1 and rank_errors(p.stderr) == {0: [line], 1: [f'stopped because rank 0 failed: {line}']}, \
        p.stderr[-3000:]
    assert 'Final top-1' not in p.stdout


# -------------------------------------------------------------------------------- train.sbatch with a stand-in step
def _step(tmp_path, code):
    """A stand-in for pretrain.sh: on every node, a process that records USR1 and exits 0, else runs `code`."""
    (tmp_path / 'step.py').write_text(
        'import os, signal, sys, time\n'
        'node = os.environ["SLURM_NODEID"]\n'
        'def stop(signum, frame):\n'
        f'    open(f"{tmp_path}/usr1.{{node}}", "w").write("saved")\n'
        '    sys.exit(0)\n'
        'signal.signal(signal.SIGUSR1, stop)\n'
        f'open(f"{tmp_path}/ready.{{node}}", "w").close()\n'
        f'{code}\n')
    script = tmp_path / 'step.sh'
    script.write_text(f'exec {sys.executable} {tmp_path / "step.py"}\n')
    return str(script)


def test_usr1_stops_the_step_on_every_node_then_requeues(tmp_path):
    slurm = FakeSlurm(tmp_path / 'slurm')
    proc = slurm.sbatch(SBATCH, options=['--nodes=2'], SCRIPT=_step(tmp_path, 'time.sleep(60)'))
    deadline = time.time() + 20
    while not all((tmp_path / f'ready.{n}').exists() for n in (0, 1)) and time.time() < deadline:
        time.sleep(0.05)
    slurm.warn(proc, SBATCH)  # what SLURM sends 120 s before the time limit
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert [(tmp_path / f'usr1.{n}').read_text() for n in (0, 1)] == ['saved', 'saved']
    calls = slurm.calls()
    assert calls[1] == 'scontrol show hostnames localhost,localhost'
    assert calls[2].startswith('srun --kill-on-bad-exit=1 --nodes=2 --ntasks-per-node=1 --cpus-per-task=64 bash -c ')
    assert 'MASTER_ADDR=localhost' in out
    assert calls[3:] == ['scancel --signal=USR1 42', 'srun: task exit 0', 'srun: task exit 0', 'scontrol requeue 42']


@pytest.mark.parametrize('code', [0, 3])
def test_a_finished_or_failed_step_is_not_requeued(tmp_path, code):
    slurm = FakeSlurm(tmp_path / 'slurm')
    proc = slurm.sbatch(SBATCH, SCRIPT=_step(tmp_path, f'sys.exit({code})'))
    proc.communicate(timeout=30)
    assert proc.returncode == code
    assert not any('requeue' in c or 'scancel' in c for c in slurm.calls())

