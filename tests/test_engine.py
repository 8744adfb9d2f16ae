"""engine.py's train_one_epoch and evaluate (no subprocesses): exact evaluation counts, stops at a step
boundary, skipped non-finite steps that leave the model (and its BatchNorm statistics and EMA) untouched,
strict-JSON logs, the random-number state a resumed epoch replays, and progress lines of every micro-batch's
loss. The optimizer step itself (accumulation, host reads, fp16, two ranks, the EMA): tests/test_optim_step.py."""
import json
import math
import random

import numpy as np
import pytest
import torch

import engine
from run import checkpoint, errors, process, resume
from training.step import OptimizerStep


# -------------------------------------------------------------------------------- evaluate, stops
class Loader(list):
    """A list of (samples, targets) batches that train_one_epoch accepts as a data loader."""
    batch_size = 4


def test_evaluate_counts_exactly_and_excludes_undecodable_images():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(2, 3, bias=False))
    with torch.no_grad():
        model[1].weight.copy_(torch.tensor([[1., 0], [0, 1], [-1, -1]]))
    x = torch.tensor([[5., 0], [0, 5], [-5, -5], [5, 0], [0, 5]])
    y = torch.tensor([0, 1, 2, 1, -100])  # one wrong, one undecodable (IGNORE_TARGET)
    loader = Loader([(x[:4].view(4, 2, 1, 1), y[:4]), (x[4:].view(1, 2, 1, 1), y[4:])])
    st = engine.evaluate(loader, model, 'cpu')
    assert st['n'] == 4 and st['seen'] == 5
    assert st['acc1'] == pytest.approx(75.0) and st['acc3'] == pytest.approx(100.0)  # 3 classes: top-3


@pytest.mark.parametrize('classes, key', [(10, 'acc5'), (5, 'acc5'), (3, 'acc3'), (2, 'acc2'), (1, None)])
def test_top_k_is_top_5_or_top_of_every_class_and_named_by_its_k(classes, key, capsys):
    """With fewer than 5 classes the second accuracy is top-(classes), named so (key and printed line), not
    'Acc@5'; one class has top-1 only."""
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(2, classes))
    st = engine.evaluate(Loader([(torch.randn(4, 2, 1, 1), torch.zeros(4, dtype=torch.long))]), model, 'cpu')
    assert engine.topk_key(st) == key and [k for k in st if k.startswith('acc')] == ['acc1'] + ([key] if key else [])
    star = [line for line in capsys.readouterr().out.splitlines() if line.startswith('* Acc@1')]
    assert len(star) == 1 and (f' Acc@{key[3:]} ' in star[0] if key else ' loss ' in star[0]) and (
        'Acc@5' not in star[0] or key == 'acc5'), star


def count_host_reads(monkeypatch):
    """Count the calls that make the host wait for a tensor's value (on a GPU: a device sync)."""
    calls = []
    for name in ('item', 'tolist', '__bool__', '__float__', '__int__'):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


@pytest.mark.parametrize('print_freq', [1000, 3])
def test_evaluate_reads_its_sums_from_the_device_once_not_per_batch(monkeypatch, print_freq):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(2, 3))
    x, y = torch.randn(32, 2), torch.randint(0, 3, (32,))
    y[5] = -100  # undecodable: not counted
    reads = {}
    for n_batches in (2, 8):
        loader = Loader([(x[i::n_batches].view(-1, 2, 1, 1), y[i::n_batches]) for i in range(n_batches)])
        calls = count_host_reads(monkeypatch)
        st = engine.evaluate(loader, model, 'cpu', print_freq=print_freq)
        monkeypatch.undo()
        reads[n_batches] = len(calls)
        assert st['n'] == 31 and st['seen'] == 32
        with torch.no_grad():
            ref = torch.nn.functional.cross_entropy(model(x.view(-1, 2, 1, 1)), y, ignore_index=-100).item()
        assert st['loss'] == pytest.approx(ref, rel=1e-5)
    if print_freq > 8:  # the first and last batch print a line: the same reads whatever the length
        assert reads[8] == reads[2], reads
    else:  # one read per progress line only
        assert reads[8] - reads[2] == 2, reads


class _NaNModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.lin(x.flatten(1)) * float('nan')


