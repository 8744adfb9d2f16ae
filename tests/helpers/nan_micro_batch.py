"""main.py with a non-finite loss on one rank: rank 1's loss is NaN on the first micro-batch of the first
accumulation window. Every rank reports its backward passes on exit, which must be equal on all ranks
(a rank that skips a backward the others run would leave SyncBatchNorm's collectives out of order): every
micro-batch runs its backward, the NaN one too, and the window is skipped at its optimizer step.

    torchrun --nproc_per_node=2 -m tests.helpers.nan_micro_batch --accum-steps 2 ...main.py flags...

It runs from the repository root (tests/integration/test_faults.py, and the accum-nan row of tools/smoke.py).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the root

import main
from training.step import OptimizerStep

calls = {'loss': 0, 'backward': 0}


def faulty_criterion(args, mixup_active):
    """main.py's loss, NaN on this process's first micro-batch when it is rank 1."""
    criterion = main_build_criterion(args, mixup_active)
    rank = int(os.environ.get('RANK', 0))

    def loss(outputs, targets):
        value = criterion(outputs, targets)
        calls['loss'] += 1
        if rank == 1 and calls['loss'] == 1:
            value = value * float('nan')
        return value
    return loss


def counted_backward(self, loss):
    calls['backward'] += 1
    optimizer_step_backward(self, loss)


main_build_criterion, optimizer_step_backward = main.build_criterion, OptimizerStep._backward

if __name__ == '__main__':
    main.build_criterion = faulty_criterion
    OptimizerStep._backward = counted_backward
    code = main.run(sys.argv[1:])
    sys.stderr.write(f"[rank {os.environ.get('RANK', 0)}] backward passes: {calls['backward']} of "
                     f"{calls['loss']} micro-batches\n")
    sys.exit(code)
