"""tools/smoke.py: its rows are valid main.py command lines, and a real (CPU) run prints one table with
passed / skipped rows and exits non-zero when a row fails."""
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, env

import main
from tools import smoke


@pytest.mark.parametrize('row', smoke.ROWS, ids=lambda r: r.name)
def test_every_row_is_a_valid_main_command_line(row, monkeypatch):
    for k in ('RANK', 'WORLD_SIZE', 'SLURM_PROCID', 'SLURM_NTASKS'):
        monkeypatch.delenv(k, raising=False)
    if row.torchrun:  # as torchrun --nproc_per_node=1 starts it
        monkeypatch.setenv('RANK', '0')
        monkeypatch.setenv('WORLD_SIZE', '1')
    for extra in [row.flags] + ([row.flags + row.then] if row.then is not None else []):
        parser = main.get_args_parser()
        args = parser.parse_args(smoke.base_flags('cpu', '/data', '/out') + extra)
        main.validate_args(args, parser)


def test_unknown_row_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as ei:
        smoke.main(['--only', 'fp32,nope'])
    assert ei.value.code == 2
    assert '--only: unknown row nope; rows: ddp, fp32' in capsys.readouterr().err


def smoke_run(*argv):
    return subprocess.run([sys.executable, '-m', 'tools.smoke', '--quick', *argv], cwd=REPO, env=env(), check=False,
                          capture_output=True, text=True, timeout=300)


def table(stdout):
    """{path: (status, detail)} of the table at the end of the output."""
    lines = stdout[stdout.index('path  '):].splitlines()[1:]
    rows = [re.match(r'(\S+)\s+(passed|failed|skipped)\s+(?:[\d.]+|-)\s+(.*)', x) for x in lines if x.strip()]
    return {m.group(1): (m.group(2), m.group(3)) for m in rows if m}


@pytest.mark.slow
def test_quick_subset_prints_one_table_with_passed_and_skipped_rows():
    p = smoke_run('--only', 'fp32,compile,sync-bn')
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count('path  ') == 1
    t = table(p.stdout)
    assert t['fp32'][0] == 'passed'
    assert t['compile'] == ('skipped', 'not in --quick: torch.compile takes minutes on a CPU')
    assert t['sync-bn'] == ('skipped', 'needs CUDA')


@pytest.mark.slow
def test_a_failing_row_is_reported_and_exits_non_zero():
    p = smoke_run('--only', 'fp32', '--extra', '--clip-grad -1')
    assert p.returncode == 1
    status, detail = table(p.stdout)['fp32']
    assert status == 'failed' and detail.startswith('exit 2: ') and '--clip-grad' in detail, detail
    logs = re.search(r'their logs: (\S+)/<path>\.log', p.stdout)
    assert logs and 'fp32.log' in os.listdir(logs.group(1))
    shutil.rmtree(logs.group(1))
