"""The paper's training recipe reaches every entry point: per-variant drop path, skipped non-finite
steps that leave the model (and its BatchNorm statistics and EMA) untouched, strict-JSON logs, BCE
targets, TF32 precision defaults, --eval without train/, and gradient accumulation."""
import json
import math
import os
import re
import shutil
import signal

import pytest
import timm
import torch

import engine
import errors
import main
import metrics
import models  # noqa: F401  (registers the variants)
import utils
from models.nalaformer import VARIANTS


def parse(*argv):
    return main.get_args_parser().parse_args(list(argv))


def last_block_drop_prob(model):
    return [m.drop_prob for m in model.modules() if hasattr(m, 'drop_prob')][-1]


# -------------------------------------------------------------------------------- drop path
@pytest.mark.parametrize('variant, rate', [('NALAFORMER_XT', 0.10), ('NALAFORMER_T', 0.10), ('NALAFORMER_S', 0.15),
                                           ('NALAFORMER_B', 0.40), ('NALAFORMER_L', 0.55)])
def test_create_model_builds_the_variants_own_drop_path(variant, rate):
    assert last_block_drop_prob(timm.create_model(variant)) == pytest.approx(rate)
    assert VARIANTS[variant]['drop_path'] == rate  # the table itself is not consumed by building
    assert last_block_drop_prob(timm.create_model(variant.lower(), drop_path_rate=0.3)) == pytest.approx(0.3)


def test_main_build_uses_the_variant_rate_unless_drop_path_is_given(capsys):
    assert main.drop_path_rate(main.build_model(parse('--model', 'NALAFORMER_S'), 10)) == pytest.approx(0.15)
    a = parse('--model', 'NALAFORMER_S', '--drop-path', '0.05')
    assert main.drop_path_rate(main.build_model(a, 10)) == pytest.approx(0.05)
    assert main.drop_path_rate(main.build_model(parse('--model', 'NALAFORMER_XT', '--drop-path', '0'), 10)) == 0.0


# -------------------------------------------------------------------------------- skipped steps
class Loader(list):
    """A list of (samples, targets) batches that train_one_epoch accepts as a data loader."""
    batch_size = 4


def ce(samples, outputs, targets):
    return torch.nn.functional.cross_entropy(outputs, targets)


def bn_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(), torch.nn.Linear(6, 3))


def batches(n, seed=1, size=4):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 4, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(n)]


def poisoned(batch):
    """A batch whose forward writes inf/NaN into BatchNorm's running statistics and gives a NaN loss."""
    x, y = batch
    x = x.clone()
    x[0, 0] = float('inf')
    return x, y


def train(model, loader, epoch=0, **kw):
    from timm.utils import ModelEmaV3
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ema = kw.pop('ema', None) or ModelEmaV3(model, decay=0.5)
    res = engine.train_one_epoch(model, ce, Loader(loader), opt, 'cpu', epoch, model_ema=ema, print_freq=1000, **kw)
    return res, ema


def assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, diff


def test_a_skipped_step_leaves_batchnorm_statistics_and_ema_untouched(one_thread):
    good = batches(2)
    ref_model = bn_model()
    _, ref_ema = train(ref_model, good)
    model = bn_model()
    res, ema = train(model, [good[0], poisoned(good[1]), good[1]])
    assert res.stats['skipped_steps'] == 1 and res.carry.skipped_steps == 1 and res.carry.bad_steps == 0
    assert torch.isfinite(model[1].running_mean).all()
    # skipping the poisoned batch is exactly as if it never existed: weights, BN statistics and EMA
    assert_bitwise_equal(model.state_dict(), ref_model.state_dict())
    assert_bitwise_equal(ema.module.state_dict(), ref_ema.module.state_dict())


def test_an_epoch_of_skipped_steps_changes_nothing_and_logs_strict_json(one_thread, tmp_path):
    model = bn_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res, ema = train(model, [poisoned(b) for b in batches(3)])
    assert res.stats['skipped_steps'] == 3 and res.carry.bad_steps == 3
    assert_bitwise_equal(model.state_dict(), before)
    assert_bitwise_equal(ema.module.state_dict(), before)
    assert math.isnan(res.stats['loss'])
    metrics.write_json_line(tmp_path / 'log.txt', {f'train_{k}': v for k, v in res.stats.items()})

    def no_constants(name):
        raise ValueError(f'non-standard JSON constant {name}')
    line = json.loads((tmp_path / 'log.txt').read_text(), parse_constant=no_constants)
    assert line['train_loss'] is None and line['train_skipped_steps'] == 3


