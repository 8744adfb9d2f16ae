"""Shared pytest fixtures."""
import pytest
import torch


@pytest.fixture(scope='module')
def one_thread():
    """One intra-op thread for a module of small tests: on a shared 2-core machine a second spinning
    OpenMP thread costs more than it brings."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
