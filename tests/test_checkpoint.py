"""The run's checkpoints (run/checkpoint.py, restored by run/resume.py): best weights, one serialisation copied to
every name, crash repair on resume, log.txt after a resume from an older checkpoint, optimizer flags on resume,
and the epoch state a resume continues from. Tiny models in-process; the file layer's tests are in
test_checkpoint_io.py, the killed-process runs in integration/test_faults.py."""
import errno
import json
import os
import random
import re
import shutil

import pytest
import timm
import torch
from conftest import TrainingRun, scheduler_of

import cli
from run import checkpoint, errors, output_dir, resume


# ------------------------------------------------------------------------------------------ helpers
def _xt(seed, num_classes=3):
    torch.manual_seed(seed)
    return timm.create_model('NALAFORMER_XT', num_classes=num_classes)


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.norm = torch.nn.LayerNorm(3)


def _tiny(seed):
    torch.manual_seed(seed)
    return _Tiny()


def _run(tmp_path, argv=(), model=None, with_state=False):
    """A TrainingRun for a tiny model and the optimizer/schedule main.py builds from `argv`."""
    from timm.optim import create_optimizer_v2
    args = cli.get_args_parser().parse_args(['--output_dir', str(tmp_path), '--epochs', '4', *argv])
    model = model or _Tiny()
    opt = create_optimizer_v2(model, opt=args.opt, lr=args.lr, weight_decay=args.weight_decay,
                              momentum=args.momentum, eps=args.opt_eps,
                              **({'betas': tuple(args.opt_betas)} if args.opt_betas else {}))
    run = TrainingRun(args, model, None, opt, scheduler_of(args, opt), None, 7, 'cpu')
    if with_state:
        model.norm(model.fc(torch.randn(2, 4))).sum().backward()
        opt.step()  # the optimizer has its moments
    return run


def test_a_full_disk_during_the_log_append_is_one_line(tmp_path, monkeypatch):
    run = _run(tmp_path)

    def full(path, obj):
        raise OSError(errno.ENOSPC, 'No space left on device')
    monkeypatch.setattr(checkpoint, 'write_json_line', full)
    with pytest.raises(errors.UserError, match=r'could not append to .*log\.txt: no space left on device; the '
                                              r'checkpoint of epoch 3 holds the line'):
        run.append_log({'epoch': 3})


# ------------------------------------------------------------------------------------------ best weights
def test_best_records_which_weights_and_both_accuracies(tmp_path):
    run = _run(tmp_path)
    assert run.record_accuracy(0, 40.0, 55.0) and run.max_accuracy == 55.0
    assert not run.record_accuracy(1, 50.0, 54.0)
    assert run.record_accuracy(2, 60.0, 58.0)
    state = run.state(2, ['checkpoint.pth', 'best.pth'], {})
    assert state['best_weights'] == 'model' and state['best_epoch'] == 2 and state['max_accuracy'] == 60.0
    assert state['best_acc1'] == state['acc1'] == {'model': 60.0, 'model_ema': 58.0}
    assert 'EMA' not in checkpoint.describe_best(state) and '60.00% at epoch 2' in checkpoint.describe_best(state)


def test_a_state_is_written_once_and_copied_to_its_other_names(tmp_path, monkeypatch):
    run = _run(tmp_path, with_state=True)
    written = []
    real = checkpoint.save_atomic
    monkeypatch.setattr(checkpoint, 'save_atomic', lambda state, path: (written.append(os.path.basename(path)),
                                                                        real(state, path)))
    run.save(0, {}, ['checkpoint.pth', 'best.pth', 'checkpoint_0000.pth'])
    assert written == ['checkpoint.pth']
    ck, best = tmp_path / 'checkpoint.pth', tmp_path / 'best.pth'
    for other in (best, tmp_path / 'checkpoint_0000.pth'):
        assert not os.path.samefile(ck, other) and other.read_bytes() == ck.read_bytes()
        assert checkpoint.load_checkpoint_file(str(other))['epoch'] == 0  # checksum verified
    # the next epoch replaces the name checkpoint.pth; best.pth stays as it was
    before = best.read_bytes()
    run.save(1, {}, ['checkpoint.pth'])
    assert best.read_bytes() == before and checkpoint.load_checkpoint_file(str(ck))['epoch'] == 1
    assert not [f for f in os.listdir(tmp_path) if f.startswith(checkpoint.TMP_PREFIX)]