def test_consecutive_bad_steps_are_counted_across_epochs(one_thread):
    model = bn_model()
    good = batches(3)
    res, ema = train(model, [good[0], poisoned(good[1]), poisoned(good[2])], epoch=0, max_bad_steps=2)
    assert res.carry.bad_steps == 2
    carry = engine.TrainCarry.from_state(res.carry.state_dict())  # as saved in and loaded from a checkpoint
    carry.skipped_steps = 0  # a new epoch
    with pytest.raises(errors.NonFiniteLossError) as ei:
        train(model, [poisoned(good[0]), good[1]], epoch=1, max_bad_steps=2, carry=carry, ema=ema)
    assert 'epoch 1 step 0' in str(ei.value) and '3 consecutive' in str(ei.value)


# -------------------------------------------------------------------------------- BCE targets
def test_bce_learns_the_smoothed_mixup_targets_not_all_ones():
    from timm.data import Mixup
    F = torch.nn.functional
    a = parse('--bce-loss', '--smoothing', '0.1')
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=a.smoothing, num_classes=5)
    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    _, soft = mixup(x, y)
    assert (soft < 0.5).any()  # smoothed, mixed probabilities: most classes are (nearly) off
    logits = torch.randn(4, 5)
    crit = main.build_criterion(a, mixup_active=True)
    assert crit(logits, soft).item() == pytest.approx(F.binary_cross_entropy_with_logits(logits, soft).item())
    assert crit(logits, soft).item() != pytest.approx(
        F.binary_cross_entropy_with_logits(logits, torch.ones_like(soft)).item())
    # without mixup: the labels one-hot encoded with --smoothing
    crit = main.build_criterion(a, mixup_active=False)
    t = torch.full((4, 5), 0.1 / 5).scatter_(1, y.view(-1, 1), 0.9 + 0.1 / 5)
    assert crit(logits, y).item() == pytest.approx(F.binary_cross_entropy_with_logits(logits, t).item())
    # --bce-target-thresh: binarised targets (both mixed classes on when each weighs more than the threshold)
    crit = main.build_criterion(parse('--bce-loss', '--bce-target-thresh', '0.2'), mixup_active=True)
    assert crit(logits, soft).item() == pytest.approx(
        F.binary_cross_entropy_with_logits(logits, soft.gt(0.2).float()).item())


# -------------------------------------------------------------------------------- command line
@pytest.mark.parametrize('argv, message', [
    (['--sched', 'plateau'], r"--sched: invalid choice: 'plateau'"),
    (['--accum-steps', '0'], r'--accum-steps must be at least 1, got 0'),
    (['--bce-target-thresh', '0.2'], r'--bce-target-thresh needs --bce-loss'),
])
def test_refused_recipe_flags_fail_like_argparse(argv, message, capsys):
    parser = main.get_args_parser()
    with pytest.raises(SystemExit) as ei:
        main.validate_args(parser.parse_args(argv), parser)
    assert ei.value.code == 2
    assert re.search(message, capsys.readouterr().err)


# -------------------------------------------------------------------------------- precision
def test_tf32_is_on_by_default_and_can_be_turned_off():
    assert parse().tf32 is True and parse('--no-tf32').tf32 is False
    assert parse('--tf32').tf32 is True


def test_set_tf32_leaves_the_backend_alone_off_cuda():
    flags = (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
    assert engine.set_tf32('cpu', True) is False
    assert engine.set_tf32(torch.device('cpu'), False) is False
    assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == flags


def test_set_tf32_sets_the_current_precision_flags_on_cuda():
    # the flags are plain settings: they can be set (and are restored) without a GPU
    saved = (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
    try:
        assert engine.set_tf32('cuda', True) is True
        assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == ('tf32', 'tf32')
        engine.set_tf32('cuda:0', False)
        assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == ('ieee', 'ieee')
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = saved


# -------------------------------------------------------------------------------- gradient accumulation
def linear_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))


class CountingSGD(torch.optim.SGD):
    """SGD that counts its optimizer steps."""
    n_steps = 0

    def step(self, closure=None):
        self.n_steps += 1
        return super().step(closure)


def steps(opt):
    return opt.n_steps


def run_accum(batch_list, accum_steps, **kw):
    from timm.utils import ModelEmaV3
    model = linear_model()
    opt = CountingSGD(model.parameters(), lr=0.5, momentum=0.9)  # SGD: a wrong loss scale would show
    ema = ModelEmaV3(model, decay=0.5)
    res = engine.train_one_epoch(model, ce, Loader(batch_list), opt, 'cpu', 0, model_ema=ema, print_freq=1000,
                                 accum_steps=accum_steps, **kw)
    return model, ema, res, opt


def test_accumulating_two_batches_equals_one_double_batch(one_thread):
    big = batches(3, size=8)
    halves = [(x[i:i + 4], y[i:i + 4]) for x, y in big for i in (0, 4)]
    m1, e1, r1, o1 = run_accum(big, 1)
    m2, e2, r2, o2 = run_accum(halves, 2)
    assert steps(o1) == steps(o2) == 3
    for a, b in ((m1, m2), (e1.module, e2.module)):  # no BatchNorm: equal up to float summation order
        for (k, v), w in zip(a.state_dict().items(), b.state_dict().values()):
            torch.testing.assert_close(v, w, rtol=1e-5, atol=1e-6, msg=k)
    assert r1.stats['loss'] == pytest.approx(r2.stats['loss'], rel=1e-5)
    # and it is not a no-op: one step per small batch (no accumulation) ends elsewhere
    m3, _, _, _ = run_accum(halves, 1)
    assert not torch.allclose(m3[0].weight, m1[0].weight, atol=1e-4)


