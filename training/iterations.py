"""What the training scripts of the dense tasks share (segmentation/train.py, detection/train.py), runs counted in
iterations: the run flags of their command lines and their checks, the start of a run (process group, precision
check, stop signals, device, loader workers), the loop's handling of a stop and of a training batch a process cannot
read (IterationLoop), the final weight digests, and the entry point that ends in one line per error.
"""
import argparse
import dataclasses
import os
import warnings
from typing import Any, Callable

import torch

import cli
from run import distributed, output_dir, process
from run.errors import UserError
from training.image_folder import DataLayoutError, data_error_line
from training.step import StopRequest, check_bf16


def add_run_flags(group: Any) -> None:
    """The run flags of a dense task's command line (its output directory, resume, device, precision, seed,
    process group); the task adds its own --save-interval."""
    group.add_argument('--output_dir', '--output-dir', dest='output_dir', default='')
    group.add_argument('--resume', default='')
    group.add_argument('--auto-resume', action=argparse.BooleanOptionalAction, default=True)
    group.add_argument('--overwrite', action='store_true')
    group.add_argument('--no-lock', dest='lock', action='store_false')
    group.add_argument('--print-freq', type=cli.POSITIVE_INT, default=50)
    group.add_argument('--device', default='cuda')
    group.add_argument('--amp', nargs='?', const='fp16', default=None, choices=['fp16', 'bf16'])
    group.add_argument('--tf32', action=argparse.BooleanOptionalAction, default=True)
    group.add_argument('--sync-bn', action=argparse.BooleanOptionalAction, default=True)
    group.add_argument('--seed', type=cli.ranged(int, 0, 2 ** 32 - 1), default=0)
    group.add_argument('--cpu-malloc', choices=['retain', 'system'], default='retain')
    group.add_argument('--dist_url', '--dist-url', dest='dist_url', default='env://')
    group.add_argument('--dist-timeout', type=cli.POSITIVE, default=1800)
    group.add_argument('--local_rank', '--local-rank', dest='local_rank', type=int, default=None,
                       help=argparse.SUPPRESS)


def check_run_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The checks every dense task makes before anything starts (argparse's two lines, exit 2): --resume and
    --pretrained name files, --eval has a checkpoint, --show-dir comes with --eval, the device fits the launch.
    --dist-eval defaults to on with several processes. Returns the launch's number of processes."""
    rank, world, _, _ = distributed.launch_env()
    if args.dist_eval is None:
        args.dist_eval = world > 1
    for flag, path in (('--resume', args.resume), ('--pretrained', args.pretrained)):
        if path and rank == 0 and not os.path.isfile(path):
            parser.error(f'{flag} {path}: {cli.not_a_file(path)}')
    if args.eval and not output_dir.find_resume_path(cli.settings(output_dir.OutputDirSettings, args)):
        parser.error('--eval needs a checkpoint: pass --resume PATH (or an --output_dir holding checkpoint.pth)')
    if args.show_dir and not args.eval:
        parser.error(f'--show-dir {args.show_dir}: draws the predictions of a checkpoint; use it with --eval '
                     f'(training evaluations draw nothing)')
    cli.check_device(args.device, world, parser)
    return world


def start_run(args: argparse.Namespace) -> tuple[torch.device, process.StopFlag]:
    """The start of a run: the process group (its facts into `args`), bf16 checked on this process's GPU, the stop
    signals caught, glibc told to keep freed memory on a CPU (--cpu-malloc retain), the loader workers chosen when
    not given; prints the launch. Returns the device and the stop flag."""
    launched = distributed.init_distributed_mode(cli.settings(distributed.DistributedSettings, args))
    vars(args).update(dataclasses.asdict(launched))
    if args.amp == 'bf16':
        check_bf16(args.device)
    stop_flag = process.StopFlag()
    stop_flag.install()
    device = torch.device(args.device)
    if device.type == 'cpu' and args.cpu_malloc == 'retain':
        process.retain_freed_cpu_memory()
    if args.num_workers is None:
        args.num_workers, why = process.default_num_workers()
        print(f'Data loader: {args.num_workers} workers per process ({why})')
    print(f'Launcher: {args.launcher}, {distributed.get_world_size()} process(es), device {device}')
    return device, stop_flag


class IterationLoop:
    """The parts of a dense task's training loop that are not its task's: the stop request the optimizer step
    reads (a stop signal, or a training batch this process could not read), the line and exit status of a stopped
    run, and the end of a run whose batch could not be read. `args` and `stop_flag` are the run's."""

    def __init__(self, args: argparse.Namespace, stop_flag: process.StopFlag):
        self.args, self.stop_flag, self.request = args, stop_flag, StopRequest(stop_flag)

    def stopped(self, done: int, eval_due: bool = False) -> int:
        """The line and exit status of a run a stop signal ended after `done` iterations (its checkpoint saved)."""
        due = f' (its evaluation of iteration {done} is still due: the resumed run does it first)' if eval_due else ''
        print(f'Stopped by {self.stop_flag.name() or "a stop signal on another rank"} after iteration {done}; '
              f'checkpoint saved{due}; run the same command again to resume')
        return process.stopped_status(self.args.launcher, self.stop_flag)

    def next_batch(self, batches):
        """The next training batch, or None when this process cannot read it: its one line is then kept for the
        next optimizer step to agree on as on a stop (every process ends after that step, its work saved)."""
        try:
            return next(batches)
        except DataLayoutError as e:
            self.request.error = data_error_line(e)
            return None

    def raise_data_error(self, done: int, saved: bool) -> None:
        """Collective: when a process could not read its batch, end every process with that line (after `done`
        iterations, saved to checkpoint.pth when `saved`)."""
        line = next((e for e in distributed.gather_objects(self.request.error) if e), None)
        if line:
            kept = (f'; checkpoint.pth holds the {done} iterations done: replace the file and run the same command '
                    f'again to resume' if saved and self.args.output_dir else '')
            raise UserError(line + kept)

    def print_digest(self, model: torch.nn.Module) -> None:
        """Under DDP, each rank's digest of the final weights (DDP keeps them identical: every rank says so)."""
        if self.args.distributed:
            digest = distributed.state_digest(model.state_dict())
            print(f'[rank {distributed.get_rank()}] final weights sha256: {digest}', force=True)


def run_script(parser: argparse.ArgumentParser, main: Callable[[argparse.Namespace, argparse.ArgumentParser], int],
               argv: list[str] | None) -> int:
    """A dense task's entry point: parse `argv`, run `main`, end as process.finish says (one line per error),
    leaving no --output_dir or --show-dir it created and wrote nothing into."""
    # DDP warns once when a depthwise conv's weight gradient comes out channels-last (layout only, harmless)
    warnings.filterwarnings('ignore', message='Grad strides do not match bucket view strides')
    args = parser.parse_args(argv)

    def body() -> int:
        return output_dir.leave_nothing_unused(lambda: main(args, parser), args.show_dir)
    return process.finish(lambda: output_dir.leave_nothing_unused(body, args.output_dir),
                          lambda: (args.num_workers, args.batch_size))
