"""Train and evaluate NaLaFormer (DeiT-style command line).

    torchrun --nproc_per_node=8 main.py --model NALAFORMER_T --data-path /data/imagenet --output_dir out/t
    python main.py --model NALAFORMER_XT --data-set DIGITS --input-size 64 --device cpu ...
    python main.py --eval --resume out/t/best.pth --model NALAFORMER_T --data-path /data/imagenet --dist-eval

Runs under torchrun (one or several nodes), `python -m torch.distributed.launch --use_env`, SLURM srun
and as a plain process; NCCL on GPUs, gloo on CPUs. See README "Training and evaluation".
"""
import argparse
import copy
import dataclasses
import datetime
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import timm
import torch

import cli
import datasets
import engine
import utils
from losses import DistillationLoss
from models.flop_count import count_flops
from run import checkpoint, distributed, output_dir, process
from run.checkpoint import RunCheckpoints, TrainingParts
from run.errors import FlagError, UserError, first_line
from run.resume import ResumeSettings, check_resumable, epoch_state_entries, resume
from run.weights import classifier_keys, finetune_from, load_model_weights, load_weights_into, select_weights
from training import image_folder, loaders, optim
from training.step import OptimizerStep, amp_dtype, check_bf16, set_tf32


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """A run, as its recipe: the flags checked and the processes joined, the data, the model and what trains it,
    the checkpoint it resumes (or evaluates), then epoch after epoch of training, each ended the same way on every
    rank, and the end. Returns the exit status."""
    device, stop_flag, resume_path, recorded, train_mode = start(args, parser)
    data = build_data(args, device)
    run = build_training(args, data, device, train_mode)
    # --eval checks the validation set's classes against the checkpoint's, a resume the training set's
    checkpoints = RunCheckpoints(
        output_dir=args.output_dir, parts=run.parts, run_args=checkpoint.args_to_dict(args),
        n_parameters=run.n_parameters, device=device, save_freq=args.save_freq,
        classes=datasets.data_classes(data.dataset_val if args.eval else data.dataset_train),
        n_train_images=len(data.dataset_train) if data.dataset_train is not None else None)
    resumed = resume(resume_path, checkpoints, cli.settings(ResumeSettings, args), recorded, eval_only=args.eval,
                     changes=optim.flag_changes(recorded, checkpoints.run_args))
    start_epoch, state = resumed.start_epoch, resumed.state  # state: a step inside start_epoch, skipped steps
    # the epoch before start_epoch, when a stop cut its evaluation short: evaluated and saved before training on
    unevaluated = None if args.eval else resumed.unevaluated
    writes = not args.eval and (start_epoch < args.epochs or unevaluated is not None)
    if writes:  # a full disk stops the run before it says it continues
        checkpoints.check_room(start_epoch, args.epochs, resume_path)
    output = cli.settings(output_dir.OutputDirSettings, args)
    print_lines(resumed.message, output_dir.resume_elsewhere_note(output, resume_path) if writes else '')
    if not args.eval and not writes:
        if not resumed.training:  # weights only: the run would start at --start_epoch
            raise FlagError(nothing_to_train(args, f'{resume_path} holds weights only (no optimizer state or epoch)'))
        print(f'Nothing to train: the checkpoint already finished epoch {start_epoch - 1} of --epochs {args.epochs}; '
              f'evaluating it (raise --epochs to train longer)')
    if not writes:
        return evaluate_checkpoint(args, ckpt=resumed.ckpt, path=resume_path, run=run, data=data, device=device,
                                   stop_flag=stop_flag)
    resumed.ckpt = None  # the loaded copy of the checkpoint is not needed while training

    parts = run.parts
    step = OptimizerStep(parts.optimizer, device, amp_dtype=run.amp_dtype, scaler=parts.loss_scaler,
                         clip_grad=args.clip_grad, clip_mode=args.clip_mode, accum_steps=args.accum_steps)
    settings = engine.TrainSettings(channels_last=args.channels_last, print_freq=args.print_freq,
                                    max_bad_steps=args.max_bad_steps, train_mode=args.train_mode)
    random_erasing = loaders.batch_random_erasing(cli.settings(datasets.Augmentation, args), device)
    tb = utils.tensorboard_logger(args.log_dir, device)
    end_epoch = engine.EpochEnd(
        checkpoints=checkpoints, loader_val=data.loader_val, eval_model=run.eval_model, eval_ema=run.eval_ema,
        dataset_train=data.dataset_train, log_dir=args.log_dir, tensorboard=tb, amp_dtype=run.amp_dtype,
        channels_last=args.channels_last, print_freq=args.print_freq,
        sum_over_ranks=bool(args.dist_eval and args.distributed), stop_flag=stop_flag)
    output_dir.save_args(args.output_dir, checkpoints.run_args, device)
    start_time = time.time()
    test_stats = ema_stats = None
    if unevaluated is not None:
        test_stats, ema_stats, stop_now = end_epoch.evaluate_resumed(start_epoch - 1, unevaluated)
        if stop_now:
            print(f'Stopped by {stop_flag.name() or "a stop signal on another rank"} at the evaluation of epoch '
                  f'{start_epoch - 1}; run the same command again to resume')
            return process.stopped_status(args.launcher, stop_flag)
    if start_epoch < args.epochs:
        print(f'Start training for {args.epochs} epochs' + (f' (from epoch {start_epoch})' if start_epoch else ''))
    for epoch in range(start_epoch, args.epochs):
        data.sampler_train.set_epoch(epoch)
        optim.start_epoch(parts.lr_scheduler, epoch)
        result = engine.train_one_epoch(run.train_model, run.criterion, data.loader_train, step, epoch,
                                        settings=settings, model_ema=parts.model_ema, mixup_fn=data.mixup_fn,
                                        state=state, stop_flag=stop_flag, logger=tb, random_erasing=random_erasing)
        state = result.state
        if result.stopped and state.step:  # inside the epoch: saved where it stopped
            where = checkpoints.save_stop(epoch, epoch_state_entries(state))
            print(f'Stopped by {stop_flag.name() or "a stop signal on another rank"} at epoch {epoch} step '
                  f'{state.step}; checkpoint {where}; run the same command again to resume')
            return process.stopped_status(args.launcher, stop_flag)
        test_stats, ema_stats, stop_now = end_epoch(epoch, result)
        if stop_now:
            print(f'Stopped by {stop_flag.name() or "a stop signal on another rank"} after epoch {epoch}; '
                  f'checkpoint saved; run the same command again to resume')
            return process.stopped_status(args.launcher, stop_flag)
    report_end(parts.model, start_time, test_stats, ema_stats, checkpoints.max_accuracy)
    return 0


