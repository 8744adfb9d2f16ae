"""The launch scripts pretrain.sh, eval.sh and finetune.sh print (or dry-run) valid main.py command lines."""
import os
import re
import subprocess

import pytest
from conftest import REPO

import cli
import main
import models


# --------------------------------------------------------------------------------- pretrain.sh, eval.sh
@pytest.mark.parametrize('variant', ['NALAFORMER_XT', 'NALAFORMER_T', 'NALAFORMER_S', 'NALAFORMER_B',
                                     'NALAFORMER_L'])
def test_pretrain_sh_holds_each_variant_recipe(variant, tmp_path):
    import subprocess
    e = dict(os.environ, MODEL=variant, PYTHON='echo', DATA=str(tmp_path), OUTPUT='/o', NPROC='4', NNODES='2',
             NODE_RANK='1', MASTER_ADDR='10.0.0.1', MASTER_PORT='1234')
    for name in ('AMP', 'DRY_RUN', 'SLURM_JOB_ID'):
        e.pop(name, None)
    p = subprocess.run(['bash', os.path.join(main.__file__.rsplit('/', 1)[0], 'pretrain.sh'), '--epochs', '7'],
                       env=e, capture_output=True, text=True, check=True)
    printed, ran = p.stdout.splitlines()
    assert printed.startswith('+ echo -m torch.distributed.run')
    for piece in ('--nnodes=2', '--nproc_per_node=4', '--rdzv-backend=c10d', '--rdzv-endpoint=10.0.0.1:1234',
                  '--rdzv-id=nalaformer', f'--model {variant}', '--batch-size 128',
                  f'--data-path {tmp_path}', '--output_dir /o'):
        assert piece in ran, piece
    assert '--node_rank' not in ran and '--master_addr' not in ran  # the rendezvous numbers the nodes
    # the variant's drop path is main.py's default; the reference trained in fp32 (+TF32), no --amp
    assert '--drop-path' not in ran and '--amp' not in ran
    assert ran.endswith('--epochs 7')  # extra flags come last and override
    args = cli.get_args_parser().parse_args(ran.split(' main.py ', 1)[1].split())
    assert args.drop_path is None and args.amp is None and args.epochs == 7 and args.lr == 5e-4


def test_eval_sh_prints_and_runs_an_exact_evaluation():
    import subprocess
    e = dict(os.environ, PYTHON='echo', CKPT='/c.pth', DATA='/d', NPROC='2')
    p = subprocess.run(['bash', os.path.join(main.__file__.rsplit('/', 1)[0], 'eval.sh')], env=e,
                       capture_output=True, text=True, check=True)
    ran = p.stdout.splitlines()[1]
    assert '--nproc_per_node=2' in ran and '--eval --resume /c.pth' in ran and '--dist-eval' in ran


@pytest.mark.parametrize('size', [None, '288'])
def test_eval_sh_passes_an_input_size_only_when_size_is_set(size):
    """Without SIZE main.py evaluates at the size the checkpoint records; SIZE=N asks for another."""
    e = {'PYTHON': 'echo', 'CKPT': '/c.pth', 'DATA': '/d', **({'SIZE': size} if size else {})}
    e = {**{k: v for k, v in os.environ.items() if k not in ('SIZE', 'DRY_RUN')}, **e}
    p = subprocess.run(['bash', os.path.join(REPO, 'eval.sh')], env=e, capture_output=True, text=True, timeout=60,
                       check=True)
    argv = p.stdout.splitlines()[1].split()  # what echo printed: main.py and its flags
    assert argv[0] == 'main.py'
    args = cli.get_args_parser().parse_args(argv[1:])
    assert args.input_size == (int(size) if size else None) and args.eval and args.resume == '/c.pth'


