"""What README.md and docs/ say agrees with the code and stays a reference (as far as a CPU run allows): every
README command runs as written, its Python lines run, which weights `--finetune` takes, the smoke and analysis
sections, every link and anchor resolves, no page grows past 400 lines or tells history (`make demo`'s figure:
tests/integration/test_commands.py)."""
import argparse
import os
import re
import shlex
import subprocess
import unicodedata

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

    rule = _section('docs/tools.md', '## Which weights a loader takes')
    assert 'else **`model_ema`**' in rule and '`main.py --finetune`' in rule
    for doc in ('README.md', *_pages(), 'finetune.sh'):
        text = ' '.join(_read(doc).replace('#', ' ').split())
        assert not re.search(r"--finetune` loads the checkpoint's `model` weights|its model weights are loaded",
                             text), doc


def _section(doc, heading):
    return _read(doc).split(heading, 1)[1].split('\n## ', 1)[0]


def _pages():
    """The reference pages: docs/*.md (docs/results/ keeps dated raw output and history)."""
    return sorted(os.path.join('docs', f) for f in os.listdir(os.path.join(REPO, 'docs')) if f.endswith('.md'))


def test_the_smoke_section_lists_the_paths_and_counts_of_tools_smoke():
    """docs/tools.md names every path of tools/smoke.py and says what --quick runs on a CPU, counted from
    tools/smoke.py itself."""
    from tools import smoke
    text = ' '.join(_section('docs/tools.md', '## Smoke test on a new machine').split())
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
    the repository root (or with it on PYTHONPATH), and docs/install.md explains the choice."""
    readme = _read('README.md')
    before = readme.split('```python\nimport torch, timm, models', 1)[0].rstrip().rsplit('\n\n', 1)[-1]
    assert 'From the repository root' in before and 'PYTHONPATH' in before, before
    where = _section('docs/install.md', '## Where to run the code: the repository root')
    assert "ModuleNotFoundError: No module named 'models'" in where and 'torch.hub.load' in where


def test_the_readme_says_where_bf16_is_fast_and_how_long_make_smoke_takes():
    """Each smoke time in the README comes with the load it was measured at, as docs/tools.md records it
    (seconds and raw log)."""
    text = ' '.join(_read('README.md').split())
    bf16 = re.search(r'`--amp bf16` is the fast precision on GPUs with bf16 tensor cores[^`]*?\)\.', text)
    assert bf16 and 'on a CPU it needs native bf16' in bf16.group(0) and 'docs/performance.md' in bf16.group(0), text
    smoke = re.search(r'`make smoke` runs [^`]*?on a CPU the quick set without compile: ([\d.]+) minutes on 2 '
                      r'cores at load average ([\d–]+), ([\d.]+) at ([\d–]+) \(`tools/smoke.py --all`: ([\d.]+) '
                      r'at ([\d–]+)\)', text)
    assert smoke, text
    quick, quick_load, loaded, loaded_load, full, full_load = smoke.groups()
    section = ' '.join(_section('docs/tools.md', '## Smoke test on a new machine').split())
    for minutes, load, tail in ((quick, quick_load, r'\)'), (loaded, loaded_load, ',')):
        m = re.search(rf'`make smoke` took {re.escape(minutes)} minutes \((\d+) s, load average {load}{tail}', section)
        assert m and abs(int(m.group(1)) / 60 - float(minutes)) <= 0.051, (minutes, load, section)
    assert re.search(rf'`--all` {re.escape(full)} minutes \(\d+ s, [^)]*load average {full_load}\)', section), section
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
    for doc in ('README.md', *_pages()):
        assert not re.search(r'\b\d{3,} tests\b', _read(doc)), doc


def test_the_failure_table_keeps_each_row_short():
    """docs/troubleshooting.md's failure table: one short line per row (what happened, what you see and do); the
    long explanations live in their pages, the list of checked flags in training.md's Training options."""
    table = _read('docs/troubleshooting.md').split('\n\n| what happened |', 1)[1]
    rows = [line for line in table.split('\n\n', 1)[0].splitlines() if line.startswith('| ')][1:]
    assert len(rows) >= 20
    long = [row for row in rows if len(row.replace('|', ' ').split()) > 40]
    assert not long, long
    assert '**Flag checks.**' in _section('docs/training.md', '## Training options')


