"""tools/smoke.py without running it: its rows are valid main.py command lines, and the GPU session's skip
rules and report (tests/integration/test_smoke_runs.py runs it)."""

import subprocess
import time

import pytest

import cli
from tools import smoke


@pytest.mark.parametrize('row', smoke.ROWS, ids=lambda r: r.name)
def test_every_row_is_a_valid_main_command_line(row, monkeypatch):
    for k in ('RANK', 'WORLD_SIZE', 'SLURM_PROCID', 'SLURM_NTASKS'):
        monkeypatch.delenv(k, raising=False)
    if row.torchrun:  # as torchrun --nproc_per_node=1 starts it
        monkeypatch.setenv('RANK', '0')
        monkeypatch.setenv('WORLD_SIZE', '1')
    for extra in [row.flags] + ([row.flags + row.then] if row.then is not None else []):
        parser = cli.get_args_parser()
        args = parser.parse_args(smoke.base_flags('cpu', '/data', '/out') + extra)
        cli.validate_args(args, parser)


def test_unknown_row_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as ei:
        smoke.main(['--only', 'fp32,nope'])
    assert ei.value.code == 2
    assert '--only: unknown row nope; rows: ddp, fp32' in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ GPU session
class FakeGpus:
    """torch.cuda of a machine with `n` GPUs whose bfloat16 is emulated only (V100-like) unless `native`."""

    def __init__(self, monkeypatch, n, native=True):
        import torch
        monkeypatch.setattr(torch.cuda, 'is_available', lambda: n > 0)
        monkeypatch.setattr(torch.cuda, 'device_count', lambda: n)
        monkeypatch.setattr(torch.cuda, 'is_bf16_supported',
                            lambda including_emulation=True: native or including_emulation)
        monkeypatch.setattr(torch.cuda, 'get_device_name', lambda i=None: 'NVIDIA H200')


def rows(*names):
    return [next(r for r in smoke.ROWS if r.name == n) for n in names]


def test_two_process_rows_run_with_two_gpus_and_say_why_not_with_one(monkeypatch):
    two = rows('sync-bn', 'accum-nan', 'compile-ddp')
    assert all(r.nproc == 2 for r in two)
    FakeGpus(monkeypatch, 1)
    assert [smoke.skip_reason(r, 'cuda', False) for r in two] == ['needs 2 GPUs, 1 present'] * 3
    FakeGpus(monkeypatch, 2)
    assert [smoke.skip_reason(r, 'cuda', False) for r in two] == [''] * 3
    assert smoke.skip_reason(rows('sync-bn')[0], 'cpu', False) == 'needs CUDA'  # SyncBatchNorm needs CUDA


def test_bf16_rows_need_native_bfloat16(monkeypatch):
    FakeGpus(monkeypatch, 1, native=False)
    assert [smoke.skip_reason(r, 'cuda', False) for r in rows('bf16', 'fast-plain-bf16')] == [
        'this GPU has no native bfloat16'] * 2


def test_accum_nan_check_wants_equal_backward_passes_and_the_window_skipped_on_both():
    ok = ('warning: non-finite loss (on another rank) at epoch 0 step 1; step skipped\n'
          '[rank 1] backward passes: 4 of 6 micro-batches\n[rank 0] backward passes: 4 of 6 micro-batches\n')
    assert smoke.same_backward_passes(ok) == ''
    assert 'differ: rank 0 ran 5, rank 1 4' in smoke.same_backward_passes(ok.replace('[rank 0] backward passes: 4',
                                                                                     '[rank 0] backward passes: 5'))
    assert smoke.same_backward_passes(ok.split('\n', 1)[1]).startswith('rank 0 did not skip')


def test_gpu_report_without_a_gpu_is_an_argparse_error(monkeypatch, capsys):
    FakeGpus(monkeypatch, 0)
    with pytest.raises(SystemExit) as ei:
        smoke.main(['--gpu-report', 'r.md'])
    assert ei.value.code == 2 and '--gpu-report needs a GPU' in capsys.readouterr().err


