"""Real runs of main.py on a tiny ImageFolder on the CPU: 1-epoch training, --eval of the saved
checkpoint, resume equality (2 epochs == 1 + resume + 1, bit for bit), a torchrun gloo run with two
ranks (identical weights, exact dist-eval equal to a single-process eval), --finetune, --eval without a
training set, and torchrun with gradient accumulation."""
import json
import math
import os
import re
import shutil
import signal
import subprocess

import pytest
import timm
import torch
from conftest import (
    BASE,
    PY,
    REPO,
    accuracy_line,
    assert_same_weights,
    env,
    error_line,
    load,
    run_main,
)
from helpers.image_folders import make_imagefolder

pytestmark = pytest.mark.slow  # every test here runs main.py in real processes


@pytest.fixture(scope='module')
def one_epoch(data, tmp_path_factory):
    """A finished 1-epoch run (part one of the resume test); its output dir is copied, never modified."""
    out = str(tmp_path_factory.mktemp('one') / 'out')
    args = [a for a in BASE[:-1] if a != '--no-flops']  # this run also prints the fvcore FLOPs
    p = run_main(args + ['1', '--data-path', data, '--output_dir', out])
    return out, p


@pytest.fixture(scope='module')
def straight(data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp('straight') / 'out')
    run_main(BASE + ['--data-path', data, '--output_dir', out])
    return out


def test_one_epoch_training_run(one_epoch):
    out, p = one_epoch
    assert 'number of params: ' in p.stdout and 'fvcore FLOPs at 1x3x32x32: ' in p.stdout
    prog = [line for line in p.stdout.splitlines() if line.startswith('Epoch: [0]') and 'eta:' in line]
    assert prog and all(s in prog[-1] for s in ('loss:', 'lr:', 'img/s:')), p.stdout[-2000:]
    assert 'Accuracy of the network on the 15 test images' in p.stdout
    logs = [json.loads(line) for line in open(os.path.join(out, 'log.txt'))]
    assert len(logs) == 1
    for k in ('epoch', 'n_parameters', 'train_lr', 'train_loss', 'test_loss', 'test_acc1', 'test_acc3',  # 3 classes
              'test_ema_acc1', 'test_ema_loss'):
        assert k in logs[0]
    assert logs[0]['train_lr'] == pytest.approx(1e-6)  # epoch 0 runs at the warmup LR
    ck = load(os.path.join(out, 'checkpoint.pth'))
    assert ck['epoch'] == 0 and isinstance(ck['args'], dict) and ck['args']['model'] == 'NALAFORMER_XT'
    assert {'model', 'model_ema', 'optimizer', 'lr_scheduler', 'scaler', 'max_accuracy', 'rng_state'} <= set(ck)
    assert not any(k.startswith('module.') for k in ck['model'])
    assert ck['max_accuracy'] == pytest.approx(max(logs[0]['test_acc1'], logs[0]['test_ema_acc1']))
    assert os.path.exists(os.path.join(out, 'best.pth'))


def _evaluated_as_trained(stdout, log):
    """The evaluation's accuracy lines and losses are those the training run logged for the same weights
    (the checkpoint holds an EMA: both are measured)."""
    assert accuracy_line(stdout) == [
        f"Accuracy of the network (model) on the 15 test images: {log['test_acc1']:.2f}%",
        f"Accuracy of the network (EMA) on the 15 test images: {log['test_ema_acc1']:.2f}%"]
    losses = re.findall(r'^\* Acc@1 .* loss (\d+\.\d+)', stdout, re.M)
    assert losses == [f"{log['test_loss']:.3f}", f"{log['test_ema_loss']:.3f}"], stdout[-2000:]


def test_eval_of_a_saved_checkpoint(one_epoch, data):
    """main.py --eval without --input-size evaluates at the 32 px the checkpoint was trained at (not 224)."""
    out, _ = one_epoch
    log = json.loads(open(os.path.join(out, 'log.txt')).readline())
    ckpt = os.path.join(out, 'checkpoint.pth')
    p = run_main(['--model', 'NALAFORMER_XT', '--batch-size', '4', '--device', 'cpu',
                  '--num_workers', '0', '--no-flops', '--eval', '--resume', ckpt, '--data-path', data])
    assert f'--input-size 32: as recorded in {ckpt}' in p.stdout
    _evaluated_as_trained(p.stdout, log)
    # and it records which of them gave its best accuracy
    ck = load(os.path.join(out, 'checkpoint.pth'))
    best = 'model_ema' if log['test_ema_acc1'] >= log['test_acc1'] else 'model'
    assert ck['best_weights'] == best and ck['best_epoch'] == 0 and ck['log'] == log
    assert ck['acc1'] == ck['best_acc1'] == {'model': log['test_acc1'], 'model_ema': log['test_ema_acc1']}
    assert f"from the {'EMA' if best == 'model_ema' else 'model'} weights" in p.stdout


