"""The file layer of the checkpoints (run/checkpoint.py): checksums that find damage, atomic writes that keep the
previous file on a full disk or Ctrl-C, the mode of a normal write, copies that are reflinks where the
filesystem has them, temporary files of killed writes removed."""
import errno
import fractions
import io
import os
import shutil

import pytest
import torch
from conftest import parse
from test_checkpoint import _run, _Tiny, _write_state

from run import checkpoint, errors, resume


def test_corruption_inside_a_checkpoint_is_detected(tmp_path):
    path = _write_state(tmp_path, big=torch.randn(64, 1024))  # 256 KiB of tensor data in the middle
    assert checkpoint.load_checkpoint_file(str(path))['epoch'] == 0
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 4096] = b'\x7f' * 4096  # float32 0x7f7f7f7f = 3.4e38
    path.write_bytes(bytes(data))
    with pytest.raises(errors.CheckpointError) as e:
        checkpoint.load_checkpoint_file(str(path))
    msg = str(e.value)
    assert 'checkpoint.pth is corrupt: the checksum of big does not match' in msg and '\n' not in msg
    assert torch.load(path, weights_only=True)['big'].max() > 1e30  # what an unchecked load would use


def test_checkpoints_without_checksum_still_load(tmp_path):
    sd = _Tiny().state_dict()
    torch.save({'model': sd, 'epoch': 2}, tmp_path / 'old.pth')
    assert checkpoint.load_checkpoint_file(str(tmp_path / 'old.pth'))['epoch'] == 2


def test_truncated_checkpoint_names_the_files_to_resume_from(tmp_path):
    path = _write_state(tmp_path)
    for name in ('best.pth', 'checkpoint_0004.pth', 'checkpoint_0009.pth'):
        shutil.copy(path, tmp_path / name)
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(errors.CheckpointError) as e:
        checkpoint.load_checkpoint_file(str(path))
    msg = str(e.value)
    assert 'is truncated or corrupt (5000 bytes)' in msg
    best, newest, older = (os.path.join(str(tmp_path), n)
                           for n in ('best.pth', 'checkpoint_0009.pth', 'checkpoint_0004.pth'))
    assert f'--resume {best}, --resume {newest}, --resume {older}' in msg
    assert '--no-auto-resume --overwrite' in msg


def test_a_text_file_or_a_damaged_pickle_header_names_the_files_to_resume_from(tmp_path):
    """Neither is a checkpoint the run can use: the line says what the file is and, as for a truncated one, which
    other checkpoints of the run to resume from."""
    path = _write_state(tmp_path)
    shutil.copy(path, tmp_path / 'best.pth')
    good = path.read_bytes()
    start = good.index(b'data.pkl') + len('data.pkl')  # the pickle follows its zip entry's local header
    start = good.index(b'\x80\x02', start)  # its PROTO opcode
    damaged = bytearray(good)
    damaged[start:start + 8] = b'\xff' * 8
    hint = f'resume from another checkpoint of the run (--resume {tmp_path / "best.pth"})'
    for content, what in ((b'step 1200 loss 3.2\nstep 1300 loss 3.1\n', "a text file beginning 'step 1200 loss 3.2'"),
                          (bytes(damaged), 'is corrupt: its pickled contents are damaged (Unsupported operand 255')):
        path.write_bytes(content)
        with pytest.raises(errors.CheckpointError) as e:
            checkpoint.load_checkpoint_file(str(path))
        msg = str(e.value)
        assert what in msg and hint in msg and '\n' not in msg, msg
        assert 'Python objects' not in msg


def test_a_checkpoint_of_python_objects_is_refused_as_unsafe_not_as_damaged(tmp_path):
    path = tmp_path / 'checkpoint.pth'
    torch.save({'model': {}, 'lr': fractions.Fraction(1, 3)}, path)  # an object no weights-only load allows
    with pytest.raises(errors.CheckpointError) as e:
        checkpoint.load_checkpoint_file(str(path))
    msg = str(e.value)
    assert 'contains Python objects other than tensors and plain containers (fractions.Fraction)' in msg, msg
    assert 'damaged' not in msg


