"""slurm/train.sbatch: the command it runs (DRY_RUN) and its requeue on USR1, with stand-ins for srun,
scancel and scontrol (no SLURM here)."""
import os
import signal
import subprocess
import sys
import time

import pytest
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


def _fake_slurm(tmp_path, step_code):
    """srun runs a Python step that records USR1; scancel signals it; scontrol logs its arguments."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    log = tmp_path / 'calls.log'
    step = tmp_path / 'step.py'
    step.write_text(
        'import os, signal, sys, time\n'
        f'open({str(tmp_path / "step.pid")!r}, "w").write(str(os.getpid()))\n'
        'def stop(signum, frame):\n'
        f'    open({str(tmp_path / "step.usr1")!r}, "w").write("saved")\n'
        '    sys.exit(128 + signum)\n'
        'signal.signal(signal.SIGUSR1, stop)\n'
        f'{step_code}\n')
    scripts = {
        'srun': f'echo "srun $*" >> {log}\nexec {sys.executable} {step}\n',
        'scancel': f'echo "scancel $*" >> {log}\nkill -USR1 "$(cat {tmp_path / "step.pid"})"\n',
        'scontrol': f'echo "scontrol $*" >> {log}\n[ "$1" = show ] && echo node1 && echo node2\nexit 0\n',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text('#!/usr/bin/env bash\n' + body)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, 'PATH': f'{bin_dir}:{os.environ["PATH"]}', 'SLURM_JOB_ID': '42',
           'SLURM_JOB_NODELIST': 'node[1-2]', 'SLURM_JOB_NUM_NODES': '2'}
    env.pop('MASTER_ADDR', None)
    return env, log


@pytest.mark.slow
def test_usr1_stops_the_step_then_requeues(tmp_path):
    env, log = _fake_slurm(tmp_path, 'time.sleep(60)')
    proc = subprocess.Popen(['bash', SBATCH], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 20
    while not (tmp_path / 'step.pid').exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)  # what SLURM sends 120 s before the time limit
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert (tmp_path / 'step.usr1').read_text() == 'saved'
    calls = log.read_text().splitlines()
    assert calls[0] == 'scontrol show hostnames node[1-2]'
    assert 'MASTER_ADDR=node1' in out and calls[1].startswith('srun --kill-on-bad-exit=1 --nodes=2')
    assert calls[2:] == ['scancel --signal=USR1 42', 'scontrol requeue 42']


@pytest.mark.slow
@pytest.mark.parametrize('code', [0, 3])
def test_a_finished_or_failed_step_is_not_requeued(tmp_path, code):
    env, log = _fake_slurm(tmp_path, f'sys.exit({code})')
    out = subprocess.run(['bash', SBATCH], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == code
    assert not any('requeue' in c or 'scancel' in c for c in log.read_text().splitlines())
