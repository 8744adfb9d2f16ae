"""training/step.py: one optimizer step from a window of micro-batches (gradient accumulation equal to one large
batch, a non-finite micro-batch skipping its window, DDP synchronising once per window, one host read per
step in fp32 and fp16, two gloo ranks skipping alike) and the TF32 flags; training/optim.py's EMA update."""
import pytest
import torch
from test_engine import Loader, assert_bitwise_equal, batches, bn_model, ce, linear_model, poisoned

import engine
from run import process
from training import optim
from training.step import OptimizerStep, set_tf32


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
    assert set_tf32('cpu', True) is False
    assert set_tf32(torch.device('cpu'), False) is False
    assert tf32_reads() == flags


def test_set_tf32_on_cuda_keeps_every_precision_read_working(tf32_restored):
    # the flags are plain settings: they can be set (and are restored) without a GPU; mixing the
    # older and newer setting APIs would make the older reads raise RuntimeError
    assert set_tf32('cuda', True) is True
    on = tf32_reads()
    assert on['matmul precision'] == 'high' and on['matmul allow_tf32'] and on['cudnn allow_tf32']
    assert on.get('matmul fp32_precision', 'tf32') == 'tf32' and on.get('conv fp32_precision', 'tf32') == 'tf32'
    set_tf32('cuda:0', False)
    off = tf32_reads()
    assert off['matmul precision'] == 'highest' and not off['matmul allow_tf32'] and not off['cudnn allow_tf32']
    assert off.get('matmul fp32_precision', 'ieee') == 'ieee' and off.get('conv fp32_precision') != 'tf32'


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
    step = OptimizerStep(opt, 'cpu', accum_steps=accum_steps)
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
    flag = process.StopFlag()
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


def test_a_skipped_window_puts_back_the_buffers_the_model_holds_now(one_thread):
    """The modules that hold buffers are gathered once per model, their buffers looked up at every window:
    after .to() has replaced the buffers, a skipped window restores the model's new ones, and a window of
    another model object saves and restores that object's."""
    model = bn_model()
    step = OptimizerStep(torch.optim.SGD(model.parameters(), lr=0.1), 'cpu')
    (x, y), = batches(1)
    assert step(model, ce, x, y).non_finite is None
    model.to(torch.float64)  # new buffer tensors (running statistics), the same modules
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad_x, _ = poisoned((x.double(), y))
    assert step(model, ce, bad_x, y).non_finite is not None
    assert_bitwise_equal(model.state_dict(), before)
    other = bn_model(seed=1)
    other_before = {k: v.clone() for k, v in other.state_dict().items()}
    assert step(other, ce, *poisoned((x, y))).non_finite is not None
    assert_bitwise_equal(other.state_dict(), other_before)
    assert_bitwise_equal(model.state_dict(), before)


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
    engine.train_one_epoch(model, ce, Loader(batches(5)), OptimizerStep(opt, 'cpu', accum_steps=2), 0,
                           engine.TrainSettings(print_freq=1000))
    # windows (0, 1), (2, 3), (4): forward and backward of 0 and 2 under no_sync, the rest synchronised
    assert model.forwards == [False, True, False, True, True]
    assert model.backwards == [False, True, False, True, True]
    assert steps(opt) == 3


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
    step = OptimizerStep(opt, 'cpu', torch.float16 if fp16 else None, scaler, clip_grad=1.0,
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
                                 OptimizerStep(opt, 'cpu', torch.float16, eng_scaler, clip_grad=1.0),
                                 0, engine.TrainSettings(print_freq=1000))
    assert res.stats['skipped_steps'] > 0  # overflow steps happened
    assert eng_scaler.get_scale() == ref_scaler.get_scale()
    assert_bitwise_equal(model.state_dict(), ref_model.state_dict())
    # a non-finite loss is not an overflow: the window is skipped with the scale as it was
    before = eng_scaler.get_scale()
    res = engine.train_one_epoch(model, ce, Loader([poisoned(good[0])]),
                                 OptimizerStep(opt, 'cpu', torch.float16, eng_scaler), 1,
                                 engine.TrainSettings(print_freq=1000))
    assert res.stats['skipped_steps'] == 1 and eng_scaler.get_scale() == before


def _ddp_rank(rank, init_file, out):
    """One rank of a 2-process DDP run (_ddp_results); its DDP model is gone before the group is destroyed."""
    import torch.distributed as dist

    from run import distributed
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=2)
    out.put(_ddp_results(rank))
    distributed.destroy_process_group()


def _ddp_results(rank):
    """A 2-process DDP run with 2 micro-batches per step: the all-reduces DDP issues, the weights, and the host
    reads per optimizer step."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from run import distributed
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
    res = engine.train_one_epoch(ddp, criterion, Loader(data), OptimizerStep(opt, 'cpu', accum_steps=2), 0,
                                 engine.TrainSettings(print_freq=1000))
    reduced_at = list(allreduces)
    reads = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        for n in (2, 6):
            recorder = HostReads(monkeypatch)
            engine.train_one_epoch(ddp, ce, Loader(batches(2 * n, seed=20 + rank)),
                                   OptimizerStep(opt, 'cpu', accum_steps=2), 1,
                                   engine.TrainSettings(print_freq=1000))
            reads[n] = recorder.reads
            monkeypatch.undo()
    return (rank, reduced_at, res.stats['skipped_steps'], (reads[6] - reads[2]) / 4,
            distributed.state_digest(dict(ddp.module.named_parameters())))  # BatchNorm statistics are per rank


def test_two_ranks_skip_a_window_alike_with_one_gradient_all_reduce_per_step(tmp_path):
    """A NaN micro-batch on rank 1 skips the window on both ranks; every window, the skipped one included,
    all-reduces its gradients exactly once (a skipped window leaves no DDP reduction armed for the next one),
    both ranks end with the same weights, and an optimizer step reads one value back per rank."""
    import multiprocessing as mp
    ctx = mp.get_context('spawn')  # fork() of the multi-threaded test process is unsafe (Python 3.12 warns)
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


def test_ema_update_equals_timms_state_dict_update_without_building_state_dicts(monkeypatch, one_thread):
    """ema.ModelEma walks the modules' tensors instead of two state_dict() calls per step: the same numbers
    as timm's ModelEmaV3 (parameters and BatchNorm statistics averaged, the step counter copied), also after
    the EMA was moved (.to() replaces buffers, as an EMA evaluated on another device is)."""
    from timm.utils import ModelEmaV3
    model = bn_model()
    ours, timms = optim.ModelEma(model, decay=0.7), ModelEmaV3(model, decay=0.7)
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

