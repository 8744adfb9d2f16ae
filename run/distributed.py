"""The process group: which launcher started this process, joining the group, and the few collectives the
engine uses (DeiT's distributed helpers, with SLURM's srun and one-line errors for a failed rendezvous)."""
import contextlib
import datetime
import gc
import hashlib
import os
import socket
import subprocess
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import torch
import torch.distributed as dist

from run.errors import PeerLostError, UserError, first_line


def is_dist_avail_and_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_world_size() -> int:
    return dist.get_world_size() if is_dist_avail_and_initialized() else 1


def get_rank() -> int:
    return dist.get_rank() if is_dist_avail_and_initialized() else 0


def is_main_process() -> bool:
    return get_rank() == 0


def launch_env() -> tuple[int, int, int, str]:
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


def _slurm_master_addr() -> str:
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


@dataclass(frozen=True)
class DistributedSettings:
    """The process-group flags, each named as its argparse destination."""
    device: str                   # --device: cuda, cuda:N or cpu
    dist_url: str                 # the rendezvous (env:// under torchrun and srun)
    dist_timeout: float           # seconds a collective may wait
    local_rank: int | None        # passed by `torch.distributed.launch` without --use_env


@dataclass(frozen=True)
class Process:
    """This process in its job: rank and world size, its GPU index, the launcher that started it ('torchrun',
    'slurm' or 'none'), whether a process group runs (`distributed`, also for one launched process) and on which
    backend, and the device it computes on (its own GPU, or the CPU)."""
    rank: int
    world_size: int
    gpu: int
    launcher: str
    distributed: bool
    dist_backend: str | None
    device: str


def init_distributed_mode(settings: DistributedSettings) -> Process:
    """Start the process group when a launcher (torchrun, srun with several tasks) started this process, also
    for one process, and make this process's GPU the current one: this process in its job.

    timm.utils.init_distributed_device is not used: it sets no MASTER_ADDR under srun, no timeout, no GPU per task.
    """
    rank, world_size, local_rank, launcher = launch_env()
    if settings.local_rank is not None and launcher == 'none':
        # old `torch.distributed.launch` without --use_env passes --local-rank; the rest is in env
        local_rank = settings.local_rank
    use_cuda = str(settings.device).startswith('cuda') and torch.cuda.is_available()
    if use_cuda and launcher != 'none':
        check_gpus_per_node(torch.cuda.device_count())
    # the GPU of this process among those it can see: with one GPU per task (SLURM's --gpus-per-task, or
    # CUDA_VISIBLE_DEVICES set per process) every process sees only its own, as cuda:0 (as DeiT does)
    gpu = local_rank % torch.cuda.device_count() if use_cuda else local_rank
    if use_cuda and launcher == 'none':  # one process: the GPU --device names (cuda: the current one, 0)
        gpu = torch.device(settings.device).index or 0
    device = 'cpu'
    if use_cuda:
        device = (f'cuda:{gpu}' if launcher != 'none' else
                  (settings.device if ':' in str(settings.device) else 'cuda'))
        # make it the current GPU: the CUDA RNG state a checkpoint saves and restores, the pin-memory thread
        # and any allocation without a device all use the current GPU
        torch.cuda.set_device(gpu)
    if launcher == 'none':  # a launcher starts a process group even for one process (DDP paths on one GPU)
        return Process(rank=rank, world_size=world_size, gpu=gpu, launcher=launcher, distributed=False,
                       dist_backend=None, device=device)
    if launcher == 'slurm':
        os.environ.setdefault('MASTER_ADDR', _slurm_master_addr())
        os.environ.setdefault('MASTER_PORT', '29500')
        os.environ['RANK'], os.environ['WORLD_SIZE'] = str(rank), str(world_size)
        os.environ['LOCAL_RANK'] = str(local_rank)
    backend = 'nccl' if use_cuda else 'gloo'
    _join(settings, backend, rank, world_size, gpu if use_cuda else None)
    return Process(rank=rank, world_size=world_size, gpu=gpu, launcher=launcher, distributed=True, dist_backend=backend,
                   device=device)