def test_damage_in_place_stays_in_its_file_and_names_an_older_version_linked_are_not_offered(tmp_path):
    run = _run(tmp_path, with_state=True)
    run.save(4, {}, ['checkpoint.pth', 'checkpoint_0004.pth'])
    run.save(5, {}, ['checkpoint.pth', 'best.pth'])
    path, best, backup = (tmp_path / n for n in ('checkpoint.pth', 'best.pth', 'checkpoint_0004.pth'))
    path.write_bytes(path.read_bytes()[:5000])  # in place
    with pytest.raises(errors.CheckpointError) as e:
        checkpoint.load_checkpoint_file(str(path))
    assert f'(--resume {best}, --resume {backup})' in str(e.value)
    assert checkpoint.load_checkpoint_file(str(best))['epoch'] == 5  # its own file: undamaged
    # a run saved by an older version, whose best.pth is a hard link to checkpoint.pth, shares the damage
    os.remove(best)
    os.link(path, best)
    with pytest.raises(errors.CheckpointError) as e:
        checkpoint.load_checkpoint_file(str(path))
    assert f'(--resume {backup})' in str(e.value) and 'best.pth' not in str(e.value)


class _FailingFile(io.RawIOBase):
    """A file that fails with `exc` once more than `limit` bytes were written."""

    def __init__(self, real, exc, limit=1000):
        self.real, self.exc, self.limit, self.n = real, exc, limit, 0

    def writable(self):
        return True

    def write(self, b):
        self.n += len(b)
        if self.n > self.limit:
            raise self.exc
        return self.real.write(b)

    def fileno(self):
        return self.real.fileno()

    def flush(self):
        if not self.real.closed:
            self.real.flush()

    def close(self):
        super().close()
        self.real.close()


def _failing_fdopen(monkeypatch, exc):
    real = os.fdopen
    monkeypatch.setattr(checkpoint.os, 'fdopen', lambda fd, mode: _FailingFile(real(fd, mode), exc))


def test_disk_full_names_the_cause_and_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / 'checkpoint.pth'
    checkpoint.save_atomic({'w': torch.zeros(10)}, str(path))
    before = path.read_bytes()
    _failing_fdopen(monkeypatch, OSError(errno.ENOSPC, 'No space left on device'))
    with pytest.raises(errors.CheckpointWriteError) as e:
        checkpoint.save_atomic({'w': torch.zeros(100000)}, str(path))
    assert str(e.value) == (f'could not write checkpoint {path}: no space left on device; '
                            f'the previous checkpoint.pth (if any) is kept')
    assert path.read_bytes() == before and os.listdir(tmp_path) == ['checkpoint.pth']


