"""segmentation/train.py in real processes on a tiny ADE20K-layout scene set: a two-process torchrun run
stopped by SIGTERM and relaunched ends with the weights and optimizer state of an uninterrupted run, and the
mIoU and --show-dir pictures of its checkpoint are the same from one process and from two (exact --dist-eval, 5
images on 2 ranks). One process, against an uninterrupted run: a stop before an evaluation was saved, a kill
between the checkpoint.pth and best.pth writes, a bad file found during training or in an evaluation; --eval with
the checkpoint's flags."""
import json
import os
import re
import shutil
import signal

import numpy as np
import pytest
import torch
from conftest import PY, TORCHRUN, env, free_port, load, run_to_end, signal_when, start_process
from PIL import Image

from segmentation import scenes

pytestmark = pytest.mark.slow  # torchrun, signals and relaunches in real processes

ARGS = ['--model', 'NALAFORMER_XT', '--num-classes', '5', '--device', 'cpu', '--iters', '6', '--batch-size', '2',
        '--crop-size', '48', '--img-scale', '96', '48', '--channels', '16', '--warmup-iters', '2', '--lr', '1e-3',
        '--eval-interval', '3', '--print-freq', '1', '--num_workers', '0', '--dist-timeout', '120']


def seg_cmd(nproc, args):
    script = os.path.join('segmentation', 'train.py')
    if nproc == 1:
        return [PY, script, *args]
    return TORCHRUN + [f'--nproc_per_node={nproc}', '--master_addr=127.0.0.1', f'--master_port={free_port()}',
                       script, *args]


def run_seg(nproc, args, timeout=240, code=0, cmd=None, environ=None):
    """segmentation/train.py (or `cmd`) to its end, which must be exit status `code`."""
    return run_to_end(cmd or seg_cmd(nproc, args), timeout=timeout, code=code, environ=environ)


#: segmentation/train.py with a fault at a chosen point (argv[1]): 'stop-in-iteration N' sends itself SIGINT as
#: iteration N starts (the step then agrees on the stop), 'stop-in-eval' as the first evaluation has scored its
#: first image, 'kill-before-best K' SIGKILLs itself before the K-th copy to best.pth (checkpoint.pth written)
FAULTS = """
import os, signal, sys
from run import checkpoint
from segmentation import miou, train
fault, argv = sys.argv[1].split(), sys.argv[2:]
calls = []
def hook(name, when, sig):
    module, attr = name.rsplit('.', 1)
    module = {'train': train, 'miou': miou, 'checkpoint': checkpoint}[module]
    original = getattr(module, attr)
    def hooked(*a, **k):
        calls.append(a)
        if when(a):
            os.kill(os.getpid(), sig)
        return original(*a, **k)
    setattr(module, attr, hooked)
if fault[0] == 'stop-in-iteration':
    hook('train.poly_lr', lambda a: a[0] == int(fault[1]) - 1 and calls.count(a) == 1, signal.SIGINT)
elif fault[0] == 'stop-in-eval':
    hook('miou.confusion_matrix', lambda a: len(calls) == 1, signal.SIGINT)
elif fault[0] == 'kill-before-best':
    best = lambda a: str(a[1]).endswith('best.pth')
    hook('checkpoint.copy_atomic', lambda a: best(a) and sum(map(best, calls)) == int(fault[1]), signal.SIGKILL)
sys.exit(train.run(argv))
"""


def run_with_fault(fault, args, code):
    return run_seg(1, args, code=code, cmd=[PY, '-c', FAULTS, fault, *args])


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    return scenes.make_scenes(str(tmp_path_factory.mktemp('scenes')), n_train=8, n_val=5, size=(40, 48))


@pytest.fixture(scope='module')
def straight(data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp('straight') / 'out')
    warnings_shown = {k: v for k, v in env().items() if k != 'PYTHONWARNINGS'}  # as a user sees them
    p = run_seg(2, ARGS + ['--data-path', data, '--output_dir', out], environ=warnings_shown)
    return out, p