def test_eval_sh_evaluates_at_the_size_the_checkpoint_was_trained_at(one_epoch, data):
    """README's eval.sh line on a checkpoint trained at 32 px: the accuracy the run logged, not a 224 px one."""
    out, _ = one_epoch
    log = json.loads(open(os.path.join(out, 'log.txt')).readline())
    e = {k: v for k, v in env().items() if k not in ('SIZE', 'DRY_RUN', 'NPROC', 'NNODES')}
    e.update(PYTHON=PY, MODEL='NALAFORMER_XT', CKPT=os.path.join(out, 'checkpoint.pth'), DATA=data, BATCH='4')
    p = subprocess.run(['bash', os.path.join(REPO, 'eval.sh'), '--device', 'cpu', '--num_workers', '0', '--no-flops'],
                       env=e, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert '--input-size' not in p.stdout.splitlines()[0]  # the command eval.sh printed
    _evaluated_as_trained(p.stdout, log)


def test_a_release_is_evaluated_by_eval_sh_at_its_size_and_cannot_resume_training(one_epoch, data, tmp_path):
    """tools/release.py's file of the 32 px run's EMA weights: eval.sh (main.py --eval --resume) measures it at
    the 32 px its metadata records, with the accuracy the run logged for those weights; a training run cannot
    continue from it (one line, pointing to --finetune) and leaves no output directory."""
    from tools import release
    out, _ = one_epoch
    log = json.loads(open(os.path.join(out, 'log.txt')).readline())
    rel = release.release(os.path.join(out, 'checkpoint.pth'), str(tmp_path / 'rel'), weights='model_ema',
                          flops=False)['file']
    e = {k: v for k, v in env().items() if k not in ('SIZE', 'DRY_RUN', 'NPROC', 'NNODES')}
    e.update(PYTHON=PY, MODEL='NALAFORMER_XT', CKPT=rel, DATA=data, BATCH='4')
    p = subprocess.run(['bash', os.path.join(REPO, 'eval.sh'), '--device', 'cpu', '--num_workers', '0', '--no-flops'],
                       env=e, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f'--input-size 32 and --eval-crop-ratio 1.0: as recorded in {rel}' in p.stdout
    assert accuracy_line(p.stdout) == [f"Accuracy of the network on the 15 test images: {log['test_ema_acc1']:.2f}%"]
    assert re.findall(r'^\* Acc@1 .* loss (\d+\.\d+)', p.stdout, re.M) == [f"{log['test_ema_loss']:.3f}"]
    p = run_main(BASE + ['--data-path', data, '--resume', rel, '--output_dir', str(tmp_path / 'out')], check=False)
    line = error_line(p)
    assert f'--resume {rel} is a release (weights only' in line and f'--finetune {rel}' in line, line
    assert p.returncode == 1 and not os.path.exists(tmp_path / 'out')


def test_resume_gives_the_same_weights_as_a_straight_run(one_epoch, straight, data, tmp_path):
    out1, _ = one_epoch
    out = str(tmp_path / 'out')
    shutil.copytree(out1, out)
    p = run_main(BASE + ['--data-path', data, '--output_dir', out])  # automatic resume from out/checkpoint.pth
    assert 'Resumed from' in p.stdout and 'continuing at epoch 1' in p.stdout
    a, b = load(os.path.join(straight, 'checkpoint.pth')), load(os.path.join(out, 'checkpoint.pth'))
    assert a['epoch'] == b['epoch'] == 1
    assert_same_weights(a, b)
    assert a['max_accuracy'] == b['max_accuracy']
    for k in a['optimizer']['state']:
        assert torch.equal(a['optimizer']['state'][k]['exp_avg'], b['optimizer']['state'][k]['exp_avg'])
    la = [json.loads(x) for x in open(os.path.join(straight, 'log.txt'))]
    lb = [json.loads(x) for x in open(os.path.join(out, 'log.txt'))]
    assert la[1]['test_acc1'] == lb[1]['test_acc1'] and la[1]['train_lr'] == lb[1]['train_lr']


@pytest.fixture(scope='module')
def torchrun_run(data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp('ddp') / 'out')
    args = BASE[:-1] + ['1', '--batch-size', '2', '--data-path', data, '--output_dir', out, '--dist-eval',
                        '--num_workers', '0']
    p = run_main(args, nproc=2)
    return out, p


def test_torchrun_two_ranks_end_with_identical_weights(torchrun_run):
    out, p = torchrun_run
    assert 'Launcher: torchrun, 2 process(es), backend gloo' in p.stdout
    digests = re.findall(r'\[rank (\d)\] final weights sha256: (\w+)', p.stdout + p.stderr)
    assert sorted(r for r, _ in digests) == ['0', '1'], p.stdout[-3000:]
    assert len({d for _, d in digests}) == 1
    assert 'Accuracy of the network on the 15 test images' in p.stdout
    assert load(os.path.join(out, 'checkpoint.pth'))['rng_state'].__len__() == 2


def test_dist_eval_is_exact_and_equals_single_process(torchrun_run, data):
    out, _ = torchrun_run
    ev = ['--model', 'NALAFORMER_XT', '--input-size', '32', '--batch-size', '4', '--device', 'cpu',
          '--num_workers', '0', '--no-flops', '--eval', '--resume', os.path.join(out, 'checkpoint.pth'),
          '--data-path', data, '--dist-eval']
    single = run_main(ev)
    multi = run_main(ev, nproc=2)
    assert accuracy_line(single.stdout) == accuracy_line(multi.stdout)
    assert 'on the 15 test images' in accuracy_line(multi.stdout)[0]
    star = lambda s: [line for line in s.splitlines() if line.startswith('* Acc@1')]  # noqa: E731
    assert star(single.stdout) == star(multi.stdout)


def test_finetune_from_a_checkpoint_with_another_head_and_size(one_epoch, tmp_path):
    out1, _ = one_epoch
    data2 = make_imagefolder(tmp_path / 'two', classes=2, n_train=4, n_val=2, size=48, seed=1)
    p = run_main(['--model', 'NALAFORMER_XT', '--input-size', '48', '--batch-size', '4', '--device', 'cpu',
                  '--num_workers', '0', '--no-flops', '--epochs', '1',
                  '--finetune', os.path.join(out1, 'checkpoint.pth'),
                  '--amp', 'bf16', '--channels-last',  # mixed precision and memory format on the CPU, too
                  '--data-path', data2, '--output_dir', str(tmp_path / 'ft')])
    assert 'classifier re-initialised' in p.stdout and 'head.weight' in p.stdout
    assert 'Accuracy of the network on the 4 test images' in p.stdout and 'precision bf16' in p.stdout
    ck = load(tmp_path / 'ft' / 'checkpoint.pth')
    src = load(os.path.join(out1, 'checkpoint.pth'))
    assert ck['model']['head.weight'].shape[0] == 2
    assert ck['epoch'] == 0 and 'step' not in ck
    assert src['model']['head.weight'].shape[0] == 3


def _bn_buffers(state_dict):
    return {k: v for k, v in state_dict.items() if k.endswith(('running_mean', 'running_var', 'num_batches_tracked'))}


@pytest.mark.parametrize('train_mode', [None, '--train-mode'])
def test_finetune_trains_in_eval_mode_unless_train_mode_is_given(one_epoch, data, tmp_path, train_mode):
    """The reference fine-tunes with the model in eval mode: BatchNorm statistics stay those of the loaded
    weights (and drop path is off, which eval mode implies); --train-mode updates them. A run from scratch
    trains in train mode."""
    out1, first = one_epoch
    assert 'Train mode: on' in first.stdout
    src = load(os.path.join(out1, 'checkpoint.pth'))
    assert any(v.abs().sum() > 0 for k, v in src['model'].items() if k.endswith('running_mean'))
    extra = [train_mode] if train_mode else []
    p = run_main(BASE[:-1] + ['1', '--data-path', data, '--output_dir', str(tmp_path / 'ft'),
                              '--finetune', os.path.join(out1, 'checkpoint.pth')] + extra)
    ck = load(tmp_path / 'ft' / 'checkpoint.pth')
    loaded, after = _bn_buffers(src['model_ema']), _bn_buffers(ck['model'])  # --finetune loads the EMA weights
    assert loaded.keys() == after.keys() and loaded
    changed = [k for k in loaded if not torch.equal(loaded[k], after[k])]
    if train_mode:
        assert 'Train mode: on (--train-mode)' in p.stdout
        assert len(changed) == len(loaded), 'every BatchNorm buffer moves in train mode'
    else:
        assert 'Train mode: off: --finetune runs in eval mode' in p.stdout
        assert not changed, f'BatchNorm statistics changed in eval mode: {changed[:3]}'
        assert not torch.equal(src['model_ema']['head.weight'], ck['model']['head.weight'])  # it did train


def test_evaluation_states_how_many_images_it_could_evaluate(one_epoch, data, tmp_path):
    out, _ = one_epoch
    bad = tmp_path / 'data'
    shutil.copytree(data, bad)
    victim = bad / 'val' / 'c1' / '0.png'
    victim.write_bytes(victim.read_bytes()[:40])  # a truncated PNG
    p = run_main(['--model', 'NALAFORMER_XT', '--input-size', '32', '--batch-size', '4', '--device', 'cpu',
                  '--num_workers', '0', '--no-flops', '--eval', '--resume', os.path.join(out, 'checkpoint.pth'),
                  '--data-path', str(bad)])
    for line, label in zip(accuracy_line(p.stdout), ('model', 'EMA'), strict=True):
        assert line.startswith(f'Accuracy of the network ({label}) on the 14 test images: ')
        assert line.endswith('(evaluated 14 of 15 images; undecodable ones excluded)')


def test_a_corrupt_training_image_is_counted_once_across_ranks(data, tmp_path):
    """Repeated augmentation reads one file on several ranks: the epoch summary counts files, not reads.
    With --strict-data the same file stops the run with its path instead."""
    from torchvision.datasets import ImageFolder

    import samplers
    bad = tmp_path / 'data'
    shutil.copytree(data, bad)
    train = ImageFolder(str(bad / 'train'))
    sampler = samplers.RASampler(train, num_replicas=2, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(0)
    first = next(iter(sampler))               # its 3 repeats go to rank 0, rank 1, rank 0
    victim = train.samples[first][0]
    with open(victim, 'r+b') as f:
        f.truncate(40)
    out = tmp_path / 'out'
    args = BASE[:-1] + ['1', '--data-path', str(bad), '--output_dir', str(out), '--repeated-aug', '--seed', '0']
    run_main(args, nproc=2)
    with open(out / 'log.txt') as f:
        (entry,) = [json.loads(line) for line in f]
    assert entry['bad_train_images'] == 1
    p = run_main(args + ['--strict-data', '--no-auto-resume', '--overwrite'], check=False)
    assert p.returncode != 0 and victim in p.stdout + p.stderr


def test_an_unexpected_error_with_loader_workers_exits_instead_of_hanging(data, tmp_path):
    """Workers ignore SIGTERM, so an exit that waited for them would hang: the run must end, code 1."""
    script = tmp_path / 'inject.py'
    script.write_text(  # the second batch fails inside the loader worker, as a broken transform would
        'import sys, main\n'
        'from torch.utils.data._utils import fetch\n'
        'real, calls = fetch._MapDatasetFetcher.fetch, []\n'
        'def failing(self, index):\n'
        '    calls.append(index)\n'
        '    if len(calls) == 2:\n'
        '        raise RuntimeError("injected failure")\n'
        '    return real(self, index)\n'
        'fetch._MapDatasetFetcher.fetch = failing\n'
        'sys.exit(main.run(sys.argv[1:]))\n')
    cmd = [PY, str(script)] + BASE[:-1] + ['1', '--data-path', data, '--output_dir', str(tmp_path / 'out')]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**env(), 'PYTHONPATH': REPO}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)       # the main process and its loader worker
        proc.communicate()
        raise AssertionError('main.py hung after an unexpected error instead of exiting') from None
    assert proc.returncode == 1 and 'RuntimeError: injected failure' in err


def test_eval_needs_no_training_set(tmp_path):
    root = make_imagefolder(tmp_path / 'data')
    shutil.rmtree(os.path.join(root, 'train'))
    ck = str(tmp_path / 'xt.pth')
    torch.save({'model': timm.create_model('NALAFORMER_XT', num_classes=3).state_dict()}, ck)
    p = run_main(['--model', 'NALAFORMER_XT', '--input-size', '32', '--batch-size', '4', '--device', 'cpu',
                  '--num_workers', '0', '--no-flops', '--eval', '--resume', ck, '--data-path', root])
    assert 'Data: IMNET, 15 val images, 3 classes' in p.stdout
    assert 'Accuracy of the network on the 15 test images' in p.stdout


def test_torchrun_with_gradient_accumulation_completes(tmp_path):
    root = make_imagefolder(tmp_path / 'data')
    out = str(tmp_path / 'out')
    p = run_main(BASE[:-1] + ['1', '--batch-size', '2', '--accum-steps', '2', '--data-path', root,
                              '--output_dir', out, '--num_workers', '0', '--no-model-ema'], nproc=2)
    assert 'global batch 8 = 2 x 2 x 2 accumulated' in p.stdout
    digests = re.findall(r'\[rank (\d)\] final weights sha256: (\w+)', p.stdout + p.stderr)
    assert sorted(r for r, _ in digests) == ['0', '1'] and len({d for _, d in digests}) == 1
    with open(os.path.join(out, 'log.txt')) as f:
        line = json.loads(f.readline())
    assert line['train_skipped_steps'] == 0 and math.isfinite(line['train_loss'])
