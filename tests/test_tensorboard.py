"""TensorBoard logging (utils.TensorBoardLogger): the logger writes readable events; the engine calls it once per
optimizer step."""
import importlib.util

import pytest
import timm
import torch
from conftest import optimizer_of, scheduler_of

import cli
import engine
import models  # noqa: F401
import utils
from training.step import OptimizerStep

# tensorboard is optional (requirements-optional.txt, which CI installs)
needs_tensorboard = pytest.mark.skipif(importlib.util.find_spec('tensorboard') is None,
                                       reason='tensorboard is not installed: pip install -r requirements-optional.txt')


def _scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()['scalars']}


@needs_tensorboard
def test_logger_writes_step_and_epoch_scalars(tmp_path):
    log = utils.TensorBoardLogger(str(tmp_path))
    for step in range(10, 14):
        log({'step': step, 'loss': 2.0 - 0.1 * step, 'lr': torch.tensor(1e-3), 'images': 64, 'loss_scale': 65536.0,
             'note': 'skipped'})
    log.log_epoch({'epoch': 1, 'train_loss': 1.2, 'test_acc1': 55.5, 'test_loss': float('nan')}, 1)
    log.close()
    log.close()  # closing twice (atexit after an explicit close) is harmless
    s = _scalars(tmp_path)
    assert [st for st, _ in s['train/loss']] == [10, 11, 12, 13]
    assert [v for _, v in s['train/loss']] == pytest.approx([1.0, 0.9, 0.8, 0.7])
    assert s['train/lr'][0][1] == pytest.approx(1e-3) and s['train/loss_scale'][0][1] == 65536.0
    assert [st for st, _ in s['train/img_per_s']] == [11, 12, 13] and all(v > 0 for _, v in s['train/img_per_s'])
    assert s['epoch/test_acc1'] == [(1, 55.5)] and s['epoch/train_loss'][0][1] == pytest.approx(1.2)
    assert 'epoch/test_loss' not in s and 'train/note' not in s and 'train/images' not in s


@needs_tensorboard
def test_engine_logs_every_step_with_the_head_lr(tmp_path, one_thread):
    torch.manual_seed(0)
    model = timm.create_model('NALAFORMER_XT', num_classes=3)
    args = cli.get_args_parser().parse_args(['--model', 'NALAFORMER_XT', '--lr', '1e-3', '--layer-decay', '0.5',
                                              '--warmup-epochs', '0'])
    optimizer = optimizer_of(args, model)
    scheduler_of(args, optimizer).step(2)  # as main.py does at the start of epoch 2
    head_lr = max(g['lr'] for g in optimizer.param_groups)
    assert min(g['lr'] for g in optimizer.param_groups) < head_lr / 100
    data = torch.utils.data.TensorDataset(torch.randn(6, 3, 32, 32), torch.tensor([0, 1, 2, 0, 1, 2]))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    log = utils.TensorBoardLogger(str(tmp_path))
    crit = lambda s, o, t: torch.nn.functional.cross_entropy(o, t)  # noqa: E731
    res = engine.train_one_epoch(model, crit, loader, OptimizerStep(optimizer, 'cpu'), epoch=2,
                                 settings=engine.TrainSettings(print_freq=100), logger=log)
    log.close()
    s = _scalars(tmp_path)
    assert [st for st, _ in s['train/loss']] == [6, 7, 8]  # global step = epoch x 3 steps + step
    assert [v for _, v in s['train/lr']] == pytest.approx([head_lr] * 3)  # the head's LR, not the stem's
    assert res.stats['lr'] == pytest.approx(head_lr)
    assert len(s['train/img_per_s']) == 2


def test_engine_logs_the_gradient_norm_of_each_step(one_thread):
    torch.manual_seed(0)
    model = timm.create_model('NALAFORMER_XT', num_classes=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 0]))
    logged = []

    def logger(values):  # called after the optimizer step, while the step's gradients are still there
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        logged.append((values['grad_norm'], float(grads.double().norm())))

    engine.train_one_epoch(model, lambda s, o, t: torch.nn.functional.cross_entropy(o, t),
                           torch.utils.data.DataLoader(data, batch_size=2), OptimizerStep(optimizer, 'cpu'),
                           epoch=0, settings=engine.TrainSettings(print_freq=100), logger=logger)
    assert len(logged) == 2
    for got, expected in logged:
        assert got == pytest.approx(expected, rel=1e-5) and got > 0


@needs_tensorboard
def test_engine_logs_the_fp16_loss_scale(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(4, 3, 2, 2), torch.tensor([0, 1, 2, 0]))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    scaler = torch.amp.GradScaler('cpu', init_scale=1024.0)
    log = utils.TensorBoardLogger(str(tmp_path))
    crit = lambda s, o, t: torch.nn.functional.cross_entropy(o, t)  # noqa: E731
    step = OptimizerStep(optimizer, 'cpu', amp_dtype=torch.float16, scaler=scaler)
    engine.train_one_epoch(model, crit, loader, step, epoch=0, settings=engine.TrainSettings(print_freq=100),
                           logger=log)
    log.close()
    assert _scalars(tmp_path)['train/loss_scale'] == [(0, 1024.0), (1, 1024.0)]


@needs_tensorboard
def test_steps_handed_over_together_get_their_img_per_s_from_their_own_times(tmp_path):
    """The engine hands over a progress line's worth of steps at once, each with the time it ran."""
    log = utils.TensorBoardLogger(str(tmp_path))
    for step, t in ((0, 10.0), (1, 10.5), (2, 11.5)):
        log({'step': step, 'time': t, 'loss': 1.0, 'images': 64})
    log.close()
    s = _scalars(tmp_path)
    assert s['train/img_per_s'] == [(1, 128.0), (2, 64.0)] and 'train/time' not in s
