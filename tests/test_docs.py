"""What README.md and docs/ say about a command agrees with what the command does (as far as a CPU run
allows): every README command runs as written, its Python lines run, which weights `--finetune` takes, the
smoke and analysis sections (`make demo`'s figure: tests/integration/test_commands.py)."""
import argparse
import os
import re
import shlex
import subprocess

import pytest
import torch
from conftest import REPO, build_xt, env

from run import weights


def _read(path):
    with open(os.path.join(REPO, path)) as f:
        return f.read()


def test_finetune_takes_the_weights_the_docs_name(tmp_path, capsys):
    """--finetune takes the EMA weights of a checkpoint that has them; the docs state that rule once, in
    the loader section, and nowhere claim it takes `model`."""
    src = build_xt(3)
    ema = {k: v + 1 if v.is_floating_point() else v for k, v in src.state_dict().items()}
    path = str(tmp_path / 'ckpt.pth')
    torch.save({'model': src.state_dict(), 'model_ema': ema}, path)
    dst = build_xt(5)
    weights.finetune_from(dst, path, 'NALAFORMER_XT')
    assert '(model_ema weights)' in capsys.readouterr().out
    w = 'patch_embed.proj.0.weight'
    assert torch.equal(dst.state_dict()[w], ema[w])

    usage = _read('docs/usage.md')
    rule = usage.split('## Which weights a loader takes', 1)[1].split('\n## ', 1)[0]
    assert 'else **`model_ema`**' in rule and '`main.py --finetune`' in rule
    for doc in ('README.md', 'docs/usage.md', 'finetune.sh'):
        text = ' '.join(_read(doc).replace('#', ' ').split())
        assert not re.search(r"--finetune` loads the checkpoint's `model` weights|its model weights are loaded",
                             text), doc


def _section(doc, heading):
    return _read(doc).split(heading, 1)[1].split('\n## ', 1)[0]


def test_the_smoke_section_lists_the_paths_and_counts_of_tools_smoke():
    """docs/usage.md names every path of tools/smoke.py and says what --quick runs on a CPU, counted from
    tools/smoke.py itself."""
    from tools import smoke
    text = ' '.join(_section('docs/usage.md', '## Smoke test on a new machine').split())
    assert all(f'`{row.name}`' in text for row in smoke.ROWS), [r.name for r in smoke.ROWS if f'`{r.name}`' not in text]
    quick = [row for row in smoke.ROWS if not smoke.skip_reason(row, 'cpu', True) and row.in_process is None]
    runs = sum(2 if row.then is not None else 1 for row in quick)
    listed = ', '.join(f'`{row.name}`' for row in quick[:-1]) + f' and `{quick[-1].name}`'
    assert f'`--quick` runs {len(quick)} paths: {listed}, {runs} runs of `main.py`' in text, text
    torchrun = [f'`{row.name}`' for row in quick if row.torchrun]
    assert f"{', '.join(torchrun[:-1])} and {torchrun[-1]} under torchrun" in text
    full = [f'`{row.name}`' for row in smoke.ROWS if smoke.skip_reason(row, 'cpu', True)
            and not smoke.skip_reason(row, 'cpu', False)]
    added = re.search(r'the full set on a CPU adds (.*?), which on a CPU', text).group(1)
    assert sorted(re.findall(r'`[\w-]+`', added)) == sorted(full), added


def test_the_analysis_commands_use_the_image_count_of_the_measurements():
    text = _read('docs/analysis.md')
    measured = re.search(r'analysed on all (\d+) validation digits', text).group(1)
    commands = re.findall(r'python tools/analyze_attention\.py[^`\n]*(?:\\\n[^`\n]*)*', text)
    digits = [c for c in commands if '--data-set DIGITS' in c]
    assert digits and all(f'--num-images {measured}' in c for c in digits), digits


