"""The command line of main.py: flags that would crash or quietly do harm end in an argparse-style error
(exit 2) naming the flag, before any work; sensible values still pass; the defaults are the published
recipe and the reference's flag spellings are accepted."""
import re
import sys

import pytest
import torch
from conftest import parse, untrained_eval_argv

import cli
import datasets
import main
from run import checkpoint, process
from run.errors import FlagError, UserError

LAUNCH_VARS = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'SLURM_PROCID', 'SLURM_NTASKS', 'SLURM_LOCALID')


@pytest.fixture
def plain_process(monkeypatch):
    """No launcher in the environment: a plain single process."""
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)


def parse_and_validate(argv):
    parser = cli.get_args_parser()
    args = parser.parse_args(argv + ['--data-path', '/nonexistent'])
    main.check_command_line(args, parser)
    return args


@pytest.mark.parametrize('argv, flag', [
    # crashed with a traceback
    (['--lr', '-1'], '--lr'),
    (['--lr', 'nan'], '--lr'),
    (['--num_workers', '-1'], '--num_workers'),
    (['--print-freq', '0'], '--print-freq'),
    (['--seed', '-1'], '--seed'),
    (['--opt', 'garbage'], '--opt'),
    (['--sched', 'garbage'], '--sched'),
    (['--sched', 'wsd', '--epochs', '3'], '--sched'),
    (['--aa', 'garbage'], '--aa'),
    (['--drop', '2'], '--drop'),
    (['--drop-path', '2'], '--drop-path'),
    (['--input-size', '64', '--eval-crop-ratio', '0'], '--eval-crop-ratio'),
    (['--cutmix-minmax', '0.5'], '--cutmix-minmax'),
    (['--cutmix-minmax', '0.5', '0.2'], '--cutmix-minmax'),
    (['--input-size', '16'], '--input-size'),  # below the network's stride, 32
    (['--color-jitter', '-1'], '--color-jitter'),  # timm: ignored under --aa, a ValueError without it
    (['--train-interpolation', 'foo'], '--train-interpolation'),  # a KeyError of timm's once the data was listed
    # accepted, then did harm
    (['--clip-grad', '-1'], '--clip-grad'),
    (['--start_epoch', '-3'], '--start_epoch'),
    (['--lr', 'inf'], '--lr'),
    (['--model-ema-decay', '2'], '--model-ema-decay'),
    (['--smoothing', '2'], '--smoothing'),
    (['--device', 'foo'], '--device'),
    (['--world_size', '4'], '--world_size'),
])
def test_bad_flag_is_an_argparse_error_naming_it(argv, flag, plain_process, capsys):
    with pytest.raises(SystemExit) as ei:
        parse_and_validate(argv)
    assert ei.value.code == 2
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if 'error:' in x][-1]
    assert re.search(re.escape(flag) + r'\b', line), line
    assert 'Traceback' not in err


@pytest.mark.parametrize('argv', [
    [],  # the recipe's defaults
    ['--opt', 'lookahead_adamw', '--clip-grad', '1', '--seed', '7', '--num_workers', '0'],
    ['--sched', 'wsd', '--decay-epochs', '0.2', '--aa', 'augmix-m5-w4-d2', '--drop', '0.1'],
    ['--aa', 'none', '--smoothing', '0', '--model-ema-decay', '0.999', '--cutmix-minmax', '0.2', '0.8'],
    ['--input-size', '64', '--eval-crop-ratio', '1', '--device', 'cpu', '--start_epoch', '3'],
])
def test_good_flags_pass(argv, plain_process):
    args = parse_and_validate(argv)
    args.drop_path = None  # "the variant's own rate" is valid too
    cli.validate_args(args, cli.get_args_parser())


@pytest.mark.parametrize('name, dest', [('model-ema', 'model_ema'), ('repeated-aug', 'repeated_aug'),
                                        ('auto-resume', 'auto_resume'),
                                        ('pin-mem', 'pin_mem'), ('tf32', 'tf32'), ('sync-bn', 'sync_bn')])
