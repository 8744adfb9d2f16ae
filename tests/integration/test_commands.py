"""The documented commands, run for real: `make demo` reaching README's figure, `main.py --eval` with extra sets
and ImageNet-ReaL, torch.hub from another directory, one message per error under torchrun, and main.py's
allocator setting reusing freed memory."""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch
from conftest import PY, REPO, env, run_main, untrained_eval_argv
from helpers.image_folders import dataset_of, eval_sets_of, make_args
from PIL import Image

pytestmark = pytest.mark.slow  # main.py, make's flags, torch.hub and torchrun in real processes


def _read(path):
    with open(os.path.join(REPO, path)) as f:
        return f.read()


def demo_flags():
    """`make demo`'s main.py flags, read from the Makefile."""
    text = _read('Makefile').replace('\\\n', ' ')
    return shlex.split(re.search(r'^DEMO_FLAGS = (.*)$', text, re.M).group(1))


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


# -------------------------------------------------------------------------------- --eval with extra sets
def test_eval_prints_every_set_asked_for(tmp_path):
    import timm

    import models  # noqa: F401  (registers the variants)
    classes = ['n01', 'n02', 'n03']
    for split in ('train', 'val'):
        for ci, c in enumerate(classes):
            for i in range(2):
                p = tmp_path / 'd' / split / c / f'ILSVRC2012_val_{ci * 2 + i + 1:08d}.JPEG'
                os.makedirs(p.parent, exist_ok=True)
                Image.new('RGB', (8, 8), (ci * 80, i * 120, 200 - ci * 60)).save(p, 'JPEG')
    for k in range(3):
        os.makedirs(tmp_path / 'v2' / str(k))
        Image.new('RGB', (8, 8), (k * 80, 30, 0)).save(tmp_path / 'v2' / str(k) / 'a.png')
    real_table = [[0], [1], [1, 2], [], [2], [0, 1]]
    (tmp_path / 'real.json').write_text(json.dumps(real_table))
    torch.manual_seed(0)
    model = timm.create_model('NALAFORMER_XT', num_classes=3).eval()
    torch.save({'model': model.state_dict()}, tmp_path / 'ck.pth')

    cmd = [sys.executable, os.path.join(REPO, 'main.py'), '--eval', '--resume', str(tmp_path / 'ck.pth'),
           '--model', 'NALAFORMER_XT', '--data-path', str(tmp_path / 'd'), '--input-size', '32',
           '--device', 'cpu', '--num-workers', '0', '--batch-size', '4',
           '--eval-sets', f"V2={tmp_path / 'v2'}", '--real-labels', str(tmp_path / 'real.json')]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]

    # expected figures from the same model, transforms and labels, computed here
    dv, _ = dataset_of(False, make_args(data_path=str(tmp_path / 'd')))
    (_, v2), = eval_sets_of(make_args(eval_sets=[str(tmp_path / 'v2')]), dv)
    with torch.no_grad():
        top1 = {name: [int(model(ds[i][0][None]).argmax()) for i in range(len(ds))]
                for name, ds in (('val', dv), ('v2', v2))}
    v2_acc = 100 * sum(p == t for p, t in zip(top1['v2'], v2.targets)) / 3
    scored = [(p, real_table[int(os.path.basename(f)[15:23]) - 1]) for p, (f, _) in zip(top1['val'], dv.samples)]
    scored = [(p, r) for p, r in scored if r]
    real_acc = 100 * sum(p in r for p, r in scored) / len(scored)
    m = re.search(r'^V2: Acc@1 ([\d.]+)% .* on 3 of 3 images$', out.stdout, re.M)
    assert m and abs(float(m.group(1)) - v2_acc) < 0.01, out.stdout[-1500:]
    m = re.search(r'^ImageNet-ReaL: Acc@1 ([\d.]+)% .* on (\d+) images', out.stdout, re.M)
    assert m and abs(float(m.group(1)) - real_acc) < 0.01 and int(m.group(2)) == len(scored), out.stdout[-1500:]

    train = [a for a in cmd if a != '--eval']  # the extra sets are evaluation-only: refused, not ignored
    out = subprocess.run(train, capture_output=True, text=True, timeout=300,
                         env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert out.returncode != 0 and 'add --eval' in out.stdout + out.stderr, out.stdout[-800:] + out.stderr[-800:]


# -------------------------------------------------------------------------------- torch.hub
def test_hub_load_from_another_directory(tmp_path):
    """A fresh interpreter outside the clone: hub puts the clone on sys.path for the entry point."""
    import subprocess
    import sys
    code = (f"import torch; m = torch.hub.load({REPO!r}, 'NALAFORMER_XT', source='local', num_classes=3); "
            "print(type(m).__name__, m.num_classes)")
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    p = subprocess.run([sys.executable, '-c', code], cwd=tmp_path, env={**env, 'OMP_NUM_THREADS': '1'},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ['NaLaFormer', '3']


# -------------------------------------------------------------------------------- torchrun
def test_under_torchrun_each_message_comes_once_and_every_rank_fails(data, tmp_path):
    p = run_main(['--eval', '--data-path', data, '--device', 'cpu'], nproc=2, check=False)
    assert p.returncode != 0 and 'exitcode  : 2' in p.stderr  # torchrun's report of the failed ranks
    assert p.stderr.count('error: --eval needs a checkpoint') == 1 and p.stderr.count('usage:') == 1, p.stderr
    p = run_main(untrained_eval_argv(data, tmp_path) + ['--dist-eval'], nproc=2)
    assert p.stdout.count('Data loader: ') == 1, p.stdout[-3000:]


# -------------------------------------------------------------------------------- sizes that cannot fit
@pytest.mark.parametrize('script, argv, flag', [
    ('main.py', ['--input-size', '100000', '--data-set', 'DIGITS'], '--input-size 100000'),
    ('main.py', ['--input-size', '100000', '--data-set', 'DIGITS', '--eval', '--finetune', 'CK'],
     '--input-size 100000'),
    ('segmentation/train.py', ['--crop-size', '100000', '--data-path', 'ADE'], '--crop-size 100000'),
    ('segmentation/train.py', ['--img-scale', '100000', '100000', '--data-path', 'ADE'], '--img-scale 100000 100000'),
])
def test_a_size_that_cannot_fit_ends_in_one_line_before_anything_is_allocated(script, argv, flag, tmp_path):
    """Killed by the out-of-memory killer (main.py) or a traceback (segmentation) before: now one line naming the
    estimate, the memory and a smaller size, seconds after the start, with nothing written."""
    import timm
    torch.save({'model': timm.create_model('NALAFORMER_XT', num_classes=10).state_dict()}, tmp_path / 'ck.pth')
    argv = [str(tmp_path / 'ck.pth') if a == 'CK' else a for a in argv]
    p = subprocess.run([PY, os.path.join(REPO, script), *argv, '--device', 'cpu', '--output_dir', 'out'],
                       cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
    errors = [line for line in p.stderr.splitlines() if 'error:' in line]
    assert p.returncode == 2 and 'Traceback' not in p.stderr and len(errors) == 1, p.stderr[-3000:]
    assert re.fullmatch(rf'error: {flag}: one (training batch|evaluation batch|evaluation image)'
                        rf'(?: \(--batch-size \d+\))? needs at least [\d.]+ [TPE]iB \(.* bytes per pixel of each '
                        rf'image, .*\), more than the .* of .*; use .* or less', errors[0]), errors[0]
    assert os.listdir(tmp_path) == ['ck.pth']  # no output directory, no DIGITS written into ./data


# -------------------------------------------------------------------------------- the allocator setting
# Allocates, touches and frees a 64 MiB tensor 20 times; prints the page faults of the last 4 rounds
# (with retain, glibc's heap takes up to ~10 rounds of alignment leftovers before it reuses blocks).
SCRIPT = r"""
import resource, sys
import torch
from run import process
retained = process.retain_freed_cpu_memory() if sys.argv[1] == 'retain' else None
faults = []
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(16 * 2 ** 20)
    t.fill_(1.0)
    del t
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(retained, sum(faults[-4:]))
"""


def faults_of_last_rounds(mode: str):
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS='1')
    out = subprocess.run([sys.executable, '-c', SCRIPT, mode], env=env, cwd=REPO, capture_output=True,
                         text=True, check=True).stdout.split()
    return out[0], int(out[1])


def test_retained_memory_is_reused_without_page_faults():
    retained, faults_retain = faults_of_last_rounds('retain')
    if retained != 'True':
        pytest.skip('no glibc mallopt here')
    _, faults_system = faults_of_last_rounds('system')
    pages = 4 * 64 * 2 ** 20 // os.sysconf('SC_PAGE_SIZE')
    assert faults_system > 0.9 * pages, (faults_system, pages)  # glibc maps and faults the 64 MiB each round
    assert faults_retain < 0.01 * pages, (faults_retain, pages)  # kept in the heap: reused without faults

