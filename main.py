"""Train and evaluate NaLaFormer (DeiT-style command line).

    torchrun --nproc_per_node=8 main.py --model NALAFORMER_T --data-path /data/imagenet --output_dir out/t
    python main.py --model NALAFORMER_XT --data-set DIGITS --input-size 64 --device cpu ...
    python main.py --eval --resume out/t/best.pth --model NALAFORMER_T --data-path /data/imagenet --dist-eval

Runs under torchrun (one or several nodes), `python -m torch.distributed.launch --use_env`, SLURM srun
and as a plain process; NCCL on GPUs, gloo on CPUs. See README "Training and evaluation".
"""
import argparse
import copy
import datetime
import json
import os
import sys
import time
import warnings
from typing import Any, Sequence

import timm
import torch

import checkpoint
import cli
import datasets
import distributed
import engine
import eval_sets
import exits
import image_folder
import loaders
import metrics
import optim_step
import run_dir
import utils
from errors import FlagError, UserError, first_line
from models.flops import count_flops
from weights import classifier_keys, finetune_from, load_model_weights, load_weights_into, select_weights


def build_model(args, nb_classes):
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


def wrap_model(args, model, device):
    """(train_model, model_without_ddp, eval_model) for `model` on `device`: SyncBatchNorm and DDP in a
    distributed run, torch.compile with --compile.

    --compile keeps BatchNorm per process: dynamo breaks the compiled graph at every SyncBatchNorm layer (a
    collective inside the forward), which would leave little of the compiled speed; the line printed says so.
    Evaluation runs the bare module (a DDP forward may broadcast buffers, a collective that would hang when
    ranks get different numbers of validation batches), compiled as well with --compile."""
    sync_bn = args.distributed and device.type == 'cuda' and args.sync_bn
    if sync_bn and args.compile:
        sync_bn = False
        print('BatchNorm: per-process statistics under --compile (SyncBatchNorm would break the compiled graph at '
              'every layer); leave out --compile for SyncBatchNorm')
    elif args.distributed and device.type == 'cuda':
        print(f"BatchNorm: {'SyncBatchNorm across the processes' if sync_bn else 'per-process statistics'}")
    if sync_bn:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model_without_ddp = model
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == 'cuda' else None, gradient_as_bucket_view=True)
    if args.compile:
        return torch.compile(model), model_without_ddp, torch.compile(model_without_ddp)
    return model, model_without_ddp, model_without_ddp


def build_criterion(args, mixup_active: bool) -> torch.nn.Module:
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


def accuracy_line(stats: dict, n_images: int, tag: str = '', label: str = '') -> str:
    """The accuracy line of one evaluation of the validation set of `n_images` images."""
    line = f"Accuracy of the {tag}network{label} on the {stats['n']} test images: {stats['acc1']:.2f}%"
    if stats['n'] != n_images or stats.get('seen', stats['n']) != n_images:
        line += f" (evaluated {stats['n']} of {n_images} images; undecodable ones excluded)"
    return line


def evaluate_with_ema(args: argparse.Namespace, loader_val: Any, eval_model: torch.nn.Module, model_ema: Any,
                      eval_ema: torch.nn.Module | None, device: torch.device, amp_dtype: torch.dtype | None,
                      sum_over_ranks: bool, stop_flag: Any) -> tuple[dict, dict | None]:
    """The validation stats of the model and of its EMA (None without one), from one pass over the validation
    set: each batch goes through both. `eval_ema` is the compiled EMA module (--compile), else None; an EMA
    kept on the CPU (--model-ema-force-cpu) is evaluated on `device`, where the data is."""
    if model_ema is None:
        return engine.evaluate(loader_val, eval_model, device, amp_dtype, args.channels_last, args.print_freq,
                               sum_over_ranks=sum_over_ranks, stop_flag=stop_flag), None
    with distributed.moved_to(model_ema.module, device):
        stats = engine.evaluate_models(loader_val, {'': eval_model, 'EMA': eval_ema or model_ema.module}, device,
                                       amp_dtype, args.channels_last, args.print_freq, sum_over_ranks=sum_over_ranks,
                                       stop_flag=stop_flag)
    return stats[''], stats['EMA']


