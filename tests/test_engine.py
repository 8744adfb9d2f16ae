"""engine.py's train_one_epoch and evaluate (no subprocesses): exact evaluation counts, stops at a step
boundary, skipped non-finite steps that leave the model (and its BatchNorm statistics and EMA) untouched,
strict-JSON logs, TF32 precision flags, gradient accumulation, and the random-number state a resumed epoch
replays."""
import json
import math
import random

import numpy as np
import pytest
import torch

import checkpoint_io
import engine
import errors
import metrics
import optim_step
import utils


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
    assert st['acc1'] == pytest.approx(75.0) and st['acc5'] == pytest.approx(100.0)


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
        engine.train_one_epoch(model, crit, loader, optim_step.OptimizerStep(opt, 'cpu'), epoch=3,
                               settings=engine.TrainSettings(max_bad_steps=2, print_freq=100))
    assert 'epoch 3 step 2' in str(ei.value) and '--max-bad-steps 2' in str(ei.value)
    for k, v in model.state_dict().items():  # skipped steps never touched the weights
        assert torch.equal(v, before[k])


def test_stop_flag_ends_epoch_at_a_step_boundary():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(2, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = Loader([(torch.randn(4, 2), torch.zeros(4, dtype=torch.long))] * 5)
    flag = utils.StopFlag()
    flag.signum = 15
    crit = lambda s, o, t: torch.nn.functional.cross_entropy(o, t)  # noqa: E731
    res = engine.train_one_epoch(model, crit, loader, optim_step.OptimizerStep(opt, 'cpu'), epoch=0, stop_flag=flag,
                                 settings=engine.TrainSettings(print_freq=100))
    st = res.state
    assert res.stopped and st.step == 1 and st.rng_state is not None and st.epoch_rng_state is not None


# -------------------------------------------------------------------------------- launch scripts


def test_a_stop_signal_cuts_evaluation_short():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(2, 2))
    loader = Loader([(torch.randn(4, 2), torch.zeros(4, dtype=torch.long))] * 3)
    flag = utils.StopFlag()
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
    res = engine.train_one_epoch(model, ce, Loader(loader), optim_step.OptimizerStep(opt, 'cpu'), epoch, settings,
                                 model_ema=ema, state=state)
    return res, ema


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
    metrics.write_json_line(tmp_path / 'log.txt', {f'train_{k}': v for k, v in res.stats.items()})

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


# -------------------------------------------------------------------------------------------- precision
def tf32_reads():
    """Every way to read the TF32 state: the older names (all releases; Inductor's max-autotune calls
    get_float32_matmul_precision) and, where the installed torch has them, the per-backend ones."""
    reads = {'matmul precision': torch.get_float32_matmul_precision(),
             'matmul allow_tf32': torch.backends.cuda.matmul.allow_tf32,
             'cudnn allow_tf32': torch.backends.cudnn.allow_tf32}
    if hasattr(torch.backends.cuda.matmul, 'fp32_precision'):
        reads['matmul fp32_precision'] = torch.backends.cuda.matmul.fp32_precision
        reads['conv fp32_precision'] = torch.backends.cudnn.conv.fp32_precision
    return reads


@pytest.fixture
def tf32_restored():
    saved = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.allow_tf32 = saved[1]


def test_set_tf32_leaves_the_backend_alone_off_cuda(tf32_restored):
    flags = tf32_reads()
    assert optim_step.set_tf32('cpu', True) is False
    assert optim_step.set_tf32(torch.device('cpu'), False) is False
    assert tf32_reads() == flags


def test_set_tf32_on_cuda_keeps_every_precision_read_working(tf32_restored):
    # the flags are plain settings: they can be set (and are restored) without a GPU; mixing the
    # older and newer setting APIs would make the older reads raise RuntimeError
    assert optim_step.set_tf32('cuda', True) is True
    on = tf32_reads()
    assert on['matmul precision'] == 'high' and on['matmul allow_tf32'] and on['cudnn allow_tf32']
    assert on.get('matmul fp32_precision', 'tf32') == 'tf32' and on.get('conv fp32_precision', 'tf32') == 'tf32'
    optim_step.set_tf32('cuda:0', False)
    off = tf32_reads()
    assert off['matmul precision'] == 'highest' and not off['matmul allow_tf32'] and not off['cudnn allow_tf32']
    assert off.get('matmul fp32_precision', 'ieee') == 'ieee' and off.get('conv fp32_precision') != 'tf32'


