"""Every tool runs both usual ways: `python tools/X.py` (the tools folder first on sys.path, the repository
root absent) and `python -m tools.X` from the repository root."""
import importlib
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

TOOLS = sorted(f[:-3] for f in os.listdir(os.path.join(REPO, 'tools'))
               if f.endswith('.py') and "if __name__ == '__main__':" in open(os.path.join(REPO, 'tools', f)).read())

# One process tries every tool both ways, as the interpreter would start it: sys.path as `python FILE` or
# `python -m` sets it, the repository's modules forgotten before each try (torch and timm stay imported).
PROBE = r"""
import contextlib, io, json, os, runpy, sys
repo, tools = sys.argv[1], sys.argv[2:]
site = [p for p in sys.path if p and os.path.abspath(p) not in (repo, os.getcwd())]
results = {}
for tool in tools:
    for way in ('path', 'module'):
        for name, mod in list(sys.modules.items()):
            file = getattr(mod, '__file__', None) or ''
            if file.startswith(repo + os.sep) and 'site-packages' not in file:
                del sys.modules[name]
        path = os.path.join(repo, 'tools', tool + '.py')
        sys.path[:] = ([os.path.dirname(path)] if way == 'path' else [repo]) + site
        sys.argv = [path, '--help']
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                if way == 'path':
                    runpy.run_path(path, run_name='__main__')
                else:
                    runpy.run_module('tools.' + tool, run_name='__main__', alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code or 0
        except Exception as e:
            code = f'{type(e).__name__}: {e}'
        results[f'{tool} ({way})'] = code
print(json.dumps(results))
"""


def test_every_tool_runs_as_a_file_and_as_a_module(tmp_path):
    assert {'benchmark', 'export', 'predict', 'release', 'smoke'} <= set(TOOLS)
    p = subprocess.run([sys.executable, '-c', PROBE, REPO, *TOOLS], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(results) == 2 * len(TOOLS)
    assert {k: v for k, v in results.items() if v != 0} == {}


# each tool's entry point and the arguments it requires, so that only the mistyped flag is wrong
TYPO_CASES = {
    'analyze_attention': ('main', ['--images', 'imgs']),
    'benchmark': ('parse_args', []),
    'block_sweep': ('parse_args', []),
    'ema_speed': ('parse_args', []),
    'export': ('main', ['--format', 'onnx', '--output', 'x.onnx']),
    'flops': ('main', []),
    'gpu_benchmark': ('parse_args', []),
    'loader_speed': ('parse_args', ['--data-loading', 'imgs']),
    'paper_throughput': ('parse_args', []),
    'plot_log': ('main', ['out']),
    'predict': ('main', ['imgs', '--checkpoint', 'c.pth']),
    'profile_ops': ('parse_args', []),
    'release': ('main', ['c.pth', '--output-dir', 'rel']),
    'smoke': ('main', []),
}


@pytest.mark.parametrize('tool', sorted(TYPO_CASES))
def test_a_mistyped_flag_is_two_lines_with_the_closest_flag(tool, capsys):
    """As main.py: a pointer to --help and the error naming the flag meant, not the page-long usage (exit 2)."""
    entry, required = TYPO_CASES[tool]
    module = importlib.import_module('tools.' + tool)
    with pytest.raises(SystemExit) as ei:
        getattr(module, entry)(required + ['--hepl'])
    err = capsys.readouterr().err.splitlines()
    assert ei.value.code == 2
    assert len(err) == 2 and err[0].endswith(' [options]  (--help lists them)'), err
    assert err[1].endswith('error: unrecognized arguments: --hepl (did you mean --help?)'), err


def test_every_tool_with_a_command_line_is_in_the_typo_cases():
    assert set(TOOLS) - {'amp_parity', 'published', 'synthetic'} == set(TYPO_CASES)


@pytest.mark.parametrize('tool', ['analyze_attention', 'benchmark', 'export', 'flops', 'profile_ops'])
def test_a_mistyped_model_name_gets_the_variant_meant(tool, capsys):
    """nalaformer-t for NALAFORMER_T: one error line naming the variant (release and predict say it when they
    read the checkpoint, their model's default)."""
    entry, required = TYPO_CASES[tool]
    module = importlib.import_module('tools.' + tool)
    with pytest.raises(SystemExit) as ei:
        getattr(module, entry)(required + ['--model', 'nalaformer-t'])
    err = capsys.readouterr().err.splitlines()
    assert ei.value.code == 2 and "unknown model 'nalaformer-t' (did you mean NALAFORMER_T?)" in err[-1], err


def test_predict_names_the_variant_meant():
    from run.errors import UserError
    from tools import predict
    with pytest.raises(UserError, match=r"unknown model 'nalaformer-t' \(did you mean NALAFORMER_T\?\)"):
        predict.predicting_model('nalaformer-t', {}, 'c.pth')
