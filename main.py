"""Train and evaluate NaLaFormer (DeiT-style command line).

    torchrun --nproc_per_node=8 main.py --model NALAFORMER_T --data-path /data/imagenet --output_dir out/t
    python main.py --model NALAFORMER_XT --data-set DIGITS --input-size 64 --device cpu ...
    python main.py --eval --resume out/t/best.pth --model NALAFORMER_T --data-path /data/imagenet --dist-eval

Runs under torchrun (one or several nodes), `python -m torch.distributed.launch --use_env`, SLURM srun
and as a plain process; NCCL on GPUs, gloo on CPUs. See README "Training and evaluation".
"""
import argparse
import datetime
import json
import os
import random
import signal
import sys
import time
import traceback
import warnings

import numpy as np
import torch

import utils
from utils import UserError, CheckpointError

DATASETS = ('CIFAR', 'IMNET', 'INAT', 'INAT19', 'DIGITS')


def str2bool_flag(parser, name, default, help_on, dest=None):
    dest = dest or name.replace('-', '_')
    parser.add_argument(f'--{name}', action='store_true', dest=dest, help=help_on)
    parser.add_argument(f'--no-{name}', action='store_false', dest=dest)
    parser.set_defaults(**{dest: default})


def get_args_parser():
    p = argparse.ArgumentParser('NaLaFormer training and evaluation script', add_help=True)
    p.add_argument('--batch-size', default=128, type=int, help='batch size per process (recipe: 128 x 8)')
    p.add_argument('--epochs', default=300, type=int)
    p.add_argument('--bce-loss', action='store_true')
    p.add_argument('--unscale-lr', action='store_true', help='do not scale --lr by global batch / 512')

    # Model
    p.add_argument('--model', default='NALAFORMER_T', type=str, metavar='MODEL')
    p.add_argument('--input-size', default=224, type=int, help='image size')
    p.add_argument('--drop', type=float, default=0.0, metavar='PCT', help='dropout rate')
    p.add_argument('--drop-path', type=float, default=0.1, metavar='PCT', help='drop path rate')
    str2bool_flag(p, 'model-ema', True, 'keep an EMA of the weights (default on)')
    p.add_argument('--model-ema-decay', type=float, default=0.99996,
                   help='EMA decay at global batch 512; the decay used is this ** (global batch / 512)')
    p.add_argument('--model-ema-force-cpu', action='store_true')

    # Optimizer
    p.add_argument('--opt', default='adamw', type=str, metavar='OPTIMIZER')
    p.add_argument('--opt-eps', default=1e-8, type=float, metavar='EPSILON')
    p.add_argument('--opt-betas', default=None, type=float, nargs='+', metavar='BETA')
    p.add_argument('--clip-grad', type=float, default=None, metavar='NORM')
    p.add_argument('--clip-mode', type=str, default='norm', choices=['norm', 'value', 'agc'])
    p.add_argument('--momentum', type=float, default=0.9, metavar='M')
    p.add_argument('--weight-decay', type=float, default=0.05)

    # Learning rate schedule
    p.add_argument('--sched', default='cosine', type=str, metavar='SCHEDULER')
    p.add_argument('--lr', type=float, default=5e-4, metavar='LR', help='base LR at global batch 512')
    p.add_argument('--lr-noise', type=float, nargs='+', default=None, metavar='pct, pct')
    p.add_argument('--lr-noise-pct', type=float, default=0.67)
    p.add_argument('--lr-noise-std', type=float, default=1.0)
    p.add_argument('--warmup-lr', type=float, default=1e-6)
    p.add_argument('--min-lr', type=float, default=1e-5)
    p.add_argument('--decay-epochs', type=float, default=30)
    p.add_argument('--warmup-epochs', type=int, default=5)
    p.add_argument('--cooldown-epochs', type=int, default=10)
    p.add_argument('--patience-epochs', type=int, default=10)
    p.add_argument('--decay-rate', '--dr', type=float, default=0.1)

    # Augmentation
    p.add_argument('--color-jitter', type=float, default=0.4, metavar='PCT')
    p.add_argument('--aa', type=str, default='rand-m9-mstd0.5-inc1', metavar='NAME')
    p.add_argument('--smoothing', type=float, default=0.1)
    p.add_argument('--train-interpolation', type=str, default='bicubic')
    str2bool_flag(p, 'repeated-aug', True, 'repeated augmentation x3 (RASampler, default on)')
    str2bool_flag(p, 'train-mode', True, 'model.train() while training (default on)')
    p.add_argument('--ThreeAugment', action='store_true')
    p.add_argument('--src', action='store_true')
    p.add_argument('--reprob', type=float, default=0.25, metavar='PCT')
    p.add_argument('--remode', type=str, default='pixel')
    p.add_argument('--recount', type=int, default=1)
    p.add_argument('--resplit', action='store_true', default=False)
    p.add_argument('--mixup', type=float, default=0.8)
    p.add_argument('--cutmix', type=float, default=1.0)
    p.add_argument('--cutmix-minmax', type=float, nargs='+', default=None)
    p.add_argument('--mixup-prob', type=float, default=1.0)
    p.add_argument('--mixup-switch-prob', type=float, default=0.5)
    p.add_argument('--mixup-mode', type=str, default='batch', choices=['batch', 'pair', 'elem'])

    # Distillation
    p.add_argument('--teacher-model', default='regnety_160', type=str, metavar='MODEL')
    p.add_argument('--teacher-path', type=str, default='')
    p.add_argument('--distillation-type', default='none', choices=['none', 'soft', 'hard'], type=str)
    p.add_argument('--distillation-alpha', default=0.5, type=float)
    p.add_argument('--distillation-tau', default=1.0, type=float)
    p.add_argument('--cosub', action='store_true', help='DeiT III cosub (not supported, refused)')

    # Finetuning
    p.add_argument('--finetune', default='', help='start from this checkpoint, re-initialising a mismatched classifier')
    p.add_argument('--attn-only', action='store_true')

    # Data
    p.add_argument('--data-path', default=None, type=str, help='dataset root (DIGITS: ./data/digits)')
    p.add_argument('--data-set', default='IMNET', choices=DATASETS, type=str)
    p.add_argument('--inat-category', default='name',
                   choices=['kingdom', 'phylum', 'class', 'order', 'supercategory', 'family', 'genus', 'name'])
    p.add_argument('--eval-crop-ratio', default=0.875, type=float)
    p.add_argument('--strict-data', action='store_true', help='an undecodable image stops the run')

    # Run
    p.add_argument('--output_dir', '--output-dir', dest='output_dir', default='',
                   help='where checkpoints and log.txt go (empty: save nothing)')
    p.add_argument('--device', default='cuda', help='cuda or cpu (falls back to cpu without a GPU)')
    p.add_argument('--cpu-malloc', choices=['retain', 'system'], default='retain',
                   help='on the CPU, keep freed memory for reuse (retain: much faster steps, the process '
                        'keeps its peak memory) or use glibc as configured (system)')
    p.add_argument('--seed', default=0, type=int)
    p.add_argument('--resume', default='', help='resume from this checkpoint (default: output_dir/checkpoint.pth if present)')
    str2bool_flag(p, 'auto-resume', True, 'resume from output_dir/checkpoint.pth when it exists (default on)')
    p.add_argument('--start_epoch', '--start-epoch', dest='start_epoch', default=0, type=int, metavar='N')
    p.add_argument('--eval', action='store_true', help='evaluation only')
    p.add_argument('--dist-eval', action='store_true', default=False,
                   help='split the validation set over the processes (exact: every image counted once)')
    p.add_argument('--num_workers', '--num-workers', dest='num_workers', default=10, type=int)
    str2bool_flag(p, 'pin-mem', True, 'pin CPU memory in the data loader (GPU runs)', dest='pin_mem')
    p.add_argument('--print-freq', default=10, type=int)
    p.add_argument('--save-freq', default=50, type=int, help='keep a backup checkpoint every N epochs (0: none)')
    p.add_argument('--no-flops', dest='flops', action='store_false', help='skip the fvcore FLOPs count at start')
    p.add_argument('--max-bad-steps', default=20, type=int,
                   help='consecutive non-finite steps skipped before the run stops')

    # Precision and speed
    p.add_argument('--amp', nargs='?', const='fp16', default=None, choices=['fp16', 'bf16'],
                   help='mixed precision: fp16 (with GradScaler, the default of a bare --amp) or bf16')
    p.add_argument('--channels-last', action='store_true')
    p.add_argument('--compile', action='store_true', help='torch.compile the model')
    str2bool_flag(p, 'sync-bn', True, 'SyncBatchNorm in multi-GPU runs (default on)')

    # Distributed
    p.add_argument('--world_size', '--world-size', dest='world_size', default=1, type=int)
    p.add_argument('--dist_url', '--dist-url', dest='dist_url', default='env://')
    p.add_argument('--dist-timeout', default=1800, type=float,
                   help='seconds a collective waits for a silent peer before the run stops')
    p.add_argument('--local_rank', '--local-rank', dest='local_rank', default=None, type=int,
                   help=argparse.SUPPRESS)
    return p


