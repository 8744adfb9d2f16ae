"""main.py's builders: the model (drop path, dropout, classes), the optimizer with --layer-decay, the LR
schedule of every epoch, the loss (BCE targets), the data loaders and the start-of-run FLOPs count."""
import argparse
import math
import os

import numpy as np
import pytest
import timm
import torch
from conftest import optimizer_of, parse, scheduler_of
from helpers.image_folders import loaders_of

import cli
import datasets
import main
import models
from models.flop_count import count_flops
from run import checkpoint, distributed


# ------------------------------------------------------------------------------------------------ model
def test_drop_path_dropout_and_classes_reach_the_model():
    a = parse('--model', 'NALAFORMER_XT', '--drop-path', '0.3', '--drop', '0.2')
    m = main.build_model(a, 7)
    assert m.eval()(torch.zeros(1, 3, 32, 32)).shape == (1, 7)
    probs = [mod.drop_prob for mod in m.modules() if hasattr(mod, 'drop_prob')]
    assert probs and max(probs) == pytest.approx(0.3)
    drops = [mod.p for mod in m.modules() if isinstance(mod, torch.nn.Dropout)]
    assert drops and max(drops) == pytest.approx(0.2)


def last_block_drop_prob(model):
    """The stochastic-depth rate main.py prints: the highest in the model, its last block's."""
    return max((m.drop_prob for m in model.modules() if hasattr(m, 'drop_prob')), default=0.0)


def test_main_build_uses_the_variant_rate_unless_drop_path_is_given(capsys):
    assert last_block_drop_prob(main.build_model(parse('--model', 'NALAFORMER_S'), 10)) == pytest.approx(0.15)
    a = parse('--model', 'NALAFORMER_S', '--drop-path', '0.05')
    assert last_block_drop_prob(main.build_model(a, 10)) == pytest.approx(0.05)
    assert last_block_drop_prob(main.build_model(parse('--model', 'NALAFORMER_XT', '--drop-path', '0'), 10)) == 0.0


def test_grad_checkpointing_reaches_the_model_and_keeps_its_gradients(monkeypatch, one_thread):
    """--grad-checkpointing turns on every stage's checkpointing: each block runs under torch's checkpoint and
    the gradients are those of the model without it."""
    import models.nalaformer
    checkpointed = []
    real = models.nalaformer.checkpoint
    monkeypatch.setattr(models.nalaformer, 'checkpoint', lambda block, *a, **kw: checkpointed.append(block) or
                        real(block, *a, **kw))
    grads = []
    for flags in ([], ['--grad-checkpointing']):
        torch.manual_seed(0)
        m = main.build_model(parse('--model', 'NALAFORMER_XT', '--drop-path', '0', *flags), 3)
        assert all(stage.grad_checkpointing for stage in m.layers) == bool(flags)
        m(torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))).square().sum().backward()
        grads.append([p.grad for p in m.parameters()])
    assert len(checkpointed) == sum(len(stage.blocks) for stage in m.layers)
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(recomputed, plain)


def test_grad_checkpointing_of_a_model_without_it_is_one_line(capsys):
    from run.errors import FlagError
    with pytest.raises(FlagError) as e:
        main.build_model(parse('--model', 'dla46_c', '--grad-checkpointing'), 3)
    assert str(e.value).startswith('--grad-checkpointing: dla46_c does not support gradient checkpointing')
    assert '\n' not in str(e.value) and 'leave out the flag' in str(e.value)


# -------------------------------------------------------------------------------------------- optimizer
def _depth(name):
    """Position of a parameter in the forward order: stem 0, then each block, a stage's downsample with the
    previous stage's last block, then the head (proj, norm, head)."""
    if name.startswith('patch_embed'):
        return 0
    if name.startswith('layers.'):
        stage, rest = int(name.split('.')[1]), name.split('.')[2]
        depths = models.VARIANTS['NALAFORMER_XT']['depths']
        before = sum(depths[:stage])
        if rest == 'blocks':
            return 1 + before + int(name.split('.')[3])
        return before  # downsample: right after the previous stage's last block
    return 1 + sum(models.VARIANTS['NALAFORMER_XT']['depths'])