def evaluate_checkpoint(args: argparse.Namespace, ckpt: Any, path: str, model: torch.nn.Module,
                        eval_model: torch.nn.Module, loader_val: Any, extra_sets: Sequence[tuple[str, Any]],
                        real: Any, device: torch.device, amp_dtype: torch.dtype | None, stop_flag: Any) -> int:
    """--eval (or a run with nothing left to train): the accuracy of the loaded weights on the validation set,
    the --eval-sets and ImageNet-ReaL; a checkpoint `ckpt` with an EMA is measured twice, one labelled line per
    set of weights and data set, both from one pass over each set (the EMA weights in a copy of the model).
    `model` is the bare module holding the weights, `eval_model` what runs them (compiled with --compile).
    Returns the exit status (128 + signal when a stop cut it short)."""
    sum_over_ranks = bool(args.dist_eval and args.distributed)
    dataset_val = loader_val.dataset
    runners = {'': eval_model}  # label of the accuracy lines -> the module that runs those weights
    if isinstance(ckpt, dict) and isinstance(ckpt.get('model_ema'), dict):
        ema_model = copy.deepcopy(model)
        load_weights_into(ema_model, select_weights(ckpt, path, 'model_ema')[1], args.model, path)
        runners = {' (model)': eval_model, ' (EMA)': torch.compile(ema_model) if args.compile else ema_model}
    test = engine.evaluate_models(loader_val, runners, device, amp_dtype, args.channels_last, args.print_freq,
                                  sum_over_ranks=sum_over_ranks, stop_flag=stop_flag, real=real)
    first = next(iter(test.values()))
    if first['aborted']:
        print(f'Evaluation stopped by {stop_flag.name() or "a stop signal on another rank"} after '
              f'{first["seen"]} of {len(dataset_val)} images: no accuracy reported')
        return exits.stopped_status(args, stop_flag, saved=False)
    extra = [(name, ds, engine.evaluate_models(  # build_loaders: only its validation loader is used
        loaders.device_loader(loaders.build_loaders(args, ds, ds)[2], args, device), runners, device, amp_dtype,
        args.channels_last, args.print_freq, header=f'{name}:', sum_over_ranks=sum_over_ranks))
        for name, ds in extra_sets]
    for label, test_stats in test.items():
        print(accuracy_line(test_stats, len(dataset_val), label=label))
        for name, ds, stats in extra:
            stats = stats[label]
            print(f"{name}{label}: Acc@1 {stats['acc1']:.2f}% Acc@5 {stats['acc5']:.2f}% "
                  f"on {stats['n']} of {len(ds)} images")
        if real is not None:
            stats = test_stats['real']
            print(f"ImageNet-ReaL{label}: Acc@1 {stats['acc1']:.2f}% Acc@5 {stats['acc5']:.2f}% "
                  f"on {stats['n']} images with a ReaL label")
    best = checkpoint.describe_best(ckpt)
    if best:
        print(f'{path}: {best}' + ('; single-weights loaders (--finetune, timm checkpoint_path=) '
                                   'take the EMA weights' if len(runners) > 1 else ''))
    return 0


