"""What main.py says when a run starts, in process: a short start-up (the whole command line only with
--print-args and in --output_dir/args.json), a checkpoint of another --model refused before anything is built,
the notes on an LR below --min-lr and on a resume into another --output_dir, and top-k named by its k
(Acc@3 with 3 classes) on the console, in log.txt and in TensorBoard."""
import contextlib
import importlib.util
import json
import os

import pytest
import timm
import torch
from conftest import parse

import cli
import datasets
import main
from run.errors import UserError
from training import optim

FLAGS = ['--model', 'NALAFORMER_XT', '--input-size', '32', '--batch-size', '4', '--device', 'cpu', '--num_workers',
         '0', '--no-flops', '--print-freq', '100']


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'SLURM_PROCID', 'SLURM_NTASKS'):
        monkeypatch.delenv(k, raising=False)


def test_the_start_up_is_a_few_lines_and_the_arguments_print_on_request(tmp_path, capsys):
    """A wrong --data-path ends right under a few lines saying what runs, not under the whole command line."""
    argv = ['--model', 'NALAFORMER_XT', '--data-set', 'IMNET', '--data-path', str(tmp_path / 'none'),
            '--output_dir', str(tmp_path / 'x'), '--device', 'cpu', '--num_workers', '0']
    assert main.run(argv) == 1
    out, err = capsys.readouterr()
    assert len(out.splitlines()) <= 3 and '{' not in out, out
    assert (f"Run: training NALAFORMER_XT on IMNET at {tmp_path / 'none'} into {tmp_path / 'x'} (every argument: "
            f"{tmp_path / 'x' / 'args.json'})") in out.splitlines()
    assert err.startswith(f"error: {tmp_path / 'none'}: data path does not exist")
    assert main.run(argv + ['--print-args']) == 1
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{')]
    assert len(printed) == 1 and printed[0]['data_path'] == str(tmp_path / 'none') and printed[0]['print_args']


def _checkpoint(tmp_path, **args):
    path = tmp_path / 'ck.pth'
    torch.save({'model': timm.create_model('NALAFORMER_XT', num_classes=3).state_dict(), 'args': args}, path)
    return str(path)


def test_a_checkpoint_of_another_model_is_refused_before_anything_is_built(tmp_path, capsys, monkeypatch):
    ck = _checkpoint(tmp_path, model='NALAFORMER_XT')

    def never(*a, **kw):  # a UserError: main.run ends with its line instead of leaving the process
        raise UserError('built before the check')
    monkeypatch.setattr(main, 'build_model', never)
    monkeypatch.setattr(datasets, 'build_dataset', never)
    assert main.run(FLAGS[2:] + ['--model', 'NALAFORMER_T', '--eval', '--resume', ck, '--data-path', 'd']) == 1
    assert capsys.readouterr().err.splitlines() == [
        f'error: {ck} is a checkpoint of --model NALAFORMER_XT, but this run has --model NALAFORMER_T: pass --model '
        f'NALAFORMER_XT, or another checkpoint']


@pytest.mark.parametrize('recorded', [{'model': 'nalaformer_xt'}, {}])  # an alias of the same model; none recorded
def test_the_recorded_model_check_lets_the_same_model_through(tmp_path, recorded):
    cli.check_recorded_model(parse('--model', 'NALAFORMER_XT'), 'ck.pth', recorded)


@pytest.mark.parametrize('argv, note', [
    (['--batch-size', '8'], 'Note: the LR 7.81e-06 (--lr 0.0005 x global batch 8 / 512) is below --min-lr 1e-05, so '
                            'the cosine schedule rises to --min-lr instead of decaying to it: use a larger batch, '
                            '--unscale-lr (the --lr as given), or a lower --min-lr'),
    (['--unscale-lr', '--lr', '5e-6'], 'Note: --lr 5e-06 is below --min-lr 1e-05, so the cosine schedule rises to '
                                       '--min-lr instead of decaying to it: raise --lr or lower --min-lr'),
    (['--batch-size', '8', '--min-lr', '1e-6'], ''),
    (['--batch-size', '8', '--sched', 'step'], ''),  # a step schedule has no floor
    (['--batch-size', '1024'], ''),
])
def test_an_lr_below_min_lr_is_noted_with_both_values_and_the_fixes(argv, note):
    args = parse(*argv)
    global_batch = args.batch_size
    lr = optim.scaled_lr(args.lr, global_batch, args.unscale_lr)
    assert optim.lr_floor_note(lr, cli.settings(optim.Schedule, args), global_batch, args.unscale_lr) == note


@pytest.mark.parametrize('epochs, warmup, last', [(3, 5, 0.4 * 5e-4 + 0.6 * 1e-6), (1, 5, 1e-6), (5, 5, None)])
def test_a_warmup_as_long_as_the_run_is_noted_with_the_lr_it_reaches(epochs, warmup, last):
    args = parse('--epochs', str(epochs), '--warmup-epochs', str(warmup), '--unscale-lr')
    note = optim.warmup_note(args.lr, cli.settings(optim.Schedule, args))
    fix = f'{epochs - 1} or fewer' if epochs > 1 else '0'
    reached = f'{last:.3g}' if last is not None else f'{(1e-6 + 4 * (5e-4 - 1e-6) / 5):.3g}'
    assert note == (f'Note: --warmup-epochs {warmup} is not below --epochs {epochs}: the LR rises from --warmup-lr '
                    f'1e-06 for the whole run, to {reached} in the last epoch, and never reaches the LR 0.0005 nor '
                    f'decays: use --warmup-epochs {fix}')
    assert optim.warmup_note(args.lr, cli.settings(optim.Schedule, parse('--epochs', str(warmup + 1)))) == ''


def test_evaluating_a_finetune_file_names_it(tmp_path):
    ck = _checkpoint(tmp_path, model='NALAFORMER_XT')
    line, _ = main.start_lines(parse('--eval', '--finetune', ck, '--data-set', 'DIGITS'), '')
    assert line == f'Run: evaluating {ck} as NALAFORMER_T on DIGITS (--print-args prints every argument)'


@pytest.fixture(scope='module')
def first_run(data, tmp_path_factory):
    """One epoch at batch 4 into OUT1 (stdout, OUT1, the TensorBoard folder or None without TensorBoard)."""
    tmp = tmp_path_factory.mktemp('first')
    tb = str(tmp / 'tb') if importlib.util.find_spec('tensorboard') else None
    argv = FLAGS + ['--epochs', '1', '--data-path', data, '--output_dir', str(tmp / 'out1')]
    with pytest.MonkeyPatch.context() as mp, open(tmp / 'stdout', 'w') as f, contextlib.redirect_stdout(f):
        for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'SLURM_PROCID', 'SLURM_NTASKS'):
            mp.delenv(k, raising=False)
        code = main.run(argv + (['--log-dir', tb] if tb else []))
    assert code == 0, (tmp / 'stdout').read_text()[-3000:]
    return (tmp / 'stdout').read_text(), tmp / 'out1', tb


