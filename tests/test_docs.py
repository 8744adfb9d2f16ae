"""What README.md and docs/ say about a command agrees with what the command does (as far as a CPU run
allows): `make demo`'s accuracy and which weights `--finetune` takes."""
import os
import re
import shlex
import subprocess

import pytest
import torch
from conftest import PY, REPO, build_xt, env

from models import weights


def _read(path):
    with open(os.path.join(REPO, path)) as f:
        return f.read()


def demo_flags():
    """`make demo`'s main.py flags, read from the Makefile."""
    text = _read('Makefile').replace('\\\n', ' ')
    return shlex.split(re.search(r'^DEMO_FLAGS = (.*)$', text, re.M).group(1))


@pytest.mark.slow
def test_make_demo_ends_as_the_readme_says(tmp_path):
    readme = ' '.join(_read('README.md').split())
    promise = re.search(r'ends with `Final top-1: XX\.XX%, best XX\.XX%` at about 98% \(above (\d+)%\)', readme)
    assert promise, 'README no longer states the demo figure in the checked form'
    measured = re.search(r'CPUs\): ((?:\d+\.\d\d%(?:, | and )?)+) measured', readme)
    floor = float(promise.group(1))
    assert measured and all(float(v) > floor for v in re.findall(r'(\d+\.\d\d)%', measured.group(1)))
    flags = demo_flags() + ['--output_dir', str(tmp_path / 'demo')]  # the Makefile's targets name their own
    e = dict(env(), OMP_WAIT_POLICY='PASSIVE')
    e.pop('OMP_NUM_THREADS')  # as `make demo` runs: torch's default thread count
    p = subprocess.run([PY, 'main.py', *flags, '--data-path', str(tmp_path / 'digits')], cwd=REPO, env=e,
                       capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    final = re.search(r'^Final top-1: (\d+\.\d\d)%, best (\d+\.\d\d)%$', p.stdout, re.M)
    assert final, p.stdout[-2000:]
    assert float(final.group(1)) > floor and float(final.group(2)) >= float(final.group(1))


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