def _write_state(tmp_path, name='checkpoint.pth', **extra):
    run = _run(tmp_path, with_state=True)
    run.save(0, {'rng_state': [resume.get_rng_state()], **extra}, [name])
    return tmp_path / name



def _killed(*args):
    raise SystemExit('killed')


def _two_runs(tmp_path):
    """Our run in tmp_path/out, its last epoch (1) a new best, and another run's checkpoint (epoch 0)."""
    out, other = tmp_path / 'out', tmp_path / 'other'
    for d in (out, other):
        d.mkdir()
    _run(other, with_state=True).save(0, {}, ['checkpoint.pth'])
    run = _run(out, with_state=True)
    for epoch, acc in ((0, 30.0), (1, 45.0)):
        run.record_accuracy(epoch, acc)
        log = {'epoch': epoch, 'test_acc1': acc}
        run.save(epoch, {'log': log}, ['checkpoint.pth', 'best.pth'])
        run.append_log(log)
    return out, other


def test_a_best_pth_restored_by_hand_leaves_checkpoint_pth_as_it_was(tmp_path, capsys):
    out, other = _two_runs(tmp_path)
    ours = (out / 'checkpoint.pth').read_bytes()
    shutil.copyfile(other / 'checkpoint.pth', out / 'best.pth')  # what `cp` does: it writes into best.pth
    assert (out / 'checkpoint.pth').read_bytes() == ours
    ck = checkpoint.load_checkpoint_file(str(out / 'checkpoint.pth'))
    assert ck['epoch'] == 1 and ck['args']['output_dir'] == str(out)
    capsys.readouterr()
    assert _run(out).resume(str(out / 'checkpoint.pth')).start_epoch == 2
    said = capsys.readouterr().out
    # best.pth holds an older state than the one saved there with checkpoint.pth, but it was put there later
    assert f'Note: {out / "best.pth"} holds an older state (epoch 0) than {out / "checkpoint.pth"} (epoch 1)' in said
    assert 'put there by hand?): left as it is' in said and 'Repaired' not in said
    assert (out / 'best.pth').read_bytes() == (other / 'checkpoint.pth').read_bytes()
    assert [json.loads(x)['epoch'] for x in open(out / 'log.txt')] == [0, 1]


def test_names_an_older_version_hard_linked_become_files_of_their_own_on_resume(tmp_path, capsys):
    out, other = _two_runs(tmp_path)
    ck, best = out / 'checkpoint.pth', out / 'best.pth'
    for name in ('best.pth', 'checkpoint_0001.pth'):  # as an older version saved them
        if (out / name).exists():
            os.remove(out / name)
        os.link(ck, out / name)
    capsys.readouterr()
    assert _run(out).resume(str(ck)).start_epoch == 2
    said = capsys.readouterr().out
    assert f'Note: {best} and {ck} were one file (hard links of an older version)' in said
    assert not os.path.samefile(ck, best) and not os.path.samefile(ck, out / 'checkpoint_0001.pth')
    assert best.read_bytes() == ck.read_bytes() == (out / 'checkpoint_0001.pth').read_bytes()
    ours = ck.read_bytes()
    shutil.copyfile(other / 'checkpoint.pth', best)
    assert ck.read_bytes() == ours == (out / 'checkpoint_0001.pth').read_bytes()


# ------------------------------------------------------------------------------------------ crash repair
def test_a_crash_between_checkpoint_and_best_is_repaired_on_resume(tmp_path, monkeypatch, capsys):
    run = _run(tmp_path, with_state=True)
    run.record_accuracy(0, 30.0, None)
    log0 = {'epoch': 0, 'test_acc1': 30.0}
    run.save(0, {'log': log0}, ['checkpoint.pth', 'best.pth'])
    run.append_log(log0)
    run.record_accuracy(1, 45.0, None)
    monkeypatch.setattr(checkpoint, 'copy_atomic', _killed)  # dies after the first file: the others are copies
    with pytest.raises(SystemExit):
        run.save(1, {'log': {'epoch': 1, 'test_acc1': 45.0}}, ['checkpoint.pth', 'best.pth'])
    monkeypatch.undo()
    with open(tmp_path / 'log.txt', 'a') as f:
        f.write('{"epoch": 1, "test_a')  # a half-written line too
    assert torch.load(tmp_path / 'best.pth', weights_only=True)['epoch'] == 0  # stale

    resumed = _run(tmp_path).resume(str(tmp_path / 'checkpoint.pth'))
    out = capsys.readouterr().out
    assert resumed.start_epoch == 2
    assert re.search(r'Repaired .*best\.pth: it was older \(epoch 0: the run stopped between writing .*checkpoint\.pth '
                     r'and it\); copied the state of epoch 1 there', out), out
    assert (tmp_path / 'best.pth').read_bytes() == (tmp_path / 'checkpoint.pth').read_bytes()
    assert [json.loads(x)['epoch'] for x in open(tmp_path / 'log.txt')] == [0, 1]
    # a second resume finds nothing to repair
    _run(tmp_path).resume(str(tmp_path / 'checkpoint.pth'))
    assert 'Repaired' not in capsys.readouterr().out