@pytest.fixture(scope='module')
def straight1(data, tmp_path_factory):
    """The uninterrupted one-process run the faults are compared with."""
    out = str(tmp_path_factory.mktemp('straight1') / 'out')
    return out, run_seg(1, ARGS + ['--data-path', data, '--output_dir', out])


def evaluations(out):
    return [json.loads(line) for line in open(os.path.join(out, 'log.txt'))]


def assert_same_run(out, p, reference):
    """log.txt's evaluation records, best.pth (its iteration and weights) and the final best line of the run in
    `out` (whose last process printed `p`) equal the uninterrupted run's."""
    ref_out, ref_p = reference
    assert evaluations(out) == evaluations(ref_out)
    a, b = load(os.path.join(ref_out, 'best.pth')), load(os.path.join(out, 'best.pth'))
    assert a['iter'] == b['iter'] and a['best_miou'] == b['best_miou']
    assert all(torch.equal(a['model'][k], b['model'][k]) for k in a['model'])
    done = re.findall(r'^Training done: mIoU .* at the last iteration \(6\), best mIoU .*$', ref_p.stdout, re.M)
    assert done and done == re.findall(r'^Training done: .*$', p.stdout, re.M)


def test_a_stopped_and_relaunched_run_ends_with_the_weights_of_an_uninterrupted_one(data, straight, tmp_path):
    out = str(tmp_path / 'out')
    args = ARGS + ['--data-path', data, '--output_dir', out]
    stdout, stderr, _ = signal_when(start_process(seg_cmd(2, args)), r'^Iter \[2/6\]', signal.SIGTERM)
    m = re.search(r'Stopped by SIGTERM after iteration (\d)', stdout)
    assert m and int(m.group(1)) < 6, stdout[-3000:] + stderr[-3000:]
    p = run_seg(2, args)
    assert f'Resumed from {out}/checkpoint.pth: continuing at iteration {m.group(1)} of 6' in p.stdout
    a, b = load(os.path.join(straight[0], 'checkpoint.pth')), load(os.path.join(out, 'checkpoint.pth'))
    assert a['iter'] == b['iter'] == 6
    diff = [k for k in a['model'] if not torch.equal(a['model'][k], b['model'][k])]
    assert not diff, f'{len(diff)} tensors differ, e.g. {diff[:3]}'
    for sa, sb in zip(a['optimizer']['state'].values(), b['optimizer']['state'].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    digests = re.findall(r'final weights sha256: (\w+)', p.stdout + straight[1].stdout)
    assert len(set(digests)) == 1, digests


def test_the_miou_is_the_same_from_one_and_from_two_processes(data, straight):
    out, _ = straight
    logged = [json.loads(line) for line in open(os.path.join(out, 'log.txt'))]
    assert [r['iter'] for r in logged] == [3, 6] and all(r['images'] == 5 for r in logged)
    ckpt = os.path.join(out, 'checkpoint.pth')
    lines = []
    for nproc, dist in ((1, '--no-dist-eval'), (2, '--dist-eval')):
        q = run_seg(nproc, ARGS + ['--data-path', data, '--eval', '--resume', ckpt, dist, '--output_dir', out])
        lines += re.findall(r'^mIoU .*$', q.stdout, re.M)
    assert len(lines) == 2 and lines[0] == lines[1] and '(5 images, whole-image inference)' in lines[0], lines
    assert lines[0].startswith(f"mIoU {logged[-1]['mIoU']:.2f}  mAcc {logged[-1]['mAcc']:.2f}")
    evals = [json.loads(line) for line in open(os.path.join(out, 'log.txt'))][2:]
    assert len(evals) == 2 and evals[0]['eval'] == ckpt and evals[0]['mIoU'] == evals[1]['mIoU'] == logged[-1]['mIoU']



@pytest.mark.parametrize('mode', ['whole', 'slide'])
def test_the_aug_test_miou_is_the_same_from_one_and_from_two_processes(data, straight, mode):
    """--eval --aug-test (6 scales + flip) of the run's checkpoint: every image scored once over the processes, the
    same per-class table and scores from one process and from two (5 images on 2 ranks), whole or slide."""
    ckpt = os.path.join(straight[0], 'checkpoint.pth')
    outputs = []
    for nproc, dist in ((1, '--no-dist-eval'), (2, '--dist-eval')):
        q = run_seg(nproc, ['--data-path', data, '--eval', '--resume', ckpt, dist, '--aug-test', '--eval-mode', mode,
                            '--slide-stride', '20', '--device', 'cpu', '--num_workers', '0', '--print-freq', '10'])
        outputs.append(re.search(r'^per class results:\n(?:[|+].*\n)+mIoU .*$', q.stdout, re.M).group(0))
    how = 'whole-image' if mode == 'whole' else 'sliding-window'
    assert outputs[0] == outputs[1] and outputs[0].endswith(f'(5 images, {how} inference, 6 scales + flip)'), outputs
    assert '| checkerboard ' in outputs[0]


def test_show_dir_pictures_are_the_same_from_one_and_from_two_processes(data, straight, tmp_path):
    """--eval --show-dir of the run's checkpoint: two processes (5 images on 2 ranks, each writing the pictures of
    the images it scores) leave the same files, byte for byte, as one process."""
    ckpt = os.path.join(straight[0], 'checkpoint.pth')
    pictures = []
    for nproc, dist in ((1, '--no-dist-eval'), (2, '--dist-eval')):
        show = str(tmp_path / f'show{nproc}' / 'pictures')
        run_seg(nproc, ['--data-path', data, '--eval', '--resume', ckpt, dist, '--show-dir', show, '--device', 'cpu',
                        '--num_workers', '0', '--print-freq', '10'])
        pictures.append({name: open(os.path.join(show, name), 'rb').read() for name in os.listdir(show)})
    names = sorted(os.path.splitext(os.path.basename(i))[0] + '.png' for i, _ in scenes_pairs(data, 'validation'))
    assert sorted(pictures[0]) == names and len(names) == 5
    assert pictures[0] == pictures[1]


def test_ddp_gradient_layout_warnings_are_not_shown(straight):
    assert 'Grad strides do not match bucket view strides' not in straight[1].stderr


def test_a_stop_before_an_evaluation_was_saved_resumes_with_that_evaluation(data, straight1, tmp_path):
    """A stop at the iteration an evaluation is due, and a stop during that evaluation in the resumed run: each
    checkpoint records the evaluation as due, the run that completes evaluates that iteration first, and the
    run's log.txt, best.pth and best mIoU are the uninterrupted run's."""
    out = str(tmp_path / 'out')
    args = ARGS + ['--data-path', data, '--output_dir', out]
    p = run_with_fault('stop-in-iteration 3', args, code=130)
    assert ('Stopped by SIGINT after iteration 3; checkpoint saved (its evaluation of iteration 3 is still due: the '
            'resumed run does it first)') in p.stdout
    assert load(os.path.join(out, 'checkpoint.pth'))['eval_due'] and not os.path.exists(os.path.join(out, 'log.txt'))
    p = run_with_fault('stop-in-eval', args, code=130)
    assert 'continuing at iteration 3 of 6; its evaluation, which the stop left due, comes first' in p.stdout
    assert 'Stopped by SIGINT after iteration 3' in p.stdout and 'Iteration 3:' not in p.stdout
    ckpt = load(os.path.join(out, 'checkpoint.pth'))
    assert ckpt['iter'] == 3 and ckpt['eval_due']
    p = run_seg(1, args)
    assert re.search(r'comes first\n(Warning: global batch .*\n)?(Test: .*\n)*per class results:\n([|+].*\n)+'
                     r'Iteration 3: mIoU', p.stdout), p.stdout
    assert_same_run(out, p, straight1)


def test_a_kill_between_the_checkpoint_and_best_writes_is_repaired(data, straight1, tmp_path):
    """A kill after checkpoint.pth is written and before its copy to best.pth: the resumed run copies it there
    (run_repair.repair, as main.py's resume), so best.pth holds the uninterrupted run's best state."""
    out = str(tmp_path / 'out')
    args = ARGS + ['--data-path', data, '--output_dir', out]
    best, improvements = -1.0, 0
    for record in evaluations(straight1[0]):
        if record['mIoU'] > best:
            best, improvements = record['mIoU'], improvements + 1
    run_with_fault(f'kill-before-best {improvements}', args, code=-signal.SIGKILL)
    ckpt = load(os.path.join(out, 'checkpoint.pth'))
    assert ckpt['files'] == ['checkpoint.pth', 'best.pth']
    stale = os.path.join(out, 'best.pth')
    assert not os.path.exists(stale) or load(stale)['iter'] < ckpt['iter']
    p = run_seg(1, args)
    assert f'Repaired {stale}: it was ' in p.stdout and f'copied the state of iteration {ckpt["iter"]}' in p.stdout
    assert_same_run(out, p, straight1)


def test_a_bad_file_found_while_training_keeps_the_training_done(data, straight1, tmp_path):
    """A training label map found bad at iteration 2 ends the run after iteration 1 with checkpoint.pth; a
    validation image found undecodable by the evaluation at iteration 3 ends it with checkpoint.pth holding that
    evaluation as due. Neither removes the output directory, and with the files restored the run ends as the
    uninterrupted one."""
    from samplers import IterationSampler
    copy = str(tmp_path / 'data')
    shutil.copytree(data, copy)
    out = str(tmp_path / 'out')
    args = ARGS + ['--data-path', copy, '--output_dir', out]
    keys = [k for k, _ in zip(IterationSampler(8, 1, 0, 2, 0), range(4))]
    index = next(i for _, i in keys[2:] if i not in [j for _, j in keys[:2]])  # first read at iteration 2
    label = scenes_pairs(copy, 'training')[index][1]
    shutil.copy(label, str(tmp_path / 'label.png'))
    Image.fromarray(np.ones((8, 8), np.uint8)).save(label)
    p = run_seg(1, args, code=1)
    assert re.search(f'^error: {re.escape(label)}: the label map is 8x8 .*; checkpoint.pth holds the 1 iterations '
                     f'done: replace the file and run the same command again to resume$', p.stderr, re.M), p.stderr
    assert load(os.path.join(out, 'checkpoint.pth'))['iter'] == 1
    shutil.copy(str(tmp_path / 'label.png'), label)
    image = scenes_pairs(copy, 'validation')[2][0]
    shutil.copy(image, str(tmp_path / 'image.jpg'))
    with open(image, 'r+b') as f:
        f.truncate(os.path.getsize(image) // 2)  # its header (the size) reads, its pixels do not
    p = run_seg(1, args, code=1)
    assert re.search(f'^error: {re.escape(image)}: cannot be decoded', p.stderr, re.M), p.stderr
    ckpt = load(os.path.join(out, 'checkpoint.pth'))
    assert ckpt['iter'] == 3 and ckpt['eval_due']
    shutil.copy(str(tmp_path / 'image.jpg'), image)
    p = run_seg(1, args)
    assert_same_run(out, p, straight1)


def test_eval_takes_the_model_and_data_flags_its_checkpoint_records(data, straight1):
    """--eval of the run's checkpoint with no model or data flag scores it as the run's own last evaluation."""
    out, _ = straight1
    p = run_seg(1, ['--eval', '--resume', os.path.join(out, 'checkpoint.pth'), '--data-path', data, '--device', 'cpu',
                    '--num_workers', '0'])
    assert '--img-scale 96 48: as recorded in' in p.stdout
    last = evaluations(out)[-1]
    assert re.findall(r'^mIoU .*$', p.stdout, re.M) == [
        f"mIoU {last['mIoU']:.2f}  mAcc {last['mAcc']:.2f}  aAcc {last['aAcc']:.2f}  (5 images, whole-image inference)"]


def scenes_pairs(root, split):
    from segmentation import ade
    return ade.scan(root, split)