# -------------------------------------------------------------------------------- gradient accumulation
def linear_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))


class CountingSGD(torch.optim.SGD):
    """SGD that counts its optimizer steps."""
    n_steps = 0

    def step(self, closure=None):
        self.n_steps += 1
        return super().step(closure)


def steps(opt):
    return opt.n_steps


def run_accum(batch_list, accum_steps, stop_flag=None):
    from timm.utils import ModelEmaV3
    model = linear_model()
    opt = CountingSGD(model.parameters(), lr=0.5, momentum=0.9)  # SGD: a wrong loss scale would show
    ema = ModelEmaV3(model, decay=0.5)
    step = optim_step.OptimizerStep(opt, 'cpu', accum_steps=accum_steps)
    res = engine.train_one_epoch(model, ce, Loader(batch_list), step, 0, engine.TrainSettings(print_freq=1000),
                                 model_ema=ema, stop_flag=stop_flag)
    return model, ema, res, opt


def test_accumulating_two_batches_equals_one_double_batch(one_thread):
    big = batches(3, size=8)
    halves = [(x[i:i + 4], y[i:i + 4]) for x, y in big for i in (0, 4)]
    m1, e1, r1, o1 = run_accum(big, 1)
    m2, e2, r2, o2 = run_accum(halves, 2)
    assert steps(o1) == steps(o2) == 3
    for a, b in ((m1, m2), (e1.module, e2.module)):  # no BatchNorm: equal up to float summation order
        for (k, v), w in zip(a.state_dict().items(), b.state_dict().values()):
            torch.testing.assert_close(v, w, rtol=1e-5, atol=1e-6, msg=k)
    assert r1.stats['loss'] == pytest.approx(r2.stats['loss'], rel=1e-5)
    # and it is not a no-op: one step per small batch (no accumulation) ends elsewhere
    m3, _, _, _ = run_accum(halves, 1)
    assert not torch.allclose(m3[0].weight, m1[0].weight, atol=1e-4)


def test_a_shorter_last_window_still_steps_and_stops_only_at_window_boundaries(one_thread):
    _, _, _, opt = run_accum(batches(5), 2)
    assert steps(opt) == 3  # windows of 2, 2 and 1 batches
    flag = utils.StopFlag()
    flag.signum = 15  # already requested: the first optimizer step ends the epoch
    _, _, res, opt = run_accum(batches(5), 2, stop_flag=flag)
    assert res.stopped and res.state.step == 2
    assert steps(opt) == 1


def test_a_non_finite_micro_step_skips_its_whole_window(one_thread):
    good = batches(4)
    m_ref, e_ref, _, _ = run_accum(good[2:], 2)
    model, ema, res, opt = run_accum([good[0], poisoned(good[1])] + good[2:], 2)
    assert res.stats['skipped_steps'] == 1 and steps(opt) == 1
    assert_bitwise_equal(model.state_dict(), m_ref.state_dict())
    assert_bitwise_equal(ema.module.state_dict(), e_ref.module.state_dict())


