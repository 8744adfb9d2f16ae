"""Unit tests of the training engine (no subprocesses): recipe defaults, LR per epoch, model flags,
checkpoint round trip and atomic writes, RNG state, exact evaluation counts, train-step behaviour."""
import math
import os
import random

import numpy as np
import pytest
import torch

import checkpoint
import datasets
import engine
import errors
import main
import utils


def parse(*argv):
    return main.get_args_parser().parse_args(list(argv))


# -------------------------------------------------------------------------------- arguments
def test_defaults_are_the_published_recipe():
    a = parse()
    assert (a.batch_size, a.epochs, a.lr, a.opt, a.weight_decay, a.opt_eps) == (128, 300, 5e-4, 'adamw', 0.05, 1e-8)
    assert (a.sched, a.min_lr, a.warmup_lr, a.warmup_epochs) == ('cosine', 1e-5, 1e-6, 5)
    assert a.clip_grad is None and a.opt_betas is None  # AdamW default betas (0.9, 0.999), no clipping
    assert (a.aa, a.color_jitter, a.train_interpolation) == ('rand-m9-mstd0.5-inc1', 0.4, 'bicubic')
    assert (a.reprob, a.remode, a.recount) == (0.25, 'pixel', 1)
    assert (a.mixup, a.cutmix, a.mixup_prob, a.mixup_switch_prob, a.mixup_mode) == (0.8, 1.0, 1.0, 0.5, 'batch')
    assert a.smoothing == 0.1 and a.repeated_aug and a.model_ema and a.model_ema_decay == 0.99996
    assert a.drop_path is None and a.drop == 0.0 and a.eval_crop_ratio is None and a.sync_bn  # None: the model's
    assert datasets.data_config(a.model, a.input_size, a.eval_crop_ratio)['crop_pct'] == 0.875
    assert a.data_set == 'IMNET' and a.dist_url == 'env://'


def test_reference_flag_spellings_are_accepted():
    a = parse('--output_dir', 'o', '--start_epoch', '3', '--num_workers', '2', '--world_size', '1',
              '--dist_url', 'env://', '--no-model-ema', '--no-repeated-aug', '--no-pin-mem', '--amp',
              '--local_rank', '0', '--dist-eval', '--drop-path', '0.3', '--data-set', 'DIGITS')
    assert (a.output_dir, a.start_epoch, a.num_workers, a.amp) == ('o', 3, 2, 'fp16')
    assert not a.model_ema and not a.repeated_aug and not a.pin_mem and a.dist_eval and a.drop_path == 0.3
    assert parse('--output-dir', 'p', '--amp', 'bf16').output_dir == 'p'
    assert parse('--amp', 'bf16').amp == 'bf16'


def test_drop_path_dropout_and_classes_reach_the_model():
    a = parse('--model', 'NALAFORMER_XT', '--drop-path', '0.3', '--drop', '0.2')
    m = main.build_model(a, 7)
    assert m.eval()(torch.zeros(1, 3, 32, 32)).shape == (1, 7)
    probs = [mod.drop_prob for mod in m.modules() if hasattr(mod, 'drop_prob')]
    assert probs and max(probs) == pytest.approx(0.3)
    drops = [mod.p for mod in m.modules() if isinstance(mod, torch.nn.Dropout)]
    assert drops and max(drops) == pytest.approx(0.2)


# -------------------------------------------------------------------------------- LR schedule
def _expected_lr(e, lr, epochs, warmup, warmup_lr, min_lr):
    if e < warmup:
        return warmup_lr + e * (lr - warmup_lr) / warmup
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * e / epochs))


def test_lr_of_every_epoch_is_the_intended_one():
    a = parse('--epochs', '30', '--lr', '1e-3', '--warmup-epochs', '5')
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=a.lr)
    sched = main.build_lr_scheduler(a, opt)
    for e in range(a.epochs):
        sched.step(e)  # as main.py does at the start of epoch e
        assert opt.param_groups[0]['lr'] == pytest.approx(_expected_lr(e, 1e-3, 30, 5, 1e-6, 1e-5), rel=1e-9), e
    # epoch 0 runs at the warmup LR and the first post-warmup epoch at (almost) the peak LR: no lag
    sched.step(0)
    assert opt.param_groups[0]['lr'] == pytest.approx(1e-6)
    sched.step(5)
    assert opt.param_groups[0]['lr'] == pytest.approx(1e-5 + 0.5 * (1e-3 - 1e-5) * (1 + math.cos(math.pi * 5 / 30)))


def test_scheduler_state_round_trip_keeps_lr():
    a = parse('--epochs', '10')
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=a.lr)
    sched = main.build_lr_scheduler(a, opt)
    sched.step(3)
    sd = sched.state_dict()
    opt2 = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=a.lr)
    sched2 = main.build_lr_scheduler(a, opt2)
    sched2.load_state_dict(sd)
    for e in range(4, 10):
        sched.step(e)
        sched2.step(e)
        assert opt.param_groups[0]['lr'] == opt2.param_groups[0]['lr']


