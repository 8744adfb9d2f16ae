"""The output directory of a run (run_dir.py): one run per directory unless --overwrite, and room and
write access for the checkpoints before training."""
import errno
import os
import shutil

import pytest

import errors
import main
import run_dir


# ------------------------------------------------------------------------------------------ output directory
def _args(tmp_path, *argv):
    return main.get_args_parser().parse_args(['--output_dir', str(tmp_path), *argv])


def test_a_new_run_over_a_finished_one_needs_overwrite(tmp_path, capsys):
    for name in ('checkpoint.pth', 'best.pth', 'checkpoint_0049.pth'):
        (tmp_path / name).write_bytes(b'x')
    (tmp_path / 'log.txt').write_text('{"epoch": 0}\n')
    (tmp_path / 'notes.md').write_text('mine')
    with pytest.raises(errors.UserError) as e:
        run_dir.prepare_output_dir(_args(tmp_path, '--no-auto-resume'), 'cpu')
    assert 'already holds a run (checkpoint.pth, best.pth, checkpoint_0049.pth, log.txt): relaunch without ' \
           '--no-auto-resume to continue it' in str(e.value) and '--overwrite' in str(e.value)
    run_dir.prepare_output_dir(_args(tmp_path), 'cpu')  # resuming it is fine
    run_dir.prepare_output_dir(_args(tmp_path, '--eval'), 'cpu')  # so is evaluating
    run_files = lambda: sorted(f for f in os.listdir(tmp_path) if f != run_dir.LOCK_NAME)  # noqa: E731
    assert len(run_files()) == 5
    run_dir.prepare_output_dir(_args(tmp_path, '--overwrite'), 'cpu')
    assert run_files() == ['notes.md']
    assert run_dir.find_resume_path(_args(tmp_path, '--overwrite')) == ''


def test_an_unwritable_or_full_output_dir_is_found_before_training(tmp_path, monkeypatch):
    def read_only(*a, **k):
        raise OSError(errno.EROFS, 'Read-only file system')
    with monkeypatch.context() as m:
        m.setattr(run_dir.tempfile, 'mkstemp', read_only)
        with pytest.raises(errors.UserError, match=r'cannot write to --output_dir .*: Read-only file system'):
            run_dir.check_room(str(tmp_path), 100, 'cpu')
    monkeypatch.setattr(run_dir.shutil, 'disk_usage', lambda p: shutil._ntuple_diskusage(10 << 30, 0, 150 << 20))
    run_dir.check_room(str(tmp_path), 70 << 20, 'cpu')
    with pytest.raises(errors.UserError, match=r'has 150 MiB free, but a checkpoint takes about 80 MiB'):
        run_dir.check_room(str(tmp_path), 80 << 20, 'cpu')