class SyncRecorder(torch.nn.Module):
    """Stands in for DDP: records, per forward and per backward, whether no_sync() was active."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.syncing, self.forwards, self.backwards = True, [], []

    def no_sync(self):
        from contextlib import contextmanager

        @contextmanager
        def ctx():
            self.syncing = False
            try:
                yield
            finally:
                self.syncing = True
        return ctx()

    def forward(self, x):
        self.forwards.append(self.syncing)
        out = self.lin(x)
        out.register_hook(lambda g: self.backwards.append(self.syncing))
        return out


def test_only_the_last_micro_step_of_a_window_synchronises(one_thread):
    model = SyncRecorder()
    opt = CountingSGD(model.parameters(), lr=0.1)
    engine.train_one_epoch(model, ce, Loader(batches(5)), optim_step.OptimizerStep(opt, 'cpu', accum_steps=2), 0,
                           engine.TrainSettings(print_freq=1000))
    # windows (0, 1), (2, 3), (4): forward and backward of 0 and 2 under no_sync, the rest synchronised
    assert model.forwards == [False, True, False, True, True]
    assert model.backwards == [False, True, False, True, True]
    assert steps(opt) == 3


# RNG state: a round trip through a weights-only file, preserved_rng, the CUDA state of the own device only
def test_rng_state_round_trip_through_a_weights_only_file(tmp_path):
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    checkpoint_io.save_atomic({'rng': engine.get_rng_state()}, tmp_path / 'r.pth')
    want = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(9)
    np.random.seed(9)
    random.seed(9)
    engine.set_rng_state(torch.load(tmp_path / 'r.pth', weights_only=True)['rng'])
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
    with engine.preserved_rng():
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
    saved = engine.get_rng_state()
    cuda = _FakeCuda(device=3, n_devices=8)
    cuda.install(monkeypatch)
    state = engine.get_rng_state()
    assert torch.equal(state['cuda'], torch.tensor([3], dtype=torch.uint8))
    one = _FakeCuda(device=0, n_devices=1)  # resumed with one visible GPU per process
    one.install(monkeypatch)
    engine.set_rng_state(state)
    assert one.set == [(3, 0)]
    old = dict(state, cuda=[torch.tensor([i], dtype=torch.uint8) for i in range(8)])  # older list form
    engine.set_rng_state(old)
    assert one.set[-1] == (0, 0)
    few = _FakeCuda(device=2, n_devices=4)
    few.install(monkeypatch)
    engine.set_rng_state(dict(state, cuda=[torch.tensor([7], dtype=torch.uint8)]))  # no IndexError
    assert few.set == []
    monkeypatch.undo()
    engine.set_rng_state(saved)


# ------------------------------------------------------------------------------ host reads per optimizer step
class HostReads:
    """The calls that make the host wait for a tensor's value (on a GPU each is a device sync), recorded in
    order with the model's forward and backward passes: Tensor.item/tolist/__bool__/__float__/__int__, and
    torch.tensor(data, device=...), whose copy from the host waits for the device's queue."""

    def __init__(self, monkeypatch):
        self.events = []
        for name in ('item', 'tolist', '__bool__', '__float__', '__int__'):
            real = getattr(torch.Tensor, name)

            def counted(tensor, *a, _real=real, **kw):
                self.events.append('read')
                return _real(tensor, *a, **kw)
            monkeypatch.setattr(torch.Tensor, name, counted)
        real_tensor = torch.tensor

        def tensor(data, *a, **kw):
            if kw.get('device') is not None:
                self.events.append('read')
            return real_tensor(data, *a, **kw)
        monkeypatch.setattr(torch, 'tensor', tensor)

    @property
    def reads(self) -> int:
        return self.events.count('read')

    def reads_between_a_forward_and_its_backward(self) -> int:
        n, inside = 0, False
        for event in self.events:
            inside = (inside or event == 'forward') and event != 'backward'
            n += inside and event == 'read'
        return n


class Recorded(torch.nn.Module):
    """bn_model's layers; each forward and each backward through the output is recorded in `events`."""

    def __init__(self, events):
        super().__init__()
        self.net, self.events = bn_model(), events

    def forward(self, x):
        self.events.append('forward')
        out = self.net(x)
        out.register_hook(lambda grad: self.events.append('backward'))
        return out


def host_reads_per_epoch(monkeypatch, n_windows, accum, fp16, logger):
    from timm.utils import ModelEmaV3
    events = []
    model = Recorded(events)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # SGD's own step reads nothing back
    scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 10) if fp16 else None
    step = optim_step.OptimizerStep(opt, 'cpu', torch.float16 if fp16 else None, scaler, clip_grad=1.0,
                                accum_steps=accum)
    loader = Loader(batches(n_windows * accum))
    recorder = HostReads(monkeypatch)
    recorder.events = events
    engine.train_one_epoch(model, ce, loader, step, 0, engine.TrainSettings(print_freq=1000),
                           model_ema=ModelEmaV3(model, decay=0.5), logger=(lambda values: None) if logger else None)
    monkeypatch.undo()
    return recorder