def _join(settings: DistributedSettings, backend: str, rank: int, world_size: int, gpu: int | None) -> None:
    """Join the process group (rendezvous problems as one line), then wait for every rank and leave printing to
    rank 0."""
    kwargs = dict(backend=backend, init_method=settings.dist_url, world_size=world_size, rank=rank,
                  timeout=datetime.timedelta(seconds=settings.dist_timeout))
    if gpu is not None:
        kwargs['device_id'] = torch.device('cuda', gpu)
    try:
        restart = os.environ.get('TORCHELASTIC_RESTART_COUNT')
        if restart is not None and settings.dist_url == 'env://' and agent_store_shared():
            # a worker group restarted by torchrun (--max-restarts) joins through the agent's store, which outlives
            # the failed attempt and still holds its rank addresses: a prefix per attempt keeps those stale keys
            # out of reach (torch's env:// rendezvous, then the default group's own prefix under it)
            store, rank, world_size = next(dist.rendezvous(settings.dist_url, rank, world_size,
                                                           timeout=kwargs['timeout']))
            store.set_timeout(kwargs['timeout'])
            kwargs.update(store=dist.PrefixStore(f'nalaformer/attempt{restart}', store), rank=rank,
                          world_size=world_size)
            del kwargs['init_method']
        dist.init_process_group(**kwargs)
    except Exception as e:  # report rendezvous problems as one line
        raise PeerLostError(f'could not join the process group (rank {rank} of {world_size}, '
                            f'{settings.dist_url}, backend {backend}): {first_line(e)}') from e
    barrier()
    setup_for_distributed(rank == 0)


def agent_store_shared() -> bool:
    """Whether the workers join through torchrun's own store (TORCHELASTIC_USE_AGENT_STORE), which outlives a
    restart. The attempt number that keeps a restart's keys apart is the agent's own restart count, the same on
    every node only where every agent restarts for the same reason: one node (static rendezvous) always. Under the
    c10d rendezvous a healthy node restarts for a membership change without counting it, so pretrain.sh and
    finetune.sh turn the shared store off there (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): every attempt then
    bootstraps a fresh store on its rank 0, as torch 2.4's c10d rendezvous always does."""
    return os.environ.get('TORCHELASTIC_USE_AGENT_STORE') == str(True)


def check_gpus_per_node(n_gpus: int) -> None:
    """Refuse more processes on this node than GPUs it sees: two ranks would share a GPU, which NCCL refuses
    with an error that looks like a network problem. torchrun says how many processes it starts on the node
    (LOCAL_WORLD_SIZE); SLURM's tasks that each see only their own GPU are not affected."""
    local_world = int(os.environ.get('LOCAL_WORLD_SIZE', 0) or 0)
    if local_world > n_gpus:
        raise UserError(f'{local_world} processes on this node but only {n_gpus} visible GPU(s): start at most '
                        f'{n_gpus} per node (torchrun --nproc_per_node={n_gpus}) or make more GPUs visible')


def destroy_process_group() -> None:
    """End the process group of a run that ended cleanly, with its backends (gloo's worker threads) ended last
    and without the GIL. Before torch 2.8 the group's destructor holds the GIL while it joins gloo's worker
    threads, and a worker still letting go of a finished collective whose tensor's Python object it now
    owns waits for the GIL: the process never exits. The Python objects of the backend classes release the
    GIL in their destructors, so they are made the last references to the backends. Whatever else holds
    the group (a DDP model) must be gone before this call; gc.collect() frees one that a reference cycle keeps."""
    group = dist.group.WORLD
    backends = [group._get_backend(device) for device in getattr(group, '_device_types', ())]
    del group
    dist.destroy_process_group()
    gc.collect()
    backends.clear()  # each backend's destructor joins its threads with the GIL released


def barrier() -> None:
    if is_dist_avail_and_initialized():
        dist.barrier()


def setup_for_distributed(is_master: bool) -> None:
    """Only rank 0 prints, unless print(..., force=True)."""
    import builtins as __builtin__
    builtin_print = __builtin__.print

    def print(*args, **kwargs):
        force = kwargs.pop('force', False)
        if is_master or force:
            # the line and its end in one write: lines of processes that share a pipe do not run into each other
            sep, end = kwargs.pop('sep', None), kwargs.pop('end', None)
            text = (' ' if sep is None else sep).join(map(str, args)) + ('\n' if end is None else end)
            builtin_print(text, end='', **kwargs)

    __builtin__.print = print


def broadcast_tensors_(tensors: Iterable[torch.Tensor], src: int = 0, device: Any = None) -> None:
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
def moved_to(module: torch.nn.Module, device: Any) -> Iterator[torch.nn.Module]:
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


