"""slurm/train.sbatch: the command it runs (DRY_RUN) and its requeue on USR1 under the fake SLURM of
tests/cluster.py (run for real, with a stand-in step and with pretrain.sh: tests/integration/test_cluster.py)."""
import os
import subprocess

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


def test_the_step_gets_the_job_cpus_and_ignores_the_warning_signal():
    """Since Slurm 22.05 srun does not inherit the job's --cpus-per-task; torchrun must not die of USR1."""
    env = {**os.environ, 'DRY_RUN': '1', 'SLURM_CPUS_PER_TASK': '64'}
    out = subprocess.run(['bash', SBATCH], env=env, capture_output=True, text=True, timeout=30)
    line = out.stdout.strip().splitlines()[-1]
    assert ' srun --kill-on-bad-exit=1 --nodes=1 --ntasks-per-node=1 --cpus-per-task=64 bash -c trap "" USR1; ' in line