# --------------------------------------------------------------------------------------------------
# The start: flags, processes, device, output directory
# --------------------------------------------------------------------------------------------------
def start(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[torch.device, Any, str, dict, str]:
    """Check the flags, join the processes, take the device, install the stop flag, say what runs, seed and
    prepare --output_dir: (device, stop flag, the checkpoint to resume or evaluate ('' for none), the command
    line it records, the train-mode line)."""
    check_command_line(args, parser)
    train_mode = cli.resolve_train_mode(args)
    want_cuda = str(args.device).startswith('cuda')
    launched = distributed.init_distributed_mode(cli.settings(distributed.DistributedSettings, args))
    vars(args).update(dataclasses.asdict(launched))  # rank, world size, launcher, device: recorded in checkpoints
    if args.amp == 'bf16':  # on the process's own GPU, now the current one
        check_bf16(args.device)
    stop_flag = process.StopFlag()
    stop_flag.install()
    if want_cuda and args.device == 'cpu':
        print('No GPU available: running on the CPU')
    device = torch.device(args.device)
    if device.type == 'cpu' and args.cpu_malloc == 'retain' and not process.retain_freed_cpu_memory():
        print('--cpu-malloc retain: this C library has no mallopt; using its defaults')
    print(f'Launcher: {args.launcher}, {distributed.get_world_size()} process(es), backend '
          f'{args.dist_backend or "none"}, device {device}')
    if args.num_workers is None:
        args.num_workers, why = process.default_num_workers()
        print(f'Data loader: {args.num_workers} workers per process (the default: {why}; --num_workers N sets it)')
    print_lines(*cli.compatibility_notes(args), *cli.augmentation_notes(args))
    output = cli.settings(output_dir.OutputDirSettings, args)
    resume_path = output_dir.agree_on_resume_path(output, device)  # rank 0 decides, every rank checks its own view
    check_resumable(resume_path, args.eval)  # a release: weights only, nothing to continue training from
    if not args.eval and not resume_path and args.start_epoch >= args.epochs:
        raise FlagError(nothing_to_train(args, 'there is no checkpoint to resume'))
    # what the checkpoint records decides before anything is built: it must be a classification checkpoint of our
    # --model, its eval transform applies (its command line is read without its weights; a release's model card
    # values); then a batch of the size that gives must fit
    if resume_path:
        checkpoint.refuse_other_task('--resume', resume_path)
    recorded = checkpoint.recorded_args(resume_path) if resume_path else {}
    cli.check_recorded_model(args, resume_path, recorded)
    cli.resolve_eval_transform(args, resume_path, recorded)
    cli.check_batch_fits(args, device)
    print_lines(*start_lines(args, resume_path))
    from timm.utils import random_seed
    random_seed(args.seed, distributed.get_rank())  # torch, numpy and python seeded with --seed + rank
    if device.type == 'cuda':
        torch.backends.cudnn.benchmark = True
    set_tf32(device, args.tf32)
    output_dir.prepare_output_dir(output, device)
    return device, stop_flag, resume_path, recorded, train_mode


def check_command_line(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The command line checked before anything starts, a bad one ending in argparse's two lines (exit 2): the flags
    against each other (cli.validate_args), then the checks that need their owners: --finetune's file is no other
    task's checkpoint, --eval has a checkpoint to evaluate, the optimizer and the LR schedule build, the --aa policy
    parses."""
    cli.validate_args(args, parser)
    if args.finetune and distributed.launch_env()[0] == 0:  # rank 0 reads the file: all ranks would say the same
        try:
            checkpoint.refuse_other_task('--finetune', args.finetune)
        except FlagError as e:
            parser.error(str(e))
    if args.eval and not args.finetune and not output_dir.find_resume_path(
            cli.settings(output_dir.OutputDirSettings, args)):
        parser.error('--eval needs a checkpoint: pass --resume PATH (or an --output_dir holding checkpoint.pth)')
    problem = (optim.optimizer_problem(cli.settings(optim.OptimizerSettings, args))
               or optim.schedule_problem(cli.settings(optim.Schedule, args), args.lr))
    if problem:
        parser.error(problem)
    cli.check_auto_augment(args.aa, parser)


def nothing_to_train(args: argparse.Namespace, why: str) -> str:
    """The refusal of a training run whose --start_epoch is not below --epochs and that resumes no training state
    (`why`, in words): it would evaluate the weights it starts with and pass them off as a trained run's."""
    return (f'--start_epoch {args.start_epoch} is not below --epochs {args.epochs} and {why}: nothing to train; '
            f'lower --start_epoch (the first epoch of a run that starts without a checkpoint) or raise --epochs, '
            f'or evaluate weights with --eval --resume FILE')


def print_lines(*lines: str) -> None:
    """Print each of `lines` that is not empty (notes that apply only sometimes)."""
    for line in filter(None, lines):
        print(line)


def start_lines(args: argparse.Namespace, resume_path: str) -> tuple[str, str]:
    """What the run does, in one line before the data is read (the model, the data, the output directory and
    where the whole command line goes: --output_dir/args.json when training starts), and with --print-args the
    whole command line as one JSON line ('' without)."""
    data = args.data_set + (f' at {args.data_path}' if args.data_path else '')
    where = (f'into {args.output_dir} (every argument: {os.path.join(args.output_dir, output_dir.ARGS_NAME)})'
             if args.output_dir else 'without --output_dir (nothing saved)')
    line = (f'Run: evaluating {resume_path or args.finetune} as {args.model} on {data} (--print-args prints every '
            f'argument)'
            if args.eval else f'Run: training {args.model} on {data} {where}')
    return line, json.dumps(checkpoint.args_to_dict(args), default=str) if args.print_args else ''


# --------------------------------------------------------------------------------------------------
# The data
# --------------------------------------------------------------------------------------------------
@dataclass
class Data:
    """The data of a run: the data config (input size, crop, mean and std, computed once), the data sets (no
    training set with --eval), the extra evaluation sets and ReaL labels (--eval), the loaders (batches
    normalised on the device) and Mixup/CutMix (None when off)."""
    cfg: dict
    dataset_train: Any
    dataset_val: Any
    nb_classes: int
    extra_sets: list
    real: Any
    sampler_train: Any
    loader_train: Any
    loader_val: Any
    mixup_fn: Any


def build_datasets(args: argparse.Namespace, cfg: dict) -> tuple[Any, Any, int, list, Any]:
    """(training set or None with --eval, validation set, classes, extra evaluation sets, ReaL labels or None) of
    the flags, their images as uint8 tensors that the loaders normalise on the device; a layout on disk that does
    not fit ends in one line."""
    source = cli.settings(datasets.DataSource, args)
    try:
        # evaluation only never lists the training set (train/ may be absent); its classes come from val
        val_transform = datasets.build_transform(False, cfg, uint8=True)
        dataset_train, nb_classes = (None, None) if args.eval else datasets.build_dataset(True, source, (
            datasets.build_transform(True, cfg, cli.settings(datasets.Augmentation, args), args.data_set, uint8=True)))
        dataset_val, nb_val = datasets.build_dataset(False, source, val_transform)
        if (args.eval_sets or args.real_labels is not None) and not args.eval:
            raise UserError('--eval-sets and --real-labels are evaluated only with --eval; add --eval')
        extra_sets = datasets.build_eval_sets(args.eval_sets, dataset_val, val_transform, args.strict_data,
                                               args.follow_links)
        real = None
        if args.real_labels is not None:
            try:
                real = datasets.RealLabels(dataset_val, args.real_labels or None)
            except image_folder.DataLayoutError as e:  # the flag does not fit this validation set
                raise FlagError(str(e)) from e
    except image_folder.DataLayoutError as e:
        raise UserError(str(e)) from e
    return dataset_train, dataset_val, nb_val if nb_classes is None else nb_classes, extra_sets, real


def build_data(args: argparse.Namespace, device: torch.device) -> Data:
    """The data config (the model's, with --input-size and --eval-crop-ratio), the data sets of the flags, their
    loaders, and Mixup/CutMix; a training set without a full batch ends in one line. Every rank checks that it
    sees the data of the others."""
    cfg = datasets.data_config(args.model, args.input_size, args.eval_crop_ratio)
    args.input_size = cfg['input_size'][-1]  # recorded in the checkpoints: the size it was trained at
    dataset_train, dataset_val, nb_classes, extra_sets, real = build_datasets(args, cfg)
    # with ReaL labels the validation batches carry the sample indices the labels are looked up by
    sampler_train, loader_train, loader_val = loaders.build_loaders(
        dataset_train, dataset_val if real is None else datasets.WithIndex(dataset_val),
        cli.settings(loaders.LoaderSettings, args))
    loader_val = loaders.device_loader(loader_val, cfg, device)
    if loader_train is not None:
        loader_train = loaders.device_loader(loader_train, cfg, device)
    if not args.eval and len(loader_train) == 0:
        raise UserError(f'the training set ({len(dataset_train)} images) gives no full batch of {args.batch_size} '
                        f'per process on {distributed.get_world_size()} process(es); lower --batch-size')
    if not args.eval:
        cli.check_accum_steps(args, len(loader_train), len(dataset_train))
    n_train = f'{len(dataset_train)} train / ' if dataset_train is not None else ''
    print(f'Data: {args.data_set}, {n_train}{len(dataset_val)} val images, {nb_classes} classes')
    distributed.check_same_everywhere(loaders.data_facts(dataset_train, dataset_val, loader_train), device,
                                      f'every node must see the same --data-path {args.data_path} (a shared '
                                      f'filesystem or identical copies)')
    mixup_fn = None
    if cli.mixup_is_active(args):
        from timm.data import Mixup
        mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, cutmix_minmax=args.cutmix_minmax,
                         prob=args.mixup_prob, switch_prob=args.mixup_switch_prob, mode=args.mixup_mode,
                         label_smoothing=args.smoothing, num_classes=nb_classes)
    return Data(cfg=cfg, dataset_train=dataset_train, dataset_val=dataset_val, nb_classes=nb_classes,
                extra_sets=extra_sets, real=real, sampler_train=sampler_train, loader_train=loader_train,
                loader_val=loader_val, mixup_fn=mixup_fn)


# --------------------------------------------------------------------------------------------------
# The model and what trains it
# --------------------------------------------------------------------------------------------------
def build_model(args: argparse.Namespace, nb_classes: int) -> torch.nn.Module:
    """The model with the number of classes and dropout of the command line; drop path from --drop-path,
    or the variant's own rate when --drop-path is not given; timm's gradient checkpointing with
    --grad-checkpointing."""
    extra = {} if args.drop_path is None else {'drop_path_rate': args.drop_path}
    model = timm.create_model(args.model, pretrained=False, num_classes=nb_classes, drop_rate=args.drop, **extra)
    if getattr(args, 'grad_checkpointing', False):
        try:
            model.set_grad_checkpointing(True)
        except (AttributeError, AssertionError, NotImplementedError) as e:  # timm's models that have none assert
            raise FlagError(f'--grad-checkpointing: {args.model} does not support gradient checkpointing '
                            f'({first_line(e)}); leave out the flag') from e
    return model


def prepare_model(args: argparse.Namespace, nb_classes: int, device: torch.device,
                  train_mode: str = '') -> tuple[torch.nn.Module, int]:
    """The model of the flags on `device`, with --finetune's weights and --attn-only's frozen parameters, and its
    trainable parameter count; its drop path, `train_mode` (cli.resolve_train_mode's line), size and FLOPs
    printed."""
    print(f'Creating model: {args.model}')
    model = build_model(args, nb_classes)
    if not args.eval:  # drop path, EMA, schedule: training only
        rate = max((m.drop_prob for m in model.modules() if hasattr(m, 'drop_prob')), default=0.0)  # the last block
        print(f'Drop path rate: {rate:.3g} ' + ('(--drop-path)' if args.drop_path is not None
                                               else f"({args.model}'s default)"))
        print(f'Train mode: {train_mode}')
    if args.finetune:  # every rank reads the file: one that a node cannot read stops all with one line
        distributed.on_every_rank(lambda: finetune_from(model, args.finetune, args.model), device,
                                  f'--finetune {args.finetune}')
    if args.attn_only:
        clf = classifier_keys(model)
        for name, p in model.named_parameters():
            p.requires_grad = ('.attn.' in name) or name in clf
    n_parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f'number of params: {n_parameters} ({n_parameters / 1e6:.2f}M)')
    if args.flops and distributed.is_main_process():
        try:
            print(f'fvcore FLOPs at 1x3x{args.input_size}x{args.input_size}: '
                  f'{count_flops(model, args.input_size) / 1e9:.3f} G')
        except Exception as e:  # FLOPs are information only
            print(f'(fvcore FLOP count failed: {first_line(e)})')
    model.to(device)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)
    return model, n_parameters


