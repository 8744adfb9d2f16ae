"""main.build_loaders: DataLoader defaults (workers persist across epochs, 2 batches prefetched each)."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import main  # noqa: E402


def loader_args(num_workers: int) -> argparse.Namespace:
    return argparse.Namespace(repeated_aug=False, seed=0, dist_eval=False, pin_mem=True, device='cpu',
                              num_workers=num_workers, batch_size=4)


def test_workers_persist_and_prefetch_two_batches():
    data = torch.utils.data.TensorDataset(torch.arange(16.0))
    _, train, val = main.build_loaders(loader_args(2), data, data)
    for loader in (train, val):
        assert loader.persistent_workers and loader.prefetch_factor == 2 and loader.num_workers == 2
        assert not loader.pin_memory                     # no GPU: nothing to pin for
    assert sorted(int(x) for batch in train for x in batch[0]) == list(range(16))


def test_no_workers_loads_in_process():
    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    _, train, val = main.build_loaders(loader_args(0), data, data)
    assert train.num_workers == 0 and not train.persistent_workers and train.prefetch_factor is None
    assert len(list(val)) == 2
