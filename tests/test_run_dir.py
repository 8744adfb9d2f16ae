"""The output directory of a run (run/output_dir.py): one run per directory unless --overwrite, and room and
write access for the checkpoints before training (and before a resume is announced)."""
import errno
import os
import re
import shutil
import tempfile

import pytest
import torch
from conftest import TrainingRun, build_xt, optimizer_of, run_dir_of, scheduler_of

import cli
import main
from run import checkpoint, errors, output_dir


# ------------------------------------------------------------------------------------------ output directory
def _args(tmp_path, *argv):
    return cli.get_args_parser().parse_args(['--output_dir', str(tmp_path), *argv])


def test_a_new_run_over_a_finished_one_needs_overwrite(tmp_path, capsys):
    for name in ('checkpoint.pth', 'best.pth', 'checkpoint_0049.pth'):
        (tmp_path / name).write_bytes(b'x')
    (tmp_path / 'log.txt').write_text('{"epoch": 0}\n')
    (tmp_path / 'notes.md').write_text('mine')
    with pytest.raises(errors.UserError) as e:
        output_dir.prepare_output_dir(run_dir_of(_args(tmp_path, '--no-auto-resume')), 'cpu')
    assert 'already holds a run (checkpoint.pth, best.pth, checkpoint_0049.pth, log.txt): relaunch without ' \
           '--no-auto-resume to continue it' in str(e.value) and '--overwrite' in str(e.value)
    output_dir.prepare_output_dir(run_dir_of(_args(tmp_path)), 'cpu')  # resuming it is fine
    output_dir.prepare_output_dir(run_dir_of(_args(tmp_path, '--eval')), 'cpu')  # so is evaluating
    run_files = lambda: sorted(f for f in os.listdir(tmp_path) if f != output_dir.LOCK_NAME)  # noqa: E731
    assert len(run_files()) == 5
    output_dir.prepare_output_dir(run_dir_of(_args(tmp_path, '--overwrite')), 'cpu')
    assert run_files() == ['notes.md']
    assert output_dir.find_resume_path(run_dir_of(_args(tmp_path, '--overwrite'))) == ''


def _read_only(monkeypatch, directory):
    """Creating a file in `directory` fails as on a read-only filesystem (root ignores chmod)."""
    real = tempfile.mkstemp

    def mkstemp(*a, dir=None, **k):
        if dir is not None and os.path.abspath(dir).startswith(os.path.abspath(directory)):
            raise OSError(errno.EROFS, 'Read-only file system')
        return real(*a, dir=dir, **k)
    monkeypatch.setattr(tempfile, 'mkstemp', mkstemp)


def test_an_unwritable_output_dir_is_found_before_anything_else(tmp_path, monkeypatch):
    _read_only(monkeypatch, tmp_path)
    with pytest.raises(errors.UserError, match=r'cannot write to --output_dir .*: Read-only file system'):
        output_dir.prepare_output_dir(run_dir_of(_args(tmp_path)), 'cpu')
    assert not os.path.exists(tmp_path / output_dir.LOCK_NAME)
    output_dir.prepare_output_dir(run_dir_of(_args(tmp_path, '--eval')), 'cpu')  # evaluation writes nothing there


def _disk(monkeypatch, free_mib):
    monkeypatch.setattr(checkpoint.shutil, 'disk_usage',
                        lambda p: shutil._ntuple_diskusage(200 << 20, (200 - free_mib) << 20, free_mib << 20))


def test_without_an_output_dir_there_is_no_room_to_check(monkeypatch):
    """A run without --output_dir (main.py's or segmentation/train.py's) saves nothing: the check passes
    without looking at any disk."""
    _disk(monkeypatch, 0)
    checkpoint.check_room('', 1 << 30, 'cpu')