@dataclass
class Training:
    """The model and what trains it: the trained parts (bare model, EMA, optimizer, LR scheduler, fp16 scaler),
    what runs them (DDP-wrapped and/or compiled for training, the bare or compiled module for evaluation, the
    compiled EMA or None), the autocast dtype, the loss (with distillation) and the trainable parameter count."""
    parts: TrainingParts
    train_model: torch.nn.Module
    eval_model: torch.nn.Module
    eval_ema: torch.nn.Module | None
    amp_dtype: torch.dtype | None
    criterion: torch.nn.Module
    n_parameters: int


def build_training(args: argparse.Namespace, data: Data, device: torch.device, train_mode: str) -> Training:
    """The model, its EMA, DDP and compile, the batch-scaled LR, the optimizer and schedule, the precision and the
    loss of the flags, with the lines that say what they are."""
    model, n_parameters = prepare_model(args, data.nb_classes, device, train_mode)
    global_batch = args.batch_size * distributed.get_world_size() * args.accum_steps  # images per optimizer step
    model_ema = None
    if args.model_ema and not args.eval:  # --eval measures the EMA weights the checkpoint holds
        decay = optim.ema_decay(args.model_ema_decay, global_batch)
        model_ema = optim.ModelEma(model, decay=decay, device='cpu' if args.model_ema_force_cpu else None)
        print(f'Model EMA: decay {decay:.8g} (= {args.model_ema_decay} ** ({global_batch} / 512))')
    train_model, bare, eval_model = distributed.wrap_model(model, device, distributed=args.distributed,
                                                           sync_bn=args.sync_bn, compile=args.compile)
    eval_ema = torch.compile(model_ema.module) if args.compile and model_ema is not None else None
    args.lr = optim.scaled_lr(args.lr, global_batch, args.unscale_lr)
    optimizer = optim.build_optimizer(bare, cli.settings(optim.OptimizerSettings, args))
    lr_schedule = cli.settings(optim.Schedule, args)
    lr_scheduler = optim.build_lr_scheduler(optimizer, lr_schedule)
    loss_scaler = torch.amp.GradScaler(device.type) if args.amp == 'fp16' else None
    accum = f' = {args.batch_size} x {distributed.get_world_size()} x {args.accum_steps} accumulated' \
        if args.accum_steps > 1 else ''
    tf32 = '+TF32' if args.tf32 and device.type == 'cuda' else ''
    numbers = f'precision {args.amp or "fp32"}{tf32}'
    print(f'Evaluation: {numbers}' if args.eval else
          f'LR {args.lr:.3g} (global batch {global_batch}{accum}), {args.sched} schedule, warmup '
          f'{args.warmup_epochs} epochs from {args.warmup_lr}, min {args.min_lr}; {numbers}')
    if not args.eval:
        print_lines(optim.lr_floor_note(args.lr, lr_schedule, global_batch, args.unscale_lr),
                    optim.warmup_note(args.lr, lr_schedule))
    criterion = DistillationLoss(build_criterion(args, data.mixup_fn is not None),
                                 build_teacher(args, data.nb_classes, device), args.distillation_type,
                                 args.distillation_alpha, args.distillation_tau)
    parts = TrainingParts(bare, model_ema=model_ema, optimizer=optimizer, lr_scheduler=lr_scheduler,
                          loss_scaler=loss_scaler)
    return Training(parts=parts, train_model=train_model, eval_model=eval_model, eval_ema=eval_ema,
                    amp_dtype=amp_dtype(args.amp), criterion=criterion, n_parameters=n_parameters)


