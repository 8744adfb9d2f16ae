"""A process group of N ranks as N threads of the test process: run/distributed.py's rank, world size and the torch
collectives it calls (all_reduce, broadcast_object_list, all_gather_object) are replaced by thread-local and
barrier-based stand-ins. Each rank records the collectives it issues; a rank that waits in a collective the
others never reach fails with a `Hang` after a few seconds instead of blocking the test, as a real rank would
wait until the process group's timeout."""
import copy
import threading
from typing import Any, Callable

import torch

from run import distributed


class Hang(AssertionError):
    pass


class ThreadWorld:
    def __init__(self, n: int, monkeypatch: Any, timeout: float = 5.0):
        self.n, self.timeout = n, timeout
        self._local = threading.local()
        self._barrier = threading.Barrier(n, timeout=timeout)
        self._slots: list[Any] = [None] * n
        self.calls: list[list[str]] = [[] for _ in range(n)]
        dist = distributed.dist
        monkeypatch.setattr(distributed, 'is_dist_avail_and_initialized', lambda: True)
        monkeypatch.setattr(distributed, 'get_rank', lambda: self._local.rank)
        monkeypatch.setattr(distributed, 'get_world_size', lambda: n)
        monkeypatch.setattr(dist, 'all_reduce', self._all_reduce)
        monkeypatch.setattr(dist, 'broadcast_object_list', self._broadcast_object_list)
        monkeypatch.setattr(dist, 'all_gather_object', self._all_gather_object)

    def rank(self) -> Any:
        """The rank of the calling thread (None outside the world's threads)."""
        return getattr(self._local, 'rank', None)

    # ---- collectives
    def _exchange(self, name: str, value: Any) -> list[Any]:
        rank = self._local.rank
        self.calls[rank].append(name)
        self._slots[rank] = value
        try:
            self._barrier.wait()  # every rank has put its value
            values = [copy.deepcopy(v) for v in self._slots]  # as if pickled and sent
            self._barrier.wait()  # every rank has read them
        except threading.BrokenBarrierError:
            raise Hang(f'rank {rank} waited in {name} (collective #{len(self.calls[rank])}) for ranks that never '
                       f'came') from None
        return values

    def _all_reduce(self, tensor: torch.Tensor, op: Any = None) -> None:
        values = torch.stack(self._exchange('all_reduce', tensor.clone()))
        if op == distributed.dist.ReduceOp.MAX:
            tensor.copy_(values.max(0).values)
        else:
            tensor.copy_(values.sum(0))

    def _broadcast_object_list(self, box: list[Any], src: int = 0, **kw: Any) -> None:
        box[:] = self._exchange('broadcast_object_list', list(box))[src]

    def _all_gather_object(self, out: list[Any], obj: Any, **kw: Any) -> None:
        out[:] = self._exchange('all_gather_object', obj)

    # ---- running
    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """fn(rank) on every rank's thread; the list of what each returned or raised."""
        results: list[Any] = [None] * self.n

        def target(rank: int) -> None:
            self._local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # the rank's outcome, for the test to check
                results[rank] = e

        threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout * 4)
        assert not any(t.is_alive() for t in threads), 'a rank never returned'
        return results