def test_the_space_check_counts_the_peak_of_the_saves(tmp_path, monkeypatch):
    ckpt = 79 << 20
    # a 200 MiB disk holds two checkpoints of 79 MiB, but not the third one the saves need at their peak
    _disk(monkeypatch, 200)
    with pytest.raises(errors.UserError) as e:
        checkpoint.check_room(str(tmp_path), ckpt, 'cpu')
    assert str(e.value) == (f'--output_dir {tmp_path} has 200 MiB free, but the saves to come need 237 MiB more (at '
                            f'their peak the directory holds 3 checkpoints of about 79 MiB: checkpoint.pth, its '
                            f'replacement while it is written, best.pth): 37 MiB are missing; free that much space '
                            f'or choose another --output_dir')
    checkpoint.check_room(str(tmp_path), ckpt, 'cpu', 2)
    # the relaunch of a run whose checkpoint.pth and best.pth are there: the amount actually missing
    for name in ('checkpoint.pth', 'best.pth'):
        with open(tmp_path / name, 'wb') as f:
            f.truncate(ckpt)
    _disk(monkeypatch, 42)
    with pytest.raises(errors.UserError, match=r'has 42 MiB free, but the saves to come need 79 MiB more \(.*, 158 '
                                               r'MiB of them are there already\): 37 MiB are missing'):
        checkpoint.check_room(str(tmp_path), ckpt, 'cpu', 3)
    with pytest.raises(errors.UserError, match=r'need 158 MiB more \(.*4 checkpoints .*best\.pth, a numbered backup, '
                                               r'158 MiB of them are there already\): 116 MiB are missing'):
        checkpoint.check_room(str(tmp_path), ckpt, 'cpu', 4)
    _disk(monkeypatch, 79)
    checkpoint.check_room(str(tmp_path), ckpt, 'cpu', 3)
    # names an older version hard-linked are one file on the disk
    os.remove(tmp_path / 'best.pth')
    os.link(tmp_path / 'checkpoint.pth', tmp_path / 'best.pth')
    with pytest.raises(errors.UserError, match=r'need 158 MiB more .*, 79 MiB of them are there already'):
        checkpoint.check_room(str(tmp_path), ckpt, 'cpu', 3)

    def peak(*argv, start=0):
        args = _args(tmp_path, *argv)
        return checkpoint.checkpoints_at_peak(args.save_freq, start, args.epochs)
    # checkpoint.pth, its replacement, best.pth; and a numbered backup when a save follows a --save-freq epoch
    assert peak('--epochs', '300') == 4 and peak('--epochs', '300', start=250) == 3  # the last backup ends the run
    assert peak('--epochs', '300', '--save-freq', '0') == 3 and peak('--epochs', '40') == 3


# ------------------------------------------------------------------------------------------ a resumed run
RUN = ['--model', 'NALAFORMER_XT', '--input-size', '32', '--batch-size', '4', '--device', 'cpu', '--num_workers', '0',
       '--no-flops', '--no-model-ema', '--unscale-lr', '--epochs', '2', '--cpu-malloc', 'system']


def test_a_resume_is_announced_only_once_the_output_dir_can_take_the_run(data, tmp_path, monkeypatch, capsys):
    for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'SLURM_PROCID', 'SLURM_NTASKS', 'SLURM_LOCALID'):
        monkeypatch.delenv(k, raising=False)  # main.py as a plain process, in this one
    out = tmp_path / 'out'
    out.mkdir()
    argv = RUN + ['--data-path', data, '--output_dir', str(out)]
    args = cli.get_args_parser().parse_args(argv)
    model = build_xt(3)
    opt = optimizer_of(args, model)
    run = TrainingRun(args, model, None, opt, scheduler_of(args, opt), None, 0, 'cpu')
    run.save(0, {}, ['checkpoint.pth'])  # epoch 0 of a run that the same command resumes at epoch 1
    before = (out / 'checkpoint.pth').read_bytes()
    for problem, error in (('read-only', r'cannot write to --output_dir .*: Read-only file system'),
                           ('full', r'has 1 MiB free, but the saves to come need \d+ MiB more')):
        with monkeypatch.context() as m:
            if problem == 'read-only':
                _read_only(m, out)
            else:
                m.setattr(checkpoint.shutil, 'disk_usage', lambda p: shutil._ntuple_diskusage(1 << 30, 0, 1 << 20))
            assert main.run(argv) == 1
        said = capsys.readouterr()
        assert re.search(error, said.err) and 'Resumed from' not in said.out, said
        assert (out / 'checkpoint.pth').read_bytes() == before
    assert main.run(argv + ['--epochs', '1']) == 0  # nothing left to train: announced, then evaluated
    said = capsys.readouterr().out
    assert said.index(f'Resumed from {out / "checkpoint.pth"}: continuing at epoch 1') < said.index('Nothing to train')