def test_layer_decay_scales_lr_by_depth(one_thread):
    args = cli.get_args_parser().parse_args(['--model', 'NALAFORMER_XT', '--layer-decay', '0.5', '--lr', '1e-3',
                                              '--warmup-epochs', '0', '--epochs', '10'])
    model = timm.create_model('NALAFORMER_XT', num_classes=10)
    optimizer = optimizer_of(args, model)
    scheduler = scheduler_of(args, optimizer)
    scheduler.step(3)
    # the schedule's LR at epoch 3, from the same flags without layer decay
    args.layer_decay = None
    plain = optimizer_of(args, timm.create_model('NALAFORMER_XT', num_classes=10))
    scheduler_of(args, plain).step(3)
    sched_lr = plain.param_groups[0]['lr']
    assert sched_lr < 1e-3
    group_of = {id(p): g for g in optimizer.param_groups for p in g['params']}
    head = 1 + sum(models.VARIANTS['NALAFORMER_XT']['depths'])
    for name, p in model.named_parameters():
        g = group_of[id(p)]
        expected = 0.5 ** (head - _depth(name))
        assert g['lr_scale'] == pytest.approx(expected), name
        assert g['lr'] == pytest.approx(sched_lr * expected), name
        assert g['weight_decay'] == (0.0 if p.ndim <= 1 or name.endswith('.bias') else 0.05), name
    assert max(g['lr'] for g in optimizer.param_groups) == pytest.approx(sched_lr)


def test_without_layer_decay_every_group_has_the_base_lr(one_thread):
    args = cli.get_args_parser().parse_args(['--model', 'NALAFORMER_XT', '--lr', '1e-3'])
    optimizer = optimizer_of(args, timm.create_model('NALAFORMER_XT', num_classes=10))
    assert {g['lr'] for g in optimizer.param_groups} == {1e-3}
    assert all(g.get('lr_scale', 1.0) == 1.0 for g in optimizer.param_groups)


def test_adam_and_adamw_take_the_fused_kernel_when_every_parameter_is_on_a_gpu(monkeypatch):
    model = torch.nn.Linear(4, 3)
    adamw = cli.get_args_parser().parse_args(['--opt', 'adamw'])
    cpu = optimizer_of(adamw, model)
    assert not cpu.defaults.get('fused')  # on the CPU: torch's default, the multi-tensor kernel
    monkeypatch.setattr(torch.Tensor, 'is_cuda', property(lambda self: True))  # the parameters "on a GPU"
    gpu = optimizer_of(adamw, model)
    adam = optimizer_of(cli.get_args_parser().parse_args(['--opt', 'adam']), model)
    sgd = optimizer_of(cli.get_args_parser().parse_args(['--opt', 'sgd']), model)
    monkeypatch.undo()
    assert gpu.defaults['fused'] and adam.defaults['fused'] and not sgd.defaults.get('fused')
    # a checkpoint keeps the kernel of the run that loads it, not that of the run that wrote it
    model(torch.randn(2, 4)).sum().backward()
    cpu.step()
    gpu.step()
    gpu.load_state_dict(cpu.state_dict())
    cpu.load_state_dict(gpu.state_dict())
    assert all(g['fused'] for g in gpu.param_groups) and not any(g['fused'] for g in cpu.param_groups)


def test_a_lookahead_optimizer_is_built_and_resumed_with_the_kernel_of_its_run():
    """timm's Lookahead wraps the optimizer without the hooks of torch's Optimizer: the kernel choice rides on
    the optimizer it wraps, which loads the state."""
    model = torch.nn.Linear(4, 3)
    optimizer = optimizer_of(cli.get_args_parser().parse_args(['--opt', 'lookahead_adamw']), model)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()
    saved['param_groups'] = [{**g, 'foreach': True} for g in saved['param_groups']]  # another run's kernel
    optimizer.load_state_dict(saved)
    assert all(g['foreach'] is optimizer.defaults['foreach'] for g in optimizer.param_groups)


# ------------------------------------------------------------------------------------------ LR schedule
def _expected_lr(e, lr, epochs, warmup, warmup_lr, min_lr):
    if e < warmup:
        return warmup_lr + e * (lr - warmup_lr) / warmup
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * e / epochs))