def test_paired_switches_default_on_and_the_last_one_wins(name, dest):
    """--x / --no-x: on by default; a later one overrides an earlier one (tools/smoke.py appends --model-ema to
    base flags holding --no-model-ema), and the pair has one help text."""
    parser = cli.get_args_parser()
    value = lambda *argv: getattr(parser.parse_args(list(argv)), dest)  # noqa: E731
    assert value() is True and value(f'--{name}') is True and value(f'--no-{name}') is False
    assert value(f'--no-{name}', f'--{name}') is True and value(f'--{name}', f'--no-{name}') is False
    helps = {tuple(a.option_strings): a.help for a in parser._actions if a.dest == dest}
    assert list(helps) == [(f'--{name}', f'--no-{name}')] and helps[f'--{name}', f'--no-{name}']


@pytest.mark.parametrize('argv, expected', [
    ([], True),                                                  # from scratch: train mode
    (['--finetune', 'x.pth'], False),                            # the reference fine-tunes in eval mode
    (['--finetune', 'x.pth', '--train-mode'], True),             # an explicit switch wins
    (['--no-train-mode'], False),
    (['--finetune', 'x.pth', '--no-train-mode', '--train-mode'], True),  # the last one given wins
])
def test_train_mode_defaults_to_the_reference_rule(argv, expected):
    args = parse(*argv)
    reason = cli.resolve_train_mode(args)
    assert args.train_mode is expected
    assert reason.startswith('on' if expected else 'off')
    assert ('--finetune' in reason) == (argv == ['--finetune', 'x.pth'])  # the default for a fine-tune says why


def test_world_size_matching_the_launcher_passes(monkeypatch):
    monkeypatch.setenv('RANK', '0')
    monkeypatch.setenv('WORLD_SIZE', '4')
    assert parse_and_validate(['--world_size', '4']).world_size == 4


@pytest.mark.parametrize('world, argv, expected', [
    (1, [], False), (4, [], True),  # exact, so on whenever there are several processes
    (4, ['--no-dist-eval'], False), (4, ['--dist-eval'], True), (1, ['--dist-eval'], True),
    (4, ['--no-dist-eval', '--dist-eval'], True)])
def test_dist_eval_is_the_default_with_several_processes(world, argv, expected, plain_process, monkeypatch):
    if world > 1:  # as torchrun starts rank 0 of `world`
        monkeypatch.setenv('RANK', '0')
        monkeypatch.setenv('WORLD_SIZE', str(world))
    assert parse_and_validate(argv).dist_eval is expected


# ------------------------------------------------------------------------------------------ recipe, more flags
def test_defaults_are_the_published_recipe():
    a = parse()
    assert (a.batch_size, a.epochs, a.lr, a.opt, a.weight_decay, a.opt_eps) == (128, 300, 5e-4, 'adamw', 0.05, 1e-8)
    assert (a.sched, a.min_lr, a.warmup_lr, a.warmup_epochs) == ('cosine', 1e-5, 1e-6, 5)
    assert a.clip_grad is None and a.opt_betas is None  # AdamW default betas (0.9, 0.999), no clipping
    assert (a.aa, a.color_jitter, a.train_interpolation) == ('rand-m9-mstd0.5-inc1', 0.4, 'bicubic')
    assert (a.reprob, a.remode, a.recount) == (0.25, 'pixel', 1)
    assert (a.mixup, a.cutmix, a.mixup_prob, a.mixup_switch_prob, a.mixup_mode) == (0.8, 1.0, 1.0, 0.5, 'batch')
    assert a.smoothing == 0.1 and a.repeated_aug and a.model_ema and a.model_ema_decay == 0.99996
    assert a.drop_path is None and a.drop == 0.0 and a.eval_crop_ratio is None and a.sync_bn  # None: the model's
    assert datasets.data_config(a.model, a.input_size, a.eval_crop_ratio)['crop_pct'] == 0.875
    assert a.data_set == 'IMNET' and a.dist_url == 'env://'


