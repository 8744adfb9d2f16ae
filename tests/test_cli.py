"""The command line of main.py: flags that would crash or quietly do harm end in an argparse-style error
(exit 2) naming the flag, before any work; sensible values still pass."""
import os
import re
import shutil
import signal

import pytest

import main

LAUNCH_VARS = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'SLURM_PROCID', 'SLURM_NTASKS', 'SLURM_LOCALID')


@pytest.fixture
def plain_process(monkeypatch):
    """No launcher in the environment: a plain single process."""
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)


def parse_and_validate(argv):
    parser = main.get_args_parser()
    args = parser.parse_args(argv + ['--data-path', '/nonexistent'])
    main.validate_args(args, parser)
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
    main.validate_args(args, main.get_args_parser())


@pytest.mark.parametrize('name, dest', [('model-ema', 'model_ema'), ('repeated-aug', 'repeated_aug'),
                                        ('train-mode', 'train_mode'), ('auto-resume', 'auto_resume'),
                                        ('pin-mem', 'pin_mem'), ('tf32', 'tf32'), ('sync-bn', 'sync_bn')])
def test_paired_switches_default_on_and_the_last_one_wins(name, dest):
    """--x / --no-x: on by default; a later one overrides an earlier one (tools/smoke.py appends --model-ema to
    base flags holding --no-model-ema), and only --x carries the help text."""
    parser = main.get_args_parser()
    value = lambda *argv: getattr(parser.parse_args(list(argv)), dest)  # noqa: E731
    assert value() is True and value(f'--{name}') is True and value(f'--no-{name}') is False
    assert value(f'--no-{name}', f'--{name}') is True and value(f'--{name}', f'--no-{name}') is False
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.dest == dest}
    assert helps[f'--{name}'] and helps[f'--no-{name}'] is None


def test_world_size_matching_the_launcher_passes(monkeypatch):
    monkeypatch.setenv('RANK', '0')
    monkeypatch.setenv('WORLD_SIZE', '4')
    assert parse_and_validate(['--world_size', '4']).world_size == 4


# ------------------------------------------------------------------------------------------ signals
SIG_RUN = ['--model', 'NALAFORMER_XT', '--input-size', '32', '--batch-size', '4', '--device', 'cpu',
           '--num_workers', '0', '--no-flops', '--unscale-lr', '--lr', '2e-3', '--warmup-epochs', '0', '--epochs', '1',
           '--mixup', '0', '--cutmix', '0', '--no-model-ema']


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """A finished 1-epoch run whose validation set is long enough (300 images, one per batch) to signal."""
    from test_runs import make_imagefolder, run_main
    data = make_imagefolder(tmp_path_factory.mktemp('sig'), n_train=4, n_val=100)
    out = str(tmp_path_factory.mktemp('sigrun') / 'out')
    run_main(SIG_RUN + ['--data-path', data, '--output_dir', out])
    return data, out


@pytest.mark.slow
@pytest.mark.parametrize('mode, sig', [('eval', signal.SIGTERM), ('nothing-to-train', signal.SIGINT)])
def test_signal_stops_evaluation_at_the_next_batch(trained, mode, sig, tmp_path):
    from test_faults import _signal_when, _start
    from test_runs import PY
    data, out = trained
    flags = ['--batch-size', '1', '--print-freq', '1', '--data-path', data]
    if mode == 'eval':
        cmd = [PY, 'main.py'] + SIG_RUN + flags + ['--eval', '--resume', os.path.join(out, 'checkpoint.pth')]
    else:  # the same command again after the last epoch: the checkpoint is evaluated
        shutil.copytree(out, tmp_path / 'out')
        cmd = [PY, 'main.py'] + SIG_RUN + flags + ['--output_dir', str(tmp_path / 'out')]
    proc = _start(cmd)
    stdout, stderr, waited = _signal_when(proc, r'Test: \[ *2/300\]', sig)
    assert proc.returncode == 128 + sig, stdout[-2000:] + stderr[-2000:]
    assert 'Traceback' not in stderr, stderr[-3000:]
    m = re.search(rf'Evaluation stopped by {sig.name} after (\d+) of 300 images', stdout)
    assert m and int(m.group(1)) < 300, stdout[-3000:]
    assert 'Accuracy of the network' not in stdout
    assert waited < 30