@pytest.mark.slow  # main.py in a real process
def test_eval_sh_with_a_run_directory_names_the_checkpoints_in_it(tmp_path):
    """CKPT=output/demo (the folder, not a file in it): one line naming best.pth and checkpoint.pth there."""
    for name in ('best.pth', 'checkpoint.pth', 'log.txt'):
        (tmp_path / name).write_bytes(b'')
    e = {**{k: v for k, v in os.environ.items() if k not in ('SIZE', 'DRY_RUN', 'PYTHON')}, 'CKPT': str(tmp_path),
         'DATA': str(tmp_path)}
    p = subprocess.run(['bash', os.path.join(REPO, 'eval.sh'), '--device', 'cpu'], env=e, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.splitlines()[-1] == (f'main.py: error: --resume {tmp_path}: a directory, not a checkpoint; pass '
                                         f"one of the checkpoints in it: {tmp_path / 'best.pth'}, "
                                         f"{tmp_path / 'checkpoint.pth'}")


def test_eval_sh_dry_run_prints_and_runs_nothing():
    # a PYTHON that fails when started: the dry run must not start it
    cmd = _dry_run('eval.sh', {'PYTHON': 'false', 'CKPT': '/c.pth', 'DATA': '/d'})
    assert cmd[:2] == ['false', 'main.py'] and '--eval' in cmd


def test_eval_sh_documents_only_the_variables_it_reads():
    with open(os.path.join(REPO, 'eval.sh')) as f:
        text = f.read()
    header = text.split('set -euo pipefail')[0]
    documented = re.findall(r'\b([A-Z][A-Z_]+) \(', header.split('Environment:')[1])
    assert documented and 'OUTPUT' not in header
    for name in documented:
        assert '${' + name in text, name


# ------------------------------------------------------------------------------------------ finetune.sh
def _dry_run(script, env, *extra):
    out = subprocess.run(['bash', os.path.join(REPO, script), *extra], env={**os.environ, 'DRY_RUN': '1', **env},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith('+ ')
    return line[2:].split()


@pytest.mark.parametrize('model, layer_decay', [('NALAFORMER_XT', '0.8'), ('NALAFORMER_B', '0.93')])
def test_finetune_sh_dry_run_prints_a_valid_384_command(tmp_path, model, layer_decay):
    ckpt = tmp_path / 'best.pth'
    ckpt.write_bytes(b'')
    cmd = _dry_run('finetune.sh', {'MODEL': model, 'CKPT': str(ckpt), 'MAX_RESTARTS': '2'}, '--epochs', '7')
    assert cmd[1:3] == ['-m', 'torch.distributed.run'] and '--max-restarts=2' in cmd
    argv = cmd[cmd.index('main.py') + 1:]
    parser = cli.get_args_parser()
    args = parser.parse_args(argv)
    cli.validate_args(args, parser)  # every flag exists and the combination is accepted
    assert (args.model, args.finetune, args.input_size, args.eval_crop_ratio) == (model, str(ckpt), 384, 1.0)
    assert args.layer_decay == float(layer_decay) and args.lr == 5e-5 and args.epochs == 7
    assert args.drop_path == models.VARIANTS[model]['drop_path']
    assert args.train_mode is True  # the recipe's drop path needs train mode (main.py's --finetune default is off)


def test_finetune_sh_needs_ckpt():
    out = subprocess.run(['bash', os.path.join(REPO, 'finetune.sh')], env={**os.environ, 'DRY_RUN': '1'},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and 'set CKPT' in out.stderr


def test_pretrain_sh_passes_max_restarts():
    assert '--max-restarts=0' in _dry_run_pretrain({})
    assert '--max-restarts=3' in _dry_run_pretrain({'MAX_RESTARTS': '3'})


def _dry_run_pretrain(env):
    return _dry_run('pretrain.sh', env)


def test_pretrain_sh_dry_run_prints_and_launches_nothing(tmp_path):
    # a PYTHON that fails when started: the dry run must not start it, whatever DATA is
    cmd = _dry_run('pretrain.sh', {'PYTHON': 'false', 'MODEL': 'NALAFORMER_XT', 'DATA': str(tmp_path / 'absent')})
    assert cmd[:3] == ['false', '-m', 'torch.distributed.run'] and f'--data-path {tmp_path}/absent' in ' '.join(cmd)


@pytest.mark.parametrize('script', ['pretrain.sh', 'finetune.sh'])
@pytest.mark.parametrize('data', ['placeholder', 'missing'])
def test_launch_scripts_refuse_a_data_folder_that_does_not_exist(tmp_path, script, data):
    ckpt = tmp_path / 'best.pth'
    ckpt.write_bytes(b'')
    e = {**os.environ, 'PYTHON': 'echo', 'CKPT': str(ckpt)}
    e.pop('DRY_RUN', None)
    e.pop('DATA', None)
    if data == 'missing':
        e['DATA'] = str(tmp_path / 'imagenet')
    out = subprocess.run(['bash', os.path.join(REPO, script)], env=e, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stdout.count('\n') == 1 and out.stdout.startswith('+ ')  # the command printed, nothing run
    assert out.stderr.count('\n') == 1 and out.stderr.startswith(f'{script}: DATA')
    assert 'set DATA to the ImageNet folder' in out.stderr
    if data == 'missing':
        assert str(tmp_path / 'imagenet') in out.stderr


# ------------------------------------------------------------------------------------------ several nodes
@pytest.mark.parametrize('script', ['pretrain.sh', 'finetune.sh'])
def test_several_nodes_meet_in_a_c10d_rendezvous_and_one_node_keeps_the_static_one(script):
    e = {'CKPT': '/c.pth', 'NNODES': '2', 'MASTER_ADDR': 'node0', 'MASTER_PORT': '4321', 'SLURM_JOB_ID': '77'}
    cmd = _dry_run(script, e)
    assert cmd[cmd.index('--nnodes=2') + 1:cmd.index('main.py')] == [
        '--nproc_per_node=8', '--max-restarts=0', '--rdzv-backend=c10d', '--rdzv-endpoint=node0:4321',
        '--rdzv-id=77']
    one = _dry_run(script, {'CKPT': '/c.pth', 'NNODES': '1'})
    assert '--master_addr=127.0.0.1' in one and '--node_rank=0' in one and not any('rdzv' in a for a in one)


@pytest.mark.parametrize('script', ['pretrain.sh', 'finetune.sh'])
def test_several_nodes_without_master_addr_are_refused_in_one_line(script):
    e = {**os.environ, 'DRY_RUN': '1', 'CKPT': '/c.pth', 'NNODES': '2'}
    e.pop('MASTER_ADDR', None)
    out = subprocess.run(['bash', os.path.join(REPO, script)], env=e, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ''
    assert out.stderr.count('\n') == 1 and out.stderr.startswith(f'{script}: NNODES=2 needs MASTER_ADDR'), out.stderr
    # on purpose, several "nodes" on one machine
    assert '--rdzv-endpoint=127.0.0.1:29500' in _dry_run(script, {'CKPT': '/c.pth', 'NNODES': '2',
                                                                   'MASTER_ADDR': '127.0.0.1'})