def test_reference_flag_spellings_are_accepted():
    a = parse('--output_dir', 'o', '--start_epoch', '3', '--num_workers', '2', '--world_size', '1',
              '--dist_url', 'env://', '--no-model-ema', '--no-repeated-aug', '--no-pin-mem', '--amp',
              '--local_rank', '0', '--dist-eval', '--drop-path', '0.3', '--data-set', 'DIGITS')
    assert (a.output_dir, a.start_epoch, a.num_workers, a.amp) == ('o', 3, 2, 'fp16')
    assert not a.model_ema and not a.repeated_aug and not a.pin_mem and a.dist_eval and a.drop_path == 0.3
    assert parse('--output-dir', 'p', '--amp', 'bf16').output_dir == 'p'
    assert parse('--amp', 'bf16').amp == 'bf16'


def test_layer_decay_out_of_range_is_an_argument_error(capsys):
    parser = cli.get_args_parser()
    with pytest.raises(SystemExit) as e:
        parser.parse_args(['--model', 'NALAFORMER_XT', '--layer-decay', '1.5'])
    assert e.value.code == 2 and '--layer-decay: expected a number > 0 and <= 1, got 1.5' in capsys.readouterr().err


@pytest.mark.parametrize('argv, message', [
    (['--sched', 'plateau'], r"--sched: invalid choice: 'plateau'"),
    (['--accum-steps', '0'], r'--accum-steps: expected an integer >= 1, got 0'),
    (['--bce-target-thresh', '0.2'], r'--bce-target-thresh needs --bce-loss'),
    (['--cosub'], r'--cosub \(DeiT III\) is not supported'),
    (['--ThreeAugment'], r'--ThreeAugment \(DeiT III\) is not supported'),
    (['--src'], r'--src \(DeiT III\) is not supported'),
])
def test_refused_recipe_flags_fail_like_argparse(argv, message, capsys):
    parser = cli.get_args_parser()
    with pytest.raises(SystemExit) as ei:
        cli.validate_args(parser.parse_args(argv), parser)
    assert ei.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_tf32_is_on_by_default_and_can_be_turned_off():
    assert parse().tf32 is True and parse('--no-tf32').tf32 is False
    assert parse('--tf32').tf32 is True


def test_log_dir_without_tensorboard_is_an_argument_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, 'tensorboard', None)  # as if it were not installed
    parser = cli.get_args_parser()
    args = parser.parse_args(['--model', 'NALAFORMER_XT', '--log-dir', 'runs/x'])
    with pytest.raises(SystemExit) as e:
        cli.validate_args(args, parser)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and 'pip install tensorboard' in err[-1] and '--log-dir' in err[-1]


@pytest.mark.parametrize('argv, message', [
    (['--model', 'NOT_A_MODEL'], r"unknown model 'NOT_A_MODEL'; the NaLaFormer variants are NALAFORMER_XT, "
                                 r"NALAFORMER_T, NALAFORMER_S, NALAFORMER_B, NALAFORMER_L \(any timm model"),
    (['--model', 'nalaformer-t'], r"unknown model 'nalaformer-t' \(did you mean NALAFORMER_T\?\)"),
    (['--model', 'resnet5'], r"unknown model 'resnet5' \(did you mean resnet50\?\)"),
    (['--distillation-type', 'soft', '--teacher-path', __file__, '--teacher-model', 'regnety-160'],
     r"--teacher-model: unknown model 'regnety-160' \(did you mean regnety_160\?\)"),
    (['--distillation-type', 'hard', '--teacher-path', 't.pth', '--finetune', 'x.pth'],
     r'--distillation-type with --finetune'),
    (['--eval'], r'--eval needs a checkpoint'),
    (['--batch-size', '0'], r'--batch-size: expected an integer >= 1'),
    (['--batch-size', '5'], r'--batch-size 5 is odd; mixup'),
    (['--resume', '/nonexistent/ck.pth'], r'--resume /nonexistent/ck.pth: no such file'),
    (['--teacher-path', 'https://x/y.pth', '--distillation-type', 'soft'], r'local file'),
    (['--data-set', 'DIGITS', '--eval', '--real-labels'],
     r'--real-labels: ImageNet-ReaL needs the 1000-class ImageNet validation set \(--data-set IMNET\), not '
     r'--data-set DIGITS'),
])
def test_incompatible_flags_fail_like_argparse_before_any_work(argv, message, capsys, monkeypatch):
    monkeypatch.setenv('WORLD_SIZE', '2')
    monkeypatch.setenv('RANK', '0')
    with pytest.raises(SystemExit) as ei:
        main.run(argv + ['--data-path', '/nonexistent'])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert 'usage:' in err and 'Traceback' not in err
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize('env', [{'RANK': '0', 'WORLD_SIZE': '2'}, {'RANK': '1', 'WORLD_SIZE': '2'},
                                 {'SLURM_PROCID': '3', 'SLURM_NTASKS': '4'}])
