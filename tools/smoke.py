"""Smoke test of a new machine: every training path of main.py once, on a tiny synthetic ImageFolder.

    python tools/smoke.py                  # on a GPU every path; on a CPU the quick set (no torch.compile)
    python tools/smoke.py --all            # every path, also on a CPU (torch.compile takes minutes there)
    python tools/smoke.py --quick          # the CPU subset CI runs (no torch.compile: minutes on a CPU)
    python tools/smoke.py --only fp16,resume
    python tools/smoke.py --extra "--input-size 64"   # flags appended to every run
    python tools/smoke.py --gpu-report report.md      # everything a first GPU session must check, as a table

Each row runs main.py (NALAFORMER_XT at 32 px, one epoch of a few steps) as its own process, or under
torchrun with one or two processes, and must exit 0 and print what the path promises; the fast-vs-plain
rows compare the model's two paths under autocast in this process. Each row prints a line when it starts
(name, what it checks), one every PROGRESS_EVERY seconds while it runs, and one with its result and seconds.
Rows named with --only run on a CPU too, unless --quick. One table at the end: path,
passed/failed/skipped (with the reason), seconds. The exit status is 1 when a row failed; the logs of a
failed run are kept and their folder printed. A row that needs more GPUs than the machine has is skipped
and says so.
"""
import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `python tools/X.py` too

from run.errors import FlagParser
from tools.synthetic import write_imagefolder

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRESS_EVERY = 30.0  # seconds between the progress lines of a running row


def torchrun(nproc: int) -> list[str]:
    return ['-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={nproc}']


@dataclass
class Row:
    """One path: main.py with `flags` added to the common ones."""

    name: str
    what: str
    flags: list[str] = field(default_factory=list)
    torchrun: bool = False           # a DDP run under torchrun (process group on gloo or NCCL)
    needs: str = ''                  # 'cuda': skipped on the CPU; 'bf16': skipped on a GPU without bfloat16
    not_quick: str = ''              # why the row is left out of --quick (empty: it is part of it)
    expect: str = ''                 # regular expression the output must match ({backend} is filled in)
    then: list[str] | None = None  # flags of a second run in the same output dir (resume)
    nproc: int = 1                   # torchrun processes; on CUDA one GPU each, skipped with fewer GPUs
    module: str = 'main.py'          # what torchrun or python runs: main.py or a module wrapping it (-m)
    check: Callable[[str], str] | None = None  # the whole output -> why it failed ('' when it passed)
    in_process: Callable[[str], tuple[str, str]] | None = None  # device -> (status, detail), no main.py run


def same_backward_passes(output: str) -> str:
    """Both ranks ran the same number of backward passes and skipped the window of rank 1's NaN."""
    counts = dict(re.findall(r'\[rank (\d)\] backward passes: (\d+) of', output))
    if sorted(counts) != ['0', '1']:
        return 'no backward count from both ranks'
    if counts['0'] != counts['1']:
        return f"backward passes differ: rank 0 ran {counts['0']}, rank 1 {counts['1']}"
    if 'non-finite loss (on another rank)' not in output:
        return "rank 0 did not skip the window of rank 1's NaN"
    return ''


def fast_vs_plain_row(dtype_name: str) -> Callable[[str], tuple[str, str]]:
    """Fast against plain path under `dtype_name` autocast: one block per stage of every variant, by the
    models' own rule (tools/amp_parity.py): the residual stream stays fp32 and the fast path is no further
    from the plain path than the plain path is from fp32 (times AMP_TOLERANCE)."""
    def run(device: str) -> tuple[str, str]:
        import torch

        from models import VARIANTS
        from tools.amp_parity import AMP_TOLERANCE, amp_path_parity
        dtype = {'fp16': torch.float16, 'bf16': torch.bfloat16}[dtype_name]
        failed, notes = [], []
        for variant in VARIANTS:
            short = variant.removeprefix('NALAFORMER_')
            rows = amp_path_parity(variant, device, dtype, size=28, batch=4)
            worst = max(rows, key=lambda r: r['fast_vs_plain'] / max(r['plain_vs_fp32'], 1e-30))
            notes.append(f"{short} {worst['fast_vs_plain']:.1e}/{worst['plain_vs_fp32']:.1e}")
            failed += [f"{short} stage {r['stage']}" for r in rows if not r['ok']]
        detail = f'worst block per variant, fast-vs-plain / plain-vs-fp32: {", ".join(notes)}'
        if failed:
            return 'failed', (f'{", ".join(failed)}: residual stream not fp32 or fast path beyond '
                              f"{AMP_TOLERANCE}x the plain path's error; {detail}")
        return 'passed', detail
    return run