def all_reduce_sum(values: Sequence[float], device: Any) -> list[float]:
    """Sum a list of numbers over all processes (float64 so counts stay exact)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if is_dist_avail_and_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_max(values: Sequence[float], device: Any) -> list[float]:
    """Element-wise maximum of a list of numbers over all processes (flags: any rank set it)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if is_dist_avail_and_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` (any picklable value) on every rank; `obj` itself without a process group."""
    if not is_dist_avail_and_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank; [obj] without a process group."""
    if not is_dist_avail_and_initialized():
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def where() -> str:
    """'rank R on host H' of this process (for errors that differ between nodes)."""
    return f'rank {get_rank()} on host {socket.gethostname()}'


def agree_on_errors(err: BaseException | str | None, device: Any) -> None:
    """Every rank calls this at the same point with its own error (None: none); when any rank has one, every
    rank raises a one-line UserError: its own error, or the first failing rank's message. Costs one small
    all-reduce, and one gather of the messages only when something failed: a rank that raised alone would
    leave the others waiting in their next collective until the process group's timeout (30 min on NCCL)."""
    if isinstance(err, str):
        err = UserError(err)
    failed = err is not None
    messages: list[Any] = []
    if is_dist_avail_and_initialized():
        failed = all_reduce_max([1.0 if failed else 0.0], device)[0] > 0
        if failed:
            messages = gather_objects(None if err is None else str(err) or type(err).__name__)
    if not failed:
        return
    if isinstance(err, UserError):
        raise err
    if err is not None:
        raise UserError(first_line(err)) from err
    rank, message = next((r, m) for r, m in enumerate(messages) if m)
    raise UserError(f'stopped because rank {rank} failed: {message}')


T = TypeVar('T')


def _agreed_call(action: Callable[[], T], device: Any, what: str, here: bool) -> T | None:
    result, err = None, None
    if here:
        try:
            result = action()
        except UserError as e:
            err = e
        except Exception as e:  # any failure: the other ranks must hear of it, not wait for it
            err = UserError(f'{what}: {type(e).__name__}: {first_line(e)}')
            err.__cause__ = e
    agree_on_errors(err, device)
    return result


def on_rank0(action: Callable[[], T], device: Any, what: str) -> T | None:
    """Run `action` on rank 0 alone (writing log.txt, a checkpoint, the lock file, TensorBoard events), then
    agree: when it raised anything, every rank raises one line within a collective's time (`what` names the
    action for exceptions other than UserError). Every rank must call this at the same point. Returns the
    action's result on rank 0, None elsewhere."""
    return _agreed_call(action, device, what, is_main_process())


def on_every_rank(action: Callable[[], T], device: Any, what: str) -> T | None:
    """Run `action` on every rank (each reading its own files), then agree as `on_rank0` does."""
    return _agreed_call(action, device, what, True)


def check_same_everywhere(facts: dict[str, Any], device: Any, fix: str) -> None:
    """Every rank compares its `facts` (name -> value) with rank 0's; a rank that sees other values stops every
    rank with one line naming the first difference and `fix`. Things each node reads from its own filesystem
    (the data set, a checkpoint) must be the same everywhere, or the ranks train different things together."""
    if not is_dist_avail_and_initialized():
        return
    theirs = broadcast_object(facts)
    diff = next((k for k in facts if facts[k] != theirs.get(k)), None)
    err = None
    if diff is not None:
        err = f'{where()} sees {diff} {facts[diff]}, rank 0 sees {theirs.get(diff)}: {fix}'
    agree_on_errors(err, device)


def state_digest(state_dict: dict[str, torch.Tensor]) -> str:
    """sha256 over the names and bytes of a state dict (compare weights across ranks/runs)."""
    h = hashlib.sha256()
    for k in sorted(state_dict):
        v = state_dict[k].detach().cpu().contiguous()
        h.update(k.encode())
        h.update(v.view(-1).view(torch.uint8).numpy().tobytes() if v.numel() else b'')
    return h.hexdigest()[:16]


def wrap_model(model: torch.nn.Module, device: torch.device, distributed: bool, sync_bn: bool,
               compile: bool) -> tuple[Any, torch.nn.Module, Any]:
    """(train_model, model_without_ddp, eval_model) for `model` on `device`: SyncBatchNorm (`sync_bn`, on GPUs)
    and DDP in a `distributed` run, torch.compile with `compile`.

    With `compile` BatchNorm stays per process: dynamo breaks the compiled graph at every SyncBatchNorm layer (a
    collective inside the forward), which would leave little of the compiled speed; the line printed says so.
    Evaluation runs the bare module (a DDP forward may broadcast buffers, a collective that would hang when
    ranks get different numbers of validation batches), compiled as well with `compile`."""
    sync_bn = distributed and device.type == 'cuda' and sync_bn
    if sync_bn and compile:
        sync_bn = False
        print('BatchNorm: per-process statistics under --compile (SyncBatchNorm would break the compiled graph at '
              'every layer); leave out --compile for SyncBatchNorm')
    elif distributed and device.type == 'cuda':
        print(f"BatchNorm: {'SyncBatchNorm across the processes' if sync_bn else 'per-process statistics'}")
    if sync_bn:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model_without_ddp = model
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == 'cuda' else None, gradient_as_bucket_view=True)
    if compile:
        return torch.compile(model), model_without_ddp, torch.compile(model_without_ddp)
    return model, model_without_ddp, model_without_ddp