def test_in_a_run_an_older_version_hard_linked_saves_and_repairs_replace_names_never_write_through(
        tmp_path, monkeypatch):
    out, _ = _two_runs(tmp_path)
    ck, best, backup = out / 'checkpoint.pth', out / 'best.pth', out / 'checkpoint_0001.pth'
    os.remove(best)
    for name in (best, backup):
        os.link(ck, name)
    epoch1 = ck.read_bytes()
    run = _run(out, with_state=True)
    run.record_accuracy(2, 50.0)
    monkeypatch.setattr(checkpoint, 'copy_atomic', _killed)
    with pytest.raises(SystemExit):  # killed after checkpoint.pth, before best.pth
        run.save(2, {}, ['checkpoint.pth', 'best.pth'])
    monkeypatch.undo()
    assert best.read_bytes() == backup.read_bytes() == epoch1 != ck.read_bytes()
    monkeypatch.setattr(output_dir, 'separate_hard_links', lambda directory: None)  # e.g. no room to separate
    _run(out).resume(str(ck))  # repairs best.pth, linked to checkpoint_0001.pth: by a rename
    assert checkpoint.load_checkpoint_file(str(best))['epoch'] == 2 and backup.read_bytes() == epoch1


# ------------------------------------------------------------------------------------------ an older checkpoint
def _run_of_four_epochs(tmp_path):
    """Epochs 0..3 saved and logged; epoch 1 the best (best.pth), the others not."""
    run = _run(tmp_path, with_state=True)
    for epoch, acc in enumerate((30.0, 45.0, 40.0, 41.0)):
        names = ['checkpoint.pth'] + (['best.pth'] if run.record_accuracy(epoch, acc) else [])
        log = {'epoch': epoch, 'test_acc1': acc}
        run.save(epoch, {'log': log}, names)
        run.append_log(log)
    return [json.loads(x) for x in open(tmp_path / 'log.txt')]


def test_resuming_an_older_checkpoint_moves_the_later_log_lines_aside(tmp_path, capsys):
    lines = _run_of_four_epochs(tmp_path)
    ck, best, log = tmp_path / 'checkpoint.pth', tmp_path / 'best.pth', tmp_path / 'log.txt'
    ck.write_bytes(ck.read_bytes()[:5000])  # truncated; the error names --resume best.pth
    capsys.readouterr()
    assert _run(tmp_path).resume(str(best)).start_epoch == 2
    out = capsys.readouterr().out
    side = [f for f in os.listdir(tmp_path) if f.startswith('log.txt.') and f.endswith('.bak')]
    assert len(side) == 1
    assert f"Note: resumed from epoch 1 ({best}), older than log.txt's last epoch 3: moved the lines of epochs " \
           f"2..3 to {tmp_path / side[0]}" in out, out
    assert [json.loads(x) for x in open(log)] == lines[:2]
    assert [json.loads(x) for x in open(tmp_path / side[0])] == lines[2:]  # nothing lost
    # checkpoint.pth was saved with epoch 1 too; it was damaged later, not left behind by a stop between writes
    assert f'Repaired {ck}: it was unreadable (truncated or damaged after it was written); copied the state of ' \
           f'epoch 1 there from {best}' in out, out
    assert 'stopped' not in out
    assert checkpoint.load_checkpoint_file(str(ck))['epoch'] == 1