# -------------------------------------------------------------------------------- checkpoints
def _state():
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.ones(1, 3)).sum().backward()
    opt.step()
    return {'model': m.state_dict(), 'optimizer': opt.state_dict(), 'epoch': 4, 'max_accuracy': 12.5,
            'args': checkpoint.args_to_dict(parse('--output_dir', 'x')), 'rng_state': [checkpoint.get_rng_state()]}


def test_checkpoint_round_trip_weights_only(tmp_path):
    st = _state()
    p = tmp_path / 'checkpoint.pth'
    checkpoint.save_atomic(st, p)
    back = torch.load(p, weights_only=True)
    assert back['epoch'] == 4 and back['max_accuracy'] == 12.5 and isinstance(back['args'], dict)
    assert back['args']['output_dir'] == 'x'
    for k, v in st['model'].items():
        assert torch.equal(v, back['model'][k])
    assert os.listdir(tmp_path) == ['checkpoint.pth']  # no temporary file left behind


def test_failing_write_keeps_previous_checkpoint_and_names_the_path(tmp_path, monkeypatch):
    p = tmp_path / 'checkpoint.pth'
    checkpoint.save_atomic({'model': {'w': torch.ones(2)}, 'epoch': 1}, p)
    before = p.read_bytes()
    real_save = torch.save

    def half_then_disk_full(obj, f, *a, **k):
        real_save(obj, f, *a, **k)  # bytes reach the temporary file ...
        raise OSError(28, 'No space left on device')  # ... then the disk fills up

    monkeypatch.setattr(torch, 'save', half_then_disk_full)
    with pytest.raises(errors.CheckpointWriteError) as ei:
        checkpoint.save_atomic({'model': {'w': torch.zeros(2)}, 'epoch': 2}, p)
    assert str(p) in str(ei.value) and 'no space left' in str(ei.value)
    assert p.read_bytes() == before
    assert os.listdir(tmp_path) == ['checkpoint.pth']


def test_stale_temporary_files_are_removed(tmp_path):
    (tmp_path / (checkpoint.TMP_PREFIX + 'checkpoint.pth.abc')).write_bytes(b'partial')
    (tmp_path / 'checkpoint.pth').write_bytes(b'keep')
    checkpoint.remove_stale_tmp(str(tmp_path))
    assert os.listdir(tmp_path) == ['checkpoint.pth']


def test_rng_state_round_trip_through_a_weights_only_file(tmp_path):
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    checkpoint.save_atomic({'rng': checkpoint.get_rng_state()}, tmp_path / 'r.pth')
    want = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(9)
    np.random.seed(9)
    random.seed(9)
    checkpoint.set_rng_state(torch.load(tmp_path / 'r.pth', weights_only=True)['rng'])
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(want[0], got[0]) and np.array_equal(want[1], got[1]) and want[2] == got[2]


# -------------------------------------------------------------------------------- engine
class _Loader(list):
    batch_size = 4


def test_evaluate_counts_exactly_and_excludes_undecodable_images():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(2, 3, bias=False))
    with torch.no_grad():
        model[1].weight.copy_(torch.tensor([[1., 0], [0, 1], [-1, -1]]))
    x = torch.tensor([[5., 0], [0, 5], [-5, -5], [5, 0], [0, 5]])
    y = torch.tensor([0, 1, 2, 1, -100])  # one wrong, one undecodable (IGNORE_TARGET)
    loader = _Loader([(x[:4].view(4, 2, 1, 1), y[:4]), (x[4:].view(1, 2, 1, 1), y[4:])])
    st = engine.evaluate(loader, model, 'cpu')
    assert st['n'] == 4 and st['seen'] == 5
    assert st['acc1'] == pytest.approx(75.0) and st['acc5'] == pytest.approx(100.0)


class _NaNModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.lin(x.flatten(1)) * float('nan')


def test_non_finite_loss_is_skipped_then_stops_with_epoch_and_step():
    model = _NaNModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = _Loader([(torch.ones(4, 2), torch.zeros(4, dtype=torch.long))] * 6)
    crit = lambda s, o, t: torch.nn.functional.cross_entropy(o, t)  # noqa: E731
    with pytest.raises(errors.NonFiniteLossError) as ei:
        engine.train_one_epoch(model, crit, loader, opt, 'cpu', epoch=3, max_bad_steps=2, print_freq=100)
    assert 'epoch 3 step 2' in str(ei.value) and '--max-bad-steps 2' in str(ei.value)
    for k, v in model.state_dict().items():  # skipped steps never touched the weights
        assert torch.equal(v, before[k])