def test_argument_errors_under_a_launcher_are_printed_by_rank_0_only(env, plain_process, monkeypatch, capsys):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for argv in (['--eval'], ['--lr', '-1']):  # a check of validate_args and one of argparse itself
        with pytest.raises(SystemExit) as ei:
            main.run(argv + ['--data-path', '/nonexistent'])
        assert ei.value.code == 2  # every rank fails
        err = capsys.readouterr().err.splitlines()
        if env.get('RANK') == '0':
            assert len(err) == 2 and err[0].startswith('usage: ') and err[0].endswith('(--help lists them)')
            assert 'error: ' in err[1] and ('--eval needs a checkpoint' in err[1] or 'argument --lr' in err[1])
        else:
            assert err == []


@pytest.mark.parametrize('argv, error', [
    (['--eval'], 'main.py: error: --eval needs a checkpoint: pass --resume PATH (or an --output_dir holding '
                 'checkpoint.pth)'),
    (['--lr', '-1'], 'main.py: error: argument --lr: expected a number > 0, got -1'),
    (['--ouput_dir', 'out'], 'main.py: error: unrecognized arguments: --ouput_dir out (did you mean --output_dir?)'),
    (['--ouput_dir=out', '--epoch-s', '3'],
     'main.py: error: unrecognized arguments: --ouput_dir=out --epoch-s 3 (did you mean --output_dir for '
     '--ouput_dir, --epochs for --epoch-s?)'),
    (['--xyz'], 'main.py: error: unrecognized arguments: --xyz'),
])
def test_argument_errors_of_a_plain_process_are_one_error_line_and_a_pointer_to_help(argv, error, plain_process,
                                                                                   capsys):
    """Not the page-long usage: the error (with the closest flag for a typo) under one line pointing to --help."""
    with pytest.raises(SystemExit) as ei:
        main.run(argv + ['--data-path', '/nonexistent'])
    err = capsys.readouterr().err.splitlines()
    assert ei.value.code == 2
    assert err == ['usage: main.py [options]  (--help lists them)', error]


def test_help_shows_the_defaults_and_the_compatibility_flags(capsys):
    with pytest.raises(SystemExit):
        main.run(['--help'])
    text = ' '.join(capsys.readouterr().out.split())
    assert text.startswith('usage: main.py ')
    assert "image size (default: 224, the model's; evaluating or resuming a checkpoint: the size it records)" in text
    compat = text.split('compatibility:', 1)[1]
    assert all(flag in compat for flag in ('--resplit', '--patience-epochs', '--distributed'))