# --------------------------------------------------------------------------------------------------
def main(args, parser):
    cli.validate_args(args, parser)
    train_mode = cli.resolve_train_mode(args)
    want_cuda = str(args.device).startswith('cuda')
    distributed.init_distributed_mode(args)
    if args.amp == 'bf16':  # on the process's own GPU, now the current one
        distributed.check_bf16(args.device)
    stop_flag = utils.StopFlag()
    stop_flag.install()
    if want_cuda and args.device == 'cpu':
        print('No GPU available: running on the CPU')
    device = torch.device(args.device)
    if device.type == 'cpu' and args.cpu_malloc == 'retain' and not utils.retain_freed_cpu_memory():
        print('--cpu-malloc retain: this C library has no mallopt; using its defaults')
    world, rank = distributed.get_world_size(), distributed.get_rank()
    print(f'Launcher: {args.launcher}, {world} process(es), backend {args.dist_backend or "none"}, device {device}')
    if args.num_workers is None:
        args.num_workers, why = utils.default_num_workers()
        print(f'Data loader: {args.num_workers} workers per process (the default: {why}; --num_workers N sets it)')
    for note in cli.compatibility_notes(args):
        print(note)
    # before the data: the validation transform is the checkpoint's own unless the command line names one
    resume_path = run_dir.agree_on_resume_path(args, device)  # rank 0 decides, every rank checks its own view
    cli.resolve_eval_transform(args, resume_path)
    print(json.dumps({k: v for k, v in checkpoint.args_to_dict(args).items()}, default=str))

    from timm.data import Mixup
    from timm.utils import distribute_bn, random_seed

    from losses import DistillationLoss

    random_seed(args.seed, rank)  # torch, numpy and python seeded with --seed + rank
    if device.type == 'cuda':
        torch.backends.cudnn.benchmark = True
    optim_step.set_tf32(device, args.tf32)

    output_dir = args.output_dir
    run_dir.prepare_output_dir(args, device)

    # ---------------- data ----------------
    try:
        # evaluation only never lists the training set (train/ may be absent); its classes come from val
        # uint8 images: the loaders normalise them on the device (loaders.DeviceLoader)
        dataset_train, nb_classes = ((None, None) if args.eval else
                                     datasets.build_dataset(is_train=True, args=args, uint8=True))
        dataset_val, nb_val = datasets.build_dataset(is_train=False, args=args, uint8=True)
        nb_classes = nb_val if nb_classes is None else nb_classes
        if (args.eval_sets or args.real_labels is not None) and not args.eval:
            raise UserError('--eval-sets and --real-labels are evaluated only with --eval; add --eval')
        extra_sets = eval_sets.build_eval_sets(args, dataset_val, uint8=True)
        real = None
        if args.real_labels is not None:
            try:
                real = eval_sets.RealLabels(dataset_val, args.real_labels or None)
            except image_folder.DataLayoutError as e:  # the flag does not fit this validation set
                raise FlagError(str(e)) from e
    except image_folder.DataLayoutError as e:
        raise UserError(str(e)) from e
    # with ReaL labels the validation batches carry the sample indices the labels are looked up by
    sampler_train, loader_train, loader_val = loaders.build_loaders(
        args, dataset_train, dataset_val if real is None else eval_sets.WithIndex(dataset_val))
    loader_val = loaders.device_loader(loader_val, args, device)
    if loader_train is not None:
        loader_train = loaders.device_loader(loader_train, args, device)
    if not args.eval and len(loader_train) == 0:
        raise UserError(f'the training set ({len(dataset_train)} images) gives no full batch of {args.batch_size} '
                        f'per process on {world} process(es); lower --batch-size')
    n_train = f'{len(dataset_train)} train / ' if dataset_train is not None else ''
    print(f'Data: {args.data_set}, {n_train}{len(dataset_val)} val images, {nb_classes} classes')
    distributed.check_same_everywhere(loaders.data_facts(dataset_train, dataset_val, loader_train), device,
                                      f'every node must see the same --data-path {args.data_path} (a shared '
                                      f'filesystem or identical copies)')

    mixup_fn = None
    mixup_active = cli.mixup_is_active(args)
    if mixup_active:
        mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, cutmix_minmax=args.cutmix_minmax,
                         prob=args.mixup_prob, switch_prob=args.mixup_switch_prob, mode=args.mixup_mode,
                         label_smoothing=args.smoothing, num_classes=nb_classes)

    # ---------------- model ----------------
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

    global_batch = args.batch_size * world * args.accum_steps  # images per optimizer step
    model_ema = None
    if args.model_ema and not args.eval:  # --eval measures the EMA weights the checkpoint holds
        decay = args.model_ema_decay ** (global_batch / 512.0)
        model_ema = optim_step.ModelEma(model, decay=decay, device='cpu' if args.model_ema_force_cpu else None)
        print(f'Model EMA: decay {decay:.8g} (= {args.model_ema_decay} ** ({global_batch} / 512))')

    train_model, model_without_ddp, eval_model = wrap_model(args, model, device)
    eval_ema = torch.compile(model_ema.module) if args.compile and model_ema is not None else None

    if not args.unscale_lr:
        args.lr = args.lr * global_batch / 512.0
    optimizer = cli.build_optimizer(args, model_without_ddp)
    lr_scheduler = cli.build_lr_scheduler(args, optimizer)
    amp_dtype = {'fp16': torch.float16, 'bf16': torch.bfloat16}.get(args.amp)
    loss_scaler = torch.amp.GradScaler(device.type) if args.amp == 'fp16' else None
    accum = f' = {args.batch_size} x {world} x {args.accum_steps} accumulated' if args.accum_steps > 1 else ''
    tf32 = '+TF32' if args.tf32 and device.type == 'cuda' else ''
    precision = f'precision {args.amp or "fp32"}{tf32}'
    print(f'Evaluation: {precision}' if args.eval else
          f'LR {args.lr:.3g} (global batch {global_batch}{accum}), {args.sched} schedule, warmup '
          f'{args.warmup_epochs} epochs from {args.warmup_lr}, min {args.min_lr}; {precision}')

    criterion = build_criterion(args, mixup_active)
    teacher_model = None
    if args.distillation_type != 'none':
        teacher_model = timm.create_model(args.teacher_model, pretrained=False, num_classes=nb_classes)
        distributed.on_every_rank(lambda: load_model_weights(teacher_model, args.teacher_path, args.teacher_model),
                                  device, f'--teacher-path {args.teacher_path}')
        teacher_model.to(device).eval()
    criterion = DistillationLoss(criterion, teacher_model, args.distillation_type, args.distillation_alpha,
                                 args.distillation_tau)

    # ---------------- resume ----------------
    checkpoints = checkpoint.TrainingCheckpoints(
        args, model_without_ddp, model_ema, optimizer, lr_scheduler, loss_scaler, n_parameters, device,
        # --eval checks the validation set's classes against the checkpoint's, a resume the training set's
        classes=datasets.data_classes(dataset_val if args.eval else dataset_train),
        n_train_images=len(dataset_train) if dataset_train is not None else None)
    resumed = checkpoints.resume(resume_path, eval_only=args.eval)
    start_epoch, state = resumed.start_epoch, resumed.state  # state: a step inside start_epoch, skipped steps
    max_accuracy = checkpoints.max_accuracy
    if not args.eval and start_epoch < args.epochs:  # a full disk stops the run before it says it continues
        run_dir.check_room(output_dir, checkpoints.estimate_bytes(resume_path), device,
                           run_dir.checkpoints_at_peak(args, start_epoch))
    if resumed.message:
        print(resumed.message)

    # evaluation uses the bare module: a DDP forward may broadcast buffers, a collective that would hang
    # when ranks get different numbers of validation batches (exact dist-eval does not pad)
    sum_over_ranks = bool(args.dist_eval and args.distributed)
    if not args.eval and start_epoch >= args.epochs:
        print(f'Nothing to train: the checkpoint already finished epoch {start_epoch - 1} of --epochs {args.epochs}; '
              f'evaluating it (raise --epochs to train longer)')
    if args.eval or start_epoch >= args.epochs:
        return evaluate_checkpoint(args, resumed.ckpt, resume_path, model_without_ddp, eval_model, loader_val,
                                   extra_sets, real, device, amp_dtype, stop_flag)
    resumed.ckpt = None  # the loaded copy of the checkpoint is not needed while training

    # ---------------- train ----------------
    save = checkpoints.save
    step = optim_step.OptimizerStep(optimizer, device, amp_dtype, loss_scaler, args.clip_grad, args.clip_mode,
                                args.accum_steps)
    settings = engine.TrainSettings(channels_last=args.channels_last, print_freq=args.print_freq,
                                    max_bad_steps=args.max_bad_steps, train_mode=args.train_mode)
    random_erasing = loaders.batch_random_erasing(args, device)  # the train transform's, on the device

    tb = metrics.tensorboard_logger(args.log_dir, device)
    print(f'Start training for {args.epochs} epochs' + (f' (from epoch {start_epoch})' if start_epoch else ''))
    start_time = time.time()
    for epoch in range(start_epoch, args.epochs):
        sampler_train.set_epoch(epoch)
        lr_scheduler.step(epoch)  # epoch e runs at the LR of epoch e (the reference lagged one epoch)
        epoch_result = engine.train_one_epoch(train_model, criterion, loader_train, step, epoch, settings, model_ema,
                                              mixup_fn, state, stop_flag, logger=tb, random_erasing=random_erasing)
        state = epoch_result.state
        if epoch_result.stopped and state.step:
            save(epoch, engine.epoch_state_entries(state), ['checkpoint.pth'])
            where = os.path.join(output_dir, 'checkpoint.pth') if output_dir else '(no --output_dir: nothing saved)'
            print(f'Stopped by {stop_flag.name() or "a stop signal on another rank"} at epoch {epoch} step '
                  f'{state.step}; checkpoint {where}; run the same command again to resume')
            return exits.stopped_status(args, stop_flag)
        if args.distributed:
            # BatchNorm running statistics are per-rank (DDP re-broadcasts rank 0's before each forward) and
            # so are the EMA's: make every rank hold rank 0's, as in the checkpoint, before evaluating
            distribute_bn(model_without_ddp, world, reduce=False)
            if model_ema is not None:  # a CPU EMA (--model-ema-force-cpu) goes through the device under NCCL
                distributed.broadcast_tensors_(list(model_ema.module.state_dict().values()), device=device)
        # distinct files: with repeated augmentation one bad file is read on up to 3 ranks
        bad = image_folder.bad_sample_count_all_ranks(dataset_train, device)

        with engine.preserved_rng():  # evaluating leaves the random stream as training left it (exact resume)
            test_stats, ema_stats = evaluate_with_ema(args, loader_val, eval_model, model_ema, eval_ema, device,
                                                      amp_dtype, sum_over_ranks, stop_flag)
        # all ranks agree whether the evaluation was cut short and whether to stop after this epoch
        flags = [float(test_stats['aborted'] or bool(ema_stats and ema_stats['aborted'])),
                 float(stop_flag.requested or epoch_result.stopped)]
        if args.distributed:
            flags = distributed.all_reduce_max(flags, device)
        eval_aborted, stop_now = flags[0] > 0, flags[1] > 0
        improved = False
        if eval_aborted:
            print(f'Evaluation of epoch {epoch} interrupted by {stop_flag.name() or "a stop signal"}: '
                  f'the epoch is saved without its accuracy')
        else:
            print(accuracy_line(test_stats, len(dataset_val)))
            if ema_stats:
                print(accuracy_line(ema_stats, len(dataset_val), 'EMA '))
            improved = checkpoints.record_accuracy(epoch, test_stats['acc1'], ema_stats['acc1'] if ema_stats else None)
            max_accuracy = checkpoints.max_accuracy
        print(f'Max accuracy: {max_accuracy:.2f}%' + (f'  (undecodable training images so far: {bad})' if bad else ''))

        names = ['checkpoint.pth']
        if improved:
            names.append('best.pth')
        if args.save_freq and (epoch + 1) % args.save_freq == 0:
            names.append(f'checkpoint_{epoch:04d}.pth')
        log_stats = {**{f'train_{k}': v for k, v in epoch_result.stats.items()},
                     **({f'test_{k}': v for k, v in test_stats.items() if k != 'aborted'} if not eval_aborted else {}),
                     **({f'test_ema_{k}': v for k, v in ema_stats.items() if k != 'aborted'}
                        if ema_stats and not eval_aborted else {}),
                     'epoch': epoch, 'n_parameters': n_parameters, 'max_accuracy': max_accuracy,
                     'bad_train_images': bad}
        # the epoch's log line travels in the checkpoint: a crash before the append loses nothing
        save(epoch, {**engine.epoch_state_entries(state), 'log': log_stats}, names)
        checkpoints.append_log(log_stats)
        if args.log_dir:
            distributed.on_rank0(lambda s=log_stats, e=epoch: tb.log_epoch(s, e), device,
                                 f'--log-dir {args.log_dir}: cannot write TensorBoard events')
        if stop_now:
            print(f'Stopped by {stop_flag.name() or "a stop signal on another rank"} after epoch {epoch}; '
                  f'checkpoint saved; run the same command again to resume')
            return exits.stopped_status(args, stop_flag)

    if args.distributed:  # every rank reports a digest of its weights: DDP keeps them identical
        digest = distributed.state_digest(model_without_ddp.state_dict())
        print(f'[rank {rank}] final weights sha256: {digest}', force=True)
    total_time = str(datetime.timedelta(seconds=int(time.time() - start_time)))
    print(f'Training time {total_time}')
    print(f'Final top-1: {test_stats["acc1"]:.2f}% (EMA {ema_stats["acc1"]:.2f}%), best {max_accuracy:.2f}%'
          if ema_stats else f'Final top-1: {test_stats["acc1"]:.2f}%, best {max_accuracy:.2f}%')
    return 0


def main_or_clean_up(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """main(); when it fails (an error, or a non-zero exit status) before writing anything into an --output_dir
    it created, that folder is removed again: a run that never started leaves nothing behind."""
    try:
        code = main(args, parser)
    except BaseException:
        run_dir.remove_unused_output_dir(args.output_dir)
        raise
    if code:
        run_dir.remove_unused_output_dir(args.output_dir)
    return code


def run(argv: Sequence[str] | None = None) -> int:
    """main.py's entry point: parse the command line, run main() (removing an --output_dir it created when it
    fails before writing anything), and end as exits.finish says."""
    # DDP warns once when a depthwise conv's weight gradient comes out channels-last (layout only, harmless)
    warnings.filterwarnings('ignore', message='Grad strides do not match bucket view strides')
    parser = cli.get_args_parser()
    args = parser.parse_args(argv)
    return exits.finish(lambda: main_or_clean_up(args, parser), args)


if __name__ == '__main__':
    sys.exit(run())