def test_stop_flag_ends_epoch_at_a_step_boundary():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(2, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = _Loader([(torch.randn(4, 2), torch.zeros(4, dtype=torch.long))] * 5)
    flag = utils.StopFlag()
    flag.signum = 15
    crit = lambda s, o, t: torch.nn.functional.cross_entropy(o, t)  # noqa: E731
    res = engine.train_one_epoch(model, crit, loader, opt, 'cpu', epoch=0, stop_flag=flag, print_freq=100)
    assert res.stopped and res.next_step == 1 and res.rng_state is not None and res.epoch_rng_state is not None


# -------------------------------------------------------------------------------- launch scripts
@pytest.mark.parametrize('variant', ['NALAFORMER_XT', 'NALAFORMER_T', 'NALAFORMER_S', 'NALAFORMER_B',
                                     'NALAFORMER_L'])
def test_pretrain_sh_holds_each_variant_recipe(variant):
    import subprocess
    e = dict(os.environ, MODEL=variant, PYTHON='echo', DATA='/d', OUTPUT='/o', NPROC='4', NNODES='2',
             NODE_RANK='1', MASTER_ADDR='10.0.0.1', MASTER_PORT='1234')
    e.pop('AMP', None)
    p = subprocess.run(['bash', os.path.join(main.__file__.rsplit('/', 1)[0], 'pretrain.sh'), '--epochs', '7'],
                       env=e, capture_output=True, text=True, check=True)
    printed, ran = p.stdout.splitlines()
    assert printed.startswith('+ echo -m torch.distributed.run')
    for piece in ('--nnodes=2', '--node_rank=1', '--nproc_per_node=4', '--master_addr=10.0.0.1',
                  '--master_port=1234', f'--model {variant}', '--batch-size 128',
                  '--data-path /d', '--output_dir /o'):
        assert piece in ran, piece
    # the variant's drop path is main.py's default; the reference trained in fp32 (+TF32), no --amp
    assert '--drop-path' not in ran and '--amp' not in ran
    assert ran.endswith('--epochs 7')  # extra flags come last and override
    args = main.get_args_parser().parse_args(ran.split(' main.py ', 1)[1].split())
    assert args.drop_path is None and args.amp is None and args.epochs == 7 and args.lr == 5e-4


@pytest.mark.slow
def test_eval_sh_prints_and_runs_an_exact_evaluation():
    import subprocess
    e = dict(os.environ, PYTHON='echo', CKPT='/c.pth', DATA='/d', NPROC='2')
    p = subprocess.run(['bash', os.path.join(main.__file__.rsplit('/', 1)[0], 'eval.sh')], env=e,
                       capture_output=True, text=True, check=True)
    ran = p.stdout.splitlines()[1]
    assert '--nproc_per_node=2' in ran and '--eval --resume /c.pth' in ran and '--dist-eval' in ran


def test_distillation_loss_soft_and_hard():
    from losses import DistillationLoss
    torch.manual_seed(0)
    teacher = torch.nn.Linear(4, 3)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    out = torch.randn(5, 3)
    base = torch.nn.CrossEntropyLoss()
    assert DistillationLoss(base, None, 'none', 0.5, 1.0)(x, out, y) == base(out, y)
    hard = DistillationLoss(base, teacher, 'hard', 0.5, 1.0)(x, out, y)
    want = 0.5 * base(out, y) + 0.5 * torch.nn.functional.cross_entropy(out, teacher(x).argmax(1))
    assert torch.allclose(hard, want)
    soft = DistillationLoss(base, teacher, 'soft', 1.0, 2.0)(x, (out, out), y)
    p_t = torch.softmax(teacher(x) / 2, 1)
    kl = (p_t * (p_t.log() - torch.log_softmax(out / 2, 1))).sum() * 4 / out.numel()
    assert torch.allclose(soft, kl, atol=1e-6)


def test_a_stop_signal_cuts_evaluation_short():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(2, 2))
    loader = _Loader([(torch.randn(4, 2), torch.zeros(4, dtype=torch.long))] * 3)
    flag = utils.StopFlag()
    assert not engine.evaluate(loader, model, 'cpu', stop_flag=flag)['aborted']
    flag.signum = 15
    st = engine.evaluate(loader, model, 'cpu', stop_flag=flag)
    assert st['aborted'] and st['n'] == 0


def test_preserved_rng_restores_every_generator():
    def seed():
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)

    def draw():
        return torch.rand(1).item(), float(np.random.rand()), random.random()

    seed()
    want = draw()
    seed()
    with checkpoint.preserved_rng():
        draw()
    assert draw() == want


def test_start_of_run_flops_match_the_reference_count():
    # docs/method.md#variants: NALAFORMER_XT, fvcore at 1x3x224x224 in eval mode = 0.652 G
    # (also with the fast attention path)
    m = main.build_model(parse('--model', 'NALAFORMER_XT'), 1000)
    assert main.count_flops(m, 224, 'cpu') / 1e9 == pytest.approx(0.652, abs=0.001)
    assert m.training  # the count leaves the model as it found it
