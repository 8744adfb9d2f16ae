"""Ranks that must agree, with two ranks as threads (helpers/thread_world.py): whatever fails on rank 0 alone
(log.txt, a checkpoint that cannot be pickled, the lock file, the repairs at resume, TensorBoard) stops every rank
with one line instead of leaving the others waiting in their next collective; the checkpoint a run resumes from is
rank 0's decision, and a rank that does not see it, or reads another file under its name, stops every rank; so
does a rank that sees other data. Every rank issues the same collectives in the same order."""
import errno
import os
import socket

import pytest
import torch
from conftest import parse, run_dir_of
from helpers.thread_world import ThreadWorld
from test_world import _tiny_run
from torchvision.datasets import ImageFolder

import utils
from run import checkpoint, distributed, output_dir, resume
from run.errors import CheckpointError, UserError
from training import loaders

HOST = socket.gethostname()


def one_line_errors(results):
    """Every rank raised a one-line UserError (none hung, none went on): their messages, by rank."""
    for rank, r in enumerate(results):
        assert isinstance(r, UserError), f'rank {rank}: {r!r}'
        assert '\n' not in str(r), str(r)
    return [str(r) for r in results]


def assert_rank_failed(results, rank, message):
    """`rank` raised `message`; every other rank raised that it stopped because `rank` failed with it."""
    lines = one_line_errors(results)
    for r, line in enumerate(lines):
        assert line == (message if r == rank else f'stopped because rank {rank} failed: {message}'), (r, line)


@pytest.fixture
def world(monkeypatch):
    w = ThreadWorld(2, monkeypatch)
    yield w
    assert w.calls[0] == w.calls[1], w.calls  # the same collectives in the same order on every rank


# ------------------------------------------------------------------------------------ rank 0 alone fails
def test_any_failure_on_rank_0_stops_every_rank_with_its_line(world):
    results = world.run(lambda rank: distributed.on_rank0(lambda: {}['missing'], 'cpu', 'reading the table'))
    assert_rank_failed(results, 0, "reading the table: KeyError: 'missing'")


def test_nothing_failed_costs_one_collective_and_returns_rank_0_result(world):
    results = world.run(lambda rank: distributed.on_rank0(lambda: 'written', 'cpu', 'writing'))
    assert results == ['written', None] and world.calls[0] == ['all_reduce']


def test_a_log_txt_that_is_a_directory_stops_every_rank(world, tmp_path):
    (tmp_path / 'log.txt').mkdir()
    results = world.run(lambda rank: _tiny_run(tmp_path).append_log({'epoch': 3}))
    assert_rank_failed(results, 0, f'could not append to {tmp_path}/log.txt: Is a directory; the checkpoint of '
                                   f'epoch 3 holds the line, it is added when the run resumes')


def test_a_checkpoint_that_cannot_be_pickled_stops_every_rank(world, tmp_path):
    results = world.run(lambda rank: _tiny_run(tmp_path).save(0, {'hook': lambda: 0}, ['checkpoint.pth']))
    line = one_line_errors(results)[0]
    assert line.startswith(f'could not write checkpoint {tmp_path}/checkpoint.pth: ') and 'pickle' in line, line
    assert line.endswith('the previous checkpoint.pth (if any) is kept')
    assert_rank_failed(results, 0, line)
    assert os.listdir(tmp_path) == []  # no temporary file left behind


def test_a_lock_file_that_cannot_be_written_stops_every_rank(world, tmp_path, monkeypatch):
    def quota(fd, data, offset):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    monkeypatch.setattr(output_dir.os, 'pwrite', quota)
    out = tmp_path / 'out'
    results = world.run(lambda rank: output_dir.prepare_output_dir(run_dir_of(parse('--output_dir', str(out))), 'cpu'))
    assert_rank_failed(results, 0, f'cannot write the lock file {out}/{output_dir.LOCK_NAME}: '
                                   f'{os.strerror(errno.EDQUOT)}; make --output_dir writable or choose another')


