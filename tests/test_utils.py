"""utils.py's RNG state: a round trip through a weights-only file, preserved_rng, and the CUDA state of the
process's own device only."""
import random

import numpy as np
import pytest
import torch

import checkpoint
import utils


def test_rng_state_round_trip_through_a_weights_only_file(tmp_path):
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    checkpoint.save_atomic({'rng': utils.get_rng_state()}, tmp_path / 'r.pth')
    want = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(9)
    np.random.seed(9)
    random.seed(9)
    utils.set_rng_state(torch.load(tmp_path / 'r.pth', weights_only=True)['rng'])
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
    with utils.preserved_rng():
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
    saved = utils.get_rng_state()
    cuda = _FakeCuda(device=3, n_devices=8)
    cuda.install(monkeypatch)
    state = utils.get_rng_state()
    assert torch.equal(state['cuda'], torch.tensor([3], dtype=torch.uint8))
    one = _FakeCuda(device=0, n_devices=1)  # resumed with one visible GPU per process
    one.install(monkeypatch)
    utils.set_rng_state(state)
    assert one.set == [(3, 0)]
    old = dict(state, cuda=[torch.tensor([i], dtype=torch.uint8) for i in range(8)])  # older list form
    utils.set_rng_state(old)
    assert one.set[-1] == (0, 0)
    few = _FakeCuda(device=2, n_devices=4)
    few.install(monkeypatch)
    utils.set_rng_state(dict(state, cuda=[torch.tensor([7], dtype=torch.uint8)]))  # no IndexError
    assert few.set == []
    monkeypatch.undo()
    utils.set_rng_state(saved)