# --------------------------------------------------------------------------------------------------
def known_models():
    import timm
    return sorted(set(timm.list_models('NALAFORMER_*')))


def validate_args(args, parser):
    """Incompatible or impossible flags: argparse-style error before any process group or data loader."""
    import timm
    try:
        import models  # noqa: F401  (registers the NaLaFormer variants)
    except ImportError as e:
        parser.error(f'cannot import the models package: {e}')
    if not timm.is_model(args.model):
        parser.error(f"unknown model '{args.model}'; known NaLaFormer variants: {', '.join(known_models())} "
                     f"(any timm model name also works)")
    if args.distillation_type != 'none':
        if args.finetune and not args.eval:
            parser.error('--distillation-type with --finetune is not supported (DeiT: "Finetuning with distillation not yet supported")')
        if not args.teacher_path:
            parser.error('--distillation-type needs --teacher-path: a local teacher checkpoint (nothing is downloaded)')
        if args.teacher_path.startswith(('http://', 'https://')):
            parser.error('--teacher-path must be a local file: downloading is disabled')
        if not timm.is_model(args.teacher_model):
            parser.error(f"unknown teacher model '{args.teacher_model}'")
    if args.cosub:
        parser.error('--cosub (DeiT III) is not supported by this engine')
    if args.batch_size < 1:
        parser.error(f'--batch-size must be at least 1, got {args.batch_size}')
    _, world, _, _ = utils.launch_env()
    mixup_active = (args.mixup > 0 or args.cutmix > 0 or args.cutmix_minmax is not None) and not args.eval
    if mixup_active and args.mixup_mode in ('batch', 'pair') and args.batch_size % 2:
        parser.error(f'--batch-size {args.batch_size} is odd; mixup/cutmix in {args.mixup_mode} mode needs an even '
                     f'per-process batch (or --mixup 0 --cutmix 0)')
    if args.epochs < 1 and not args.eval:
        parser.error('--epochs must be at least 1')
    if args.input_size < 8:
        parser.error(f'--input-size {args.input_size} is too small')
    for flag, path in (('--resume', args.resume), ('--finetune', args.finetune), ('--teacher-path', args.teacher_path)):
        if path and not path.startswith(('http://', 'https://')) and not os.path.isfile(path):
            parser.error(f'{flag} {path}: no such file')
    if args.resume.startswith(('http://', 'https://')) or args.finetune.startswith(('http://', 'https://')):
        parser.error('checkpoints must be local files: downloading is disabled')
    if args.eval and not args.resume and not args.finetune:
        auto = os.path.join(args.output_dir, 'checkpoint.pth') if args.output_dir else ''
        if not (auto and args.auto_resume and os.path.isfile(auto)):
            parser.error('--eval needs a checkpoint: pass --resume PATH (or an --output_dir holding checkpoint.pth)')
    if args.resume and args.finetune:
        parser.error('--resume and --finetune exclude each other (resume continues a run; finetune starts a new one)')
    if args.save_freq < 0 or args.max_bad_steps < 0:
        parser.error('--save-freq and --max-bad-steps must be >= 0')
    if args.dist_timeout <= 0:
        parser.error('--dist-timeout must be positive')
    if args.compile and not hasattr(torch, 'compile'):
        parser.error('--compile needs torch >= 2.0')
    if args.amp == 'bf16' and str(args.device).startswith('cuda') and torch.cuda.is_available() \
            and not torch.cuda.is_bf16_supported():
        parser.error('--amp bf16: this GPU does not support bfloat16; use --amp fp16')
    if world > 1 and args.world_size not in (1, world):
        parser.error(f'--world_size {args.world_size} disagrees with the launcher ({world} processes)')