def test_ctrl_c_during_a_save_is_an_interrupt_and_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / 'checkpoint.pth'
    checkpoint.save_atomic({'w': torch.zeros(10)}, str(path))
    before = path.read_bytes()
    _failing_fdopen(monkeypatch, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_atomic({'w': torch.zeros(100000)}, str(path))
    assert path.read_bytes() == before and os.listdir(tmp_path) == ['checkpoint.pth']


def test_checkpoints_get_the_mode_of_a_normal_write(tmp_path):
    old = os.umask(0o027)
    try:
        checkpoint.save_atomic({'w': torch.zeros(1)}, str(tmp_path / 'a.pth'))
        with open(tmp_path / 'log.txt', 'w'):
            pass
    finally:
        os.umask(old)
    assert os.stat(tmp_path / 'a.pth').st_mode & 0o777 == os.stat(tmp_path / 'log.txt').st_mode & 0o777 == 0o640
    os.chmod(tmp_path / 'a.pth', 0o604)  # an existing file keeps its mode, as open(path, 'wb') does
    checkpoint.save_atomic({'w': torch.zeros(1)}, str(tmp_path / 'a.pth'))
    assert os.stat(tmp_path / 'a.pth').st_mode & 0o777 == 0o604


def test_a_copy_is_a_reflink_where_the_filesystem_has_them_else_a_copy_of_the_bytes(tmp_path, monkeypatch):
    src, dst = tmp_path / 'a.pth', tmp_path / 'b.pth'
    src.write_bytes(os.urandom(3 << 20))
    calls = []

    def reflink(fd, request, src_fd):  # what FICLONE does: the destination gets the source's contents
        calls.append(request)
        os.write(fd, os.pread(src_fd, 1 << 30, 0))
    monkeypatch.setattr(checkpoint.fcntl, 'ioctl', reflink)
    monkeypatch.setattr(checkpoint.os, 'copy_file_range', lambda *a: pytest.fail('copied after a reflink'))
    checkpoint.copy_atomic(str(src), str(dst))
    assert calls == [checkpoint.FICLONE] and dst.read_bytes() == src.read_bytes()

    def no_reflinks(fd, request, src_fd):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))  # ext4, tmpfs
    monkeypatch.undo()
    monkeypatch.setattr(checkpoint.fcntl, 'ioctl', no_reflinks)
    checkpoint.copy_atomic(str(src), str(tmp_path / 'c.pth'))  # copy_file_range
    assert (tmp_path / 'c.pth').read_bytes() == src.read_bytes()

    def half_then_unsupported(src_fd, dst_fd, count):  # e.g. a FUSE filesystem that gives up: start again
        if os.fstat(dst_fd).st_size:
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        return os.write(dst_fd, os.read(src_fd, 1 << 20))
    monkeypatch.setattr(checkpoint.os, 'copy_file_range', half_then_unsupported)
    checkpoint.copy_atomic(str(src), str(tmp_path / 'd.pth'))
    assert (tmp_path / 'd.pth').read_bytes() == src.read_bytes()


def _state():
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.ones(1, 3)).sum().backward()
    opt.step()
    return {'model': m.state_dict(), 'optimizer': opt.state_dict(), 'epoch': 4, 'max_accuracy': 12.5,
            'args': checkpoint.args_to_dict(parse('--output_dir', 'x')), 'rng_state': [resume.get_rng_state()]}


def test_checkpoint_round_trip_weights_only(tmp_path):
    st = _state()
    p = tmp_path / 'checkpoint.pth'
    checkpoint.save_atomic(st, p)
    back = torch.load(p, weights_only=True)
    assert back['epoch'] == 4 and back['max_accuracy'] == 12.5 and isinstance(back['args'], dict)
    assert back['args']['output_dir'] == 'x'
    for k, v in st['model'].items():
        assert torch.equal(v, back['model'][k])
    assert os.listdir(tmp_path) == ['checkpoint.pth']  # no temporary file left behind


def test_failing_write_keeps_previous_checkpoint_and_names_the_path(tmp_path, monkeypatch):
    p = tmp_path / 'checkpoint.pth'
    checkpoint.save_atomic({'model': {'w': torch.ones(2)}, 'epoch': 1}, p)
    before = p.read_bytes()
    real_save = torch.save

    def half_then_disk_full(obj, f, *a, **k):
        real_save(obj, f, *a, **k)  # bytes reach the temporary file ...
        raise OSError(28, 'No space left on device')  # ... then the disk fills up

    monkeypatch.setattr(torch, 'save', half_then_disk_full)
    with pytest.raises(errors.CheckpointWriteError) as ei:
        checkpoint.save_atomic({'model': {'w': torch.zeros(2)}, 'epoch': 2}, p)
    assert str(p) in str(ei.value) and 'no space left' in str(ei.value)
    assert p.read_bytes() == before
    assert os.listdir(tmp_path) == ['checkpoint.pth']


def test_stale_temporary_files_are_removed(tmp_path):
    (tmp_path / (checkpoint.TMP_PREFIX + 'checkpoint.pth.abc')).write_bytes(b'partial')
    (tmp_path / 'checkpoint.pth').write_bytes(b'keep')
    checkpoint.remove_stale_tmp(str(tmp_path))
    assert os.listdir(tmp_path) == ['checkpoint.pth']

