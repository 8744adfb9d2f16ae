"""A run whose world changes between its start and its resume, in-process: a second job in the same
--output_dir, other classes or another data path, another number of processes or batch in the middle of an
epoch, a killed data-loader worker named; and the notes a resumed run prints about what changed. The same
cases in real processes (torchrun, kills): tests/integration/test_relaunch.py."""
import errno
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import warnings

import pytest
import torch
from conftest import (
    PY,
    REPO,
    TrainingRun,
    env,
    load,
    parse,
    run_dir_of,
    scheduler_of,
)
from PIL import Image

from run import checkpoint, errors, output_dir, process, resume
from training import image_folder, optim

# ------------------------------------------------------------------------------ one job per output dir
LOCK_HOLDER = ('import sys\n'
               'from run import output_dir\n'
               'assert output_dir.lock_run_dir(sys.argv[1]) is None\n'
               'print("held", flush=True)\n'
               'sys.stdin.read()\n')


def _no_locks(fd, op):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))


def test_a_held_output_dir_is_refused_naming_the_holder_also_under_no_lock(tmp_path, monkeypatch):
    """--no-lock takes no lock, but a job holding one (its lock seen held, or its recorded process alive on this
    host where locks do not work) is refused with the same line."""
    holder = subprocess.Popen([PY, '-c', LOCK_HOLDER, str(tmp_path)], cwd=REPO, env=env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    no_lock = parse('--output_dir', str(tmp_path), '--no-lock')
    try:
        assert holder.stdout.readline().strip() == 'held'
        err = output_dir.lock_run_dir(str(tmp_path))
        line = f'--output_dir {tmp_path} is in use by another run (PID {holder.pid} on host '
        assert err and line in err
        # the holder's checkpoint being written: a refused job must not clean it away
        saving = tmp_path / (checkpoint.TMP_PREFIX + 'checkpoint.pth.x1')
        saving.write_bytes(b'half a checkpoint')
        with pytest.raises(errors.UserError, match='is in use by another run'):
            output_dir.prepare_output_dir(run_dir_of(parse('--output_dir', str(tmp_path))), 'cpu')
        with pytest.raises(errors.UserError, match=re.escape(line)):
            output_dir.prepare_output_dir(run_dir_of(no_lock), 'cpu')
        with monkeypatch.context() as m:  # a filesystem whose locks fail: the recorded process still runs
            m.setattr(output_dir.fcntl, 'lockf', _no_locks)
            with pytest.raises(errors.UserError, match=re.escape(line)):
                output_dir.prepare_output_dir(run_dir_of(no_lock), 'cpu')
        assert saving.exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    output_dir.prepare_output_dir(run_dir_of(no_lock), 'cpu')  # its process ended, so did its lock
    assert str(tmp_path) not in output_dir._held_locks  # --no-lock took none
    # nothing stale is left behind
    assert output_dir.lock_run_dir(str(tmp_path)) is None


def test_no_lock_ignores_a_recorded_process_number_that_a_later_process_reuses(tmp_path):
    lock = tmp_path / output_dir.LOCK_NAME
    no_lock = parse('--output_dir', str(tmp_path), '--no-lock')
    other = subprocess.Popen(['sleep', '30'])
    try:
        lock.write_text(f'PID {other.pid} on host {socket.gethostname()}\n')
        os.utime(lock, (time.time() - 60, time.time() - 60))  # written before that process started
        output_dir.prepare_output_dir(run_dir_of(no_lock), 'cpu')
        os.utime(lock)  # written after it started: the process that wrote it
        with pytest.raises(errors.UserError, match=f'is in use by another run \\(PID {other.pid} on host'):
            output_dir.prepare_output_dir(run_dir_of(no_lock), 'cpu')
    finally:
        other.kill()
        other.wait()


def test_a_filesystem_without_locks_is_named_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(output_dir.fcntl, 'lockf', _no_locks)
    assert output_dir.lock_run_dir(str(tmp_path)) is None
    out = capsys.readouterr().out
    assert 'does not support file locks' in out and 'running without a lock' in out


def test_no_lock_leaves_the_output_dir_unlocked(tmp_path):
    output_dir.prepare_output_dir(run_dir_of(parse('--output_dir', str(tmp_path / 'a'), '--no-lock')), 'cpu')
    assert not os.path.exists(tmp_path / 'a' / output_dir.LOCK_NAME)
    output_dir.prepare_output_dir(run_dir_of(parse('--output_dir', str(tmp_path / 'b'))), 'cpu')
    assert os.path.exists(tmp_path / 'b' / output_dir.LOCK_NAME)


# ------------------------------------------------------------------------------ classes of a resumed run
def _tiny_run(tmp_path, argv=(), classes=None, n_train_images=None):
    """A TrainingRun for a tiny model, with the optimizer and schedule main.py builds from `argv`."""
    from timm.optim import create_optimizer_v2
    args = parse('--output_dir', str(tmp_path), '--epochs', '4', '--no-model-ema', *argv)
    model = torch.nn.Linear(4, 3)
    opt = create_optimizer_v2(model, opt=args.opt, lr=args.lr, weight_decay=args.weight_decay)
    return TrainingRun(args, model, None, opt, scheduler_of(args, opt), None, 15, 'cpu',
                                          classes=classes, n_train_images=n_train_images)


def test_other_classes_stop_a_resume_naming_the_first_difference(tmp_path, capsys):
    _tiny_run(tmp_path, classes=['a', 'b', 'c'], n_train_images=24).save(0, {}, ['checkpoint.pth'])
    path = str(tmp_path / 'checkpoint.pth')
    assert load(path)['classes'] == ['a', 'b', 'c'] and load(path)['n_train_images'] == 24
    with pytest.raises(errors.CheckpointError, match=r"class 0 is 'a' in the checkpoint but 'd' in the data.*"
                                                         r"--finetune"):
        _tiny_run(tmp_path, classes=['d', 'b', 'c']).resume(path)
    with pytest.raises(errors.CheckpointError, match=r"3 classes, the data 4 \(class 3 'e' only in the data\)"):
        _tiny_run(tmp_path, classes=['a', 'b', 'c', 'e']).resume(path)
    _tiny_run(tmp_path, classes=['a', 'b', 'c'], n_train_images=30).resume(path)
    assert 'the training set has 30 images, 24 when the checkpoint was written' in capsys.readouterr().out


def test_a_checkpoint_without_classes_still_resumes(tmp_path):
    _tiny_run(tmp_path).save(1, {}, ['checkpoint.pth'])  # as written before classes were recorded
    assert 'classes' not in load(tmp_path / 'checkpoint.pth')
    assert _tiny_run(tmp_path, classes=['a', 'b', 'c']).resume(str(tmp_path / 'checkpoint.pth')).start_epoch == 2


def test_a_changed_data_path_is_a_note_naming_both_paths(tmp_path, monkeypatch, capsys):
    old, new = tmp_path / 'imagenet', tmp_path / 'imagenet-copy'
    old.mkdir()
    new.mkdir()
    run = _tiny_run(tmp_path, ['--data-path', str(old)], classes=['a', 'b'], n_train_images=24)
    run.record_accuracy(0, 12.5)
    run.save(0, {}, ['checkpoint.pth'])
    path = str(tmp_path / 'checkpoint.pth')
    capsys.readouterr()
    _tiny_run(tmp_path, ['--data-path', str(new)], classes=['a', 'b'], n_train_images=24).resume(path)
    assert f'Note: --data-path changed since the checkpoint: {old} -> {new}; continuing on the images there (the ' \
           f'best accuracy so far, 12.50%, was measured on the validation set of {old})' in capsys.readouterr().out
    # the same directory spelt otherwise (relative, a trailing slash, a link) is no change
    monkeypatch.chdir(tmp_path)
    os.symlink(old, tmp_path / 'link')
    for same in ('imagenet', './imagenet/', str(tmp_path / 'link')):
        _tiny_run(tmp_path, ['--data-path', same], classes=['a', 'b'], n_train_images=24).resume(path)
        assert '--data-path changed' not in capsys.readouterr().out, same


# ------------------------------------------------------------------------------ mid-epoch resume, other world
def _mid_epoch_checkpoint(tmp_path, argv, writers=1):
    """A checkpoint of a stop at step 2 of epoch 1, written by `writers` processes (their entries faked)."""
    run = _tiny_run(tmp_path, argv, n_train_images=24)
    state = resume.EpochState(step=2, rng_state=resume.get_rng_state(),
                                   epoch_rng_state=resume.get_rng_state(), loss_meter={'total': 1.0, 'count': 2})
    entries = resume.epoch_state_entries(state)
    for key in ('rng_state', 'epoch_rng_state'):
        entries[key] = entries[key] * writers
    entries['loss_meter'] = [{'total': 1.0 + rank, 'count': 2} for rank in range(writers)]
    run.save(1, entries, ['checkpoint.pth'])
    return str(tmp_path / 'checkpoint.pth')


def test_a_mid_epoch_checkpoint_under_another_split_continues_where_its_images_stopped(tmp_path, capsys):
    """2 steps of 4 images (batches of 4, one process) took the first 8 images of the epoch's order:
    another --batch-size or --accum-steps continues after them when 8 images end one of its optimizer steps; the
    epoch restarts when they do not, or when the order itself changed."""
    path = _mid_epoch_checkpoint(tmp_path, ['--batch-size', '4', '--accum-steps', '2'])
    same = _tiny_run(tmp_path, ['--batch-size', '4', '--accum-steps', '2'], n_train_images=24).resume(path)
    assert (same.start_epoch, same.state.step, same.state.loss_meter) == (1, 2, {'total': 1.0, 'count': 2})
    assert 'Note: the checkpoint stopped' not in capsys.readouterr().out
    # the loss meter's 2 batch losses of 4 images count as 4 of 2 images, or 1 of 8: the average weighs images alike
    for argv, step, meter in ((['--batch-size', '2', '--accum-steps', '2'], 4, {'total': 2.0, 'count': 4}),
                              (['--batch-size', '4', '--accum-steps', '1'], 2, {'total': 1.0, 'count': 2}),
                              (['--batch-size', '8', '--accum-steps', '1'], 1, {'total': 0.5, 'count': 1})):
        r = _tiny_run(tmp_path, argv, n_train_images=24).resume(path)
        assert (r.start_epoch, r.state.step, r.state.loss_meter) == (1, step, meter), argv
        assert r.state.rng_state is not None  # the same processes: their random streams continue
        out = capsys.readouterr().out
        assert f'the epoch continues at step {step} of this run, with the images of its order that the stop had ' \
               f'not reached' in out, out
    for argv, n, what in ((['--batch-size', '2', '--accum-steps', '3'], 24, '--accum-steps changed (2 -> 3)'),
                          (['--batch-size', '16', '--accum-steps', '1'], 24, '--batch-size changed (4 -> 16)'),
                          (['--batch-size', '4', '--accum-steps', '2'], 27, 'the training set changed (24 -> 27'),
                          (['--batch-size', '4', '--accum-steps', '2', '--seed', '1'], 24, '--seed changed (0 -> 1)')):
        capsys.readouterr()
        r = _tiny_run(tmp_path, argv, n_train_images=n).resume(path)
        assert (r.start_epoch, r.state.step, r.state.loss_meter) == (1, 0, None)
        assert r.state.epoch_rng_state is not None  # the epoch restarts from the random state it started with
        out = capsys.readouterr().out
        assert what in out and 'epoch 1 restarts from its first step' in out, out


def test_a_mid_epoch_checkpoint_of_two_processes_continues_on_one(tmp_path, capsys):
    """Written by 2 processes of 2 images: the stop at step 2 had taken 8 images. One process of 4 continues at
    its step 2, its loss meter that of both processes; the random streams of 2 processes cannot be restored."""
    path = _mid_epoch_checkpoint(tmp_path, ['--batch-size', '2'], writers=2)
    r = _tiny_run(tmp_path, ['--batch-size', '4'], n_train_images=24).resume(path)
    # both meters summed (total 1 + 2 over 4 batches of 2), counted in batches of 4
    assert (r.start_epoch, r.state.step, r.state.loss_meter) == (1, 2, {'total': 1.5, 'count': 2})
    assert r.state.rng_state is None and r.state.epoch_rng_state is None
    out = capsys.readouterr().out
    assert ('Note: the checkpoint stopped inside epoch 1 at step 2, and the number of processes changed (2 -> 1), '
            '--batch-size changed (2 -> 4) since then: the epoch continues at step 2 of this run, with the images '
            'of its order that the stop had not reached; the checkpoint was written by 2 process(es), this run has '
            '1: random-number state not restored') in out, out
    assert resume._loss_meter([{'total': 1.0, 'count': 2}, {'total': 2.0, 'count': 2}], 2, 1) == \
        {'total': 2.0, 'count': 2}  # as many processes: each its own
    assert resume._loss_meter([{'total': 1.0, 'count': 2}] * 2, 1, 0) == {'total': 2.0, 'count': 4}
    assert resume._loss_meter([{'total': 1.0, 'count': 2}] * 2, 4, 3) == {'total': 0.0, 'count': 0}


# ------------------------------------------------------------------------------ torchrun --max-restarts


# ------------------------------------------------------------------------------ a killed data-loader worker


def test_dead_loader_worker_messages_of_torch_are_recognised():
    assert process._dead_loader_worker(RuntimeError('DataLoader worker (pid 812) is killed by signal: Killed. ')) \
        == 'a data-loader worker (pid 812) was killed by signal Killed'
    wrapped = RuntimeError('DataLoader worker (pid(s) 812, 813) exited unexpectedly')
    try:
        raise ValueError('while loading') from wrapped
    except ValueError as e:
        assert process._dead_loader_worker(e) == 'a data-loader worker (pid 812, 813) exited unexpectedly'
    assert process._dead_loader_worker(RuntimeError('something else')) == ''


def test_a_dead_worker_that_first_shows_as_a_reset_connection_is_still_named(monkeypatch):
    """A worker killed while its batch is received ends the run with a ConnectionResetError, and the
    DataLoader's SIGCHLD handler would raise its own error in the middle of the report: the report asks
    torch's worker check itself, with that handler switched off."""
    import torch.utils.data._utils.signal_handling as handling

    def dead():
        raise RuntimeError('DataLoader worker (pid 812) is killed by signal: Killed. ')

    monkeypatch.setattr(handling, '_error_if_any_worker_fails', dead)
    previous = signal.signal(signal.SIGCHLD, lambda *a: dead())
    try:
        assert process._dead_loader_worker_after(ConnectionResetError(104, 'Connection reset by peer')) \
            == 'a data-loader worker (pid 812) was killed by signal Killed'
        assert signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGCHLD, previous)
    monkeypatch.setattr(handling, '_error_if_any_worker_fails', lambda: None)
    assert process._dead_loader_worker_after(ValueError('a bug')) == ''