def test_a_mid_epoch_checkpoint_keeps_the_log_lines_of_the_epochs_it_finished(tmp_path, capsys):
    lines = _run_of_four_epochs(tmp_path)
    run = _run(tmp_path, with_state=True)
    state = resume.EpochState(step=3, rng_state=resume.get_rng_state(),
                                   epoch_rng_state=resume.get_rng_state())
    run.save(2, resume.epoch_state_entries(state), ['checkpoint.pth'])  # a stop inside epoch 2, kept aside
    os.rename(tmp_path / 'checkpoint.pth', tmp_path / 'stopped.pth')
    with open(tmp_path / 'log.txt', 'a') as f:
        f.write('{"epoch": 4, "test_a')  # a half-written line after the later epochs goes with them
    capsys.readouterr()
    r = _run(tmp_path).resume(str(tmp_path / 'stopped.pth'))
    assert (r.start_epoch, r.state.step) == (2, 3)
    out = capsys.readouterr().out
    assert f"Note: {tmp_path / 'stopped.pth'} stopped inside epoch 2, older than log.txt's last epoch 3: moved the " \
           f"lines of epochs 2..3 to " in out, out
    assert [json.loads(x) for x in open(tmp_path / 'log.txt')] == lines[:2]
    side, = (f for f in os.listdir(tmp_path) if f.endswith('.bak'))
    assert open(tmp_path / side).read().splitlines()[-1] == '{"epoch": 4, "test_a'
    # the newest state resumes with log.txt as it is
    capsys.readouterr()
    _run(tmp_path).resume(str(tmp_path / 'best.pth'))
    assert 'moved' not in capsys.readouterr().out and len(open(tmp_path / 'log.txt').readlines()) == 2


# ------------------------------------------------------------------------------------------ optimizer on resume
def test_resume_follows_the_optimizer_flags_of_the_command_line(tmp_path, capsys):
    _write_state(tmp_path)
    run = _run(tmp_path, ['--weight-decay', '0.1', '--opt-betas', '0.9', '0.95'])
    run.resume(str(tmp_path / 'checkpoint.pth'))
    decays = sorted({g['weight_decay'] for g in run.optimizer.param_groups})
    assert decays == [0.0, 0.1]
    assert all(tuple(g['betas']) == (0.9, 0.95) for g in run.optimizer.param_groups)
    assert run.optimizer.state  # the moments were loaded
    out = capsys.readouterr().out
    assert 'optimizer settings changed since the checkpoint (weight_decay: 0.05 -> 0.1, betas: (0.9, 0.999) -> ' \
           '(0.9, 0.95)); following the command line' in out


def test_resume_with_another_optimizer_is_refused(tmp_path, capsys):
    _write_state(tmp_path)
    with pytest.raises(errors.CheckpointError) as e:
        _run(tmp_path, ['--opt', 'sgd']).resume(str(tmp_path / 'checkpoint.pth'))
    assert 'is from --opt adamw, this run has --opt sgd: relaunch with --opt adamw' in str(e.value)
    assert 'Loaded weights' not in capsys.readouterr().out  # a refused resume loaded nothing it keeps


def test_resume_on_other_classes_is_refused_before_anything_is_loaded(tmp_path, capsys):
    _write_state(tmp_path, classes=['a', 'b', 'c'])
    run = _run(tmp_path)
    run.classes = ['a', 'b', 'd']
    with pytest.raises(errors.CheckpointError, match="class 2 is 'c' in the checkpoint but 'd' in the data; "
                                                     'resume with the data of that run'):
        run.resume(str(tmp_path / 'checkpoint.pth'))
    assert 'Loaded weights' not in capsys.readouterr().out
    run.classes = ['a', 'b', 'c']
    run.resume(str(tmp_path / 'checkpoint.pth'))
    assert f"Loaded weights from {tmp_path / 'checkpoint.pth'}" in capsys.readouterr().out


def test_restore_reads_back_what_the_saver_wrote(tmp_path):
    """CheckpointSaver.restore is the inverse of CheckpointSaver.state: another run's parts (other weights, EMA,
    no optimizer moments, a fresh schedule and best accuracy) come back to the saved run's, and saving them
    again gives the same entries."""
    from training.optim import ModelEma

    def run_of(seed):
        run = _run(tmp_path, with_state=seed == 0, model=_tiny(seed))
        run.saver.parts.model_ema = ModelEma(run.model)
        return run

    saved = run_of(0)
    saved.saver.parts.lr_scheduler.step(2)
    saved.record_accuracy(1, 40.0, 45.0)
    saved.save(1, {'rng_state': [resume.get_rng_state()]}, ['checkpoint.pth'])
    other = run_of(1)
    assert not _same(other.model.state_dict(), saved.model.state_dict())
    other.resume(str(tmp_path / 'checkpoint.pth'))
    a, b = saved.saver.state(1, ['x'], {}), other.saver.state(1, ['x'], {})
    for key in ('model', 'model_ema'):
        assert _same(a[key], b[key]), key
    assert a['lr_scheduler'] == b['lr_scheduler']
    assert all(_same(a['optimizer']['state'][i], b['optimizer']['state'][i]) for i in a['optimizer']['state'])
    assert a['optimizer']['param_groups'] == b['optimizer']['param_groups']
    assert (b['max_accuracy'], b['best_weights'], b['best_epoch']) == (45.0, 'model_ema', 1)