def test_non_finite_loss_is_skipped_then_stops_with_epoch_and_step():
    model = _NaNModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = Loader([(torch.ones(4, 2), torch.zeros(4, dtype=torch.long))] * 6)
    crit = lambda s, o, t: torch.nn.functional.cross_entropy(o, t)  # noqa: E731
    with pytest.raises(errors.NonFiniteLossError) as ei:
        engine.train_one_epoch(model, crit, loader, OptimizerStep(opt, 'cpu'), epoch=3,
                               settings=engine.TrainSettings(max_bad_steps=2, print_freq=100))
    assert 'epoch 3 step 2' in str(ei.value) and '--max-bad-steps 2' in str(ei.value)
    for k, v in model.state_dict().items():  # skipped steps never touched the weights
        assert torch.equal(v, before[k])


def test_stop_flag_ends_epoch_at_a_step_boundary():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(2, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = Loader([(torch.randn(4, 2), torch.zeros(4, dtype=torch.long))] * 5)
    flag = process.StopFlag()
    flag.signum = 15
    crit = lambda s, o, t: torch.nn.functional.cross_entropy(o, t)  # noqa: E731
    res = engine.train_one_epoch(model, crit, loader, OptimizerStep(opt, 'cpu'), epoch=0, stop_flag=flag,
                                 settings=engine.TrainSettings(print_freq=100))
    st = res.state
    assert res.stopped and st.step == 1 and st.rng_state is not None and st.epoch_rng_state is not None


# -------------------------------------------------------------------------------- launch scripts


def test_a_stop_signal_cuts_evaluation_short():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(2, 2))
    loader = Loader([(torch.randn(4, 2), torch.zeros(4, dtype=torch.long))] * 3)
    flag = process.StopFlag()
    assert not engine.evaluate(loader, model, 'cpu', stop_flag=flag)['aborted']
    flag.signum = 15
    st = engine.evaluate(loader, model, 'cpu', stop_flag=flag)
    assert st['aborted'] and st['n'] == 0


# ---------------------------------------------------------------------------------------- skipped steps
def ce(samples, outputs, targets):
    return torch.nn.functional.cross_entropy(outputs, targets)


def bn_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(), torch.nn.Linear(6, 3))


def batches(n, seed=1, size=4):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 4, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(n)]


def poisoned(batch):
    """A batch whose forward writes inf/NaN into BatchNorm's running statistics and gives a NaN loss."""
    x, y = batch
    x = x.clone()
    x[0, 0] = float('inf')
    return x, y


def train(model, loader, epoch=0, max_bad_steps=20, state=None, ema=None):
    from timm.utils import ModelEmaV3
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ema = ema or ModelEmaV3(model, decay=0.5)
    settings = engine.TrainSettings(print_freq=1000, max_bad_steps=max_bad_steps)
    res = engine.train_one_epoch(model, ce, Loader(loader), OptimizerStep(opt, 'cpu'), epoch, settings,
                                 model_ema=ema, state=state)
    return res, ema


def linear_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))



def assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, diff


def test_a_skipped_step_leaves_batchnorm_statistics_and_ema_untouched(one_thread):
    good = batches(2)
    ref_model = bn_model()
    _, ref_ema = train(ref_model, good)
    model = bn_model()
    res, ema = train(model, [good[0], poisoned(good[1]), good[1]])
    assert res.stats['skipped_steps'] == 1 and res.state.bad_steps == 0
    assert res.state.skipped_steps == 0  # the state to continue from: the next epoch, which has skipped none
    assert torch.isfinite(model[1].running_mean).all()
    # skipping the poisoned batch is exactly as if it never existed: weights, BN statistics and EMA
    assert_bitwise_equal(model.state_dict(), ref_model.state_dict())
    assert_bitwise_equal(ema.module.state_dict(), ref_ema.module.state_dict())


def test_an_epoch_of_skipped_steps_changes_nothing_and_logs_strict_json(one_thread, tmp_path):
    model = bn_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res, ema = train(model, [poisoned(b) for b in batches(3)])
    assert res.stats['skipped_steps'] == 3 and res.state.bad_steps == 3
    assert_bitwise_equal(model.state_dict(), before)
    assert_bitwise_equal(ema.module.state_dict(), before)
    assert math.isnan(res.stats['loss'])
    checkpoint.write_json_line(tmp_path / 'log.txt', {f'train_{k}': v for k, v in res.stats.items()})

    def no_constants(name):
        raise ValueError(f'non-standard JSON constant {name}')
    line = json.loads((tmp_path / 'log.txt').read_text(), parse_constant=no_constants)
    assert line['train_loss'] is None and line['train_skipped_steps'] == 3