def test_the_python_snippet_says_where_it_runs():
    """README's Python lines import this repository's `models`: the line before them says to run them from
    the repository root (or with it on PYTHONPATH), and usage.md explains the choice."""
    readme = _read('README.md')
    before = readme.split('```python\nimport torch, timm, models', 1)[0].rstrip().rsplit('\n\n', 1)[-1]
    assert 'From the repository root' in before and 'PYTHONPATH' in before, before
    where = _section('docs/usage.md', '## Where to run the code: the repository root')
    assert "ModuleNotFoundError: No module named 'models'" in where and 'torch.hub.load' in where


def test_the_readme_says_where_bf16_is_fast_and_how_long_make_smoke_takes():
    """Each smoke time in the README comes with the load it was measured at, as docs/usage.md records it
    (seconds and raw log)."""
    text = ' '.join(_read('README.md').split())
    bf16 = re.search(r'`--amp bf16` is the fast precision on GPUs with bf16 tensor cores[^`]*?\)\.', text)
    assert bf16 and 'on a CPU it needs native bf16' in bf16.group(0) and 'docs/performance.md' in bf16.group(0), text
    smoke = re.search(r'`make smoke` runs [^`]*?on a CPU the quick set without compile: ([\d.]+) minutes on 2 '
                      r'cores at load average ([\d–]+), ([\d.]+) at ([\d–]+) \(`tools/smoke.py --all`: ([\d.]+) '
                      r'at ([\d–]+)\)', text)
    assert smoke, text
    quick, quick_load, loaded, loaded_load, full, full_load = smoke.groups()
    usage = ' '.join(_section('docs/usage.md', '## Smoke test on a new machine').split())
    for minutes, load, tail in ((quick, quick_load, r'\)'), (loaded, loaded_load, ',')):
        m = re.search(rf'`make smoke` took {re.escape(minutes)} minutes \((\d+) s, load average {load}{tail}', usage)
        assert m and abs(int(m.group(1)) / 60 - float(minutes)) <= 0.051, (minutes, load, usage)
    assert re.search(rf'`--all` {re.escape(full)} minutes \(\d+ s, [^)]*load average {full_load}\)', usage), usage
    assert 'wall time 242s' in _read('docs/results/smoke_cpu_loaded_2026-12-07.log')


def test_the_readme_benchmark_commands_say_how_long_they_take():
    """A short comparison comes first; the table's command says how long it took, from its raw log, and both run
    with OMP_WAIT_POLICY=PASSIVE, as the figures were measured."""
    commands = [c for c in readme_commands() if 'tools/benchmark.py' in c]
    assert len(commands) == 2 and all(c.startswith('OMP_WAIT_POLICY=PASSIVE python ') for c in commands), commands
    models = [len(re.search(r'--compare (\S+)', c).group(1).split(',')) for c in commands]
    assert models[0] < models[1] and '--modes inference' in commands[0]
    raw = _read('docs/results/benchmark_compare_T_fp32_bf16_idle_2026-12-06.txt')
    assert 'OMP_WAIT_POLICY=PASSIVE python ' + commands[1].split(' python ', 1)[1] in raw
    seconds = float(re.findall(r'\[224x224,\s+([\d.]+) s\]', raw)[-1])
    text = ' '.join(_read('README.md').split('## Performance', 1)[1].split('\n## ', 1)[0].split())
    assert f"the table's {seconds / 60:.1f} on the idle machine" in text, text


def test_the_docs_give_no_test_count_that_goes_stale():
    for doc in ('README.md', *(os.path.join('docs', f) for f in os.listdir(os.path.join(REPO, 'docs'))
                               if f.endswith('.md'))):
        assert not re.search(r'\b\d{3,} tests\b', _read(doc)), doc


def test_the_failure_table_keeps_each_row_short():
    """docs/usage.md's failure table: one short line per row (what happened, what you see and do); the long
    explanations live in their sections, the list of checked flags in Training options."""
    table = _section('docs/usage.md', '## When things go wrong').split('\n\n| what happened |', 1)[1]
    rows = [line for line in table.split('\n\n', 1)[0].splitlines() if line.startswith('| ')][1:]
    assert len(rows) >= 20
    long = [row for row in rows if len(row.replace('|', ' ').split()) > 40]
    assert not long, long
    assert '**Flag checks.**' in _section('docs/usage.md', '## Training options')