def test_gpu_report_is_a_markdown_table_of_every_row(monkeypatch, tmp_path):
    FakeGpus(monkeypatch, 1)
    monkeypatch.setattr(smoke, 'write_imagefolder', lambda root: root)
    ran = []

    def fake_run(row, device, data, work, extra, timeout):
        ran.append((row.name, device, timeout))
        return 'passed', 1.0, row.what

    monkeypatch.setattr(smoke, 'run_row', fake_run)
    assert smoke.main(['--gpu-report', str(tmp_path / 'r.md')]) == 0
    lines = (tmp_path / 'r.md').read_text().splitlines()
    assert lines[0].startswith('`python tools/smoke.py --gpu-report`: 1 GPU(s) (NVIDIA H200)')
    table = {line.split(' | ')[0][2:]: line.split(' | ')[1:] for line in lines[4:]}
    assert list(table) == [r.name for r in smoke.ROWS]
    assert table['sync-bn'][:2] == ['skipped', '-'] and table['sync-bn'][2] == 'needs 2 GPUs, 1 present |'
    assert table['fp32'][0] == 'passed'
    assert all(device == 'cuda' and timeout == 240 for _, device, timeout in ran)


# ------------------------------------------------------------------------------------- CPU default, progress
def _ran(monkeypatch, argv, gpus=0):
    """The rows smoke.main runs for `argv` (run_row stood in for) on a machine with `gpus` GPUs, and its output."""
    FakeGpus(monkeypatch, gpus)
    monkeypatch.setattr(smoke, 'write_imagefolder', lambda root: root)
    ran = []
    monkeypatch.setattr(smoke, 'run_row', lambda row, *a: ran.append(row.name) or ('passed', 1.0, row.what))
    assert smoke.main(argv) == 0
    return ran


def test_the_cpu_default_is_the_quick_set_and_all_runs_every_row(monkeypatch, capsys):
    quick = [r.name for r in smoke.ROWS if not smoke.skip_reason(r, 'cpu', True)]
    assert 'compile' not in quick
    assert _ran(monkeypatch, []) == quick
    out = capsys.readouterr().out
    assert 'the quick set (the default on a CPU; --all runs every path)' in out.splitlines()[0]
    assert 'not in the CPU default set (--all runs it): torch.compile takes minutes on a CPU' in out
    assert _ran(monkeypatch, ['--all']) == [r.name for r in smoke.ROWS if not smoke.skip_reason(r, 'cpu', False)]
    assert _ran(monkeypatch, ['--only', 'compile']) == ['compile']  # a row named on a CPU runs
    assert _ran(monkeypatch, [], gpus=1) == [r.name for r in smoke.ROWS if not smoke.skip_reason(r, 'cuda', False)]
    with pytest.raises(SystemExit):
        smoke.main(['--all', '--quick'])


def test_each_row_says_when_it_starts_and_how_long_it_has_run(monkeypatch, capsys):
    import sys
    _ran(monkeypatch, ['--only', 'fp32'])
    assert '  fp32: running (fp32 (TF32 matmuls on CUDA))' in capsys.readouterr().out.splitlines()
    monkeypatch.setattr(smoke, 'PROGRESS_EVERY', 0.3)
    proc = smoke.run_command([sys.executable, '-c', 'import time; time.sleep(1.2); print("done")'], 30, 'slow',
                             time.time() - 100)
    assert proc.returncode == 0 and proc.stdout == 'done\n'
    ticks = [line for line in capsys.readouterr().out.splitlines() if line.startswith('  slow: running, ')]
    assert len(ticks) >= 2 and all(int(t.split(', ')[1].split()[0]) >= 100 for t in ticks), ticks
    with pytest.raises(subprocess.TimeoutExpired):
        smoke.run_command([sys.executable, '-c', 'import time; time.sleep(30)'], 0.5, 'stuck', time.time())