def test_no_reference_page_is_over_400_lines_and_the_readme_stays_short():
    long = {page: n for page in _pages() if (n := len(_read(page).splitlines())) > 400}
    assert not long, long
    assert len(_read('README.md').splitlines()) <= 160


#: a commit hash: 7 to 40 hex digits with a letter and a digit among them (the release digest that tools.md and the
#: README show as an example file name, 1a2b3c4d, is not one)
_HASH = re.compile(r'(?<![\w-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])')
_HISTORY = re.compile(r'\bno longer\b|\bFixed:|\bthis branch\b|\bbase commit\b|\bas of (?:this|today)\b|'
                      r'\b(?:before|now)(?: \([^)|]*\))?(?:, run \d+)? *\|', re.I)  # the last: a before/now column


def test_readme_and_reference_pages_tell_no_history():
    """README.md and docs/*.md say what the code does; commit hashes, changelog words and before/now columns belong
    to docs/results/ (the dated raw output and history files)."""
    for doc in ('README.md', *_pages()):
        text = _read(doc)
        hashes = [h for h in _HASH.findall(text) if h != '1a2b3c4d']
        assert not hashes, (doc, hashes)
        assert not _HISTORY.search(text), (doc, _HISTORY.search(text).group(0))


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: link text kept, lower case, punctuation but '-' and '_' dropped,
    spaces as '-'."""
    text = re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', heading.strip().replace('`', '')).lower()
    return ''.join('-' if c == ' ' else c for c in text if c in '-_ ' or unicodedata.category(c)[0] in 'LN')


def _anchors(path: str) -> set[str]:
    found, seen = set(), {}
    text = re.sub(r'^```.*?^```', '', _read(path), flags=re.S | re.M)
    for m in re.finditer(r'^#{1,6} +(.+?) *$', text, re.M):
        slug = _anchor(m.group(1))
        found.add(slug if slug not in seen else f'{slug}-{seen[slug]}')
        seen[slug] = seen.get(slug, 0) + 1
    return found


def _broken(source: str, target: str) -> str | None:
    """Why `target`, a link in `source` (paths from the repository root), does not resolve; None when it does."""
    file, _, anchor = target.partition('#')
    path = os.path.normpath(os.path.join(os.path.dirname(source), file)) if file else source
    if not os.path.exists(os.path.join(REPO, path)):
        return f'no file {path}'
    if anchor and path.endswith('.md') and anchor not in _anchors(path):
        return f'no heading #{anchor} in {path}'
    return None


def test_every_link_into_the_docs_resolves():
    """Every relative link and #anchor of README.md and docs/ (GitHub's anchors), every docs/... reference in the
    code's comments, docstrings and messages, and the index: docs/README.md links every page, README.md the index."""
    docs = ['README.md'] + sorted(os.path.relpath(os.path.join(d, f), REPO) for d, _, files in
                                  os.walk(os.path.join(REPO, 'docs')) for f in files if f.endswith('.md'))
    broken = []
    for doc in docs:
        text = re.sub(r'`[^`\n]*`', '', re.sub(r'^```.*?^```', '', _read(doc), flags=re.S | re.M))
        for target in re.findall(r'\]\(([^)\s]+)\)', text):
            if not re.match(r'[a-z]+:', target) and (why := _broken(doc, target)):
                broken.append(f'{doc}: {target}: {why}')
    skip = {'.git', 'docs', 'output', 'data', 'node_modules'}
    for d, dirs, files in os.walk(REPO):
        dirs[:] = [x for x in dirs if x not in skip and not x.startswith('.')]
        for f in files:
            if f.endswith(('.py', '.sh', '.sbatch')) or f == 'Makefile':
                path = os.path.relpath(os.path.join(d, f), REPO)
                for m in re.finditer(r'docs/([\w/.-]+?\.md(?:#[\w-]+)?)', _read(path)):
                    if why := _broken('README.md', 'docs/' + m.group(1)):
                        broken.append(f'{path}: docs/{m.group(1)}: {why}')
    assert not broken, '\n'.join(broken)
    index = _read('docs/README.md')
    assert not [p for p in _pages() if p != 'docs/README.md' and f'({os.path.basename(p)})' not in index]
    assert '(docs/README.md)' in _read('README.md')


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


def test_make_test_duration_is_in_the_install_page_not_in_the_readme():
    assert re.search(r'`make test` runs the whole suite, about \d+ minutes on a 2-core machine',
                     ' '.join(_read('docs/install.md').split()))
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