def test_lr_of_every_epoch_is_the_intended_one():
    a = parse('--epochs', '30', '--lr', '1e-3', '--warmup-epochs', '5')
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=a.lr)
    sched = scheduler_of(a, opt)
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
    sched = scheduler_of(a, opt)
    sched.step(3)
    sd = sched.state_dict()
    opt2 = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=a.lr)
    sched2 = scheduler_of(a, opt2)
    sched2.load_state_dict(sd)
    for e in range(4, 10):
        sched.step(e)
        sched2.step(e)
        assert opt.param_groups[0]['lr'] == opt2.param_groups[0]['lr']


# ------------------------------------------------------------------------------------------------- loss
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


# ----------------------------------------------------------------------------------------- data loaders
class RandomDraws(torch.utils.data.Dataset):
    """Each item is a random draw made in the loader worker, like a random augmentation."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(1)


def loader_args(num_workers: int) -> argparse.Namespace:
    return argparse.Namespace(repeated_aug=False, seed=0, dist_eval=False, pin_mem=True, device='cpu',
                              num_workers=num_workers, batch_size=4)


def draws(loader) -> list:
    return [round(float(x), 7) for batch in loader for x in batch]


def test_an_epoch_replays_from_the_rng_state_saved_at_its_start():
    torch.manual_seed(0)
    sampler, train, _ = loaders_of(loader_args(2), RandomDraws(), RandomDraws())
    sampler.set_epoch(0)
    draws(train)                         # epoch 0
    state = torch.get_rng_state()        # what a checkpoint after epoch 0 holds
    sampler.set_epoch(1)
    epoch1 = draws(train)

    torch.set_rng_state(state)           # a resumed run: fresh loaders, the saved state
    sampler2, train2, _ = loaders_of(loader_args(2), RandomDraws(), RandomDraws())
    sampler2.set_epoch(1)
    assert draws(train2) == epoch1


class WorkerDraws(torch.utils.data.Dataset):
    """Each item: the worker's pid and one draw of each generator an augmentation may use."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple:
        import random
        return os.getpid(), random.random(), float(np.random.rand()), float(torch.rand(()))


def test_workers_stay_across_epochs_and_draw_as_workers_started_anew_each_epoch():
    """build_loaders' workers are started once and reused every epoch, yet each epoch's draws are those of
    workers that torch starts for that epoch (a plain DataLoader), from the same random state at its start."""
    args = loader_args(2)
    torch.manual_seed(0)
    sampler, train, _ = loaders_of(args, WorkerDraws(), WorkerDraws())
    persistent = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        persistent.append([item for batch in train for item in zip(*(t.tolist() for t in batch))])
    after_persistent = torch.get_rng_state()
    torch.manual_seed(0)
    plain = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        loader = torch.utils.data.DataLoader(WorkerDraws(), sampler=sampler, batch_size=4, num_workers=2)
        plain.append([item for batch in loader for item in zip(*(t.tolist() for t in batch))])
    assert torch.equal(torch.get_rng_state(), after_persistent)  # the main process's stream advanced alike
    pids = [{item[0] for item in epoch} for epoch in persistent]
    assert len(pids[0]) == 2 and pids[1] == pids[0]  # the same two workers served both epochs
    assert [[item[1:] for item in epoch] for epoch in persistent] == [[item[1:] for item in epoch] for epoch in plain]
    assert persistent[0] != persistent[1]


LOADER_LEFT_ALIVE = """
import sys, torch
sys.path.insert(0, 'tests')
from helpers.image_folders import loaders_of
from test_main import WorkerDraws, loader_args
_, train, _ = loaders_of(loader_args(1), WorkerDraws(), WorkerDraws())
keep = [next(iter(train))]  # a loader alive to the end, its worker waiting for work
print('loaded', flush=True)
"""


