"""Fine-tuning: --layer-decay parameter groups (built as main.py builds them) and finetune.sh."""
import os
import subprocess

import pytest
import timm

import main
import models

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _depth(name):
    """Position of a parameter in the forward order: stem 0, then each block, a stage's downsample with its
    last block, then the head (proj, norm, head)."""
    if name.startswith('patch_embed'):
        return 0
    if name.startswith('layers.'):
        stage, rest = int(name.split('.')[1]), name.split('.')[2]
        depths = models.VARIANTS['NALAFORMER_XT']['depths']
        before = sum(depths[:stage])
        if rest == 'blocks':
            return 1 + before + int(name.split('.')[3])
        return before + depths[stage]  # downsample: after the stage's last block
    return 1 + sum(models.VARIANTS['NALAFORMER_XT']['depths'])


def test_layer_decay_scales_lr_by_depth(one_thread):
    args = main.get_args_parser().parse_args(['--model', 'NALAFORMER_XT', '--layer-decay', '0.5', '--lr', '1e-3',
                                              '--warmup-epochs', '0', '--epochs', '10'])
    model = timm.create_model('NALAFORMER_XT', num_classes=10)
    optimizer = main.build_optimizer(args, model)
    scheduler = main.build_lr_scheduler(args, optimizer)
    scheduler.step(3)
    # the schedule's LR at epoch 3, from the same flags without layer decay
    args.layer_decay = None
    plain = main.build_optimizer(args, timm.create_model('NALAFORMER_XT', num_classes=10))
    main.build_lr_scheduler(args, plain).step(3)
    sched_lr = plain.param_groups[0]['lr']
    assert sched_lr < 1e-3
    group_of = {id(p): g for g in optimizer.param_groups for p in g['params']}
    head = 1 + sum(models.VARIANTS['NALAFORMER_XT']['depths'])
    for name, p in model.named_parameters():
        g = group_of[id(p)]
        expected = 0.5 ** (head - _depth(name))
        assert g['lr_scale'] == pytest.approx(expected), name
        assert g['lr'] == pytest.approx(sched_lr * expected), name
        assert g['weight_decay'] == (0.0 if p.ndim <= 1 or name.endswith('.bias') else 0.05), name
    assert max(g['lr'] for g in optimizer.param_groups) == pytest.approx(sched_lr)


def test_without_layer_decay_every_group_has_the_base_lr(one_thread):
    args = main.get_args_parser().parse_args(['--model', 'NALAFORMER_XT', '--lr', '1e-3'])
    optimizer = main.build_optimizer(args, timm.create_model('NALAFORMER_XT', num_classes=10))
    assert {g['lr'] for g in optimizer.param_groups} == {1e-3}
    assert all(g.get('lr_scale', 1.0) == 1.0 for g in optimizer.param_groups)


def test_layer_decay_out_of_range_is_an_argument_error(capsys):
    parser = main.get_args_parser()
    args = parser.parse_args(['--model', 'NALAFORMER_XT', '--layer-decay', '1.5'])
    with pytest.raises(SystemExit) as e:
        main.validate_args(args, parser)
    assert e.value.code == 2 and '--layer-decay must be in (0, 1]' in capsys.readouterr().err


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
    parser = main.get_args_parser()
    args = parser.parse_args(argv)
    main.validate_args(args, parser)  # every flag exists and the combination is accepted
    assert (args.model, args.finetune, args.input_size, args.eval_crop_ratio) == (model, str(ckpt), 384, 1.0)
    assert args.layer_decay == float(layer_decay) and args.lr == 5e-5 and args.epochs == 7
    assert args.drop_path == models.VARIANTS[model]['drop_path']


def test_finetune_sh_needs_ckpt():
    out = subprocess.run(['bash', os.path.join(REPO, 'finetune.sh')], env={**os.environ, 'DRY_RUN': '1'},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and 'set CKPT' in out.stderr


def test_pretrain_sh_passes_max_restarts():
    assert '--max-restarts=0' in _dry_run_pretrain({})
    assert '--max-restarts=3' in _dry_run_pretrain({'MAX_RESTARTS': '3'})


def _dry_run_pretrain(env):
    # pretrain.sh has no dry-run knob: a PYTHON that prints its arguments stands in for the interpreter
    out = subprocess.run(['bash', os.path.join(REPO, 'pretrain.sh')], env={**os.environ, 'PYTHON': 'echo', **env},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()