def build_model(args, nb_classes):
    """The model with the number of classes, dropout and drop path of the command line."""
    import timm
    import models  # noqa: F401
    return timm.create_model(args.model, pretrained=False, num_classes=nb_classes, drop_rate=args.drop,
                             drop_path_rate=args.drop_path)


def build_lr_scheduler(args, optimizer):
    """timm scheduler stepped per epoch; call `.step(epoch)` at the START of epoch `epoch`, so that
    epoch e runs at the LR of epoch e (warmup from --warmup-lr over --warmup-epochs, then cosine)."""
    from timm.scheduler import create_scheduler_v2
    lr_scheduler, _ = create_scheduler_v2(
        optimizer, sched=args.sched, num_epochs=args.epochs, decay_epochs=args.decay_epochs,
        cooldown_epochs=args.cooldown_epochs, patience_epochs=args.patience_epochs, decay_rate=args.decay_rate,
        min_lr=args.min_lr, warmup_lr=args.warmup_lr, warmup_epochs=args.warmup_epochs, noise=args.lr_noise,
        noise_pct=args.lr_noise_pct, noise_std=args.lr_noise_std, noise_seed=args.seed, step_on_epochs=True)
    return lr_scheduler


def seed_everything(seed):
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def flop_handles():
    """fvcore handles for fused ops it cannot see into (the fast NaLa path, SDPA), from tools/flops.py when
    present; without them fvcore would count fewer FLOPs than the reference model has."""
    try:
        from tools.flops import FAST_PATH_HANDLES
        return dict(FAST_PATH_HANDLES)
    except Exception:  # noqa: BLE001 - an optional refinement
        return {}


