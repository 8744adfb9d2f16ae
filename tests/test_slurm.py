"""slurm/train.sbatch: the command it runs (DRY_RUN) and its requeue on USR1 under the fake SLURM of
tests/cluster.py, with a stand-in for pretrain.sh (the real one: tests/integration/test_cluster.py)."""
import os
import subprocess
import sys
import time

import pytest
from cluster import FakeSlurm
from conftest import REPO

SBATCH = os.path.join(REPO, 'slurm', 'train.sbatch')


def test_sbatch_header_asks_for_the_warning_signal_and_requeue():
    with open(SBATCH) as f:
        text = f.read()
    assert '#SBATCH --signal=B:USR1@120' in text and '#SBATCH --requeue' in text
    assert subprocess.run(['bash', '-n', SBATCH]).returncode == 0


def test_dry_run_prints_one_task_per_node_running_the_script():
    env = {**os.environ, 'DRY_RUN': '1', 'SLURM_JOB_NUM_NODES': '4', 'MASTER_ADDR': 'node7', 'NPROC': '4',
           'SCRIPT': 'finetune.sh'}
    out = subprocess.run(['bash', SBATCH, '--epochs', '3'], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith('+ NNODES=4 MASTER_ADDR=node7 MASTER_PORT=29500 NPROC=4 MAX_RESTARTS=0 srun ')
    assert '--nodes=4 --ntasks-per-node=1' in line and 'NODE_RANK=$SLURM_NODEID' in line
    assert line.endswith('finetune.sh --epochs 3')


def test_unknown_script_is_a_clear_error():
    env = {**os.environ, 'DRY_RUN': '1', 'SCRIPT': 'nope.sh'}
    out = subprocess.run(['bash', SBATCH], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and 'SCRIPT=nope.sh is not in' in out.stderr


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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize('code', [0, 3])
def test_a_finished_or_failed_step_is_not_requeued(tmp_path, code):
    slurm = FakeSlurm(tmp_path / 'slurm')
    proc = slurm.sbatch(SBATCH, SCRIPT=_step(tmp_path, f'sys.exit({code})'))
    proc.communicate(timeout=30)
    assert proc.returncode == code
    assert not any('requeue' in c or 'scancel' in c for c in slurm.calls())


def test_the_step_gets_the_job_cpus_and_ignores_the_warning_signal():
    """Since Slurm 22.05 srun does not inherit the job's --cpus-per-task; torchrun must not die of USR1."""
    env = {**os.environ, 'DRY_RUN': '1', 'SLURM_CPUS_PER_TASK': '64'}
    out = subprocess.run(['bash', SBATCH], env=env, capture_output=True, text=True, timeout=30)
    line = out.stdout.strip().splitlines()[-1]
    assert ' srun --kill-on-bad-exit=1 --nodes=1 --ntasks-per-node=1 --cpus-per-task=64 bash -c trap "" USR1; ' in line