def test_a_run_notes_its_lr_below_min_lr_and_names_top_k_by_its_k(first_run):
    out, out1, tb = first_run
    assert 'Note: the LR 3.91e-06 (--lr 0.0005 x global batch 4 / 512) is below --min-lr 1e-05' in out
    assert 'Note: --warmup-epochs 5 is not below --epochs 1: the LR rises from --warmup-lr 1e-06' in out
    stars = [line for line in out.splitlines() if line.startswith('* Acc@1')]
    assert len(stars) == 2 and all(' Acc@3 ' in line and 'Acc@5' not in line for line in stars), stars
    (log,) = [json.loads(line) for line in open(out1 / 'log.txt')]
    assert {'test_acc3', 'test_ema_acc3'} <= set(log) and not any(k.endswith('acc5') for k in log)
    assert json.load(open(out1 / 'args.json'))['output_dir'] == str(out1)
    if tb:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        acc = EventAccumulator(tb)
        acc.Reload()
        tags = acc.Tags()['scalars']
        assert 'epoch/test_acc3' in tags and not any(t.endswith('acc5') for t in tags)


class _Started(Exception):
    """Raised instead of training the first epoch: everything before it has run."""


def test_resuming_into_another_output_dir_names_both_and_gets_the_run_files(first_run, data, tmp_path, capsys,
                                                                             monkeypatch):
    _, out1, _ = first_run
    out2 = tmp_path / 'out2'

    def started(*a, **kw):
        raise _Started
    monkeypatch.setattr(main.engine, 'train_one_epoch', started)
    argv = FLAGS + ['--epochs', '2', '--data-path', data, '--resume', str(out1 / 'checkpoint.pth'),
                    '--output_dir', str(out2)]
    with pytest.raises(_Started):
        main.main(cli.get_args_parser().parse_args(argv), cli.get_args_parser())
    lines = capsys.readouterr().out.splitlines()
    assert (f"Note: resuming {out1 / 'checkpoint.pth'} into another --output_dir: {out2} gets the checkpoints and "
            f'log.txt from here on; {out1} keeps those so far') in lines
    assert json.load(open(out2 / 'args.json'))['resume'] == str(out1 / 'checkpoint.pth')
    with pytest.raises(_Started):  # the run's own directory: no note
        main.main(cli.get_args_parser().parse_args(argv[:-1] + [str(out1)]), cli.get_args_parser())
    assert 'another --output_dir' not in capsys.readouterr().out
    assert os.path.isfile(out1 / 'args.json')