def test_a_checkpoint_without_ema_weights_restarts_the_ema_from_the_model(tmp_path, capsys):
    from training.optim import ModelEma
    _write_state(tmp_path)  # a run without --model-ema
    run = _run(tmp_path, model=_tiny(3))
    run.saver.parts.model_ema = ModelEma(_tiny(4))
    run.resume(str(tmp_path / 'checkpoint.pth'))
    assert 'the checkpoint has no EMA weights; the EMA restarts from the model weights' in capsys.readouterr().out
    assert _same(run.saver.parts.model_ema.module.state_dict(), run.model.state_dict())
    assert _same(run.model.state_dict(), torch.load(tmp_path / 'checkpoint.pth', weights_only=True)['model'])


def test_a_refused_resume_leaves_the_parts_and_the_run_directory_as_they_were(tmp_path, capsys):
    """The classes and the optimizer's kind are checked before the saver loads anything into the run, and the
    run directory is repaired only after a resume that went through: after a refusal the model, optimizer and
    best accuracy are this run's own, and a missing best.pth is still missing."""
    _run(tmp_path, with_state=True).save(0, {}, ['checkpoint.pth', 'best.pth'])
    os.remove(tmp_path / 'best.pth')
    run = _run(tmp_path, ['--opt', 'sgd'], model=_tiny(5))
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    with pytest.raises(errors.CheckpointError, match='this run has --opt sgd'):
        run.resume(str(tmp_path / 'checkpoint.pth'))
    assert _same(run.model.state_dict(), before) and not run.optimizer.state and run.max_accuracy == 0.0
    assert not os.path.exists(tmp_path / 'best.pth')
    _run(tmp_path).resume(str(tmp_path / 'checkpoint.pth'))
    assert os.path.exists(tmp_path / 'best.pth') and 'Repaired' in capsys.readouterr().out


class _TinyWithBuffer(_Tiny):
    """_Tiny's parameters (so its optimizer state fits) and one more tensor in its state dict."""
    def __init__(self):
        super().__init__()
        self.register_buffer('scale', torch.ones(3))


def test_weights_that_do_not_fit_are_refused_before_the_optimizer_state_loads(tmp_path):
    _run(tmp_path, with_state=True).save(0, {}, ['checkpoint.pth'])
    torch.manual_seed(5)
    run = _run(tmp_path, model=_TinyWithBuffer())
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    with pytest.raises(errors.CheckpointError, match=r'does not match .*1 missing keys \(e\.g\. scale\)'):
        run.resume(str(tmp_path / 'checkpoint.pth'))
    assert _same(run.model.state_dict(), before) and not run.optimizer.state and run.max_accuracy == 0.0


# ------------------------------------------------------------------------------------------ where training stands
def _draws(rng_state):
    """What the random streams give after `rng_state` is restored."""
    resume.set_rng_state(rng_state)
    return torch.rand(4).tolist(), random.random()


