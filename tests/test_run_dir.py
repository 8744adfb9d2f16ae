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
        assert os.listdir(out) == [run_dir.LOCK_NAME]  # the lock file of a folder it did not create stays


def test_only_an_unused_folder_is_removed(tmp_path):
    out = tmp_path / 'a' / 'b'
    run_dir.make_output_dir(str(out))
    assert run_dir.lock_run_dir(str(out)) is None
    (out / 'notes.md').write_text('mine')  # something else arrived: nothing is removed
    run_dir.remove_unused_output_dir(str(out))
    assert sorted(os.listdir(out)) == sorted([run_dir.LOCK_NAME, 'notes.md'])
    run_dir.make_output_dir(str(tmp_path / 'a' / 'c'))
    (tmp_path / 'a' / 'c' / 'x').mkdir()
    run_dir.remove_unused_output_dir(str(tmp_path / 'a' / 'c'))
    assert os.path.isdir(tmp_path / 'a' / 'c' / 'x')
    run_dir.make_output_dir(str(tmp_path / 'new'))
    run_dir.remove_unused_output_dir(str(tmp_path / 'new'))  # nothing in it, not even a lock
    assert not os.path.exists(tmp_path / 'new')
