"""GPU-only paths of the distributed setup, checked without a GPU: a CPU-held EMA under NCCL (broadcast and
evaluation through the GPU) and the GPU index of a SLURM task that sees only its own GPU. CUDA and NCCL are
stood in for by fakes that enforce what the real ones require."""
import argparse

import pytest
import torch

import distributed


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
    args = argparse.Namespace(device='cuda', local_rank=None, dist_url='env://', dist_timeout=60)
    distributed.init_distributed_mode(args)
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
    args = argparse.Namespace(device='cpu', local_rank=None, dist_url='env://', dist_timeout=60)
    distributed.init_distributed_mode(args)
    assert args.distributed and args.dist_backend == 'gloo' and joined['world_size'] == 1