def build_criterion(args: argparse.Namespace, mixup_active: bool) -> torch.nn.Module:
    """The training loss (before distillation): soft-target CE with Mixup/CutMix, label-smoothing CE, or
    with --bce-loss timm's BinaryCrossEntropy. BCE learns Mixup's mixed and smoothed target probabilities as
    they are (label smoothing is already in them); without Mixup the labels are one-hot encoded with
    --smoothing; --bce-target-thresh binarises the targets (1 where target > threshold)."""
    from timm.loss import BinaryCrossEntropy, LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
    if args.bce_loss:
        return BinaryCrossEntropy(smoothing=0.0 if mixup_active else args.smoothing,
                                  target_threshold=args.bce_target_thresh)
    if mixup_active:
        return SoftTargetCrossEntropy()
    if args.smoothing:
        return LabelSmoothingCrossEntropy(smoothing=args.smoothing)
    return torch.nn.CrossEntropyLoss()


def build_teacher(args: argparse.Namespace, nb_classes: int, device: torch.device) -> torch.nn.Module | None:
    """--teacher-model with --teacher-path's weights, on `device` in eval mode, for --distillation-type; None
    without distillation. Every rank reads the file: one that a node cannot read stops all with one line."""
    if args.distillation_type == 'none':
        return None
    teacher = timm.create_model(args.teacher_model, pretrained=False, num_classes=nb_classes)
    distributed.on_every_rank(lambda: load_model_weights(teacher, args.teacher_path, args.teacher_model),
                              device, f'--teacher-path {args.teacher_path}')
    return teacher.to(device).eval()


