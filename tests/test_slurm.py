"""slurm/train.sbatch: the commands it runs (DRY_RUN: the srun line and each node's main.py command) and its
requeue on USR1 under the fake SLURM of tests/helpers/cluster.py (run for real, with a stand-in step and with
pretrain.sh: tests/integration/test_cluster.py)."""
import os
import subprocess

from conftest import REPO

import cli

SBATCH = os.path.join(REPO, 'slurm', 'train.sbatch')


def test_sbatch_header_asks_for_the_warning_signal_and_requeue():
    with open(SBATCH) as f:
        text = f.read()
    assert '#SBATCH --signal=B:USR1@120' in text and '#SBATCH --requeue' in text
    assert subprocess.run(['bash', '-n', SBATCH]).returncode == 0


def _dry_run(*argv, **env):
    """The lines train.sbatch prints with DRY_RUN=1: the srun line first, the command of each node's task last."""
    out = subprocess.run(['bash', SBATCH, *argv], env={**os.environ, 'DRY_RUN': '1', **env}, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [line for line in out.stdout.splitlines() if line.startswith('+ ')]


def test_dry_run_prints_one_task_per_node_running_the_script():
    srun = _dry_run('--epochs', '3', SLURM_JOB_NUM_NODES='4', MASTER_ADDR='node7', NPROC='4', SCRIPT='finetune.sh',
                    CKPT='/ckpt/s/best.pth')[0]
    assert srun.startswith('+ NNODES=4 MASTER_ADDR=node7 MASTER_PORT=29500 NPROC=4 MAX_RESTARTS=0 srun ')
    assert '--nodes=4 --ntasks-per-node=1' in srun and 'NODE_RANK=$SLURM_NODEID' in srun
    assert srun.endswith('finetune.sh --epochs 3')


def test_dry_run_prints_the_main_py_command_each_node_runs():
    """The script's own command under the job's settings: torchrun with the allocation's nodes and GPUs, and
    main.py with the recipe, the environment of the submission and the extra flags."""
    srun, node = _dry_run('--epochs', '3', SLURM_JOB_NUM_NODES='2', MASTER_ADDR='node7', NPROC='4',
                          MODEL='NALAFORMER_S', DATA='/data/imagenet', OUTPUT='/ckpt/s', PYTHON='python3')
    words = node[2:].split()
    assert words[:3] == ['python3', '-m', 'torch.distributed.run']
    assert '--nnodes=2' in words and '--nproc_per_node=4' in words and '--rdzv-endpoint=node7:29500' in words
    args = cli.get_args_parser().parse_args(words[words.index('main.py') + 1:])
    assert (args.model, args.data_path, args.output_dir) == ('NALAFORMER_S', '/data/imagenet', '/ckpt/s')
    assert args.epochs == 3 and args.lr == 5e-4


def test_unknown_script_is_a_clear_error():
    env = {**os.environ, 'DRY_RUN': '1', 'SCRIPT': 'nope.sh'}
    out = subprocess.run(['bash', SBATCH], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and 'SCRIPT=nope.sh is not in' in out.stderr


def test_the_step_gets_the_job_cpus_and_ignores_the_warning_signal():
    """Since Slurm 22.05 srun does not inherit the job's --cpus-per-task; torchrun must not die of USR1."""
    line = _dry_run(SLURM_CPUS_PER_TASK='64')[0]
    assert ' srun --kill-on-bad-exit=1 --nodes=1 --ntasks-per-node=1 --cpus-per-task=64 bash -c trap "" USR1; ' in line
