"""Smoke test of a new machine: every training path of main.py once, on a tiny synthetic ImageFolder.

    python -m tools.smoke                  # all paths on this machine's device (cuda if present, else cpu)
    python -m tools.smoke --quick          # the CPU subset CI runs (no torch.compile: minutes on a CPU)
    python -m tools.smoke --only fp16,resume
    python -m tools.smoke --extra "--input-size 64"   # flags appended to every run

Each row runs main.py (NALAFORMER_XT at 32 px, one epoch of a few steps) as its own process and must exit 0
and print what the path promises. One table at the end: path, passed/failed/skipped (with the reason),
seconds. The exit status is 1 when a row failed; the logs of a failed run are kept and their folder printed.
"""
import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = ['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=1']


@dataclass
class Row:
    """One path: main.py with `flags` added to the common ones."""

    name: str
    what: str
    flags: list[str] = field(default_factory=list)
    torchrun: bool = False           # a 1-process DDP run (process group on gloo or NCCL)
    needs: str = ''                  # 'cuda': skipped on the CPU; 'bf16': skipped on a GPU without bfloat16
    not_quick: str = ''              # why the row is left out of --quick (empty: it is part of it)
    expect: str = ''                 # regular expression the output must match ({backend} is filled in)
    then: list[str] | None = None  # flags of a second run in the same output dir (resume)


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
    Row('sync-bn', 'SyncBatchNorm under DDP', ['--sync-bn'], torchrun=True, needs='cuda'),
    Row('ema', 'EMA on the device', ['--model-ema'], expect=r'Accuracy of the EMA network',
        not_quick='on the CPU the same as ema-cpu'),
    Row('ema-cpu', 'EMA on the CPU under DDP (broadcast, evaluation)', ['--model-ema', '--model-ema-force-cpu'],
        torchrun=True, expect=r'Accuracy of the EMA network'),
    Row('accum', 'gradient accumulation, 2 batches per optimizer step, under DDP', ['--accum-steps', '2'],
        torchrun=True, expect=r'global batch 8 = 4 x 1 x 2 accumulated'),
    Row('resume', 'save, then resume for a 2nd epoch', then=['--epochs', '2'],
        expect=r'Resumed from .*checkpoint\.pth: continuing at epoch 1'),
]


def base_flags(device: str, data: str, out: str) -> list[str]:
    return ['--model', 'NALAFORMER_XT', '--input-size', '32', '--batch-size', '4', '--epochs', '1',
            '--device', device, '--num_workers', '0', '--no-flops', '--print-freq', '100', '--unscale-lr',
            '--lr', '1e-3', '--warmup-epochs', '0', '--no-model-ema', '--data-path', data, '--output_dir', out]


def write_imagefolder(root: str, classes: int = 3, n_train: int = 8, n_val: int = 4, size: int = 32,
                      seed: int = 0) -> str:
    """Random PNGs in train/ and val/ whose class c brightens colour channel c % 3 (less so for c >= 3)."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    for split, n in (('train', n_train), ('val', n_val)):
        for c in range(classes):
            folder = os.path.join(root, split, f'c{c}')
            os.makedirs(folder, exist_ok=True)
            for i in range(n):
                a = rng.integers(0, 80, (size, size, 3), dtype=np.uint8)
                a[..., c % 3] += 150 - 40 * (c // 3)
                Image.fromarray(a).save(os.path.join(folder, f'{i}.png'))
    return str(root)


def skip_reason(row: Row, device: str, quick: bool) -> str:
    if quick and row.not_quick:
        return f'not in --quick: {row.not_quick}'
    if row.needs == 'cuda' and device != 'cuda':
        return 'needs CUDA'
    if row.needs == 'bf16' and device == 'cuda':
        import torch
        if not torch.cuda.is_bf16_supported():
            return 'this GPU has no bfloat16'
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


def run_row(row: Row, device: str, data: str, work: str, extra: list[str], timeout: float):
    """(status, seconds, detail) of one row; its output goes to WORK/NAME.log."""
    out = os.path.join(work, row.name)
    launch = [sys.executable] + (TORCHRUN if row.torchrun else []) + ['main.py']
    runs = [row.flags] + ([row.flags + row.then] if row.then is not None else [])
    t0 = time.time()
    with open(os.path.join(work, f'{row.name}.log'), 'w') as log:
        for flags in runs:
            cmd = launch + base_flags(device, data, out) + flags + extra
            log.write('$ ' + shlex.join(cmd) + '\n')
            try:
                proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True,
                                      timeout=timeout, check=False)
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
    return 'passed', time.time() - t0, row.what


def print_table(results) -> None:
    width = max(len('path'), *(len(name) for name, *_ in results))
    print(f"{'path':<{width}}  {'status':<7}  {'seconds':>7}  detail")
    for name, status, seconds, detail in results:
        secs = f'{seconds:7.1f}' if status != 'skipped' else f"{'-':>7}"
        print(f'{name:<{width}}  {status:<7}  {secs}  {detail}')


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser('python -m tools.smoke', description=__doc__.split('\n\n')[0])
    p.add_argument('--quick', action='store_true', help='the CPU subset CI runs (no --compile); implies --device cpu')
    p.add_argument('--only', default='', metavar='NAME[,NAME]',
                   help='these rows only: ' + ', '.join(r.name for r in ROWS))
    p.add_argument('--device', choices=['cuda', 'cpu'], default=None,
                   help='default: cpu with --quick, else cuda when a GPU is present')
    p.add_argument('--extra', default='', metavar='"FLAGS"', help='main.py flags appended to every run')
    p.add_argument('--timeout', type=float, default=900, help='seconds one run of main.py may take')
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
    if device is None:
        import torch
        device = 'cuda' if torch.cuda.is_available() and not args.quick else 'cpu'
    print(f'Smoke test on {device}: {len(rows)} path(s), main.py in {REPO}', flush=True)

    work = tempfile.mkdtemp(prefix='nalaformer-smoke-')
    data = write_imagefolder(os.path.join(work, 'data'))
    results = []
    for row in rows:
        reason = skip_reason(row, device, args.quick)
        if reason:
            results.append((row.name, 'skipped', 0.0, reason))
            continue
        status, seconds, detail = run_row(row, device, data, work, shlex.split(args.extra), args.timeout)
        print(f'  {row.name}: {status} ({seconds:.1f} s)', flush=True)
        results.append((row.name, status, seconds, detail))
    print()
    print_table(results)
    failed = [name for name, status, *_ in results if status == 'failed']
    if failed:
        print(f'\n{len(failed)} path(s) failed; their logs: {work}/<path>.log')
        return 1
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