def test_pasted_reference_flags_are_accepted_and_change_nothing(data, tmp_path, plain_process, capsys):
    """A command line copied from the reference's or DeiT's scripts (--resplit, --patience-epochs, --distributed)
    runs: here an evaluation, with one note per flag saying why it changes nothing."""
    argv = untrained_eval_argv(data, tmp_path) + ['--num_workers', '0']
    assert main.run(argv + ['--resplit', '--patience-epochs', '10', '--distributed']) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if 'changes nothing here' in line]
    assert [n.split()[1] for n in notes] == ['--resplit', '--patience-epochs', '--distributed'], out[-2000:]
    assert 'plateau' in notes[1] and 'launcher' in notes[2]
    plain = parse(*argv)
    for flags in (['--resplit'], ['--patience-epochs', '10'], ['--distributed']):
        changed = {k for k, v in vars(parse(*argv, *flags)).items() if v != getattr(plain, k)}
        assert changed <= {'resplit', 'patience_epochs', 'compat_distributed'}, changed
    assert not cli.compatibility_notes(plain)


LAUNCHERS = {'plain': {}, 'torchrun x8': {'RANK': '3', 'WORLD_SIZE': '16', 'LOCAL_WORLD_SIZE': '8'},
             'srun 8 tasks, 8 CPUs each': {'SLURM_PROCID': '3', 'SLURM_NTASKS': '16', 'SLURM_NTASKS_PER_NODE': '8',
                                           'SLURM_CPUS_PER_TASK': '8'},
             'srun 8 tasks': {'SLURM_PROCID': '3', 'SLURM_NTASKS': '16', 'SLURM_STEP_TASKS_PER_NODE': '8(x2)'}}


@pytest.mark.parametrize('launcher, cpus, expected', [
    ('plain', 1, 1), ('plain', 2, 1), ('plain', 3, 2), ('plain', 64, 10),
    ('torchrun x8', 64, 7), ('torchrun x8', 8, 1), ('torchrun x8', 128, 10),
    ('srun 8 tasks, 8 CPUs each', 8, 7), ('srun 8 tasks, 8 CPUs each', 64, 7),  # bound to its CPUs, or not
    ('srun 8 tasks', 64, 7)])
def test_default_num_workers_is_the_cpus_per_process_less_one(launcher, cpus, expected, monkeypatch):
    """A 64-CPU node with 8 processes: each gets 8 CPUs, one of them for the training process itself."""
    for k in ('RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'SLURM_PROCID', 'SLURM_NTASKS', 'SLURM_NTASKS_PER_NODE',
              'SLURM_CPUS_PER_TASK', 'SLURM_STEP_TASKS_PER_NODE', 'SLURM_TASKS_PER_NODE'):
        monkeypatch.delenv(k, raising=False)
    for k, v in LAUNCHERS[launcher].items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(main.os, 'sched_getaffinity', lambda pid: set(range(cpus)), raising=False)
    assert process.default_num_workers()[0] == expected
    assert parse().num_workers is None and parse('--num-workers', '12').num_workers == 12  # given: taken as is


def test_default_num_workers_is_printed_and_draws_no_worker_warning(data, tmp_path, plain_process, capsys):
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        assert main.run(untrained_eval_argv(data, tmp_path)) == 0
    n, cpus = process.default_num_workers()[0], process.available_cpus()
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith('Data loader:')]
    assert line == [f'Data loader: {n} workers per process (the default: {cpus} CPU(s) per process (the {cpus} CPUs '
                    f'available to this process), one of them left to the training process; at most 10, at least 1; '
                    f'--num_workers N sets it)']
    assert not [w for w in caught if 'worker' in str(w.message)], [str(w.message) for w in caught]




def test_train_interpolation_names_its_choices_and_each_choice_builds_the_training_transform(capsys):
    with pytest.raises(SystemExit):
        parse('--train-interpolation', 'foo')
    line = capsys.readouterr().err.splitlines()[-1]
    assert "invalid choice: 'foo'" in line and all(f"'{c}'" in line for c in cli.TRAIN_INTERPOLATIONS), line
    for choice in cli.TRAIN_INTERPOLATIONS:
        args = parse('--train-interpolation', choice)
        datasets.build_transform(True, datasets.data_config('NALAFORMER_XT', 64), cli.settings(datasets.Augmentation,
                                                                                                args))