def test_a_shorter_last_window_still_steps_and_stops_only_at_window_boundaries(one_thread):
    _, _, _, opt = run_accum(batches(5), 2)
    assert steps(opt) == 3  # windows of 2, 2 and 1 batches
    flag = utils.StopFlag()
    flag.signum = 15  # already requested: the first optimizer step ends the epoch
    _, _, res, opt = run_accum(batches(5), 2, stop_flag=flag)
    assert res.stopped and res.next_step == 2
    assert steps(opt) == 1


def test_a_non_finite_micro_step_skips_its_whole_window(one_thread):
    good = batches(4)
    m_ref, e_ref, _, _ = run_accum(good[2:], 2)
    model, ema, res, opt = run_accum([good[0], poisoned(good[1])] + good[2:], 2)
    assert res.stats['skipped_steps'] == 1 and steps(opt) == 1
    assert_bitwise_equal(model.state_dict(), m_ref.state_dict())
    assert_bitwise_equal(ema.module.state_dict(), e_ref.module.state_dict())


class SyncRecorder(torch.nn.Module):
    """Stands in for DDP: records, per forward and per backward, whether no_sync() was active."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.syncing, self.forwards, self.backwards = True, [], []

    def no_sync(self):
        from contextlib import contextmanager

        @contextmanager
        def ctx():
            self.syncing = False
            try:
                yield
            finally:
                self.syncing = True
        return ctx()

    def forward(self, x):
        self.forwards.append(self.syncing)
        out = self.lin(x)
        out.register_hook(lambda g: self.backwards.append(self.syncing))
        return out


def test_only_the_last_micro_step_of_a_window_synchronises(one_thread):
    model = SyncRecorder()
    opt = CountingSGD(model.parameters(), lr=0.1)
    engine.train_one_epoch(model, ce, Loader(batches(5)), opt, 'cpu', 0, print_freq=1000, accum_steps=2)
    # windows (0, 1), (2, 3), (4): forward and backward of 0 and 2 under no_sync, the rest synchronised
    assert model.forwards == [False, True, False, True, True]
    assert model.backwards == [False, True, False, True, True]
    assert steps(opt) == 3


# -------------------------------------------------------------------------------- real runs
@pytest.mark.slow
def test_eval_needs_no_training_set(tmp_path):
    from test_runs import make_imagefolder, run_main
    root = make_imagefolder(tmp_path / 'data')
    shutil.rmtree(os.path.join(root, 'train'))
    ck = str(tmp_path / 'xt.pth')
    torch.save({'model': timm.create_model('NALAFORMER_XT', num_classes=3).state_dict()}, ck)
    p = run_main(['--model', 'NALAFORMER_XT', '--input-size', '32', '--batch-size', '4', '--device', 'cpu',
                  '--num_workers', '0', '--no-flops', '--eval', '--resume', ck, '--data-path', root])
    assert 'Data: IMNET, 15 val images, 3 classes' in p.stdout
    assert 'Accuracy of the network on the 15 test images' in p.stdout


@pytest.mark.slow
def test_torchrun_with_gradient_accumulation_completes(tmp_path):
    from test_runs import BASE, make_imagefolder, run_main
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


@pytest.mark.slow
def test_a_stop_with_accumulation_lands_on_a_window_boundary_and_resumes_exactly(tmp_path):
    from test_faults import _signal_when, _start
    from test_runs import (
        BASE,
        PY,
        assert_same_weights,
        load,
        make_imagefolder,
        run_main,
    )
    root = make_imagefolder(tmp_path / 'data')
    args = BASE[:-1] + ['1', '--batch-size', '2', '--accum-steps', '3', '--data-path', root]  # 12 steps, 4 windows
    ref = str(tmp_path / 'ref')
    run_main(args + ['--output_dir', ref])
    out = str(tmp_path / 'out')
    stdout, stderr, _ = _signal_when(_start([PY, 'main.py'] + args + ['--output_dir', out]),
                                     r'Epoch: \[0\] \[ ?1/', signal.SIGINT)
    m = re.search(r'Stopped by SIGINT at epoch 0 step (\d+)', stdout)
    assert m, stdout[-3000:] + stderr[-3000:]
    assert int(m.group(1)) % 3 == 0
    run_main(args + ['--output_dir', out])
    assert_same_weights(load(os.path.join(ref, 'checkpoint.pth')), load(os.path.join(out, 'checkpoint.pth')))
