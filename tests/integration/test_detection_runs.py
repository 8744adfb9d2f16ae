"""detection/train.py in real processes on a tiny COCO-layout shapes set: a two-process torchrun run stopped by
SIGTERM and relaunched ends with the weights, optimizer state and log.txt of an uninterrupted run; --eval of its
checkpoint scores the same from one process and from two (exact --dist-eval, 5 images on 2 ranks). One process,
against an uninterrupted run: a stop at the end of an epoch and a stop during its evaluation resume with that
evaluation, and a kill between the checkpoint.pth and best.pth writes is repaired."""
import json
import os
import re
import signal

import pytest
import torch
from conftest import PY, TORCHRUN, free_port, load, run_to_end, signal_when, start_process

from detection import shapes

pytestmark = pytest.mark.slow  # torchrun, signals and relaunches in real processes

#: 10 training images (1 without annotations is left out) at batch 2 per process: 2 epochs of 3 steps on 2
#: processes, of 5 on 1; a low LR leaves the untrained classifier's scores above the test threshold, so that the
#: evaluations score detections
ARGS = ['--recipe', 'demo', '--model', 'NALAFORMER_XT', '--epochs', '2', '--batch-size', '2', '--warmup-iters', '2',
        '--lr', '1e-5', '--print-freq', '1', '--device', 'cpu', '--num_workers', '0', '--dist-timeout', '120']


def det_cmd(nproc, args):
    script = os.path.join('detection', 'train.py')
    if nproc == 1:
        return [PY, script, *args]
    return TORCHRUN + [f'--nproc_per_node={nproc}', '--master_addr=127.0.0.1', f'--master_port={free_port()}',
                       script, *args]


def run_det(nproc, args, timeout=240, code=0, cmd=None):
    """detection/train.py (or `cmd`) to its end, which must be exit status `code`."""
    return run_to_end(cmd or det_cmd(nproc, args), timeout=timeout, code=code)


#: detection/train.py with a fault (argv[1]): 'stop-in-iteration N' sends itself SIGINT as iteration N starts,
#: 'stop-in-eval' as the first evaluation has predicted its first image, 'kill-before-best K' SIGKILLs itself
#: before the K-th copy to best.pth (checkpoint.pth written)
FAULTS = """
import os, signal, sys
from detection import evaluate, train
from run import checkpoint
fault, argv = sys.argv[1].split(), sys.argv[2:]
calls = []
def hook(module, attr, when, sig):
    original = getattr(module, attr)
    def hooked(*a, **k):
        calls.append(a)
        if when(a):
            os.kill(os.getpid(), sig)
        return original(*a, **k)
    setattr(module, attr, hooked)
if fault[0] == 'stop-in-iteration':
    hook(train, 'step_lr', lambda a: a[0] == int(fault[1]) - 1 and calls.count(a) == 1, signal.SIGINT)
elif fault[0] == 'stop-in-eval':
    hook(evaluate, 'coco_results', lambda a: len(calls) == 1, signal.SIGINT)
elif fault[0] == 'kill-before-best':
    best = lambda a: str(a[1]).endswith('best.pth')
    hook(checkpoint, 'copy_atomic', lambda a: best(a) and sum(map(best, calls)) == int(fault[1]), signal.SIGKILL)
sys.exit(train.run(argv))
"""


def run_with_fault(fault, args, code):
    return run_det(1, args, code=code, cmd=[PY, '-c', FAULTS, fault, *args])


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    return shapes.make_shapes(str(tmp_path_factory.mktemp('shapes')), n_train=10, n_val=5, seed=3)


@pytest.fixture(scope='module')
def straight(data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp('straight') / 'out')
    return out, run_det(2, ARGS + ['--data-path', data, '--output_dir', out])


@pytest.fixture(scope='module')
def straight1(data, tmp_path_factory):
    """The uninterrupted one-process run the faults are compared with."""
    out = str(tmp_path_factory.mktemp('straight1') / 'out')
    return out, run_det(1, ARGS + ['--data-path', data, '--output_dir', out])


def records(out):
    return [json.loads(line) for line in open(os.path.join(out, 'log.txt'))]


def same_weights(a, b):
    diff = [k for k in a['model'] if not torch.equal(a['model'][k], b['model'][k])]
    assert not diff, f'{len(diff)} tensors differ, e.g. {diff[:3]}'


def assert_same_run(out, p, reference):
    """log.txt, best.pth and the final line of the run in `out` (whose last process printed `p`) are the
    uninterrupted run's; so are the final weights."""
    ref_out, ref_p = reference
    assert records(out) == records(ref_out)
    a, b = load(os.path.join(ref_out, 'best.pth')), load(os.path.join(out, 'best.pth'))
    assert a['iter'] == b['iter'] and a['best_box_ap'] == b['best_box_ap']
    same_weights(a, b)
    same_weights(load(os.path.join(ref_out, 'checkpoint.pth')), load(os.path.join(out, 'checkpoint.pth')))
    done = re.findall(r'^Training done: .*$', ref_p.stdout, re.M)
    assert done and done == re.findall(r'^Training done: .*$', p.stdout, re.M)