@pytest.mark.parametrize('argv, noted', [
    (['--color-jitter', '0.3'], True),  # the default --aa rand-m9-mstd0.5-inc1 switches color jitter off in timm
    (['--color-jitter', '0.3', '--aa', 'none'], False),
    (['--color-jitter', '0.3', '--aa', '3a'], False),
    (['--color-jitter', '0.3', '--eval'], False),
    ([], False),  # DeiT's default 0.4 under its own RandAugment: the recipe as it is
])
def test_a_color_jitter_that_changes_nothing_under_aa_is_noted(argv, noted):
    notes = cli.augmentation_notes(parse(*argv))
    assert notes == (['Note: --color-jitter 0.3 changes nothing while --aa rand-m9-mstd0.5-inc1 is on (timm jitters '
                      'colours only without --aa, or with a 3a policy); add --aa none to jitter colours instead']
                     if noted else [])


def test_a_checkpoint_directory_names_the_checkpoints_in_it(tmp_path, plain_process, capsys):
    run = tmp_path / 'demo'
    run.mkdir()
    for name in ('checkpoint_0001.pth', 'checkpoint.pth', 'best.pth', 'log.txt', '.tmp-checkpoint.pth.x'):
        (run / name).write_bytes(b'')
    for flag in ('--resume', '--finetune'):
        with pytest.raises(SystemExit):
            parse_and_validate([flag, str(run)])
        assert capsys.readouterr().err.splitlines()[-1] == (
            f'main.py: error: {flag} {run}: a directory, not a checkpoint; pass one of the checkpoints in it: '
            f"{run / 'best.pth'}, {run / 'checkpoint.pth'}, {run / 'checkpoint_0001.pth'}")
    with pytest.raises(SystemExit):
        parse_and_validate(['--resume', str(tmp_path)])  # no .pth directly inside
    assert capsys.readouterr().err.splitlines()[-1].endswith(': a directory holding no checkpoint (.pth); pass a '
                                                             'checkpoint file')


@pytest.mark.parametrize('task, script', [('segmentation', 'segmentation/train.py'),
                                          ('detection', 'detection/train.py')])
def test_a_checkpoint_of_another_task_names_what_it_is_and_the_command_that_takes_it(task, script, tmp_path,
                                                                                     plain_process, capsys):
    path = tmp_path / f'{task}.pth'
    torch.save({'task': task, 'model': {'backbone.model.x': torch.zeros(1)},
                'args': {'model': 'NALAFORMER_XT', 'data_path': '/data/ADE'}}, path)
    line = (f'{path} is a {task} checkpoint (written by {script}), not a classification one: evaluate it with '
            f'`python {script} --eval --resume {path} --data-path /data/ADE` (or continue its training with --resume '
            f'instead of --eval); main.py takes classification checkpoints')
    with pytest.raises(SystemExit):
        parse_and_validate(['--finetune', str(path)])
    assert capsys.readouterr().err.splitlines()[-1] == f'main.py: error: --finetune {line}'
    for argv in (['--resume', str(path)], ['--eval', '--resume', str(path)]):  # refused before anything is built
        assert main.run(argv + ['--model', 'NALAFORMER_XT', '--device', 'cpu', '--num_workers', '0',
                                '--data-path', str(tmp_path)]) == 2
        assert capsys.readouterr().err.splitlines() == [f'error: --resume {line}']
    torch.save({'task': 'classification', 'model': {}}, path)  # a task this repository writes: passes
    checkpoint.refuse_other_task('--resume', str(path))


def test_accum_steps_above_the_batches_of_an_epoch_are_refused_with_the_numbers(plain_process):
    args = parse('--batch-size', '4', '--accum-steps', '8')
    cli.check_accum_steps(args, batches=8, images=32)  # every window whole
    with pytest.raises(FlagError) as e:
        cli.check_accum_steps(args, batches=6, images=24)
    assert str(e.value) == ('--accum-steps 8 is more than the 6 batch(es) of an epoch (24 training images, '
                            '--batch-size 4 on 1 process(es)): every optimizer step would accumulate 6 (a global batch '
                            'of 24) while the LR and the EMA decay are scaled for 8 (a global batch of 32); use '
                            '--accum-steps 6 or fewer')