def _rng_at(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    return resume.get_rng_state()


def test_a_mid_epoch_state_written_in_the_checkpoint_layout_resumes_as_it_was(tmp_path):
    epoch_rng, stop_rng = _rng_at(1), _rng_at(2)
    # the keys a mid-epoch stop writes, as main.py has written them since before EpochState
    layout = {'step': 6, 'rng_state': [stop_rng], 'epoch_rng_state': [epoch_rng],
              'loss_meter': {'total': 4.5, 'count': 6}, 'train_carry': {'bad_steps': 2, 'skipped_steps': 3}}
    state = resume.EpochState(step=6, rng_state=stop_rng, epoch_rng_state=epoch_rng,
                              loss_meter={'total': 4.5, 'count': 6}, bad_steps=2, skipped_steps=3)
    entries = resume.epoch_state_entries(state)
    assert entries.keys() == layout.keys() and entries['train_carry'] == layout['train_carry']
    for extra in (layout, entries):
        _run(tmp_path, with_state=True).save(1, extra, ['checkpoint.pth'])
        r = _run(tmp_path).resume(str(tmp_path / 'checkpoint.pth'))
        got = r.state
        assert r.start_epoch == 1 and (got.step, got.loss_meter, got.bad_steps, got.skipped_steps) == (
            6, {'total': 4.5, 'count': 6}, 2, 3)
        assert _draws(got.rng_state) == _draws(stop_rng) and _draws(got.epoch_rng_state) == _draws(epoch_rng)


def test_an_end_of_epoch_state_resumes_at_the_next_epoch_with_the_bad_step_count(tmp_path):
    rng = _rng_at(3)
    want = _draws(rng)
    # the count of consecutive skipped steps survives; the finished epoch's own count does not
    for extra, bad in (({'rng_state': [rng], 'train_carry': {'bad_steps': 4, 'skipped_steps': 5}}, 4),
                       ({'rng_state': [rng]}, 0)):  # a checkpoint from before the counts were saved
        _run(tmp_path, with_state=True).save(2, extra, ['checkpoint.pth'])
        _rng_at(9)
        r = _run(tmp_path).resume(str(tmp_path / 'checkpoint.pth'))
        assert _draws(resume.get_rng_state()) == want  # the RNG state is restored at once
        got = r.state
        assert r.start_epoch == 3 and (got.step, got.bad_steps, got.skipped_steps) == (0, bad, 0)
        assert got.rng_state is None and got.epoch_rng_state is None and got.loss_meter is None
    _rng_at(3)
    entries = resume.epoch_state_entries(resume.EpochState(bad_steps=4))
    assert set(entries) == {'rng_state', 'train_carry'}
    assert entries['train_carry'] == {'bad_steps': 4, 'skipped_steps': 0}
    assert _draws(entries['rng_state'][0]) == want  # between epochs: the RNG state of now


def test_an_epoch_saved_without_its_accuracy_is_handed_to_the_resume_to_evaluate(tmp_path):
    """A stop during an epoch's evaluation saves the epoch with no acc1 and a log record without test_* entries:
    the resume hands that record and where training stood to main.py, which evaluates the epoch and puts the
    complete record in place of the log line. An evaluated epoch and a stop inside an epoch hand over nothing."""
    rng, carry = _rng_at(3), {'bad_steps': 1, 'skipped_steps': 2}
    unevaluated = {'train_loss': 1.5, 'epoch': 2, 'max_accuracy': 40.0}
    run = _run(tmp_path, with_state=True)
    run.save(2, {'rng_state': [rng], 'train_carry': carry, 'log': unevaluated}, ['checkpoint.pth'])
    r = _run(tmp_path).resume(str(tmp_path / 'checkpoint.pth'))
    assert r.start_epoch == 3
    assert set(r.unevaluated) == {'log', 'rng_state', 'train_carry'}
    assert r.unevaluated['log'] == unevaluated and r.unevaluated['train_carry'] == carry
    assert _draws(r.unevaluated['rng_state'][0]) == _draws(rng)
    run.record_accuracy(2, 50.0)
    run.save(2, {'rng_state': [rng], 'log': {**unevaluated, 'test_acc1': 50.0}}, ['checkpoint.pth'])
    assert _run(tmp_path).resume(str(tmp_path / 'checkpoint.pth')).unevaluated is None
    mid = resume.epoch_state_entries(resume.EpochState(step=3, rng_state=rng, epoch_rng_state=rng))
    run.save(3, mid, ['checkpoint.pth'])
    assert _run(tmp_path).resume(str(tmp_path / 'checkpoint.pth')).unevaluated is None

    log = tmp_path / 'log.txt'
    lines = [{'epoch': 0, 'test_acc1': 30.0}, {'epoch': 1, 'train_loss': 1.5}, {'epoch': 2, 'train_loss': 1.4}]
    log.write_text(''.join(json.dumps(x) + '\n' for x in lines))
    checkpoint.replace_log_line(str(tmp_path), {'epoch': 1, 'train_loss': 1.5, 'test_acc1': float('nan')})
    assert [json.loads(x) for x in open(log)] == [lines[0], {'epoch': 1, 'train_loss': 1.5, 'test_acc1': None},
                                                  lines[2]]
    checkpoint.replace_log_line(str(tmp_path), {'epoch': 3, 'test_acc1': 31.0})  # no line of it yet: appended
    assert json.loads(open(log).readlines()[-1]) == {'epoch': 3, 'test_acc1': 31.0}


def test_a_checkpoint_is_estimated_as_weights_and_two_optimizer_moments(tmp_path):
    run = _run(tmp_path)
    n = sum(p.numel() for p in run.model.parameters())
    assert run.estimate_bytes() == 4 * n * 3  # weights + two optimizer moments, fp32