def test_a_stopped_and_relaunched_run_ends_with_the_weights_of_an_uninterrupted_one(data, straight, tmp_path):
    out = str(tmp_path / 'out')
    args = ARGS + ['--data-path', data, '--output_dir', out]
    stdout, stderr, _ = signal_when(start_process(det_cmd(2, args)), r'^Epoch \[1\]\[2/3\]', signal.SIGTERM)
    m = re.search(r'Stopped by SIGTERM after iteration (\d)', stdout)
    assert m and int(m.group(1)) < 6, stdout[-3000:] + stderr[-3000:]
    p = run_det(2, args)
    assert f'Resumed from {out}/checkpoint.pth: continuing at iteration {m.group(1)} of 6' in p.stdout
    a, b = load(os.path.join(straight[0], 'checkpoint.pth')), load(os.path.join(out, 'checkpoint.pth'))
    assert a['iter'] == b['iter'] == 6
    same_weights(a, b)
    for sa, sb in zip(a['optimizer']['state'].values(), b['optimizer']['state'].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert records(out) == records(straight[0])
    digests = re.findall(r'final weights sha256: (\w+)', p.stdout + straight[1].stdout)
    assert len(digests) == 4 and len(set(digests)) == 1, digests


def test_the_ap_is_the_same_from_one_and_from_two_processes(data, straight):
    out, _ = straight
    last = records(out)[-1]
    assert last['images'] == 5 and last['detections'] > 0
    for nproc in (1, 2):
        p = run_det(nproc, ['--eval', '--resume', os.path.join(out, 'checkpoint.pth'), '--data-path', data,
                            '--device', 'cpu', '--num_workers', '0', '--output_dir', os.path.join(out, f'eval{nproc}')])
        record = records(os.path.join(out, f'eval{nproc}'))[0]
        assert {k: v for k, v in record.items() if k not in ('eval', 'iter')} == \
            {k: v for k, v in last.items() if k not in ('epoch', 'iter', 'train_loss', 'lr')}
        line = f"box AP {last['box_AP']:.1f}  mask AP {last['mask_AP']:.1f}"
        assert re.findall(r'^box AP .*$', p.stdout, re.M) == [line]


def test_a_stop_before_an_evaluation_was_saved_resumes_with_that_evaluation(data, straight1, tmp_path):
    """A stop at the last iteration of epoch 1, then a stop during its evaluation in the resumed run: each
    checkpoint records the evaluation as due, the run that completes evaluates that iteration first, and log.txt,
    best.pth and the final weights are the uninterrupted run's."""
    out = str(tmp_path / 'out')
    args = ARGS + ['--data-path', data, '--output_dir', out]
    p = run_with_fault('stop-in-iteration 5', args, code=130)
    assert ('Stopped by SIGINT after iteration 5; checkpoint saved (its evaluation of iteration 5 is still due: the '
            'resumed run does it first)') in p.stdout
    assert load(os.path.join(out, 'checkpoint.pth'))['eval_due'] and not os.path.exists(os.path.join(out, 'log.txt'))
    p = run_with_fault('stop-in-eval', args, code=130)
    assert 'continuing at iteration 5 of 10; its evaluation, which the stop left due, comes first' in p.stdout
    assert 'Stopped by SIGINT after iteration 5' in p.stdout and 'Epoch 1 (iteration 5)' not in p.stdout
    ckpt = load(os.path.join(out, 'checkpoint.pth'))
    assert ckpt['iter'] == 5 and ckpt['eval_due']
    p = run_det(1, args)
    first = r'comes first\n(Warning: global batch .*\n)?(Test: .*\n)*Evaluating bbox:'
    assert re.search(first, p.stdout), p.stdout[-3000:]
    assert_same_run(out, p, straight1)


def test_a_kill_between_the_checkpoint_and_best_writes_is_repaired(data, straight1, tmp_path):
    """A kill after checkpoint.pth is written and before its copy to best.pth: the resumed run copies it there, so
    best.pth holds the uninterrupted run's best state."""
    out = str(tmp_path / 'out')
    args = ARGS + ['--data-path', data, '--output_dir', out]
    best, improvements = -1.0, 0
    for record in records(straight1[0]):
        if record['box_AP'] > best:
            best, improvements = record['box_AP'], improvements + 1
    run_with_fault(f'kill-before-best {improvements}', args, code=-signal.SIGKILL)
    ckpt = load(os.path.join(out, 'checkpoint.pth'))
    assert ckpt['files'] == ['checkpoint.pth', 'best.pth']
    stale = os.path.join(out, 'best.pth')
    assert not os.path.exists(stale) or load(stale)['iter'] < ckpt['iter']
    p = run_det(1, args)
    assert f'Repaired {stale}: it was ' in p.stdout and f'copied the state of iteration {ckpt["iter"]}' in p.stdout
    assert_same_run(out, p, straight1)