def test_the_cpu_only_install_takes_torch_from_the_given_index_first(tmp_path):
    """README's CPU line: `make venv TORCH_INDEX=...` installs torch and torchvision from that index at the pinned
    versions before the requirements, which keep them (a +cpu local version satisfies the pin)."""
    from packaging.specifiers import SpecifierSet
    index = 'https://download.pytorch.org/whl/cpu'
    assert f'make venv TORCH_INDEX={index}' in _read('README.md')
    for target, venv, constraints in (('venv', 'VENV', 'constraints.txt'), ('venv-min', 'VENV_MIN',
                                                                           'constraints-min.txt')):
        args = ['make', '-n', target, f'{venv}={tmp_path / target}']
        plain = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60).stdout
        assert '--index-url' not in plain
        p = subprocess.run([*args, f'TORCH_INDEX={index}'], cwd=REPO, capture_output=True, text=True, timeout=60)
        installs = [line for line in p.stdout.splitlines() if ' -m pip install ' in line]
        assert len(installs) == 2, p.stdout
        assert installs[0].endswith(f'pip install -q torch torchvision -c {constraints} --index-url {index}')
        assert f'-r requirements.txt -r requirements-dev.txt -c {constraints}' in installs[1]
        pins = dict(line.split('==') for line in _read(constraints).splitlines() if '==' in line)
        for name in ('torch', 'torchvision'):
            assert SpecifierSet(f'=={pins[name]}').contains(f'{pins[name]}+cpu')


def test_make_test_duration_is_in_usage_not_in_the_readme():
    assert re.search(r'`make test` runs the whole suite, about \d+ minutes on a 2-core machine',
                     ' '.join(_read('docs/usage.md').split()))
    assert not re.search(r'make test[^\n]*minutes', _read('README.md'))