def test_a_repair_that_fails_at_resume_stops_every_rank(tmp_path, monkeypatch):
    _tiny_run(tmp_path).save(0, {'log': {'epoch': 0, 'train_loss': 1.0}}, ['checkpoint.pth'])
    (tmp_path / 'log.txt').mkdir()  # the line of epoch 0 is missing from log.txt, and cannot be added
    world = ThreadWorld(2, monkeypatch)
    results = world.run(lambda rank: _tiny_run(tmp_path).resume(str(tmp_path / 'checkpoint.pth')))
    assert_rank_failed(results, 0, f'could not append to {tmp_path}/log.txt: Is a directory; the checkpoint of '
                                   f'epoch 0 holds the line, it is added when the run resumes')
    assert world.calls[0] == world.calls[1]


def test_a_tensorboard_writer_that_cannot_start_stops_every_rank(world, tmp_path):
    pytest.importorskip('tensorboard', reason='optional: pip install -r requirements-optional.txt')
    blocked = tmp_path / 'tb'
    blocked.write_text('a file where the event directory should be')
    results = world.run(lambda rank: utils.tensorboard_logger(str(blocked), 'cpu'))
    line = one_line_errors(results)[0]
    assert line.startswith(f'--log-dir {blocked}: cannot write TensorBoard events there: '), line
    assert_rank_failed(results, 0, line)


# ------------------------------------------------------------------------------------ the resumed checkpoint
def seen_by(world, rank, monkeypatch):
    """os.path.isfile as each rank sees it: `rank` does not see any checkpoint.pth (a node-local directory)."""
    real = os.path.isfile
    monkeypatch.setattr(os.path, 'isfile', lambda p: real(p) and not (
        world.rank() == rank and str(p).endswith('checkpoint.pth')))


@pytest.mark.parametrize('blind', [1, 0])
def test_a_rank_that_sees_another_resume_checkpoint_stops_every_rank(tmp_path, monkeypatch, blind):
    _tiny_run(tmp_path).save(0, {}, ['checkpoint.pth'])
    world = ThreadWorld(2, monkeypatch)
    seen_by(world, blind, monkeypatch)
    settings = run_dir_of(parse('--output_dir', str(tmp_path)))
    results = world.run(lambda rank: output_dir.agree_on_resume_path(settings, 'cpu'))
    fix = ('every node must see the same --output_dir (a shared filesystem), or pass --resume with a path every '
           'node sees')
    path = f'{tmp_path}/checkpoint.pth'
    assert_rank_failed(results, 1, f'rank 1 on host {HOST} does not see {path}, which rank 0 resumes from: {fix}'
                       if blind == 1 else f'rank 1 on host {HOST} sees {path}, but rank 0 does not and would start '
                                          f'afresh: {fix}')
    assert world.calls[0] == world.calls[1]


def test_every_rank_takes_rank_0_resume_decision(tmp_path, monkeypatch):
    _tiny_run(tmp_path).save(0, {}, ['checkpoint.pth'])
    world = ThreadWorld(2, monkeypatch)
    settings = run_dir_of(parse('--output_dir', str(tmp_path)))
    results = world.run(lambda rank: output_dir.agree_on_resume_path(settings, 'cpu'))
    assert results == [f'{tmp_path}/checkpoint.pth'] * 2