ROWS = [
    Row('ddp', '1-process DDP + exact --dist-eval', ['--dist-eval'], torchrun=True,
        expect=r'Launcher: torchrun, 1 process\(es\), backend {backend}'),
    Row('fp32', 'fp32 (TF32 matmuls on CUDA)', expect=r'precision fp32'),
    Row('ieee-fp32', 'fp32 without TF32', ['--no-tf32'], expect=r'precision fp32(?!\+TF32)',
        not_quick='on the CPU the same as fp32'),
    Row('fp16', 'fp16 autocast + GradScaler', ['--amp', 'fp16'], expect=r'precision fp16'),
    Row('bf16', 'bf16 autocast', ['--amp', 'bf16'], needs='bf16', expect=r'precision bf16'),
    Row('compile', 'torch.compile', ['--compile'], not_quick='torch.compile takes minutes on a CPU'),
    Row('channels-last', 'channels-last memory format', ['--channels-last']),
    Row('sync-bn', 'SyncBatchNorm under DDP, 2 processes', ['--sync-bn'], torchrun=True, nproc=2, needs='cuda',
        expect=r'BatchNorm: SyncBatchNorm across the processes'),
    Row('ema', 'EMA on the device', ['--model-ema'], expect=r'Accuracy of the EMA network',
        not_quick='on the CPU the same as ema-cpu'),
    Row('ema-cpu', 'EMA on the CPU under DDP (broadcast, evaluation)', ['--model-ema', '--model-ema-force-cpu'],
        torchrun=True, expect=r'Accuracy of the EMA network'),
    Row('accum', 'gradient accumulation, 2 batches per optimizer step, under DDP', ['--accum-steps', '2'],
        torchrun=True, expect=r'global batch 8 = 4 x 1 x 2 accumulated'),
    Row('resume', 'save, then resume for a 2nd epoch', then=['--epochs', '2'],
        expect=r'Resumed from .*checkpoint\.pth: continuing at epoch 1'),
    Row('accum-nan', 'accumulation with a NaN micro-batch on rank 1 of 2: both skip the window alike',
        ['--accum-steps', '2', '--batch-size', '2', '--mixup', '0', '--cutmix', '0'], torchrun=True, nproc=2,
        module='tests.helpers.nan_micro_batch', check=same_backward_passes,
        not_quick='tests/integration/test_faults.py runs it on gloo'),
    Row('compile-ddp', '--compile under DDP, 2 processes (BatchNorm per process)', ['--compile'], torchrun=True,
        nproc=2, needs='cuda', expect=r'BatchNorm: per-process statistics under --compile'),
    Row('fast-plain-fp16', 'fast vs plain path of every variant under fp16 autocast', needs='cuda',
        in_process=fast_vs_plain_row('fp16')),
    Row('fast-plain-bf16', 'fast vs plain path of every variant under bf16 autocast', needs='bf16',
        in_process=fast_vs_plain_row('bf16'), not_quick='tests/test_fast_path.py checks it on the CPU'),
]


def base_flags(device: str, data: str, out: str) -> list[str]:
    return ['--model', 'NALAFORMER_XT', '--input-size', '32', '--batch-size', '4', '--epochs', '1',
            '--device', device, '--num_workers', '0', '--no-flops', '--print-freq', '100', '--unscale-lr',
            '--lr', '1e-3', '--warmup-epochs', '0', '--no-model-ema', '--data-path', data, '--output_dir', out]


def skip_reason(row: Row, device: str, quick: bool, quick_set: str = '--quick') -> str:
    """Why `row` does not run on `device` ('' when it runs); `quick`: only the quick set runs, which
    `quick_set` names in the reason."""
    if quick and row.not_quick:
        return f'not in {quick_set}: {row.not_quick}'
    if row.needs == 'cuda' and device != 'cuda':
        return 'needs CUDA'
    if device == 'cuda':
        import torch
        if row.needs == 'bf16' and not torch.cuda.is_bf16_supported(including_emulation=False):
            return 'this GPU has no native bfloat16'
        if row.nproc > torch.cuda.device_count():
            return f'needs {row.nproc} GPUs, {torch.cuda.device_count()} present'
    return ''