@pytest.mark.parametrize('accum', [1, 4])
@pytest.mark.parametrize('precision', ['fp32', 'fp16', 'fp16+logger'])
def test_an_optimizer_step_reads_one_value_back_and_none_before_its_backward(monkeypatch, one_thread, accum,
                                                                                 precision):
    """At most one host read per optimizer step, whatever the number of micro-batches, the precision (fp16 with
    GradScaler) or a per-step logger; none between a forward and its backward. The progress line's values are
    read every print-freq steps, not per step (the epochs' two progress lines read the same in both)."""
    fp16, logger = precision.startswith('fp16'), precision.endswith('logger')
    short = host_reads_per_epoch(monkeypatch, 2, accum, fp16, logger)
    long = host_reads_per_epoch(monkeypatch, 6, accum, fp16, logger)
    assert (long.reads - short.reads) / 4 <= 1, (short.reads, long.reads)
    assert long.reads_between_a_forward_and_its_backward() == 0


def plain_fp16_training(model, batch_list, scaler, clip):
    """GradScaler's documented loop, the reference for the engine's fp16 steps."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batch_list:
        opt.zero_grad(set_to_none=True)
        with torch.autocast('cpu', dtype=torch.float16):
            loss = ce(x, model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
    return opt


def test_fp16_overflow_steps_match_gradscalers_own_loop(one_thread):
    """The engine decides on the device whether fp16 gradients overflowed (and reads that with the step's one
    flag) instead of letting GradScaler.step read it back: the same steps are skipped, the same scale results."""
    good = batches(8)

    def scaler():  # starts far too high: the first steps overflow; grows every 2 finite steps
        return torch.amp.GradScaler('cpu', init_scale=2.0 ** 40, growth_interval=2)
    ref_model, ref_scaler = bn_model(), scaler()
    plain_fp16_training(ref_model, good, ref_scaler, clip=1.0)
    model, eng_scaler = bn_model(), scaler()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    res = engine.train_one_epoch(model, ce, Loader(good),
                                 optim_step.OptimizerStep(opt, 'cpu', torch.float16, eng_scaler, clip_grad=1.0),
                                 0, engine.TrainSettings(print_freq=1000))
    assert res.stats['skipped_steps'] > 0  # overflow steps happened
    assert eng_scaler.get_scale() == ref_scaler.get_scale()
    assert_bitwise_equal(model.state_dict(), ref_model.state_dict())
    # a non-finite loss is not an overflow: the window is skipped with the scale as it was
    before = eng_scaler.get_scale()
    res = engine.train_one_epoch(model, ce, Loader([poisoned(good[0])]),
                                 optim_step.OptimizerStep(opt, 'cpu', torch.float16, eng_scaler), 1,
                                 engine.TrainSettings(print_freq=1000))
    assert res.stats['skipped_steps'] == 1 and eng_scaler.get_scale() == before


# ------------------------------------------------------------------------------ two ranks (gloo, forked)
def _ddp_rank(rank, init_file, out):
    """One rank of a 2-process DDP run with 2 micro-batches per step: the all-reduces DDP issues, the weights,
    and the host reads per optimizer step."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import distributed
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=2)
    torch.set_num_threads(1)
    forwards, allreduces = [], []  # the micro-batch (1, 2, ...) whose backward issued each gradient all-reduce

    def counted(state, bucket):
        allreduces.append(len(forwards))
        return default_hooks.allreduce_hook(state, bucket)

    def criterion(samples, outputs, targets):
        forwards.append(1)
        return ce(samples, outputs, targets)
    ddp = torch.nn.parallel.DistributedDataParallel(bn_model())
    ddp.register_comm_hook(None, counted)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    data = batches(6, seed=10 + rank)
    if rank == 1:
        data[2] = poisoned(data[2])  # the first micro-batch of the second of three windows
    res = engine.train_one_epoch(ddp, criterion, Loader(data), optim_step.OptimizerStep(opt, 'cpu', accum_steps=2), 0,
                                 engine.TrainSettings(print_freq=1000))
    reduced_at = list(allreduces)
    reads = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        for n in (2, 6):
            recorder = HostReads(monkeypatch)
            engine.train_one_epoch(ddp, ce, Loader(batches(2 * n, seed=20 + rank)),
                                   optim_step.OptimizerStep(opt, 'cpu', accum_steps=2), 1,
                                   engine.TrainSettings(print_freq=1000))
            reads[n] = recorder.reads
            monkeypatch.undo()
    out.put((rank, reduced_at, res.stats['skipped_steps'], (reads[6] - reads[2]) / 4,
             distributed.state_digest(dict(ddp.module.named_parameters()))))  # BatchNorm statistics are per rank
    dist.destroy_process_group()


