"""GPU-only paths of the distributed setup, checked without a GPU: a CPU-held EMA under NCCL (broadcast and
evaluation through the GPU), the GPU index of a SLURM task that sees only its own GPU, `--device cuda:N`,
more processes than GPUs, and native bfloat16. CUDA and NCCL are stood in for by fakes that enforce what
the real ones require. And the end of a gloo process group, in two real processes."""

import time

import pytest
import torch

import cli
from run import distributed, errors
from training.step import check_bf16


@pytest.fixture
def fake_gpu(monkeypatch):
    """Tensor.to('cuda') without a GPU: a CPU copy whose storage is recorded as GPU memory; moving such a
    tensor anywhere else gives a fresh CPU copy. Returns `on_gpu(tensor)`."""
    gpu_storage = set()
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        target = kwargs.get('device', next((a for a in args if isinstance(a, (str, torch.device))), None))
        if target is not None and torch.device(target).type == 'cuda':
            out = real_to(self, 'cpu', copy=True)
            gpu_storage.add(out.untyped_storage().data_ptr())
            return out
        if target is not None and self.untyped_storage().data_ptr() in gpu_storage:
            return real_to(self, 'cpu', copy=True)
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, 'to', to)
    return lambda t: t.untyped_storage().data_ptr() in gpu_storage


@pytest.fixture
def fake_nccl(monkeypatch, fake_gpu):
    """A process group whose broadcast, like NCCL's, takes GPU tensors only and here writes 'rank 0's values'
    (ones)."""
    def broadcast(t, src):
        if not fake_gpu(t):
            raise RuntimeError('No backend type associated with device type cpu')
        t.fill_(1.0)

    monkeypatch.setattr(distributed, 'is_dist_avail_and_initialized', lambda: True)
    monkeypatch.setattr(distributed.dist, 'broadcast', broadcast)


def test_cpu_tensors_are_broadcast_through_the_gpu(fake_nccl):
    ema = torch.nn.BatchNorm2d(3)  # an EMA kept on the CPU: weights and running statistics
    tensors = list(ema.state_dict().values())
    floating = [t for t in tensors if t.is_floating_point()]
    distributed.broadcast_tensors_(tensors, device='cuda:0')
    assert all(t.device.type == 'cpu' for t in tensors)
    assert all(torch.equal(t, torch.ones_like(t)) for t in floating)  # rank 0's values arrived


def test_cpu_module_runs_on_the_gpu_for_the_block_and_returns(fake_gpu):
    ema = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4))
    before = {k: v.clone() for k, v in ema.state_dict().items()}
    with distributed.moved_to(ema, 'cuda:0'):
        assert all(fake_gpu(t) for t in ema.state_dict().values())
    assert not any(fake_gpu(t) for t in ema.state_dict().values())
    assert all(torch.equal(before[k], v) for k, v in ema.state_dict().items())


def test_moved_to_the_same_device_changes_nothing():
    m = torch.nn.Linear(2, 2)
    weight = m.weight
    with distributed.moved_to(m, 'cpu'):
        assert m.weight is weight


def test_slurm_task_seeing_only_its_own_gpu_uses_cuda_0(monkeypatch):
    for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK'):
        # init_distributed_mode exports these; setenv first, so that monkeypatch removes them again afterwards
        # (a delenv of an absent variable records nothing to restore)
        monkeypatch.setenv(k, '')
        monkeypatch.delenv(k)
    monkeypatch.setenv('SLURM_PROCID', '3')
    monkeypatch.setenv('SLURM_NTASKS', '4')
    monkeypatch.setenv('SLURM_LOCALID', '3')  # 4th task on its node, given one GPU (--gpus-per-task=1)
    monkeypatch.setenv('MASTER_ADDR', '127.0.0.1')
    monkeypatch.setenv('MASTER_PORT', '29500')
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 1)
    chosen, joined = [], {}

    def set_device(i):
        if not 0 <= i < torch.cuda.device_count():
            raise RuntimeError('CUDA error: invalid device ordinal')
        chosen.append(i)

    monkeypatch.setattr(torch.cuda, 'set_device', set_device)
    monkeypatch.setattr(distributed.dist, 'init_process_group', lambda **kw: joined.update(kw))
    monkeypatch.setattr(distributed, 'barrier', lambda: None)
    monkeypatch.setattr(distributed, 'setup_for_distributed', lambda is_master: None)
    args = distributed.init_distributed_mode(_settings('cuda'))
    assert chosen == [0] and args.gpu == 0 and args.device == 'cuda:0'
    assert joined['device_id'] == torch.device('cuda', 0) and joined['backend'] == 'nccl'
    assert (args.rank, args.world_size, args.launcher) == (3, 4, 'slurm')


def test_one_process_under_torchrun_joins_a_process_group(monkeypatch):
    """torchrun --nproc_per_node=1 runs the DDP code paths (as DeiT does), e.g. to try them on one GPU."""
    for k in ('SLURM_PROCID', 'SLURM_NTASKS', 'LOCAL_RANK'):
        monkeypatch.setenv(k, '')  # recorded, so that the test ends with the variable as it was
        monkeypatch.delenv(k)
    monkeypatch.setenv('RANK', '0')
    monkeypatch.setenv('WORLD_SIZE', '1')
    joined = {}
    monkeypatch.setattr(distributed.dist, 'init_process_group', lambda **kw: joined.update(kw))
    monkeypatch.setattr(distributed, 'barrier', lambda: None)
    monkeypatch.setattr(distributed, 'setup_for_distributed', lambda is_master: None)
    args = distributed.init_distributed_mode(_settings('cpu'))
    assert args.distributed and args.dist_backend == 'gloo' and joined['world_size'] == 1