def test_make_demo_keeps_other_files_in_its_output_dir():
    """`make demo` replaces an earlier demo's run files through main.py --overwrite (which keeps other files,
    tests/test_run_dir.py) instead of deleting the folder."""
    p = subprocess.run(['make', '-n', 'demo', 'VENV=/nonexistent-venv'], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    recipe = [line for line in p.stdout.splitlines() if 'output/demo' in line]
    assert len(recipe) == 1 and 'main.py' in recipe[0] and recipe[0].endswith('--output_dir output/demo --overwrite')
    assert not re.search(r'\brm\b', p.stdout)


# ------------------------------------------------------------------------------------------ README's commands
def readme_commands():
    """The command lines of README's bash blocks: continuations joined, comments dropped."""
    lines = []
    for block in re.findall(r'```bash\n(.*?)```', _read('README.md'), re.S):
        for line in block.replace('\\\n', ' ').splitlines():
            line = re.split(r'\s+#\s', line, maxsplit=1)[0].strip()
            if line and not line.startswith('#'):
                lines.append(line)
    return lines


class _Parsed(Exception):
    """Raised by a tool's argparse once its command line parsed: the tool does nothing more."""


def _parse_only(monkeypatch, main_fn, argv):
    real = argparse.ArgumentParser.parse_args

    def parse(self, args=None, namespace=None):
        raise _Parsed(real(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, 'parse_args', parse)
    with pytest.raises(_Parsed):
        main_fn(list(argv))
    monkeypatch.undo()


def test_every_readme_command_runs_as_written(monkeypatch, tmp_path):
    """Each command line README shows is one this checkout accepts: Makefile targets exist, the scripts run
    dry (DRY_RUN=1) and the main.py command they print parses, main.py's and every tool's flags parse."""
    import importlib

    import cli
    from segmentation import train as seg_train
    commands = readme_commands()
    assert len(commands) >= 12, commands
    seen = set()
    for line in commands:
        words = shlex.split(line)
        assigned = dict(w.split('=', 1) for w in words if re.fullmatch(r'[A-Z_]+=\S*', w))
        words = [w for w in words if not re.fullmatch(r'[A-Z_]+=\S*', w)]
        tool, rest = words[0], words[1:]
        if tool == 'make':
            p = subprocess.run(['make', '-n', *rest], cwd=REPO, capture_output=True, text=True, timeout=60)
            assert p.returncode == 0, (line, p.stderr)
        elif tool == 'pip':
            assert rest[:2] == ['install', '-r'] and os.path.isfile(os.path.join(REPO, rest[2])), line
        elif tool in ('bash', 'sbatch'):
            script = next(w for w in rest if w.endswith(('.sh', '.sbatch')))
            e = {**env(), **assigned, 'DRY_RUN': '1'}
            p = subprocess.run(['bash', os.path.join(REPO, script), *rest[rest.index(script) + 1:]], cwd=tmp_path,
                               env=e, capture_output=True, text=True, timeout=60)
            assert p.returncode == 0, (line, p.stderr)
            launched = shlex.split(p.stdout.strip().splitlines()[-1].lstrip('+ '))
            if 'main.py' in launched:
                cli.get_args_parser().parse_args(launched[launched.index('main.py') + 1:])
            elif 'segmentation/train.py' in launched:
                seg_train.get_args_parser().parse_args(launched[launched.index('segmentation/train.py') + 1:])
        elif tool == 'python' and rest[0] == 'main.py':
            cli.get_args_parser().parse_args(rest[1:])
        elif tool == 'python' and rest[0] == 'segmentation/train.py':
            seg_train.get_args_parser().parse_args(rest[1:])
        elif tool == 'python' and rest[0].startswith('tools/'):
            module = importlib.import_module('tools.' + os.path.basename(rest[0])[:-3])
            _parse_only(monkeypatch, module.main, rest[1:])
        else:
            raise AssertionError(f'README command of an unknown kind: {line}')
        seen.add(tool)
    assert {'make', 'bash', 'sbatch', 'python'} <= seen


def test_every_variable_a_readme_command_sets_changes_what_its_script_runs(tmp_path):
    """A launch line of the README sets only variables its script reads: each one, given another value, changes
    the command the script prints, or is refused (DRY_RUN=1; slurm/train.sbatch prints each node's command)."""
    def dry_run(script, args, assigned):
        p = subprocess.run(['bash', os.path.join(REPO, script), *args], cwd=tmp_path, capture_output=True, text=True,
                           env={**env(), **assigned, 'DRY_RUN': '1'}, timeout=60)
        return p.returncode, p.stdout, p.stderr  # a refused value (an unknown MODEL) is read too

    checked = 0
    for line in readme_commands():
        words = shlex.split(line)
        assigned = dict(w.split('=', 1) for w in words if re.fullmatch(r'[A-Z_]+=\S*', w))
        rest = [w for w in words if not re.fullmatch(r'[A-Z_]+=\S*', w)]
        if rest[0] not in ('bash', 'sbatch'):
            continue
        script = next(w for w in rest if w.endswith(('.sh', '.sbatch')))
        args = rest[rest.index(script) + 1:]
        printed = dry_run(script, args, assigned)
        assert printed[0] == 0, (line, printed)
        for name, value in assigned.items():
            other = str(int(value) + 1) if value.isdigit() else value + 'x'
            assert dry_run(script, args, {**assigned, name: other}) != printed, f'{script} does not read {name}: {line}'
            checked += 1
    assert checked >= 10


def test_readme_python_lines_run():
    """README's Python block, run as it stands (from the repository root, as the line before it says)."""
    code = re.search(r'```python\n(.*?)```', _read('README.md'), re.S).group(1)
    namespace = {}
    exec(compile(code, 'README.md', 'exec'), namespace)
    assert tuple(namespace['feats'].shape) == (2, 512, 7, 5)
    assert namespace['backbone'].feature_info.reduction() == [4, 8, 16, 32]