def test_a_resume_with_nothing_to_train_into_a_new_output_dir_leaves_nothing_there(data, tmp_path, monkeypatch,
                                                                                   capsys):
    """The checkpoint of a finished run resumed into a new --output_dir: it is evaluated, nothing is written, and
    the folder the run created for its files goes again (lock file and all), as after a failed start."""
    for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'SLURM_PROCID', 'SLURM_NTASKS', 'SLURM_LOCALID'):
        monkeypatch.delenv(k, raising=False)
    done = tmp_path / 'done'
    done.mkdir()
    args = cli.get_args_parser().parse_args(RUN + ['--data-path', data, '--output_dir', str(done)])
    model = build_xt(3)
    opt = optimizer_of(args, model)
    TrainingRun(args, model, None, opt, scheduler_of(args, opt), None, 0, 'cpu').save(1, {}, ['checkpoint.pth'])
    new = tmp_path / 'runs' / 'new'
    assert main.run(RUN + ['--data-path', data, '--resume', str(done / 'checkpoint.pth'),
                           '--output_dir', str(new)]) == 0
    assert not os.path.exists(tmp_path / 'runs')
    said = capsys.readouterr().out
    assert 'Nothing to train' in said and 'Accuracy of the network' in said
    assert 'into another --output_dir' not in said  # no files go there


def test_a_start_epoch_past_the_last_epoch_without_a_checkpoint_is_refused(data, tmp_path, monkeypatch, capsys):
    """Nothing to train and no checkpoint to evaluate: one line, exit 2, no output directory; not an evaluation of
    the untrained weights announced as a checkpoint's."""
    for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'SLURM_PROCID', 'SLURM_NTASKS', 'SLURM_LOCALID'):
        monkeypatch.delenv(k, raising=False)
    out = tmp_path / 'out'
    assert main.run(RUN + ['--data-path', data, '--output_dir', str(out), '--start_epoch', '5', '--epochs', '1']) == 2
    said = capsys.readouterr()
    assert said.err.splitlines() == ['error: --start_epoch 5 is not below --epochs 1 and there is no checkpoint to '
                                     'resume: nothing to train; lower --start_epoch (the first epoch of a run that '
                                     'starts without a checkpoint) or raise --epochs, or evaluate weights with --eval '
                                     '--resume FILE']
    assert 'Accuracy' not in said.out and 'already finished' not in said.out
    assert not os.path.exists(out)
    weights = tmp_path / 'weights.pth'  # weights only: the run would start at --start_epoch as well
    torch.save(build_xt(3).state_dict(), weights)
    assert main.run(RUN + ['--data-path', data, '--output_dir', str(out), '--start_epoch', '5', '--epochs', '1',
                           '--resume', str(weights)]) == 2
    said = capsys.readouterr()
    assert said.err.splitlines()[-1].startswith(f'error: --start_epoch 5 is not below --epochs 1 and {weights} holds '
                                                f'weights only (no optimizer state or epoch): nothing to train')
    assert 'Accuracy' not in said.out and 'already finished' not in said.out
    assert not os.path.exists(out)


# ------------------------------------------------------------------------------------------ a failed start
@pytest.mark.parametrize('existed', [False, True])
def test_a_failed_start_leaves_no_output_dir_it_created(tmp_path, existed, capsys, monkeypatch):
    """README's ImageNet command without ImageNet: the run stops at the data, after locking --output_dir. A folder
    it created (and the parents it created) goes again, lock and all; one that existed stays."""
    for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'SLURM_PROCID', 'SLURM_NTASKS'):
        monkeypatch.delenv(k, raising=False)
    out = tmp_path / 'output' / 't'
    if existed:
        out.mkdir(parents=True)
    code = main.run(['--model', 'NALAFORMER_XT', '--device', 'cpu', '--data-path', str(tmp_path / 'imagenet'),
                     '--output_dir', str(out)])
    assert code == 1 and 'data path does not exist' in capsys.readouterr().err
    assert os.listdir(tmp_path) == (['output'] if existed else [])
    if existed:
        assert os.listdir(out) == [output_dir.LOCK_NAME]  # the lock file of a folder it did not create stays


def test_only_an_unused_folder_is_removed(tmp_path):
    out = tmp_path / 'a' / 'b'
    output_dir.make_output_dir(str(out))
    assert output_dir.lock_run_dir(str(out)) is None
    (out / 'notes.md').write_text('mine')  # something else arrived: nothing is removed
    output_dir.remove_unused_output_dir(str(out))
    assert sorted(os.listdir(out)) == sorted([output_dir.LOCK_NAME, 'notes.md'])
    output_dir.make_output_dir(str(tmp_path / 'a' / 'c'))
    (tmp_path / 'a' / 'c' / 'x').mkdir()
    output_dir.remove_unused_output_dir(str(tmp_path / 'a' / 'c'))
    assert os.path.isdir(tmp_path / 'a' / 'c' / 'x')
    output_dir.make_output_dir(str(tmp_path / 'new'))
    output_dir.remove_unused_output_dir(str(tmp_path / 'new'))  # nothing in it, not even a lock
    assert not os.path.exists(tmp_path / 'new')
