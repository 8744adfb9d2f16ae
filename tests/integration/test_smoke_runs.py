"""tools/smoke.py for real on the CPU: it prints one table with passed / skipped rows, exits non-zero when a
row fails, and its fast-vs-plain and accum-nan rows pass."""
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, env

from tools import smoke

pytestmark = pytest.mark.slow  # every test here runs tools.smoke's rows


def smoke_run(*argv):
    return subprocess.run([sys.executable, '-m', 'tools.smoke', '--quick', *argv], cwd=REPO, env=env(), check=False,
                          capture_output=True, text=True, timeout=300)


def table(stdout):
    """{path: (status, detail)} of the table at the end of the output."""
    lines = stdout[stdout.index('path  '):].splitlines()[1:]
    rows = [re.match(r'(\S+)\s+(passed|failed|skipped)\s+(?:[\d.]+|-)\s+(.*)', x) for x in lines if x.strip()]
    return {m.group(1): (m.group(2), m.group(3)) for m in rows if m}


def test_quick_subset_prints_one_table_with_passed_and_skipped_rows():
    p = smoke_run('--only', 'fp32,compile,sync-bn')
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count('path  ') == 1
    t = table(p.stdout)
    assert t['fp32'][0] == 'passed'
    assert t['compile'] == ('skipped', 'not in --quick: torch.compile takes minutes on a CPU')
    assert t['sync-bn'] == ('skipped', 'needs CUDA')


def test_a_failing_row_is_reported_and_exits_non_zero():
    p = smoke_run('--only', 'fp32', '--extra', '--clip-grad -1')
    assert p.returncode == 1
    status, detail = table(p.stdout)['fp32']
    assert status == 'failed' and detail.startswith('exit 2: ') and '--clip-grad' in detail, detail
    logs = re.search(r'their logs: (\S+)/<path>\.log', p.stdout)
    assert logs and 'fp32.log' in os.listdir(logs.group(1))
    shutil.rmtree(logs.group(1))


def test_fast_vs_plain_row_applies_the_models_amp_rule_to_every_variant(monkeypatch):
    from tools import amp_parity
    status, detail = smoke.fast_vs_plain_row('bf16')('cpu')
    assert status == 'passed', detail
    assert all(f'{v} ' in detail for v in ('XT', 'T', 'S', 'B', 'L'))
    monkeypatch.setattr(amp_parity, 'AMP_TOLERANCE', 0.0)  # no slack: any rounding difference fails the row
    status, detail = smoke.fast_vs_plain_row('bf16')('cpu')
    assert status == 'failed' and 'stage' in detail


def test_accum_nan_row_passes_on_gloo():
    p = subprocess.run([sys.executable, '-m', 'tools.smoke', '--device', 'cpu', '--only', 'accum-nan'], cwd=REPO,
                       env=env(), check=False, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert table(p.stdout)['accum-nan'][0] == 'passed'