def test_two_ranks_skip_a_window_alike_with_one_gradient_all_reduce_per_step(tmp_path):
    """A NaN micro-batch on rank 1 skips the window on both ranks; every window, the skipped one included,
    all-reduces its gradients exactly once (a skipped window leaves no DDP reduction armed for the next one),
    both ranks end with the same weights, and an optimizer step reads one value back per rank."""
    import multiprocessing as mp
    ctx = mp.get_context('fork')
    out = ctx.Queue()
    procs = [ctx.Process(target=_ddp_rank, args=(r, str(tmp_path / 'init'), out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    (_, reduced0, skipped0, reads0, digest0), (_, reduced1, skipped1, reads1, digest1) = results
    assert reduced0 == reduced1 == [2, 4, 6]  # the one bucket all-reduced by each window's last micro-batch
    assert skipped0 == skipped1 == 1 and digest0 == digest1
    assert reads0 <= 1 and reads1 <= 1


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
    res = engine.train_one_epoch(model, ce, Loader(data), optim_step.OptimizerStep(opt, 'cpu', accum_steps=2), 0,
                                 engine.TrainSettings(print_freq=3))
    lines = re.findall(r'\[ ?(\d+)/10\].*?loss: ([\d.]+) \(([\d.]+)\)', capsys.readouterr().out)
    assert [int(i) for i, _, _ in lines] == [3, 6, 9]  # (the line after micro-batch 0 has no loss yet)
    for i, median, avg in lines:
        seen = losses[:(int(i) + 1) // 2 * 2]  # the losses of the windows finished by micro-batch i
        assert (median, avg) == (f'{statistics.median(seen[-20:]):.4f}', f'{sum(seen) / len(seen):.4f}')
    assert res.stats['loss'] == sum(losses) / len(losses)


# ------------------------------------------------------------------------------ the EMA update
def test_ema_update_equals_timms_state_dict_update_without_building_state_dicts(monkeypatch, one_thread):
    """optim_step.ModelEma walks the modules' tensors instead of two state_dict() calls per step: the same numbers
    as timm's ModelEmaV3 (parameters and BatchNorm statistics averaged, the step counter copied), also after
    the EMA was moved (.to() replaces buffers, as an EMA evaluated on another device is)."""
    from timm.utils import ModelEmaV3
    model = bn_model()
    ours, timms = optim_step.ModelEma(model, decay=0.7), ModelEmaV3(model, decay=0.7)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, (x, y) in enumerate(batches(4)):
        opt.zero_grad()
        ce(x, model(x), y).backward()
        opt.step()
        timms.update(model)
        if i == 2:
            ours.module.to(torch.float64).to(torch.float32)
        with monkeypatch.context() as m:
            m.setattr(torch.nn.Module, 'state_dict', lambda *a, **k: pytest.fail('state_dict() built'))
            ours.update(model)
    assert_bitwise_equal(ours.module.state_dict(), timms.module.state_dict())
    assert int(ours.module[1].num_batches_tracked) == 4