def count_flops(model, input_size, device):
    """fvcore FLOPs (multiply-adds) of one image, model in eval mode, warnings silenced."""
    import logging
    logging.getLogger('fvcore').setLevel(logging.ERROR)
    was_training = model.training
    model.eval()
    try:  # fork_rng: counting FLOPs must not change the random stream of the run
        with warnings.catch_warnings(), torch.no_grad(), torch.random.fork_rng(devices=[]):
            warnings.simplefilter('ignore')  # fvcore imports deprecated torch.jit APIs and warns per unsupported op
            from fvcore.nn import FlopCountAnalysis
            x = torch.zeros(1, 3, input_size, input_size, device=device)
            fca = FlopCountAnalysis(model, x).unsupported_ops_warnings(False).uncalled_modules_warnings(False)
            fca.set_op_handle(**flop_handles())
            return fca.total()
    except Exception as e:  # noqa: BLE001 - FLOPs are information only
        print(f'(fvcore FLOP count failed: {utils.first_line(e)})')
        return None
    finally:
        model.train(was_training)


def build_loaders(args, dataset_train, dataset_val):
    import samplers
    world, rank = utils.get_world_size(), utils.get_rank()
    if args.repeated_aug:
        sampler_train = samplers.RASampler(dataset_train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    else:
        # DistributedSampler also for one process: reshuffled (set_epoch) and seeded, so resumable
        sampler_train = torch.utils.data.DistributedSampler(dataset_train, num_replicas=world, rank=rank,
                                                            shuffle=True, seed=args.seed)
    if args.dist_eval and world > 1:
        sampler_val = samplers.DistributedEvalSampler(dataset_val, num_replicas=world, rank=rank)
    else:
        sampler_val = torch.utils.data.SequentialSampler(dataset_val)
    pin = args.pin_mem and str(args.device).startswith('cuda')
    # Workers persist across epochs and evaluations (no re-fork and re-import per epoch); 2 batches in
    # flight per worker suffice, as a batch's augmentation time varies little (docs/performance.md).
    workers = dict(persistent_workers=True, prefetch_factor=2) if args.num_workers > 0 else {}
    common = dict(num_workers=args.num_workers, pin_memory=pin, worker_init_fn=utils.worker_init_fn, **workers)
    loader_train = torch.utils.data.DataLoader(dataset_train, sampler=sampler_train, batch_size=args.batch_size,
                                               drop_last=True, **common)
    loader_val = torch.utils.data.DataLoader(dataset_val, sampler=sampler_val, batch_size=int(1.5 * args.batch_size),
                                             drop_last=False, **common)
    return sampler_train, loader_train, loader_val


def load_model_weights(model, path, model_name, strict_msg=True):
    ckpt = utils.load_checkpoint_file(path)
    sd = utils.checkpoint_state_dict(ckpt, path)
    msg = utils.describe_mismatch(model, sd, model_name, path, candidates=known_models())
    if msg:
        raise CheckpointError(msg)
    model.load_state_dict(sd, strict=True)
    return ckpt


def finetune_from(model, path, model_name):
    ckpt = utils.load_checkpoint_file(path)
    sd = utils.checkpoint_state_dict(ckpt, path)
    own = model.state_dict()
    clf = utils.classifier_keys(model)
    dropped = [k for k in sd if k in own and k in clf and tuple(sd[k].shape) != tuple(own[k].shape)]
    rest = {k: v for k, v in sd.items() if k not in dropped}
    wrong = [k for k in rest if k in own and tuple(rest[k].shape) != tuple(own[k].shape)]
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    if wrong or unexpected or (set(missing) - clf):
        msg = utils.describe_mismatch(model, rest, model_name, path, candidates=known_models())
        raise CheckpointError(msg or f'{path} does not match {model_name}')
    model.load_state_dict(rest, strict=False)
    if dropped:
        shapes = ', '.join(f'{k} {tuple(sd[k].shape)} -> {tuple(own[k].shape)}' for k in dropped)
        print(f'Finetune: loaded {path}; classifier re-initialised (shape differs): {shapes}')
    else:
        print(f'Finetune: loaded {path} (all {len(own)} tensors, classifier kept)')


# --------------------------------------------------------------------------------------------------
def main(args, parser):
    validate_args(args, parser)
    want_cuda = str(args.device).startswith('cuda')
    utils.init_distributed_mode(args)
    stop_flag = utils.StopFlag()
    stop_flag.install()
    if want_cuda and args.device == 'cpu':
        print('No GPU available: running on the CPU')
    device = torch.device(args.device)
    if device.type == 'cpu' and args.cpu_malloc == 'retain' and not utils.retain_freed_cpu_memory():
        print('--cpu-malloc retain: this C library has no mallopt; using its defaults')
    world, rank = utils.get_world_size(), utils.get_rank()
    print(f'Launcher: {args.launcher}, {world} process(es), backend {args.dist_backend or "none"}, device {device}')
    print(json.dumps({k: v for k, v in utils.args_to_dict(args).items()}, default=str))

    import timm
    from timm.data import Mixup
    from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
    from timm.optim import create_optimizer_v2
    from timm.utils import ModelEmaV3
    import datasets
    import engine
    from losses import DistillationLoss

    seed_everything(args.seed + rank)
    if device.type == 'cuda':
        torch.backends.cudnn.benchmark = True

    output_dir = args.output_dir
    if output_dir and utils.is_main_process():
        try:
            os.makedirs(output_dir, exist_ok=True)
        except OSError as e:
            raise UserError(f'cannot create --output_dir {output_dir}: {e.strerror}') from e
        utils.remove_stale_tmp(output_dir)

    # ---------------- data ----------------
    try:
        dataset_train, nb_classes = datasets.build_dataset(is_train=True, args=args)
        dataset_val, nb_val = datasets.build_dataset(is_train=False, args=args)
    except datasets.DataLayoutError as e:
        raise UserError(str(e)) from e
    sampler_train, loader_train, loader_val = build_loaders(args, dataset_train, dataset_val)
    if not args.eval and len(loader_train) == 0:
        raise UserError(f'the training set ({len(dataset_train)} images) gives no full batch of {args.batch_size} '
                        f'per process on {world} process(es); lower --batch-size')
    print(f'Data: {args.data_set}, {len(dataset_train)} train / {len(dataset_val)} val images, {nb_classes} classes')

    mixup_fn = None
    mixup_active = args.mixup > 0 or args.cutmix > 0. or args.cutmix_minmax is not None
    if mixup_active:
        mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, cutmix_minmax=args.cutmix_minmax,
                         prob=args.mixup_prob, switch_prob=args.mixup_switch_prob, mode=args.mixup_mode,
                         label_smoothing=args.smoothing, num_classes=nb_classes)

    # ---------------- model ----------------
    print(f'Creating model: {args.model}')
    model = build_model(args, nb_classes)
    if args.finetune:
        finetune_from(model, args.finetune, args.model)
    if args.attn_only:
        clf = utils.classifier_keys(model)
        for name, p in model.named_parameters():
            p.requires_grad = ('.attn.' in name) or name in clf
    n_parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f'number of params: {n_parameters} ({n_parameters / 1e6:.2f}M)')
    if args.flops and utils.is_main_process():
        flops = count_flops(model, args.input_size, 'cpu')
        if flops is not None:
            print(f'fvcore FLOPs at 1x3x{args.input_size}x{args.input_size}: {flops / 1e9:.3f} G')
    model.to(device)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)

    global_batch = args.batch_size * world
    model_ema = None
    if args.model_ema:
        decay = args.model_ema_decay ** (global_batch / 512.0)
        model_ema = ModelEmaV3(model, decay=decay, device='cpu' if args.model_ema_force_cpu else None)
        print(f'Model EMA: decay {decay:.8g} (= {args.model_ema_decay} ** ({global_batch} / 512))')

    model_without_ddp = model
    if args.distributed:
        if device.type == 'cuda' and args.sync_bn:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
            model_without_ddp = model
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
        model_without_ddp = model.module
    train_model = torch.compile(model) if args.compile else model

    if not args.unscale_lr:
        args.lr = args.lr * global_batch / 512.0
    optimizer = create_optimizer_v2(model_without_ddp, opt=args.opt, lr=args.lr, weight_decay=args.weight_decay,
                                    momentum=args.momentum, eps=args.opt_eps,
                                    **({'betas': tuple(args.opt_betas)} if args.opt_betas else {}))
    lr_scheduler = build_lr_scheduler(args, optimizer)
    amp_dtype = {'fp16': torch.float16, 'bf16': torch.bfloat16}.get(args.amp)
    loss_scaler = torch.amp.GradScaler(device.type) if args.amp == 'fp16' else None
    print(f'LR {args.lr:.3g} (global batch {global_batch}), {args.sched} schedule, warmup {args.warmup_epochs} epochs '
          f'from {args.warmup_lr}, min {args.min_lr}; precision {args.amp or "fp32"}')

    if mixup_active:
        criterion = SoftTargetCrossEntropy()
    elif args.smoothing:
        criterion = LabelSmoothingCrossEntropy(smoothing=args.smoothing)
    else:
        criterion = torch.nn.CrossEntropyLoss()
    if args.bce_loss:
        criterion = torch.nn.BCEWithLogitsLoss()
    teacher_model = None
    if args.distillation_type != 'none':
        teacher_model = timm.create_model(args.teacher_model, pretrained=False, num_classes=nb_classes)
        load_model_weights(teacher_model, args.teacher_path, args.teacher_model)
        teacher_model.to(device).eval()
    criterion = DistillationLoss(criterion, teacher_model, args.distillation_type, args.distillation_alpha,
                                 args.distillation_tau)

    # ---------------- resume ----------------
    max_accuracy = 0.0
    start_epoch, start_step = args.start_epoch, 0
    resume_rng = epoch_rng = loss_meter = None
    resume_path = args.resume
    if not resume_path and args.auto_resume and output_dir and os.path.isfile(os.path.join(output_dir, 'checkpoint.pth')):
        resume_path = os.path.join(output_dir, 'checkpoint.pth')
    if resume_path:
        ckpt = load_model_weights(model_without_ddp, resume_path, args.model)
        print(f'Loaded weights from {resume_path}')
        if not args.eval and isinstance(ckpt, dict) and all(k in ckpt for k in ('optimizer', 'lr_scheduler', 'epoch')):
            try:
                optimizer.load_state_dict(ckpt['optimizer'])
            except (ValueError, KeyError) as e:
                raise CheckpointError(f'the optimizer state in {resume_path} does not fit this run ({utils.first_line(e)}); '
                                      f'were --opt/--attn-only different? use --finetune to start from its weights') from e
            saved, fresh = ckpt['lr_scheduler'], lr_scheduler.state_dict()
            changed = sorted(k for k in fresh if k in saved and saved[k] != fresh[k])
            if changed:  # e.g. a longer --epochs: follow the command line, not the old schedule (DeiT did not)
                print('Note: the LR schedule flags changed since the checkpoint ('
                      + ', '.join(f'{k}: {saved[k]} -> {fresh[k]}' for k in changed[:4]) + '); following the command line')
            else:
                lr_scheduler.load_state_dict(saved)
            if model_ema is not None:
                if 'model_ema' in ckpt:
                    model_ema.module.load_state_dict(ckpt['model_ema'], strict=True)
                else:
                    print('Warning: the checkpoint has no EMA weights; the EMA restarts from the model weights')
                    model_ema.module.load_state_dict(model_without_ddp.state_dict())
            if loss_scaler is not None and ckpt.get('scaler'):
                loss_scaler.load_state_dict(ckpt['scaler'])
            max_accuracy = float(ckpt.get('max_accuracy', 0.0))
            if ckpt.get('step'):
                start_epoch, start_step = int(ckpt['epoch']), int(ckpt['step'])
                loss_meter = ckpt.get('loss_meter')
            else:
                start_epoch = int(ckpt['epoch']) + 1
            rng = ckpt.get('rng_state')
            if isinstance(rng, list) and len(rng) == world:
                resume_rng = rng[rank]
                if start_step:
                    epoch_rng = ckpt['epoch_rng_state'][rank]
                else:
                    utils.set_rng_state(resume_rng)
            else:
                print(f'Note: the checkpoint was written by {len(rng) if isinstance(rng, list) else "an unknown number of"} '
                      f'process(es), this run has {world}: random-number state not restored')
            where = f'epoch {start_epoch} step {start_step}' if start_step else f'epoch {start_epoch}'
            print(f'Resumed from {resume_path}: continuing at {where}, best accuracy so far {max_accuracy:.2f}%')

    def accuracy_line(stats, tag=''):
        line = f"Accuracy of the {tag}network on the {stats['n']} test images: {stats['acc1']:.2f}%"
        if stats['n'] != len(dataset_val) or stats.get('seen', stats['n']) != len(dataset_val):
            line += f" (evaluated {stats['n']} of {len(dataset_val)} images; undecodable ones excluded)"
        return line

    # evaluation uses the bare module: a DDP forward may broadcast buffers, a collective that would hang
    # when ranks get different numbers of validation batches (exact dist-eval does not pad)
    sum_over_ranks = bool(args.dist_eval and args.distributed)
    if not args.eval and start_epoch >= args.epochs:
        print(f'Nothing to train: the checkpoint already finished epoch {start_epoch - 1} of --epochs {args.epochs}; '
              f'evaluating it (raise --epochs to train longer)')
    if args.eval or start_epoch >= args.epochs:
        test_stats = engine.evaluate(loader_val, model_without_ddp, device, amp_dtype, args.channels_last, args.print_freq,
                                     sum_over_ranks=sum_over_ranks)
        print(accuracy_line(test_stats))
        return 0

    # ---------------- train ----------------
    def save(state_epoch, extra, names):
        err = None
        if utils.is_main_process() and output_dir:
            state = {
                'model': model_without_ddp.state_dict(),
                'optimizer': optimizer.state_dict(),
                'lr_scheduler': lr_scheduler.state_dict(),
                'epoch': state_epoch,
                'scaler': loss_scaler.state_dict() if loss_scaler is not None else None,
                'args': utils.args_to_dict(args),
                'max_accuracy': max_accuracy,
                'n_parameters': n_parameters,
            }
            if model_ema is not None:
                state['model_ema'] = model_ema.module.state_dict()
            state.update(extra)
            try:
                for name in names:
                    utils.save_atomic(state, os.path.join(output_dir, name))
            except utils.CheckpointWriteError as e:
                err = e
        if args.distributed:
            failed, = utils.all_reduce_max([1.0 if err else 0.0], device)
            if failed and err is None:
                raise utils.CheckpointWriteError('rank 0 could not write a checkpoint (see its error); stopped')
        if err is not None:
            raise err

    def gather_rng(state):
        if not args.distributed:
            return [state]
        out = [None] * world
        torch.distributed.all_gather_object(out, state)
        return out

    print(f'Start training for {args.epochs} epochs' + (f' (from epoch {start_epoch})' if start_epoch else ''))
    start_time = time.time()
    for epoch in range(start_epoch, args.epochs):
        sampler_train.set_epoch(epoch)
        lr_scheduler.step(epoch)  # epoch e runs at the LR of epoch e (the reference lagged one epoch)
        res = engine.train_one_epoch(
            train_model, criterion, loader_train, optimizer, device, epoch, loss_scaler, amp_dtype,
            args.clip_grad, args.clip_mode, model_ema, mixup_fn, set_training_mode=args.train_mode, args=args,
            stop_flag=stop_flag, start_step=start_step if epoch == start_epoch else 0,
            resume_rng_state=resume_rng if (epoch == start_epoch and start_step) else None,
            epoch_rng_state=epoch_rng if epoch == start_epoch else None,
            loss_meter_state=loss_meter if epoch == start_epoch else None,
            bce_loss=args.bce_loss, channels_last=args.channels_last, print_freq=args.print_freq,
            max_bad_steps=args.max_bad_steps, num_classes=nb_classes, ema_source=model_without_ddp)
        if res.stopped and res.next_step:
            save(epoch, {'step': res.next_step, 'rng_state': gather_rng(res.rng_state),
                         'epoch_rng_state': gather_rng(res.epoch_rng_state), 'loss_meter': res.loss_meter},
                 ['checkpoint.pth'])
            where = os.path.join(output_dir, 'checkpoint.pth') if output_dir else '(no --output_dir: nothing saved)'
            print(f'Stopped by {stop_flag.name() or "a stop signal on another rank"} at epoch {epoch} step '
                  f'{res.next_step}; checkpoint {where}; run the same command again to resume')
            return 128 + int(stop_flag.signum or signal.SIGTERM)
        if args.distributed:
            # BatchNorm running statistics are per-rank (DDP re-broadcasts rank 0's before each forward) and
            # so are the EMA's: make every rank hold rank 0's, as in the checkpoint, before evaluating
            utils.broadcast_tensors_(list(model_without_ddp.buffers()))
            if model_ema is not None:
                utils.broadcast_tensors_(list(model_ema.module.state_dict().values()))
        # distinct files: with repeated augmentation one bad file is read on up to 3 ranks
        bad = datasets.bad_sample_count_all_ranks(dataset_train, device)

        with utils.preserved_rng():  # evaluating leaves the random stream as training left it (exact resume)
            test_stats = engine.evaluate(loader_val, model_without_ddp, device, amp_dtype, args.channels_last,
                                         args.print_freq, sum_over_ranks=sum_over_ranks, stop_flag=stop_flag)
            ema_stats = None
            if model_ema is not None and not test_stats['aborted']:
                ema_stats = engine.evaluate(loader_val, model_ema.module, device, amp_dtype, args.channels_last,
                                            args.print_freq, header='Test (EMA):', sum_over_ranks=sum_over_ranks,
                                            stop_flag=stop_flag)
        # all ranks agree whether the evaluation was cut short and whether to stop after this epoch
        flags = [float(test_stats['aborted'] or bool(ema_stats and ema_stats['aborted'])),
                 float(stop_flag.requested or res.stopped)]
        if args.distributed:
            flags = utils.all_reduce_max(flags, device)
        eval_aborted, stop_now = flags[0] > 0, flags[1] > 0
        improved = False
        if eval_aborted:
            print(f'Evaluation of epoch {epoch} interrupted by {stop_flag.name() or "a stop signal"}: '
                  f'the epoch is saved without its accuracy')
        else:
            print(accuracy_line(test_stats))
            if ema_stats:
                print(accuracy_line(ema_stats, 'EMA '))
            best_now = max(test_stats['acc1'], ema_stats['acc1'] if ema_stats else float('-inf'))
            improved = best_now > max_accuracy
            max_accuracy = max(max_accuracy, best_now)
        print(f'Max accuracy: {max_accuracy:.2f}%' + (f'  (undecodable training images so far: {bad})' if bad else ''))

        names = ['checkpoint.pth']
        if improved:
            names.append('best.pth')
        if args.save_freq and (epoch + 1) % args.save_freq == 0:
            names.append(f'checkpoint_{epoch:04d}.pth')
        save(epoch, {'rng_state': gather_rng(utils.get_rng_state())}, names)

        log_stats = {**{f'train_{k}': v for k, v in res.stats.items()},
                     **({f'test_{k}': v for k, v in test_stats.items() if k != 'aborted'} if not eval_aborted else {}),
                     **({f'test_ema_{k}': v for k, v in ema_stats.items() if k != 'aborted'}
                        if ema_stats and not eval_aborted else {}),
                     'epoch': epoch, 'n_parameters': n_parameters, 'max_accuracy': max_accuracy,
                     'bad_train_images': bad}
        if output_dir and utils.is_main_process():
            utils.write_json_line(os.path.join(output_dir, 'log.txt'), log_stats)
        if stop_now:
            print(f'Stopped by {stop_flag.name() or "a stop signal on another rank"} after epoch {epoch}; '
                  f'checkpoint saved; run the same command again to resume')
            return 128 + int(stop_flag.signum or signal.SIGTERM)

    if args.distributed:  # every rank reports a digest of its weights: DDP keeps them identical
        print(f'[rank {rank}] final weights sha256: {utils.state_digest(model_without_ddp.state_dict())}', force=True)
    total_time = str(datetime.timedelta(seconds=int(time.time() - start_time)))
    print(f'Training time {total_time}')
    print(f'Final top-1: {test_stats["acc1"]:.2f}% (EMA {ema_stats["acc1"]:.2f}%), best {max_accuracy:.2f}%'
          if ema_stats else f'Final top-1: {test_stats["acc1"]:.2f}%, best {max_accuracy:.2f}%')
    return 0