def test_a_worker_whose_death_shows_after_its_connection_broke_is_still_named(monkeypatch):
    """A killed worker closes its connection before the kernel records its exit: the check finds no dead
    worker at first, and the report asks again until it does (a wait only after a broken connection)."""
    import torch.utils.data._utils.signal_handling as handling
    calls = []

    def dead_on_third_call():
        calls.append(1)
        if len(calls) >= 3:
            raise RuntimeError('DataLoader worker (pid 812) is killed by signal: Killed. ')

    monkeypatch.setattr(handling, '_error_if_any_worker_fails', dead_on_third_call)
    previous = signal.getsignal(signal.SIGCHLD)
    try:
        assert process._dead_loader_worker_after(ConnectionResetError(104, 'Connection reset by peer')) \
            == 'a data-loader worker (pid 812) was killed by signal Killed'
        calls.clear()
        assert process._dead_loader_worker_after(ValueError('a bug')) == ''
        assert len(calls) == 1  # no broken connection: asked once, no wait
    finally:
        signal.signal(signal.SIGCHLD, previous)


# ------------------------------------------------------------------------------ notes in flag terms
def test_resume_notes_name_the_flags_and_what_they_change():
    saved = checkpoint.args_to_dict(parse('--batch-size', '4', '--accum-steps', '2', '--epochs', '2'))
    saved.update(world_size=2, lr=5e-4 * 16 / 512)
    now = parse('--batch-size', '4', '--accum-steps', '1', '--epochs', '3')
    now.world_size, now.lr = 2, 5e-4 * 8 / 512
    decay = 0.99996
    lines = optim.flag_changes(saved, vars(now))
    assert lines[0] == (f'--accum-steps 2 -> 1: global batch 16 -> 8, '
                        f'LR {5e-4 * 16 / 512:.4g} -> {5e-4 * 8 / 512:.4g}, '
                        f'EMA decay {decay ** (16 / 512):.8g} -> {decay ** (8 / 512):.8g}')
    assert lines[1:] == ['--epochs 2 -> 3']
    assert optim.flag_changes(saved, vars(parse())) != [] and optim.flag_changes({}, vars(now)) == []


# ------------------------------------------------------------------------------ file names in messages
def test_pil_large_image_warning_names_the_file(tmp_path, monkeypatch):
    path = str(tmp_path / 'big.png')
    Image.new('RGB', (40, 40)).save(path)
    monkeypatch.setattr(Image, 'MAX_IMAGE_PIXELS', 1000)  # 1600 pixels: over the limit, under twice it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        assert image_folder.load_image(path).size == (40, 40)
    bombs = [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]
    assert len(bombs) == 1 and str(bombs[0].message).startswith(path + ': '), [str(w.message) for w in caught]


def test_a_deleted_output_dir_is_reported_as_gone(tmp_path):
    out = tmp_path / 'out'
    out.mkdir()
    checkpoint.save_atomic({'epoch': 0}, str(out / 'checkpoint.pth'))
    shutil.rmtree(out)  # the whole run directory deleted while the run goes on
    with pytest.raises(errors.CheckpointWriteError) as e:
        checkpoint.save_atomic({'epoch': 1}, str(out / 'checkpoint.pth'))
    assert f'the output directory {out} is gone' in str(e.value) and 'is kept' not in str(e.value)
