"""Helpers of the training engine: distributed setup, progress logging, RNG state, signals (the
checkpoint format lives in checkpoint.py).

Everything here is independent of the model: the engine only needs `import models` to register the
NaLaFormer variants in timm.
"""
import contextlib
import datetime
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict, deque

import numpy as np
import torch
import torch.distributed as dist

# --------------------------------------------------------------------------------------------------
# CPU memory allocator
# --------------------------------------------------------------------------------------------------

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameter numbers (malloc.h)


def retain_freed_cpu_memory() -> bool:
    """Keep freed CPU memory in the process for reuse instead of handing it back to the OS.

    glibc serves blocks above its mmap threshold (adaptive, at most 32 MiB) with a fresh ``mmap`` and
    unmaps them on free, so every large activation of every step page-faults and is zeroed again by
    the kernel. With mmap and heap trimming off, freed blocks are reused as they are. The cost: the
    process keeps its peak heap, and glibc's aligned allocations leave gaps that grow it for the first
    steps (figures in docs/performance.md). Returns False, changing nothing, where glibc's ``mallopt``
    is not available.
    """
    import ctypes
    import ctypes.util
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6').mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 ** 31 - 1))


# --------------------------------------------------------------------------------------------------
# Errors that end the run with one line and a non-zero exit status (no stack trace).
# --------------------------------------------------------------------------------------------------
class UserError(Exception):
    """A problem the user can fix (bad flag, bad file, bad checkpoint): printed as one line."""

    exit_code = 1


class CheckpointError(UserError):
    pass


class CheckpointWriteError(UserError):
    pass


class NonFiniteLossError(UserError):
    pass


class PeerLostError(UserError):
    """Another process of the job died or stopped answering."""


# --------------------------------------------------------------------------------------------------
# Distributed
# --------------------------------------------------------------------------------------------------
def is_dist_avail_and_initialized():
    return dist.is_available() and dist.is_initialized()


def get_world_size():
    return dist.get_world_size() if is_dist_avail_and_initialized() else 1


def get_rank():
    return dist.get_rank() if is_dist_avail_and_initialized() else 0


def is_main_process():
    return get_rank() == 0


def launch_env():
    """(rank, world_size, local_rank, launcher) read from the environment, without starting anything.

    torchrun and `torch.distributed.launch --use_env` set RANK/WORLD_SIZE/LOCAL_RANK; SLURM's srun
    sets SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID; otherwise this is a plain single process.
    """
    env = os.environ
    if 'RANK' in env and 'WORLD_SIZE' in env:
        return int(env['RANK']), int(env['WORLD_SIZE']), int(env.get('LOCAL_RANK', 0)), 'torchrun'
    if 'SLURM_PROCID' in env and int(env.get('SLURM_NTASKS', '1')) > 1:
        return int(env['SLURM_PROCID']), int(env['SLURM_NTASKS']), int(env.get('SLURM_LOCALID', 0)), 'slurm'
    return 0, 1, 0, 'none'