def test_a_loader_left_alive_does_not_hold_up_the_exit():
    """Persistent workers ignore SIGTERM (stop signals are the main process's), which the interpreter's exit
    sends the children it finds still running before it waits for them: loaders still alive are closed."""
    import subprocess
    import sys
    p = subprocess.run([sys.executable, '-c', LOADER_LEFT_ALIVE], cwd=os.path.dirname(os.path.dirname(__file__)),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and 'loaded' in p.stdout, p.stderr[-2000:]


def test_no_workers_loads_in_process():
    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    _, train, val = loaders_of(loader_args(0), data, data)
    assert train.num_workers == 0 and not train.persistent_workers
    assert len(list(val)) == 2


# ------------------------------------------------------------------------------------------------ FLOPs
def test_start_of_run_flops_match_the_reference_count():
    # docs/method.md#variants: NALAFORMER_XT, fvcore at 1x3x224x224 in eval mode = 0.652 G
    # (also with the fast attention path)
    m = main.build_model(parse('--model', 'NALAFORMER_XT'), 1000)
    assert count_flops(m, 224) / 1e9 == pytest.approx(0.652, abs=0.001)
    assert m.training  # the count leaves the model as it found it


# ---------------------------------------------------------------------------- SyncBatchNorm, DDP, compile
@pytest.mark.parametrize('compile_, sync_bn', [(False, True), (True, True), (False, False)])
def test_compile_keeps_batchnorm_per_process_and_covers_evaluation(compile_, sync_bn, monkeypatch, capsys):
    """A multi-GPU run converts BatchNorm to SyncBatchNorm (default), except under --compile: dynamo would break
    the graph at every SyncBatchNorm layer; the run says so. --compile also compiles the evaluated module.
    DDP and torch.compile are stood in for (no process group, no compile time)."""
    wrapped, compiled = [], []

    class FakeDDP(torch.nn.Module):
        def __init__(self, module, **kw):
            super().__init__()
            self.module = module
            wrapped.append(module)

    monkeypatch.setattr(torch.nn.parallel, 'DistributedDataParallel', FakeDDP)
    monkeypatch.setattr(torch, 'compile', lambda m: compiled.append(m) or ('compiled', m))
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    train_model, bare, eval_model = distributed.wrap_model(model, torch.device('cuda', 0), distributed=True,
                                                           sync_bn=sync_bn, compile=compile_)
    has_sync = any(isinstance(m, torch.nn.SyncBatchNorm) for m in bare.modules())
    out = capsys.readouterr().out
    assert wrapped == [bare]
    assert has_sync == (sync_bn and not compile_)
    if compile_:
        assert train_model[0] == 'compiled' and isinstance(train_model[1], FakeDDP)
        assert eval_model == ('compiled', bare)
        assert 'BatchNorm: per-process statistics under --compile' in out
    else:
        assert isinstance(train_model, FakeDDP) and eval_model is bare and not compiled
        assert ('SyncBatchNorm across the processes' in out) == sync_bn


# ------------------------------------------------------------------------------------------ evaluation
def _saved(tmp_path, num_classes=4, **entries):
    path = tmp_path / 'ck.pth'
    torch.save({'model': timm.create_model('NALAFORMER_XT', num_classes=num_classes).state_dict(), **entries}, path)
    return str(path)


@pytest.mark.parametrize('argv, recorded, expected, printed', [
    ([], {'input_size': 48, 'eval_crop_ratio': 0.9}, (48, 0.9), '--input-size 48 and --eval-crop-ratio 0.9: as '
                                                                'recorded in CK (pass the flag to choose another)'),
    ([], {'input_size': 384, 'eval_crop_ratio': None}, (384, None), '--input-size 384: as recorded in CK'),
    (['--input-size', '64'], {'input_size': 48, 'eval_crop_ratio': 0.9}, (64, 0.9),
     'Note: --input-size 64 on the command line, 48 in CK; using 64'),
    (['--eval-crop-ratio', '1'], {'input_size': 48, 'eval_crop_ratio': None}, (48, 1.0),
     "Note: --eval-crop-ratio 1.0 on the command line, none (the model's crop_pct) in CK; using 1.0"),
    ([], None, (224, None), ''),           # no checkpoint: the model's size
    ([], {}, (224, None), ''),             # a checkpoint without args (a bare state dict)
    (['--input-size', '96'], None, (96, None), ''),
])
def test_the_eval_transform_is_the_checkpoints_unless_the_command_line_names_one(tmp_path, capsys, argv, recorded,
                                                                                  expected, printed):
    path = _saved(tmp_path, args={'model': 'NALAFORMER_XT', **recorded}) if recorded else \
        _saved(tmp_path) if recorded == {} else ''
    args = parse('--model', 'NALAFORMER_XT', *argv)
    cli.resolve_eval_transform(args, path, checkpoint.recorded_args(path) if path else {})
    cfg = datasets.data_config(args.model, args.input_size, args.eval_crop_ratio)  # main.py's one data config
    assert (cfg['input_size'][-1], args.eval_crop_ratio) == expected
    out = capsys.readouterr().out
    assert printed.replace('CK', path) in out if printed else out == ''


def _eval(tmp_path, classes, saved_classes, capsys):
    """main.run --eval on a val/ folder of `classes` of a 4-class checkpoint recording `saved_classes` (None:
    none recorded); (exit status, stdout, stderr)."""
    from helpers.image_folders import make_folder
    root = make_folder(tmp_path / 'data', classes=classes, n=1, splits=('val',))
    ck = _saved(tmp_path, **({'classes': saved_classes} if saved_classes else {}))
    code = main.run(['--model', 'NALAFORMER_XT', '--input-size', '32', '--batch-size', '4', '--device', 'cpu',
                     '--num_workers', '0', '--no-flops', '--eval', '--resume', ck, '--data-path', root])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_eval_refuses_a_checkpoint_of_other_classes(tmp_path, capsys, one_thread):
    code, out, err = _eval(tmp_path, ('a', 'b', 'c', 'e'), ['a', 'b', 'c', 'd'], capsys)
    assert code == 1 and 'Accuracy' not in out and 'Loaded weights' not in out
    assert err.splitlines() == [f"error: {tmp_path / 'ck.pth'} was trained on other classes than --data-path "
                                f"{tmp_path / 'data'} holds: class 3 is 'd' in the checkpoint but 'e' in the data; "
                                f"evaluate it on the data of that run (here its labels would count as other "
                                f"classes), or fine-tune it on these classes with --finetune {tmp_path / 'ck.pth'}"]


def test_eval_of_a_checkpoint_without_classes_says_so_and_prints_no_training_settings(tmp_path, capsys, one_thread):
    code, out, _ = _eval(tmp_path, ('a', 'b', 'c', 'e'), None, capsys)
    assert code == 0 and 'Accuracy of the network on the 4 test images' in out
    assert (f"Note: {tmp_path / 'ck.pth'} does not record the classes it was trained on (e.g. a reference "
            f"checkpoint), so they are not checked: the accuracy assumes they are these 4 classes, in this order"
            in out)
    for training_only in ('Model EMA', 'LR ', 'schedule', 'Drop path rate', 'Train mode'):
        assert training_only not in out, training_only
    assert 'Evaluation: precision fp32' in out
    code, out, _ = _eval(tmp_path / 'same', ('a', 'b', 'c', 'd'), ['a', 'b', 'c', 'd'], capsys)
    assert code == 0 and 'Accuracy of the network' in out and 'does not record' not in out


# ------------------------------------------------------------------------------------ one validation pass
def test_validation_decodes_each_image_once_per_evaluation_with_an_ema(data, tmp_path, monkeypatch, capsys):
    """The model and its EMA are scored from one pass over the validation set, in a training epoch and in
    --eval: each validation image is opened once per evaluation, and both accuracy lines are printed."""
    import collections

    from PIL import Image
    for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'SLURM_PROCID', 'SLURM_NTASKS'):
        monkeypatch.delenv(k, raising=False)
    opened = collections.Counter()
    real_open = Image.open

    def counted_open(fp, *a, **kw):
        opened[getattr(fp, 'name', fp)] += 1
        return real_open(fp, *a, **kw)
    monkeypatch.setattr(Image, 'open', counted_open)
    out = tmp_path / 'out'
    argv = ['--model', 'NALAFORMER_XT', '--input-size', '32', '--batch-size', '4', '--device', 'cpu', '--num_workers',
            '0', '--no-flops', '--print-freq', '100', '--epochs', '1', '--data-path', data]
    for run in (argv + ['--output_dir', str(out)], argv + ['--eval', '--resume', str(out / 'checkpoint.pth')]):
        opened.clear()
        assert main.run(run) == 0
        val = [n for p, n in opened.items() if f'{os.sep}val{os.sep}' in str(p)]
        assert len(val) == 15 and set(val) == {1}, opened
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith('Accuracy of the')]
    assert [x.split(' on ')[0] for x in lines] == [
        'Accuracy of the network', 'Accuracy of the EMA network',  # the training epoch
        'Accuracy of the network (model)', 'Accuracy of the network (EMA)']  # --eval of its checkpoint