def test_ranks_that_read_different_checkpoints_under_one_name_stop_every_rank(tmp_path, monkeypatch):
    (tmp_path / 'a').mkdir()
    (tmp_path / 'b').mkdir()
    _tiny_run(tmp_path / 'a').save(0, {}, ['checkpoint.pth'])
    later = _tiny_run(tmp_path / 'b')
    torch.nn.init.zeros_(later.model.weight)
    later.save(1, {}, ['checkpoint.pth'])
    path = str(tmp_path / 'a' / 'checkpoint.pth')
    ids = [checkpoint.describe_identity(checkpoint.checkpoint_identity(checkpoint.load_checkpoint_file(p), p))
           for p in (path, str(tmp_path / 'b' / 'checkpoint.pth'))]
    world = ThreadWorld(2, monkeypatch)
    real = checkpoint.load_checkpoint_file
    monkeypatch.setattr(resume, 'load_checkpoint_file', lambda p, **kw: real(
        p.replace('/a/', '/b/') if world.rank() == 1 else p, **kw))  # rank 1's node holds another file there
    results = world.run(lambda rank: _tiny_run(tmp_path / 'a').resume(path))
    assert ids[0].startswith('epoch 0, sha256 ') and ids[1].startswith('epoch 1, sha256 ')
    assert_rank_failed(results, 1, f'rank 1 on host {HOST} reads another {path} than rank 0 ({ids[1]} here, '
                                   f'{ids[0]} on rank 0): every node must see the same --output_dir (a shared '
                                   f'filesystem) and --resume file')
    assert world.calls[0] == world.calls[1]


def test_a_rank_that_cannot_read_the_resumed_checkpoint_stops_every_rank(tmp_path, monkeypatch):
    _tiny_run(tmp_path).save(0, {}, ['checkpoint.pth'])
    path = str(tmp_path / 'checkpoint.pth')
    world = ThreadWorld(2, monkeypatch)
    real = checkpoint.load_checkpoint_file

    def load(p, **kw):
        if world.rank() == 1:
            raise CheckpointError(f'checkpoint {p} does not exist')
        return real(p, **kw)
    monkeypatch.setattr(resume, 'load_checkpoint_file', load)
    results = world.run(lambda rank: _tiny_run(tmp_path).resume(path))
    assert_rank_failed(results, 1, f'rank 1 on host {HOST} cannot read {path}, which rank 0 resumes from '
                                   f'(checkpoint {path} does not exist): every node must see the same --output_dir '
                                   f'(a shared filesystem) and --resume file')


def test_ranks_that_read_the_same_checkpoint_resume_alike(tmp_path, monkeypatch):
    _tiny_run(tmp_path).save(2, {}, ['checkpoint.pth'])
    world = ThreadWorld(2, monkeypatch)
    results = world.run(lambda rank: _tiny_run(tmp_path).resume(str(tmp_path / 'checkpoint.pth')).start_epoch)
    assert results == [3, 3] and world.calls[0] == world.calls[1]


# ------------------------------------------------------------------------------------ the data every rank sees
def test_a_rank_that_sees_other_data_stops_every_rank(world, data, tmp_path):
    from helpers.image_folders import make_imagefolder
    other = make_imagefolder(tmp_path / 'other', n_train=9)  # one more training image per class on rank 1's node

    def facts(rank):
        root = data if rank == 0 else other
        train, val = ImageFolder(os.path.join(root, 'train')), ImageFolder(os.path.join(root, 'val'))
        loader = torch.utils.data.DataLoader(train, batch_size=4, drop_last=True)
        distributed.check_same_everywhere(loaders.data_facts(train, val, loader), 'cpu', 'use the same data')
    assert_rank_failed(world.run(facts), 1, f'rank 1 on host {HOST} sees training images 27, rank 0 sees 24: '
                                            f'use the same data')


def test_ranks_that_see_the_same_data_go_on(world, data):
    train, val = ImageFolder(os.path.join(data, 'train')), ImageFolder(os.path.join(data, 'val'))
    loader = torch.utils.data.DataLoader(train, batch_size=4, drop_last=True)
    facts = loaders.data_facts(train, val, loader)
    assert facts['classes'].startswith('3 (sha256 ') and facts['training batches per epoch'] == 6
    assert world.run(lambda rank: distributed.check_same_everywhere(facts, 'cpu', 'fix')) == [None, None]