# --------------------------------------------------------------------------------------------------
# Evaluating a checkpoint, and the end of a run
# --------------------------------------------------------------------------------------------------
def accuracies(stats: dict) -> str:
    """'Acc@1 80.00% Acc@5 95.00%' of evaluation stats (Acc@3 for a 3-class model: engine.topk_key)."""
    key = engine.topk_key(stats)
    return f"Acc@1 {stats['acc1']:.2f}%" + (f' Acc@{key[3:]} {stats[key]:.2f}%' if key else '')


def evaluate_checkpoint(args: argparse.Namespace, *, ckpt: Any, path: str, run: Training, data: Data,
                        device: torch.device, stop_flag: Any) -> int:
    """--eval (or a run with nothing left to train): the accuracy of the loaded weights on the validation set,
    the --eval-sets and ImageNet-ReaL; a checkpoint `ckpt` with an EMA is measured twice, one labelled line per
    set of weights and data set, both from one pass over each set (the EMA weights in a copy of the model).
    Returns the exit status (128 + signal when a stop cut it short)."""
    sum_over_ranks = bool(args.dist_eval and args.distributed)
    dataset_val = data.loader_val.dataset
    runners = {'': run.eval_model}  # label of the accuracy lines -> the module that runs those weights
    if isinstance(ckpt, dict) and isinstance(ckpt.get('model_ema'), dict):
        ema_model = copy.deepcopy(run.parts.model)
        load_weights_into(ema_model, select_weights(ckpt, path, 'model_ema')[1], args.model, path)
        runners = {' (model)': run.eval_model, ' (EMA)': torch.compile(ema_model) if args.compile else ema_model}
    test = engine.evaluate_models(data.loader_val, runners, device, run.amp_dtype, args.channels_last,
                                  args.print_freq, sum_over_ranks=sum_over_ranks, stop_flag=stop_flag, real=data.real)
    first = next(iter(test.values()))
    if first['aborted']:
        print(f'Evaluation stopped by {stop_flag.name() or "a stop signal on another rank"} after '
              f'{first["seen"]} of {len(dataset_val)} images: no accuracy reported')
        return process.stopped_status(args.launcher, stop_flag, saved=False)
    extra = [(name, ds, engine.evaluate_models(
        loaders.device_loader(loaders.build_loaders(None, ds, cli.settings(loaders.LoaderSettings, args))[2],
                              data.cfg, device), runners, device, run.amp_dtype,
        args.channels_last, args.print_freq, header=f'{name}:', sum_over_ranks=sum_over_ranks))
        for name, ds in data.extra_sets]
    for label, test_stats in test.items():
        print(engine.accuracy_line(test_stats, len(dataset_val), label=label))
        for name, ds, stats in extra:
            stats = stats[label]
            print(f"{name}{label}: {accuracies(stats)} on {stats['n']} of {len(ds)} images")
        if data.real is not None:
            stats = test_stats['real']
            print(f"ImageNet-ReaL{label}: {accuracies(stats)} on {stats['n']} images with a ReaL label")
    best = checkpoint.describe_best(ckpt)
    if best:
        print(f'{path}: {best}' + ('; single-weights loaders (--finetune, timm checkpoint_path=) '
                                   'take the EMA weights' if len(runners) > 1 else ''))
    return 0