def child_env() -> dict:
    # PASSIVE: idle OpenMP threads sleep instead of spinning, which on a CPU shared with other work (CI
    # runners) makes a run several times slower
    env = dict(os.environ, PYTHONUNBUFFERED='1', OMP_WAIT_POLICY=os.environ.get('OMP_WAIT_POLICY', 'PASSIVE'))
    for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT',
              'SLURM_PROCID', 'SLURM_NTASKS', 'SLURM_LOCALID'):
        env.pop(k, None)  # run as a fresh job even inside an allocation or a launcher
    return env


def failure(proc: subprocess.CompletedProcess) -> str:
    """The line that says why a run failed: its `error:` line, else the last line of stderr."""
    lines = [x.strip() for x in proc.stderr.splitlines() if x.strip()]
    errors = [x for x in lines if 'error:' in x.lower()]
    return f'exit {proc.returncode}: ' + ((errors or lines or ['no output'])[-1])[:160]


def run_command(cmd: list[str], timeout: float, name: str, started: float) -> subprocess.CompletedProcess:
    """Run `cmd` (its output captured), printing `name: running, N s` (seconds since `started`, the row's start)
    every PROGRESS_EVERY seconds until it ends. After `timeout` seconds its process group (torchrun's workers
    too) is killed and subprocess.TimeoutExpired raised with the output so far."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    while True:
        left = timeout - (time.time() - t0)
        try:
            out, err = proc.communicate(timeout=max(0.0, min(PROGRESS_EVERY, left)))
            return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        except subprocess.TimeoutExpired:
            if time.time() - t0 >= timeout:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
                raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
            print(f'  {name}: running, {time.time() - started:.0f} s', flush=True)


def run_row(row: Row, device: str, data: str, work: str, extra: list[str], timeout: float):
    """(status, seconds, detail) of one row; its output goes to WORK/NAME.log."""
    if row.in_process is not None:
        t0 = time.time()
        try:
            status, detail = row.in_process(device)
        except Exception as e:  # a crash of the check is its failure, reported in the table
            status, detail = 'failed', f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}'[:160]
        return status, time.time() - t0, detail
    out = os.path.join(work, row.name)
    target = ['-m', row.module] if row.module != 'main.py' else ['main.py']
    launch = [sys.executable] + (torchrun(row.nproc) if row.torchrun else []) + target
    runs = [row.flags] + ([row.flags + row.then] if row.then is not None else [])
    t0 = time.time()
    with open(os.path.join(work, f'{row.name}.log'), 'w') as log:
        for flags in runs:
            cmd = launch + base_flags(device, data, out) + flags + extra
            log.write('$ ' + shlex.join(cmd) + '\n')
            try:
                proc = run_command(cmd, timeout, row.name, t0)
            except subprocess.TimeoutExpired as e:
                for part in (e.stdout, e.stderr):
                    log.write(part.decode(errors='replace') if isinstance(part, bytes) else part or '')
                return 'failed', time.time() - t0, f'timed out after {timeout:.0f} s (--timeout)'
            log.write(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                return 'failed', time.time() - t0, failure(proc)
    pattern = row.expect.format(backend='nccl' if device == 'cuda' else 'gloo')
    if pattern and not re.search(pattern, proc.stdout + proc.stderr):
        return 'failed', time.time() - t0, f'output lacks /{pattern}/'
    why = row.check(proc.stdout + proc.stderr) if row.check is not None else ''
    if why:
        return 'failed', time.time() - t0, why
    return 'passed', time.time() - t0, row.what


def print_table(results) -> None:
    width = max(len('path'), *(len(name) for name, *_ in results))
    print(f"{'path':<{width}}  {'status':<7}  {'seconds':>7}  detail")
    for name, status, seconds, detail in results:
        secs = f'{seconds:7.1f}' if status != 'skipped' else f"{'-':>7}"
        print(f'{name:<{width}}  {status:<7}  {secs}  {detail}')


def write_report(path: str, results, total_s: float) -> None:
    """The results as a Markdown table under a line naming the machine (GPUs, torch, CUDA)."""
    import torch
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    lines = [f"`python tools/smoke.py --gpu-report`: {len(gpus)} GPU(s) ({', '.join(sorted(set(gpus)))}), "
             f'torch {torch.__version__}, CUDA {torch.version.cuda}, {total_s / 60:.1f} min in all', '',
             '| path | status | seconds | detail |', '|---|---|---:|---|']
    for name, status, seconds, detail in results:
        secs = f'{seconds:.1f}' if status != 'skipped' else '-'
        lines.append(f"| {name} | {status} | {secs} | {detail.replace('|', '/')} |")
    with open(path, 'w') as f:
        f.write('\n'.join(lines) + '\n')


def get_args_parser() -> argparse.ArgumentParser:
    p = FlagParser('python tools/smoke.py', description=__doc__.split('\n\n')[0])
    p.add_argument('--quick', action='store_true', help='the CPU subset CI runs (no --compile); implies --device cpu')
    p.add_argument('--all', action='store_true',
                   help='every row, also on a CPU (whose default is the quick set: --compile takes minutes there)')
    p.add_argument('--only', default='', metavar='NAME[,NAME]',
                   help='these rows only: ' + ', '.join(r.name for r in ROWS))
    p.add_argument('--device', choices=['cuda', 'cpu'], default=None,
                   help='default: cpu with --quick, else cuda when a GPU is present')
    p.add_argument('--extra', default='', metavar='"FLAGS"', help='main.py flags appended to every run')
    p.add_argument('--timeout', type=float, default=None,
                   help='seconds one run of main.py may take (default 900; 240 with --gpu-report)')
    p.add_argument('--gpu-report', default=None, metavar='FILE',
                   help='every row on the GPU(s) (the 2-process rows need 2 GPUs), then the table as Markdown '
                        'in FILE: what a first GPU session must check, in under 8 minutes on one GPU')
    return p


def main(argv: list[str] | None = None) -> int:
    parser = get_args_parser()
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(',') if n]
    unknown = [n for n in names if n not in {r.name for r in ROWS}]
    if unknown:
        parser.error(f"--only: unknown row {', '.join(unknown)}; rows: {', '.join(r.name for r in ROWS)}")
    rows = [r for r in ROWS if not names or r.name in names]
    device = args.device
    if args.all and args.quick:
        parser.error('--all and --quick contradict each other: pass one')
    if args.gpu_report is not None:
        import torch
        if args.quick or device == 'cpu':
            parser.error('--gpu-report runs every row on the GPU: leave out --quick and --device cpu')
        if not torch.cuda.is_available():
            parser.error('--gpu-report needs a GPU: torch.cuda.is_available() is False on this machine')
        device = 'cuda'
    if device is None:
        import torch
        device = 'cuda' if torch.cuda.is_available() and not args.quick else 'cpu'
    timeout = args.timeout or (240 if args.gpu_report else 900)
    # on a CPU the quick set unless --all (or rows named with --only); --quick: the quick set anywhere
    quick = args.quick or (device == 'cpu' and not args.all and not names)
    quick_set = '--quick' if args.quick else 'the CPU default set (--all runs it)'
    mode = ('' if not quick else ', --quick' if args.quick else
            ', the quick set (the default on a CPU; --all runs every path)')
    print(f'Smoke test on {device}: {len(rows)} path(s){mode}, main.py in {REPO}', flush=True)

    start = time.time()
    work = tempfile.mkdtemp(prefix='nalaformer-smoke-')
    data = write_imagefolder(os.path.join(work, 'data'))
    results = []
    for row in rows:
        reason = skip_reason(row, device, quick, quick_set)
        if reason:
            results.append((row.name, 'skipped', 0.0, reason))
            continue
        print(f'  {row.name}: running ({row.what})', flush=True)
        status, seconds, detail = run_row(row, device, data, work, shlex.split(args.extra), timeout)
        print(f'  {row.name}: {status} ({seconds:.1f} s)', flush=True)
        results.append((row.name, status, seconds, detail))
    print()
    print_table(results)
    if args.gpu_report:
        write_report(args.gpu_report, results, time.time() - start)
        print(f'\nwrote {args.gpu_report}')
    failed = [name for name, status, *_ in results if status == 'failed']
    if failed:
        print(f'\n{len(failed)} path(s) failed; their logs: {work}/<path>.log')
        return 1
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
