"""main.build_loaders: a later epoch's augmentations follow from the RNG state saved at its start."""
import argparse

import torch

import main


class RandomDraws(torch.utils.data.Dataset):
    """Each item is a random draw made in the loader worker, like a random augmentation."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(1)


def loader_args(num_workers: int) -> argparse.Namespace:
    return argparse.Namespace(repeated_aug=False, seed=0, dist_eval=False, pin_mem=True, device='cpu',
                              num_workers=num_workers, batch_size=4)


def draws(loader) -> list:
    return [round(float(x), 7) for batch in loader for x in batch]


def test_an_epoch_replays_from_the_rng_state_saved_at_its_start():
    torch.manual_seed(0)
    sampler, train, _ = main.build_loaders(loader_args(2), RandomDraws(), RandomDraws())
    sampler.set_epoch(0)
    draws(train)                         # epoch 0
    state = torch.get_rng_state()        # what a checkpoint after epoch 0 holds
    sampler.set_epoch(1)
    epoch1 = draws(train)

    torch.set_rng_state(state)           # a resumed run: fresh loaders, the saved state
    sampler2, train2, _ = main.build_loaders(loader_args(2), RandomDraws(), RandomDraws())
    sampler2.set_epoch(1)
    assert draws(train2) == epoch1


def test_no_workers_loads_in_process():
    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    _, train, val = main.build_loaders(loader_args(0), data, data)
    assert train.num_workers == 0 and not train.persistent_workers
    assert len(list(val)) == 2