def _settings(device):
    """The process-group settings of main.py's defaults with `device`."""
    return distributed.DistributedSettings(device=device, dist_url='env://', dist_timeout=60, local_rank=None)


class FakeCuda:
    """torch.cuda of a machine with `n` GPUs (bfloat16 emulated only, as on a V100 or T4): records
    set_device and refuses an index it does not have, as CUDA does."""

    def __init__(self, monkeypatch, n, native_bf16=False):
        self.n, self.native_bf16, self.current, self.bf16_asked = n, native_bf16, None, []
        for name in ('is_available', 'device_count', 'set_device', 'is_bf16_supported', 'get_device_name'):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def is_available(self):
        return True

    def device_count(self):
        return self.n

    def set_device(self, i):
        i = torch.device(i).index if not isinstance(i, int) else i
        if not 0 <= i < self.n:
            raise RuntimeError('CUDA error: invalid device ordinal')
        self.current = i

    def is_bf16_supported(self, including_emulation=True):
        self.bf16_asked.append((self.current, including_emulation))
        return self.native_bf16 or including_emulation

    def get_device_name(self, device=None):
        return 'Tesla V100-SXM2-16GB'


def single_process(monkeypatch):
    for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'SLURM_PROCID', 'SLURM_NTASKS'):
        monkeypatch.setenv(k, '')
        monkeypatch.delenv(k)


def test_one_process_on_cuda_n_makes_gpu_n_the_current_device(monkeypatch):
    """The CUDA RNG state a checkpoint saves, the pin-memory thread and device-less allocations follow the
    current GPU: --device cuda:2 must make GPU 2 current, not leave GPU 0."""
    single_process(monkeypatch)
    cuda = FakeCuda(monkeypatch, 4)
    args = distributed.init_distributed_mode(_settings('cuda:2'))
    assert cuda.current == 2 and args.device == 'cuda:2' and args.gpu == 2 and not args.distributed


def test_more_processes_per_node_than_gpus_is_refused_in_one_line(monkeypatch):
    single_process(monkeypatch)
    for k, v in dict(RANK='3', WORLD_SIZE='4', LOCAL_RANK='3', LOCAL_WORLD_SIZE='4').items():
        monkeypatch.setenv(k, v)  # torchrun --nproc_per_node=4 on a node with 2 GPUs
    FakeCuda(monkeypatch, 2)
    joined = []
    monkeypatch.setattr(distributed.dist, 'init_process_group', lambda **kw: joined.append(kw))
    with pytest.raises(errors.UserError) as ei:
        distributed.init_distributed_mode(_settings('cuda'))
    msg = str(ei.value)
    assert '\n' not in msg and not joined
    assert msg.startswith('4 processes on this node but only 2 visible GPU(s)') and '--nproc_per_node=2' in msg


def test_bf16_is_checked_natively_on_the_process_own_gpu(monkeypatch):
    """--amp bf16 on a GPU that only emulates bfloat16 is refused, and no GPU is touched before the process
    has made its own GPU current."""
    single_process(monkeypatch)
    cuda = FakeCuda(monkeypatch, 2)
    parser = cli.get_args_parser()
    args = parser.parse_args(['--model', 'NALAFORMER_XT', '--amp', 'bf16', '--device', 'cuda:1', '--data-path', '/d'])
    cli.validate_args(args, parser)
    assert cuda.bf16_asked == []  # not before set_device (it would set up a context on GPU 0)
    distributed.init_distributed_mode(_settings('cuda:1'))
    with pytest.raises(errors.UserError, match=r'--amp bf16: Tesla V100\S* has no native bfloat16 .*use --amp fp16'):
        check_bf16('cuda:1')
    assert cuda.bf16_asked == [(1, False)]
    cuda.native_bf16 = True
    check_bf16('cuda:1')  # an A100/H100: accepted
    check_bf16('cpu')  # CPU autocast: no GPU asked
    assert cuda.bf16_asked == [(1, False), (1, False)]


# ------------------------------------------------------------------------------------- the end of a process group
def _rank_ends_while_its_collective_finishes(rank, init_file, teardown_started):
    """Rank 1 destroys its group while a gloo worker thread still runs an all-reduce that waits for rank 0, and
    that worker holds the only reference to the all-reduce's tensor (and so to its Python object)."""
    import torch.distributed as dist
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=2)
    if rank == 1:
        tensor = torch.ones(4)
        dist.all_reduce(tensor, async_op=True)
        del tensor
        teardown_started.set()
    else:
        teardown_started.wait(120)
        time.sleep(1)  # rank 1 is in its teardown, joining the worker thread that waits for this all-reduce
        dist.all_reduce(torch.ones(4))
    distributed.destroy_process_group()


def test_a_rank_exits_when_a_gloo_worker_lets_go_of_a_python_tensor_during_the_teardown(tmp_path):
    """The worker, done with the all-reduce, frees the tensor's Python object, for which it needs the GIL while
    the teardown joins it: torch before 2.8 held the GIL there, and the rank never exited."""
    import multiprocessing as mp
    ctx = mp.get_context('spawn')  # fork() of the multi-threaded test process is unsafe (Python 3.12 warns)
    teardown_started = ctx.Event()
    procs = [ctx.Process(target=_rank_ends_while_its_collective_finishes,
                         args=(r, str(tmp_path / 'init'), teardown_started)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