def report_end(model: torch.nn.Module, start_time: float, test_stats: dict, ema_stats: dict | None,
               max_accuracy: float) -> None:
    """The end of a training run: every rank's digest of its weights under a process group (DDP keeps them
    identical), the training time, the last epoch's accuracy and the best."""
    if distributed.is_dist_avail_and_initialized():
        digest = distributed.state_digest(model.state_dict())
        print(f'[rank {distributed.get_rank()}] final weights sha256: {digest}', force=True)
    print(f'Training time {datetime.timedelta(seconds=int(time.time() - start_time))}')
    print(f'Final top-1: {test_stats["acc1"]:.2f}% (EMA {ema_stats["acc1"]:.2f}%), best {max_accuracy:.2f}%'
          if ema_stats else f'Final top-1: {test_stats["acc1"]:.2f}%, best {max_accuracy:.2f}%')


def run(argv: Sequence[str] | None = None) -> int:
    """main.py's entry point: parse the command line, run main() (removing an --output_dir it created when it ends
    without writing anything there: output_dir.leave_nothing_unused), and end as process.finish says."""
    # DDP warns once when a depthwise conv's weight gradient comes out channels-last (layout only, harmless)
    warnings.filterwarnings('ignore', message='Grad strides do not match bucket view strides')
    parser = cli.get_args_parser()
    args = parser.parse_args(argv)
    return process.finish(lambda: output_dir.leave_nothing_unused(lambda: main(args, parser), args.output_dir),
                          lambda: (args.num_workers, args.batch_size))


if __name__ == '__main__':
    sys.exit(run())