def _is_peer_failure(e):
    import torch.distributed as dist
    if isinstance(e, (getattr(dist, 'DistBackendError', ()), getattr(dist, 'DistNetworkError', ()),
                      getattr(dist, 'DistStoreError', ()))):
        return True
    msg = str(e)
    return isinstance(e, RuntimeError) and utils.is_dist_avail_and_initialized() and any(
        s in msg for s in ('Connection closed by peer', 'Connection reset', 'Broken pipe', 'timed out',
                           'Timed out', 'ProcessGroupGloo', 'gloo', 'NCCL', 'Socket Timeout'))


def run(argv=None):
    # DDP warns once when a depthwise conv's weight gradient comes out channels-last (layout only, harmless)
    warnings.filterwarnings('ignore', message='Grad strides do not match bucket view strides')
    parser = get_args_parser()
    args = parser.parse_args(argv)
    from datasets import BadSampleError
    code = 0
    try:
        code = main(args, parser)
    except UserError as e:
        prefix = f'[rank {utils.get_rank()}] ' if utils.get_world_size() > 1 else ''
        utils.eprint(f'{prefix}error: {e}')
        code = e.exit_code
    except BadSampleError as e:  # --strict-data: raised in a loader worker, re-raised here
        # from a worker, the message is the last line of the worker's traceback
        utils.eprint(f"error: {str(e).strip().splitlines()[-1].split('BadSampleError: ', 1)[-1]}")
        code = 1
    except KeyboardInterrupt:
        utils.eprint('interrupted')
        code = 130
    except Exception as e:  # noqa: BLE001
        if _is_peer_failure(e):
            utils.eprint(f'[rank {utils.get_rank()}] error: lost contact with the other processes '
                         f'({utils.first_line(e)}); another rank probably died or stopped - see its log')
            sys.stdout.flush()
            os._exit(1)  # do not wait in process-group shutdown for a dead peer
        # An unexpected error: show it, then leave at once. Its traceback keeps the data loaders alive,
        # and their workers ignore SIGTERM (so a stop signal reaches only this process), so a normal
        # interpreter exit would wait for them forever. Checkpoints are written atomically: nothing is lost.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if utils.is_dist_avail_and_initialized():
        if code == 0:
            torch.distributed.destroy_process_group()
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return code


if __name__ == '__main__':
    sys.exit(run())