def _slurm_master_addr():
    nodelist = (os.environ.get('SLURM_STEP_NODELIST') or os.environ.get('SLURM_JOB_NODELIST')
                or os.environ.get('SLURM_NODELIST', ''))
    try:
        out = subprocess.run(['scontrol', 'show', 'hostnames', nodelist], capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    # simple fallback for "node[01-04],other" style lists: take the first host
    first = nodelist.split(',')[0]
    if '[' in first:
        prefix, rest = first.split('[', 1)
        first = prefix + rest.split('-')[0].split(',')[0].rstrip(']')
    return first or '127.0.0.1'


def init_distributed_mode(args):
    """Start the process group when a launcher (torchrun, srun with several tasks) started this process, also
    for one process; sets args.rank, args.world_size, args.gpu, args.distributed, args.dist_backend and
    args.device."""
    rank, world_size, local_rank, launcher = launch_env()
    if args.local_rank is not None and launcher == 'none':
        # old `torch.distributed.launch` without --use_env passes --local-rank; the rest is in env
        local_rank = args.local_rank
    use_cuda = str(args.device).startswith('cuda') and torch.cuda.is_available()
    # the GPU of this process among those it can see: with one GPU per task (SLURM's --gpus-per-task, or
    # CUDA_VISIBLE_DEVICES set per process) every process sees only its own, as cuda:0 (as DeiT does)
    gpu = local_rank % torch.cuda.device_count() if use_cuda else local_rank
    args.rank, args.world_size, args.gpu, args.launcher = rank, world_size, gpu, launcher
    if use_cuda:
        args.device = f'cuda:{gpu}' if launcher != 'none' else (args.device if ':' in str(args.device) else 'cuda')
    else:
        args.device = 'cpu'
    if launcher == 'none':  # a launcher starts a process group even for one process (DDP paths on one GPU)
        args.distributed = False
        args.dist_backend = None
        return
    if launcher == 'slurm':
        os.environ.setdefault('MASTER_ADDR', _slurm_master_addr())
        os.environ.setdefault('MASTER_PORT', '29500')
        os.environ['RANK'], os.environ['WORLD_SIZE'] = str(rank), str(world_size)
        os.environ['LOCAL_RANK'] = str(local_rank)
    args.distributed = True
    args.dist_backend = 'nccl' if use_cuda else 'gloo'
    if use_cuda:
        torch.cuda.set_device(gpu)
    kwargs = dict(backend=args.dist_backend, init_method=args.dist_url, world_size=world_size, rank=rank,
                  timeout=datetime.timedelta(seconds=args.dist_timeout))
    if use_cuda:
        kwargs['device_id'] = torch.device('cuda', gpu)
    try:
        dist.init_process_group(**kwargs)
    except Exception as e:  # report rendezvous problems as one line
        raise PeerLostError(f'could not join the process group (rank {rank} of {world_size}, '
                            f'{args.dist_url}, backend {args.dist_backend}): {first_line(e)}') from e
    barrier()
    setup_for_distributed(rank == 0)


def barrier():
    if is_dist_avail_and_initialized():
        dist.barrier()


def setup_for_distributed(is_master):
    """Only rank 0 prints, unless print(..., force=True)."""
    import builtins as __builtin__
    builtin_print = __builtin__.print

    def print(*args, **kwargs):
        force = kwargs.pop('force', False)
        if is_master or force:
            builtin_print(*args, **kwargs)

    __builtin__.print = print


def broadcast_tensors_(tensors, src=0, device=None):
    """Overwrite the tensors of every rank with rank `src`'s (in place). A tensor not on `device` (the
    process group's device) travels through it: NCCL only broadcasts CUDA tensors, and an EMA kept on the
    CPU (--model-ema-force-cpu) holds CPU tensors."""
    if not is_dist_avail_and_initialized():
        return
    device = torch.device(device) if device is not None else None
    for t in tensors:
        if device is None or t.device == device:
            dist.broadcast(t.data, src)
        else:
            staged = t.data.to(device)
            dist.broadcast(staged, src)
            t.data.copy_(staged)


@contextlib.contextmanager
def moved_to(module, device):
    """Run the block with `module` on `device`, then move it back to where its parameters were (evaluate
    a CPU-held EMA on the GPU the data and the collectives of the evaluation use)."""
    home = next(module.parameters()).device
    device = torch.device(device)
    if device == home:
        yield module
        return
    module.to(device)
    try:
        yield module
    finally:
        module.to(home)


def all_reduce_sum(values, device):
    """Sum a list of numbers over all processes (float64 so counts stay exact)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if is_dist_avail_and_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_max(values, device):
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if is_dist_avail_and_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def first_line(e):
    msg = str(e).strip().splitlines()
    return msg[0] if msg else type(e).__name__


# --------------------------------------------------------------------------------------------------
# Progress logging (DeiT/torchvision MetricLogger with an img/s meter)
# --------------------------------------------------------------------------------------------------
class SmoothedValue:
    def __init__(self, window_size=20, fmt=None):
        self.deque = deque(maxlen=window_size)
        self.total = 0.0
        self.count = 0
        self.fmt = fmt or '{median:.4f} ({global_avg:.4f})'

    def update(self, value, n=1):
        self.deque.append(value)
        self.count += n
        self.total += value * n

    def synchronize_between_processes(self, device='cpu'):
        if not is_dist_avail_and_initialized():
            return
        count, total = all_reduce_sum([self.count, self.total], device)
        self.count, self.total = int(count), total

    @property
    def median(self):
        return float(np.median(list(self.deque))) if self.deque else 0.0

    @property
    def avg(self):
        return float(np.mean(list(self.deque))) if self.deque else 0.0

    @property
    def global_avg(self):
        return self.total / max(self.count, 1)

    @property
    def max(self):
        return max(self.deque) if self.deque else 0.0

    @property
    def value(self):
        return self.deque[-1] if self.deque else 0.0

    def __str__(self):
        return self.fmt.format(median=self.median, avg=self.avg, global_avg=self.global_avg,
                               max=self.max, value=self.value)


class MetricLogger:
    def __init__(self, delimiter='  '):
        self.meters = defaultdict(SmoothedValue)
        self.delimiter = delimiter

    def update(self, n=1, **kwargs):
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                v = v.item()
            self.meters[k].update(float(v), n=n)

    def __getattr__(self, attr):
        if attr in self.__dict__.get('meters', {}):
            return self.meters[attr]
        raise AttributeError(attr)

    def __str__(self):
        return self.delimiter.join(f'{name}: {meter}' for name, meter in self.meters.items())

    def synchronize_between_processes(self, device='cpu'):
        for meter in self.meters.values():
            meter.synchronize_between_processes(device)

    def add_meter(self, name, meter):
        self.meters[name] = meter

    def log_every(self, iterable, print_freq, header='', total=None, start=0, images_per_step=None):
        """Yield from `iterable`, printing a progress line (ETA, meters, img/s) every `print_freq` steps."""
        total = len(iterable) if total is None else total
        start_time = end = time.time()
        iter_time = SmoothedValue(fmt='{avg:.4f}')
        data_time = SmoothedValue(fmt='{avg:.4f}')
        width = len(str(total))
        for i, obj in enumerate(iterable, start=start):
            data_time.update(time.time() - end)
            yield obj
            iter_time.update(time.time() - end)
            if i % print_freq == 0 or i == total - 1:
                eta = str(datetime.timedelta(seconds=int(iter_time.global_avg * (total - i - 1))))
                ips = ''
                if images_per_step and iter_time.avg > 0:
                    ips = f'{self.delimiter}img/s: {images_per_step / iter_time.avg:.1f}'
                print(f'{header} [{i:>{width}}/{total}]{self.delimiter}eta: {eta}{self.delimiter}{self}'
                      f'{ips}{self.delimiter}time: {iter_time}{self.delimiter}data: {data_time}', flush=True)
            end = time.time()
        total_time = str(datetime.timedelta(seconds=int(time.time() - start_time)))
        print(f'{header} Total time: {total_time}', flush=True)


# --------------------------------------------------------------------------------------------------
# Random-number state (torch, CUDA, numpy, python) as weights_only-loadable plain objects
# --------------------------------------------------------------------------------------------------
def get_rng_state() -> dict:
    """torch, numpy and python RNG state (and this process's CUDA device's) as plain objects."""
    np_state = np.random.get_state()
    state = {
        'torch': torch.get_rng_state(),
        'numpy': {'name': str(np_state[0]), 'keys': torch.from_numpy(np_state[1].astype(np.int64)),
                  'pos': int(np_state[2]), 'has_gauss': int(np_state[3]), 'cached_gaussian': float(np_state[4])},
        'python': _to_plain(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # this process's own device only: another launch may see fewer GPUs per process
        state['cuda'] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict) -> None:
    """Restore get_rng_state()'s result; the CUDA state goes to this process's current device."""
    torch.set_rng_state(state['torch'])
    n = state['numpy']
    np.random.set_state((n['name'], n['keys'].numpy().astype(np.uint32), n['pos'], n['has_gauss'],
                         n['cached_gaussian']))
    py = state['python']
    random.setstate((py[0], tuple(py[1]), py[2]))
    cuda = state.get('cuda')
    if cuda is not None and torch.cuda.is_available():
        device = torch.cuda.current_device()
        if isinstance(cuda, (list, tuple)):  # older checkpoints: every visible device's state
            cuda = cuda[device] if device < len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


class preserved_rng:
    """Context manager: the torch/numpy/python RNG state is the same after the block as before."""

    def __enter__(self):
        self.state = get_rng_state()

    def __exit__(self, *exc):
        set_rng_state(self.state)
        return False


def _to_plain(obj):
    """Convert to types that torch.load(weights_only=True) accepts (dict/list/tuple/str/int/float/bool/None)."""
    if isinstance(obj, dict):
        return {str(k): _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_plain(v) for v in obj)
    if obj is None or isinstance(obj, (bool, int, float, str, torch.Tensor)):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    return str(obj)


def args_to_dict(args):
    return _to_plain(dict(vars(args)))


# --------------------------------------------------------------------------------------------------
# Graceful stop on SIGTERM / SIGINT
# --------------------------------------------------------------------------------------------------
class StopFlag:
    """Set by SIGTERM/SIGINT; the training loop checks it (agreed over all ranks) at each step boundary.
    A second SIGINT aborts at once."""

    def __init__(self):
        self.signum = None

    def install(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)
        if hasattr(signal, 'SIGUSR1'):  # some schedulers warn with SIGUSR1 before SIGTERM
            signal.signal(signal.SIGUSR1, self._handler)

    def _handler(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    @property
    def requested(self):
        return self.signum is not None

    def name(self):
        return signal.Signals(self.signum).name if self.signum is not None else ''


def worker_init_fn(worker_id):
    # Data-loader workers leave SIGINT/SIGTERM to the main process, which stops them cleanly.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def state_digest(state_dict):
    """sha256 over the names and bytes of a state dict (compare weights across ranks/runs)."""
    import hashlib
    h = hashlib.sha256()
    for k in sorted(state_dict):
        v = state_dict[k].detach().cpu().contiguous()
        h.update(k.encode())
        h.update(v.view(-1).view(torch.uint8).numpy().tobytes() if v.numel() else b'')
    return h.hexdigest()[:16]


def json_safe(obj):
    """`obj` with every non-finite float (NaN, inf) replaced by None, so that it serialises as strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_json_line(path, obj):
    """Append `obj` as one strict-JSON line (non-finite numbers written as null)."""
    with open(path, 'a') as f:
        f.write(json.dumps(json_safe(obj), allow_nan=False) + '\n')
        f.flush()


def eprint(*a):
    """Print to stderr on every rank (error lines)."""
    sys.stderr.write(' '.join(str(x) for x in a) + '\n')
    sys.stderr.flush()