def test_consecutive_bad_steps_are_counted_across_epochs(one_thread):
    model = bn_model()
    good = batches(3)
    res, ema = train(model, [good[0], poisoned(good[1]), poisoned(good[2])], epoch=0, max_bad_steps=2)
    assert res.state.bad_steps == 2  # (tests/test_checkpoint.py: the count survives a checkpoint)
    with pytest.raises(errors.NonFiniteLossError) as ei:
        train(model, [poisoned(good[0]), good[1]], epoch=1, max_bad_steps=2, state=res.state, ema=ema)
    assert 'epoch 1 step 0' in str(ei.value) and '3 consecutive' in str(ei.value)


# RNG state: a round trip through a weights-only file, preserved_rng, the CUDA state of the own device only
def test_rng_state_round_trip_through_a_weights_only_file(tmp_path):
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    checkpoint.save_atomic({'rng': resume.get_rng_state()}, tmp_path / 'r.pth')
    want = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(9)
    np.random.seed(9)
    random.seed(9)
    resume.set_rng_state(torch.load(tmp_path / 'r.pth', weights_only=True)['rng'])
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(want[0], got[0]) and np.array_equal(want[1], got[1]) and want[2] == got[2]


def test_preserved_rng_restores_every_generator():
    def seed():
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)

    def draw():
        return torch.rand(1).item(), float(np.random.rand()), random.random()

    seed()
    want = draw()
    seed()
    with resume.preserved_rng():
        draw()
    assert draw() == want


class _FakeCuda:
    def __init__(self, device, n_devices):
        self.device, self.set = device, []
        self.states = [torch.tensor([i], dtype=torch.uint8) for i in range(n_devices)]

    def install(self, monkeypatch):
        c = torch.cuda
        monkeypatch.setattr(c, 'is_available', lambda: True)
        monkeypatch.setattr(c, 'is_initialized', lambda: True)
        monkeypatch.setattr(c, 'current_device', lambda: self.device)
        monkeypatch.setattr(c, 'get_rng_state', lambda device='cuda': self.states[device])
        monkeypatch.setattr(c, 'set_rng_state', lambda state, device='cuda': self.set.append((int(state[0]), device)))
        monkeypatch.setattr(c, 'get_rng_state_all', lambda: pytest.fail('every device saved'))
        monkeypatch.setattr(c, 'set_rng_state_all', lambda s: pytest.fail('every device restored'))


def test_cuda_rng_state_is_the_own_device_only(monkeypatch):
    saved = resume.get_rng_state()
    cuda = _FakeCuda(device=3, n_devices=8)
    cuda.install(monkeypatch)
    state = resume.get_rng_state()
    assert torch.equal(state['cuda'], torch.tensor([3], dtype=torch.uint8))
    one = _FakeCuda(device=0, n_devices=1)  # resumed with one visible GPU per process
    one.install(monkeypatch)
    resume.set_rng_state(state)
    assert one.set == [(3, 0)]
    old = dict(state, cuda=[torch.tensor([i], dtype=torch.uint8) for i in range(8)])  # older list form
    resume.set_rng_state(old)
    assert one.set[-1] == (0, 0)
    few = _FakeCuda(device=2, n_devices=4)
    few.install(monkeypatch)
    resume.set_rng_state(dict(state, cuda=[torch.tensor([7], dtype=torch.uint8)]))  # no IndexError
    assert few.set == []
    monkeypatch.undo()
    resume.set_rng_state(saved)


def test_progress_lines_and_epoch_loss_are_those_of_every_micro_batch_loss(one_thread, capsys):
    """The losses read back every print-freq steps make the same progress lines (median of the last 20
    micro-batch losses, and their running average) and epoch loss as reading each loss at its step."""
    import re
    import statistics
    data = batches(10)
    ref = linear_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for w in range(0, 10, 2):  # the plain loop: two micro-batches per step
        opt.zero_grad(set_to_none=True)
        for x, y in data[w:w + 2]:
            loss = ce(x, ref(x), y)
            losses.append(loss.item())
            (loss / 2).backward()
        opt.step()
    model = linear_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    capsys.readouterr()
    res = engine.train_one_epoch(model, ce, Loader(data), OptimizerStep(opt, 'cpu', accum_steps=2), 0,
                                 engine.TrainSettings(print_freq=3))
    lines = re.findall(r'\[ ?(\d+)/10\].*?loss: ([\d.]+) \(([\d.]+)\)', capsys.readouterr().out)
    assert [int(i) for i, _, _ in lines] == [3, 6, 9]  # (the line after micro-batch 0 has no loss yet)
    for i, median, avg in lines:
        seen = losses[:(int(i) + 1) // 2 * 2]  # the losses of the windows finished by micro-batch i
        assert (median, avg) == (f'{statistics.median(seen[-20:]):.4f}', f'{sum(seen) / len(seen):.4f}')
    assert res.stats['loss'] == sum(losses) / len(losses)