def test_a_run_with_too_many_accum_steps_stops_after_listing_its_data(data, plain_process, capsys):
    argv = ['--model', 'NALAFORMER_XT', '--input-size', '32', '--batch-size', '4', '--device', 'cpu', '--num_workers',
            '0', '--no-flops', '--epochs', '1', '--data-path', data, '--accum-steps', '7']
    assert main.run(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith('error: --accum-steps 7 is more than the 6 batch(es) of an epoch '
                                               '(24 training images'), err


# --------------------------------------------------------------------------------------------------------- memory
def _kept_bytes_per_pixel(name, fast=True, amp=False, sizes=(64, 96)):
    """What autograd keeps for the backward of one training image of `name` (each storage once, parameters left
    out), per input pixel: the growth between two sizes, so that what does not grow with the image drops out."""
    import timm

    from models.nalaformer import set_fast_path
    model = timm.create_model(name, drop_path_rate=0.1).train()
    set_fast_path(model, fast)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = []
    for side in sizes:
        storages = {}

        def pack(t, storages=storages):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast('cpu', torch.bfloat16, enabled=amp):
            model(torch.randn(1, 3, side, side))
        kept.append(sum(n for k, n in storages.items() if k not in params))
    return (kept[1] - kept[0]) / (sizes[1] ** 2 - sizes[0] ** 2)


def _largest_live_pair_per_pixel(name, side=64):
    """The largest input plus output of one layer of `name` in an evaluation forward, per input pixel: both are
    alive at once, so the evaluation's peak is at least this."""
    import timm
    model = timm.create_model(name).eval()
    largest = [0]

    def hook(module, inputs, output):
        outputs = output if isinstance(output, tuple) else (output,)
        largest[0] = max(largest[0], sum(t.nbytes for t in (*inputs, *outputs) if torch.is_tensor(t)))
    for m in model.modules():
        if not list(m.children()):
            m.register_forward_hook(hook)
    with torch.no_grad():
        model(torch.randn(1, 3, side, side))
    return largest[0] / side ** 2


@pytest.mark.parametrize('name, fast, amp', [('NALAFORMER_XT', True, False), ('NALAFORMER_XT', False, False),
                                             ('NALAFORMER_XT', True, True), ('NALAFORMER_T', True, False)])
def test_the_memory_estimate_is_a_lower_bound_of_what_training_and_evaluation_keep(name, fast, amp, one_thread):
    """bytes_per_pixel, from the widths alone, against what the model keeps (the fast path, the plain path,
    bf16 autocast): never above it (a size check on it refuses only what cannot fit), and not far below the fast
    path's (the plain path keeps about twice as much)."""
    kept = _kept_bytes_per_pixel(name, fast=fast, amp=amp)
    estimate = cli.bytes_per_pixel(name, training=True, half=amp)
    assert estimate <= kept and (0.6 * kept < estimate or not fast), (estimate, kept)
    assert cli.bytes_per_pixel(name, training=False) <= _largest_live_pair_per_pixel(name)
    assert cli.bytes_per_pixel('resnet50', training=True) is None  # other timm models: no estimate, no check


GPU_80GB = 80 * 2 ** 30


def _fits(argv, memory, monkeypatch):
    monkeypatch.setattr(cli, 'device_memory', lambda device: (memory, f'the {cli.gib(memory)} of a test GPU'))
    cli.check_batch_fits(parse(*argv), torch.device('cpu'))


@pytest.mark.parametrize('argv', [
    *[['--model', name, '--input-size', '224', '--batch-size', '128'] for name in cli.VARIANTS],  # pretrain.sh
    *[['--model', name, '--input-size', '384', '--batch-size', '64'] for name in cli.VARIANTS],  # finetune.sh
    ['--model', 'NALAFORMER_T', '--input-size', '384', '--batch-size', '128'],
    ['--model', 'NALAFORMER_L', '--input-size', '384', '--batch-size', '128', '--amp', 'bf16'],
    ['--model', 'NALAFORMER_L', '--input-size', '384', '--batch-size', '1024', '--eval'],
    ['--model', 'NALAFORMER_L', '--input-size', '1024', '--batch-size', '16', '--grad-checkpointing'],
])
def test_the_recipes_sizes_fit_an_80_gb_gpu(argv, monkeypatch):
    _fits(argv, GPU_80GB, monkeypatch)


@pytest.mark.parametrize('argv, what', [
    (['--input-size', '100000'], 'one training batch (--batch-size 128) needs at least 1.92 PiB (NALAFORMER_T: about '
                                 '1688 bytes per pixel of each image, 128 images of 100000x100000)'),
    (['--model', 'NALAFORMER_L', '--input-size', '384', '--batch-size', '128'], 'one training batch'),
    (['--model', 'NALAFORMER_XT', '--input-size', '4096', '--eval'],  # evaluation: 1.5 x --batch-size
     'one evaluation batch (--batch-size 128) needs at least 120 GiB (NALAFORMER_XT: about 40 bytes per pixel of '
     'each image, 192 images of 4096x4096)'),
])
def test_a_size_whose_batch_cannot_fit_is_refused_naming_estimate_memory_and_fixes_that_fit(argv, what,
                                                                                           monkeypatch):
    with pytest.raises(FlagError) as e:
        _fits(argv, GPU_80GB, monkeypatch)
    size = parse(*argv).input_size
    head, fixes = str(e.value).split('; use ')
    assert head == f'--input-size {size}: {what}, more than the 80 GiB of a test GPU' or (
        head.startswith(f'--input-size {size}: {what}') and head.endswith('more than the 80 GiB of a test GPU'))
    fixes = re.findall(r'(--[\w-]+) (\d+)', fixes)
    assert fixes and {flag for flag, _ in fixes} <= {'--input-size', '--batch-size'}, fixes
    for flag, value in fixes:  # each fix fits, one step further does not
        step = 32 if flag == '--input-size' else 1
        _fits(argv + [flag, value], GPU_80GB, monkeypatch)
        with pytest.raises(FlagError):
            _fits(argv + [flag, str(int(value) + step)], GPU_80GB, monkeypatch)


def test_small_runs_fit_a_laptop_and_other_timm_models_are_not_checked(monkeypatch):
    _fits(['--model', 'NALAFORMER_XT', '--input-size', '32', '--batch-size', '4'], 2 ** 30, monkeypatch)
    _fits(['--model', 'resnet50', '--input-size', '100000'], 2 ** 30, monkeypatch)  # no estimate: no check


def test_the_cpu_memory_is_what_the_machine_has_left_within_its_cgroup(monkeypatch):
    memory, what = cli.device_memory(torch.device('cpu'))
    if memory is None:
        pytest.skip('no /proc/meminfo or sysconf on this system')
    assert memory > 0 and what.startswith(f'the {cli.gib(memory)} of ')
    monkeypatch.setattr(process, '_cgroup_limit', lambda: 2 ** 20)
    assert process.available_memory() == (2 ** 20, "the cgroup's memory limit")


def test_main_refuses_a_size_that_cannot_fit_before_the_data_is_read(plain_process, monkeypatch, capsys):
    def never(*a, **kw):  # a UserError: main.run ends with its line instead of leaving the process
        raise UserError('the data was read before the size check')
    monkeypatch.setattr(datasets, 'build_dataset', never)
    assert main.run(['--input-size', '100000', '--device', 'cpu', '--data-path', '/nonexistent']) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith('error: --input-size 100000: one training batch (--batch-size 128) '
                                               'needs at least 1.92 PiB'), err
