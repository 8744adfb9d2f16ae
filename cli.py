"""main.py's command line: the flags in groups, their types, ranges and choices, the checks of flags against each
other and against the machine's memory (whether one batch of the size fits), and the settings resolved from them
once the run starts (the evaluation transform a checkpoint records, the train mode). It imports nothing that
trains, reads or writes: the checks that need an optimizer, a schedule or a checkpoint built or read are their
owners' (main.check_command_line runs them). Every process of a launched job parses the same command line; a bad
one ends in one error line (and a pointer to --help) before anything starts.
"""
import argparse
import dataclasses
import math
import os
from typing import Any, TypeVar

import timm
import torch

from models.nalaformer import VARIANTS
from run import distributed
from run.errors import CheckpointError, FlagError, FlagParser, first_line, is_url, unknown_model
from run.process import DEFAULT_NUM_WORKERS, available_memory

Settings = TypeVar('Settings')


def ranged(kind=float, lo=None, hi=None, lo_open=False, hi_open=False):
    """argparse `type=`: a finite number of type `kind` within [lo, hi] (an end excluded when `*_open`).
    Out-of-range values end in argparse's `error: argument --flag: ...` (exit 2)."""
    what = 'an integer' if kind is int else 'a number'
    bounds = []
    if lo is not None:
        bounds.append(f"{'>' if lo_open else '>='} {lo}")
    if hi is not None:
        bounds.append(f"{'<' if hi_open else '<='} {hi}")
    expected = what + (' ' + ' and '.join(bounds) if bounds else '')

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f'expected {expected}, got {text!r}') from None
        ok = math.isfinite(value)
        if ok and lo is not None:
            ok = value > lo if lo_open else value >= lo
        if ok and hi is not None:
            ok = value < hi if hi_open else value <= hi
        if not ok:
            raise argparse.ArgumentTypeError(f'expected {expected}, got {text}')
        return value

    return parse


PROBABILITY = ranged(float, 0, 1)
RATE = ranged(float, 0, 1, hi_open=True)  # dropout, drop path, label smoothing, EMA decay: 1 would be degenerate
NON_NEGATIVE = ranged(float, 0)
NON_NEGATIVE_INT = ranged(int, 0)
POSITIVE = ranged(float, 0, lo_open=True)
POSITIVE_INT = ranged(int, 1)
#: the smallest --input-size: the last stage of every variant has stride 32
MIN_INPUT_SIZE = 32
#: --color-jitter's default, DeiT's (which its RandAugment switches off, as here)
COLOR_JITTER = 0.4
#: timm's resize methods for the training crop (timm.data.transforms' names, and 'random')
TRAIN_INTERPOLATIONS = ('bicubic', 'bilinear', 'nearest', 'box', 'hamming', 'lanczos', 'random')
#: the --data-set names datasets.build_dataset knows
DATA_SETS: tuple[str, ...] = ('CIFAR', 'IMNET', 'INAT', 'INAT19', 'DIGITS')
#: the --inat-category choices: the fields of iNaturalist's categories.json a class can be named by
INAT_CATEGORIES: tuple[str, ...] = ('kingdom', 'phylum', 'class', 'order', 'supercategory', 'family', 'genus', 'name')
# the --sched choices: the schedules of timm's create_scheduler_v2 that fit a per-epoch step without a metric:
# 'plateau' needs a validation metric at every step, is deprecated by timm and cannot save its state in a checkpoint
# (a resumed run would restart it); 'none' builds no scheduler at all
SCHEDULERS = ('cosine', 'tanh', 'step', 'constant', 'multistep', 'poly', 'wsd', 'rsqrt')


class LauncherArgumentParser(FlagParser):
    """The two-line flag errors of FlagParser for a launched job: every process of a torchrun or srun job parses
    the same command line, so rank 0 prints the two lines and the others exit silently (status 2)."""

    def error(self, message: str):
        rank, world, _, _ = distributed.launch_env()
        if world > 1 and rank != 0:
            self.exit(2)
        super().error(message)


def get_args_parser() -> LauncherArgumentParser:
    """main.py's command line: DeiT's flags and meanings, in groups as in timm's train.py."""
    p = LauncherArgumentParser(prog='main.py', description='NaLaFormer training and evaluation (DeiT command line)')
    for add_flags in (_training_flags, _model_flags, _optimizer_flags, _learning_rate_schedule_flags,
                      _augmentation_flags, _distillation_flags, _fine_tuning_flags, _data_flags, _run_flags,
                      _precision_and_speed_flags, _distributed_flags, _output_directory_flags):
        add_flags(p)
    compat = p.add_argument_group('compatibility', 'flags of the reference and DeiT command lines, accepted so '
                                                   'that those run; each changes nothing here (a note says why)')
    for flag, (dest, kwargs, why) in COMPATIBILITY_FLAGS.items():
        compat.add_argument(flag, dest=dest, help=why, **kwargs)
    return p


def _training_flags(parser: argparse.ArgumentParser) -> None:
    """The 'Training' flags."""
    g = parser.add_argument_group('Training')
    g.add_argument('--batch-size', default=128, type=POSITIVE_INT, help='batch size per process (recipe: 128 x 8)')
    g.add_argument('--epochs', default=300, type=int)
    g.add_argument('--bce-loss', action='store_true',
                   help='binary cross-entropy on the (mixed, smoothed) soft targets instead of soft-target CE')
    g.add_argument('--bce-target-thresh', type=float, default=None, metavar='T',
                   help='with --bce-loss: binarise the targets at this threshold (1 where target > T)')
    g.add_argument('--accum-steps', type=POSITIVE_INT, default=1, metavar='K',
                   help='accumulate the gradients of K batches per optimizer step (global batch = '
                        'batch x processes x K, for the LR and EMA scaling)')
    g.add_argument('--unscale-lr', action='store_true', help='do not scale --lr by global batch / 512')


def _model_flags(parser: argparse.ArgumentParser) -> None:
    """The 'Model' flags."""
    g = parser.add_argument_group('Model')
    g.add_argument('--model', default='NALAFORMER_T', type=str, metavar='MODEL')
    # None: not given; a checkpoint's recorded size (resolve_eval_transform), else the model's (datasets.data_config)
    g.add_argument('--input-size', default=None, type=ranged(int, MIN_INPUT_SIZE),
                   help="image size (default: 224, the model's; evaluating or resuming a checkpoint: the size "
                        "it records); at least 32, the network's total stride")
    g.add_argument('--drop', type=RATE, default=0.0, metavar='PCT', help='dropout rate')
    g.add_argument('--drop-path', type=RATE, default=None, metavar='PCT',
                   help="drop path (stochastic depth) rate; default: the variant's own rate "
                        "(XT 0.1, T 0.1, S 0.15, B 0.4, L 0.55)")
    g.add_argument('--model-ema', action=argparse.BooleanOptionalAction, default=True,
                   help='keep an EMA of the weights')
    g.add_argument('--model-ema-decay', type=RATE, default=0.99996,
                   help='EMA decay at global batch 512; the decay used is this ** (global batch / 512)')
    g.add_argument('--model-ema-force-cpu', action='store_true')


def _optimizer_flags(parser: argparse.ArgumentParser) -> None:
    """The 'Optimizer' flags."""
    g = parser.add_argument_group('Optimizer')
    g.add_argument('--opt', default='adamw', type=str, metavar='OPTIMIZER')
    g.add_argument('--opt-eps', default=1e-8, type=float, metavar='EPSILON')
    g.add_argument('--opt-betas', default=None, type=float, nargs='+', metavar='BETA')
    g.add_argument('--clip-grad', type=POSITIVE, default=None, metavar='NORM')
    g.add_argument('--clip-mode', type=str, default='norm', choices=['norm', 'value', 'agc'])
    g.add_argument('--momentum', type=float, default=0.9, metavar='M')
    g.add_argument('--weight-decay', type=NON_NEGATIVE, default=0.05)
    g.add_argument('--layer-decay', type=ranged(float, 0, 1, lo_open=True), default=None,
                   help='layer-wise LR decay for fine-tuning: block i of n gets LR x decay^(n - i) (head: x1)')


def _learning_rate_schedule_flags(parser: argparse.ArgumentParser) -> None:
    """The 'Learning rate schedule' flags (training.optim.Schedule holds what they set)."""
    g = parser.add_argument_group('Learning rate schedule')
    g.add_argument('--sched', default='cosine', type=str, choices=SCHEDULERS)
    g.add_argument('--lr', type=POSITIVE, default=5e-4, metavar='LR', help='base LR at global batch 512')
    g.add_argument('--lr-noise', type=float, nargs='+', default=None, metavar='pct, pct')
    g.add_argument('--lr-noise-pct', type=float, default=0.67)
    g.add_argument('--lr-noise-std', type=float, default=1.0)
    g.add_argument('--warmup-lr', type=NON_NEGATIVE, default=1e-6)
    g.add_argument('--min-lr', type=NON_NEGATIVE, default=1e-5)
    g.add_argument('--decay-epochs', type=float, default=30)
    g.add_argument('--warmup-epochs', type=NON_NEGATIVE_INT, default=5)
    g.add_argument('--cooldown-epochs', type=int, default=10)
    g.add_argument('--decay-rate', '--dr', type=float, default=0.1)


def _augmentation_flags(parser: argparse.ArgumentParser) -> None:
    """The 'Augmentation' flags."""
    g = parser.add_argument_group('Augmentation')
    g.add_argument('--color-jitter', type=NON_NEGATIVE, default=COLOR_JITTER, metavar='PCT',
                   help='brightness, contrast and saturation jitter; timm applies it only without --aa (or with '
                        'a 3a policy)')
    g.add_argument('--aa', type=str, default='rand-m9-mstd0.5-inc1', metavar='NAME')
    g.add_argument('--smoothing', type=RATE, default=0.1)
    g.add_argument('--train-interpolation', type=str, default='bicubic', choices=TRAIN_INTERPOLATIONS,
                   help="the training crop's resize (random: bilinear or bicubic at random, per image)")
    g.add_argument('--repeated-aug', action=argparse.BooleanOptionalAction, default=True,
                   help='repeated augmentation x3 (RASampler)')
    g.add_argument('--train-mode', action=argparse.BooleanOptionalAction, default=None,
                   help='model.train() while training (default: on, but off with --finetune, as the '
                        'reference fine-tunes)')
    g.add_argument('--ThreeAugment', action='store_true', help="DeiT III's three-augment (not supported, refused)")
    g.add_argument('--src', action='store_true', help="DeiT III's simple random crop (not supported, refused)")
    g.add_argument('--reprob', type=PROBABILITY, default=0.25, metavar='PCT')
    g.add_argument('--remode', type=str, default='pixel')
    g.add_argument('--recount', type=int, default=1)
    g.add_argument('--mixup', type=NON_NEGATIVE, default=0.8)
    g.add_argument('--cutmix', type=NON_NEGATIVE, default=1.0)
    g.add_argument('--cutmix-minmax', type=PROBABILITY, nargs=2, default=None, metavar=('MIN', 'MAX'),
                   help='CutMix box size range as fractions of the image side (overrides --cutmix alpha)')
    g.add_argument('--mixup-prob', type=PROBABILITY, default=1.0)
    g.add_argument('--mixup-switch-prob', type=PROBABILITY, default=0.5)
    g.add_argument('--mixup-mode', type=str, default='batch', choices=['batch', 'pair', 'elem'])


def _distillation_flags(parser: argparse.ArgumentParser) -> None:
    """The 'Distillation' flags."""
    g = parser.add_argument_group('Distillation')
    g.add_argument('--teacher-model', default='regnety_160', type=str, metavar='MODEL')
    g.add_argument('--teacher-path', type=str, default='')
    g.add_argument('--distillation-type', default='none', choices=['none', 'soft', 'hard'], type=str)
    g.add_argument('--distillation-alpha', default=0.5, type=float)
    g.add_argument('--distillation-tau', default=1.0, type=float)
    g.add_argument('--cosub', action='store_true', help='DeiT III cosub (not supported, refused)')


def _fine_tuning_flags(parser: argparse.ArgumentParser) -> None:
    """The 'Fine-tuning' flags."""
    g = parser.add_argument_group('Fine-tuning')
    g.add_argument('--finetune', default='', help='start from this checkpoint, re-initialising a mismatched classifier')
    g.add_argument('--attn-only', action='store_true')


def _data_flags(parser: argparse.ArgumentParser) -> None:
    """The 'Data' flags."""
    g = parser.add_argument_group('Data')
    g.add_argument('--data-path', default=None, type=str, help='dataset root (DIGITS: ./data/digits)')
    g.add_argument('--data-set', default='IMNET', choices=DATA_SETS, type=str)
    g.add_argument('--inat-category', default='name', choices=INAT_CATEGORIES)
    g.add_argument('--eval-crop-ratio', default=None, type=ranged(float, 0, 1, lo_open=True),
                   help="evaluation: resize to input-size / ratio, then center-crop input-size "
                        "(default: the model's crop_pct, 0.875; evaluating or resuming a checkpoint: the "
                        "ratio it records)")
    g.add_argument('--strict-data', action='store_true', help='an undecodable image stops the run')
    g.add_argument('--follow-links', action='store_true',
                   help='follow directory links inside class folders (never loops)')
    g.add_argument('--eval-sets', nargs='+', default=[], metavar='[NAME=]PATH',
                   help='with --eval, also evaluate these sets '
                        '(class folders, ImageNet-V2 0..999 folders, or flat + label file)')
    g.add_argument('--real-labels', nargs='?', const='', default=None, metavar='REAL_JSON',
                   help="with --eval, also print ImageNet-ReaL accuracy (timm's bundled labels, or this real.json)")


def _run_flags(parser: argparse.ArgumentParser) -> None:
    """The 'Run' flags."""
    g = parser.add_argument_group('Run')
    g.add_argument('--output_dir', '--output-dir', dest='output_dir', default='',
                   help='where checkpoints and log.txt go (empty: save nothing)')
    g.add_argument('--device', default='cuda', help='cuda, cuda:N or cpu (cuda falls back to cpu without a GPU)')
    g.add_argument('--cpu-malloc', choices=['retain', 'system'], default='retain',
                   help='on the CPU, keep freed memory for reuse (retain: much faster steps, the process '
                        'keeps its peak memory) or use glibc as configured (system)')
    g.add_argument('--seed', default=0, type=ranged(int, 0, 2 ** 32 - 1))
    g.add_argument('--resume', default='',
                   help='resume from this checkpoint (default: output_dir/checkpoint.pth if present)')
    g.add_argument('--auto-resume', action=argparse.BooleanOptionalAction, default=True,
                   help='resume from output_dir/checkpoint.pth when it exists')
    g.add_argument('--start_epoch', '--start-epoch', dest='start_epoch', default=0, type=NON_NEGATIVE_INT, metavar='N')
    g.add_argument('--eval', action='store_true', help='evaluation only')
    g.add_argument('--dist-eval', action=argparse.BooleanOptionalAction, default=None,
                   help='split the validation set over the processes (exact: every image counted once); '
                        'default on with several processes, --no-dist-eval: every process evaluates the whole set')
    g.add_argument('--num_workers', '--num-workers', dest='num_workers', default=None, type=NON_NEGATIVE_INT,
                   help=f"data-loader workers per process (default: the CPUs of each process, the node's "
                        f'divided by the processes on it, less one, at most {DEFAULT_NUM_WORKERS}, at least 1)')
    g.add_argument('--pin-mem', action=argparse.BooleanOptionalAction, default=True,
                   help='pin CPU memory in the data loader (GPU runs)')
    g.add_argument('--print-freq', default=10, type=POSITIVE_INT)
    g.add_argument('--log-dir', default='', help='also write TensorBoard events here (rank 0; needs tensorboard)')
    g.add_argument('--save-freq', default=50, type=NON_NEGATIVE_INT,
                   help='keep a backup checkpoint every N epochs (0: none)')
    g.add_argument('--no-flops', dest='flops', action='store_false', help='skip the fvcore FLOPs count at start')
    g.add_argument('--print-args', action='store_true',
                   help='print every argument at start, as JSON (a training run writes them to '
                        '--output_dir/args.json either way)')
    g.add_argument('--max-bad-steps', default=20, type=NON_NEGATIVE_INT,
                   help='consecutive non-finite steps skipped before the run stops')


def _precision_and_speed_flags(parser: argparse.ArgumentParser) -> None:
    """The 'Precision and speed' flags."""
    g = parser.add_argument_group('Precision and speed')
    g.add_argument('--amp', nargs='?', const='fp16', default=None, choices=['fp16', 'bf16'],
                   help='mixed precision: fp16 (with GradScaler, the default of a bare --amp) or bf16')
    g.add_argument('--tf32', action=argparse.BooleanOptionalAction, default=True,
                   help='let fp32 matmuls/convolutions use TF32 on CUDA, as the reference trained '
                        '(--no-tf32: full fp32)')
    g.add_argument('--channels-last', action='store_true')
    g.add_argument('--compile', action='store_true', help='torch.compile the model')
    g.add_argument('--grad-checkpointing', action='store_true',
                   help="recompute each block's activations in the backward instead of keeping them (timm's "
                        'set_grad_checkpointing): less memory, more time per step, for large inputs or batches')
    g.add_argument('--sync-bn', action=argparse.BooleanOptionalAction, default=True,
                   help='SyncBatchNorm in multi-GPU runs')


def _distributed_flags(parser: argparse.ArgumentParser) -> None:
    """The 'Distributed' flags."""
    g = parser.add_argument_group('Distributed')
    g.add_argument('--world_size', '--world-size', dest='world_size', default=1, type=POSITIVE_INT,
                   help='number of processes; set by the launcher (torchrun, srun), checked against it')
    g.add_argument('--dist_url', '--dist-url', dest='dist_url', default='env://')
    g.add_argument('--dist-timeout', default=1800, type=POSITIVE,
                   help='seconds a collective waits for a silent peer before the run stops')
    g.add_argument('--local_rank', '--local-rank', dest='local_rank', default=None, type=int,
                   help=argparse.SUPPRESS)


def _output_directory_flags(parser: argparse.ArgumentParser) -> None:
    """The 'Output directory' flags."""
    g = parser.add_argument_group('Output directory')
    g.add_argument('--overwrite', action='store_true',
                   help='start a new run in an --output_dir that holds one: its checkpoints and log.txt are '
                        'deleted (without it such a run is refused; relaunching without flags resumes it)')
    g.add_argument('--no-lock', dest='lock', action='store_false',
                   help='do not lock --output_dir (by default a second training job in the same directory is '
                        'refused while the first runs; for filesystems whose locks misbehave)')



#: accepted flags that change nothing here: flag -> (dest, argparse settings, why it changes nothing)
COMPATIBILITY_FLAGS = {
    '--resplit': ('resplit', dict(action='store_true'),
                  "random erasing's clean split of timm's --aug-splits, which neither the reference nor DeiT "
                  'implements, so nothing read it there either'),
    '--patience-epochs': ('patience_epochs', dict(type=int, default=None, metavar='N'),
                          "only timm's plateau schedule reads it, and --sched plateau is refused here"),
    '--distributed': ('compat_distributed', dict(action='store_true'),
                      "DeiT's flag, which its init_distributed_mode overwrote too; the launcher (torchrun, "
                      'srun or none) decides'),
}


def compatibility_notes(args: argparse.Namespace) -> list:
    """One note for each flag of COMPATIBILITY_FLAGS the command line gave."""
    return [f'Note: {flag} is accepted but changes nothing here: {why}'
            for flag, (dest, _, why) in COMPATIBILITY_FLAGS.items() if getattr(args, dest) not in (None, False)]


def augmentation_notes(args: argparse.Namespace) -> list:
    """A note when a training run's --color-jitter differs from the default while --aa is on: timm's
    create_transform applies color jitter only without an --aa policy (or with a 3a policy), so it changes nothing."""
    aa = args.aa if args.aa not in (None, '', 'none', 'None') else None
    if args.eval or args.color_jitter == COLOR_JITTER or not aa or '3a' in aa:
        return []
    return [f'Note: --color-jitter {args.color_jitter} changes nothing while --aa {aa} is on (timm jitters colours '
            f'only without --aa, or with a 3a policy); add --aa none to jitter colours instead']


#: the line of --log-dir without TensorBoard installed
INSTALL_HINT = '--log-dir needs TensorBoard, which is not installed: pip install tensorboard'


def tensorboard_missing() -> str | None:
    """None when TensorBoard can be used, else a one-line message that says how to install it."""
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return INSTALL_HINT
    return None


def check_accum_steps(args: argparse.Namespace, batches: int, images: int) -> None:
    """Refuse (FlagError) an --accum-steps above the `batches` an epoch of `images` training images gives each
    process: every optimizer step would then accumulate fewer batches than the global batch its LR and EMA decay
    are scaled for."""
    if args.accum_steps <= batches:
        return
    world = distributed.get_world_size()
    raise FlagError(f'--accum-steps {args.accum_steps} is more than the {batches} batch(es) of an epoch ({images} '
                    f'training images, --batch-size {args.batch_size} on {world} process(es)): every optimizer step '
                    f'would accumulate {batches} (a global batch of {args.batch_size * world * batches}) while the '
                    f'LR and the EMA decay are scaled for {args.accum_steps} (a global batch of '
                    f'{args.batch_size * world * args.accum_steps}); use --accum-steps {batches} or fewer')


def validate_args(args, parser):
    """Incompatible or impossible flags: argparse-style error before any process group or data loader (ranges of
    single flags are their argparse types). The checks that need their owners run after it, in
    main.check_command_line."""
    if not timm.is_model(args.model):
        parser.error(unknown_model(args.model, VARIANTS, timm.list_models()) + ' (any timm model name works too)')
    if args.distillation_type != 'none':
        if args.finetune and not args.eval:
            parser.error('--distillation-type with --finetune is not supported '
                         '(DeiT: "Finetuning with distillation not yet supported")')
        if not args.teacher_path:
            parser.error('--distillation-type needs --teacher-path: a local teacher checkpoint (nothing is downloaded)')
        if not timm.is_model(args.teacher_model):
            parser.error('--teacher-model: ' + unknown_model(args.teacher_model, VARIANTS, timm.list_models()))
    for flag, on in (('--cosub', args.cosub), ('--ThreeAugment', args.ThreeAugment), ('--src', args.src)):
        if on:
            parser.error(f"{flag} (DeiT III) is not supported by this engine (the recipe is DeiT's: --aa)")
    _, world, _, _ = distributed.launch_env()
    if args.dist_eval is None:  # exact, so the default whenever there are several processes
        args.dist_eval = world > 1
    mixup_active = mixup_is_active(args) and not args.eval
    if mixup_active and args.mixup_mode in ('batch', 'pair') and args.batch_size % 2:
        parser.error(f'--batch-size {args.batch_size} is odd; mixup/cutmix in {args.mixup_mode} mode needs an even '
                     f'per-process batch (or --mixup 0 --cutmix 0)')
    if args.epochs < 1 and not args.eval:
        parser.error('--epochs must be at least 1')
    # files: rank 0 checks them here (all ranks would print the same line); a file that another node does not
    # see stops every rank with one line once they load it (output_dir.agree_on_resume_path, on_every_rank)
    rank0 = distributed.launch_env()[0] == 0
    for flag, path in (('--resume', args.resume), ('--finetune', args.finetune), ('--teacher-path', args.teacher_path)):
        if path and rank0 and not os.path.isfile(path):
            parser.error(f'{flag} {path}: ' + ('checkpoints must be local files: downloading is disabled'
                                               if is_url(path) else not_a_file(path)))
    if args.real_labels is not None and args.data_set != 'IMNET':
        parser.error(f'--real-labels: ImageNet-ReaL needs the 1000-class ImageNet validation set (--data-set IMNET), '
                     f'not --data-set {args.data_set}; drop --real-labels')
    if args.resume and args.finetune:
        parser.error('--resume and --finetune exclude each other (resume continues a run; finetune starts a new one)')
    if args.log_dir and tensorboard_missing():
        parser.error(tensorboard_missing())
    if args.compile and not hasattr(torch, 'compile'):
        parser.error('--compile needs torch >= 2.0')
    if args.world_size not in (1, world):  # 1, the default, takes the launcher's count
        parser.error(f'--world_size {args.world_size} disagrees with the launcher ({world} processes)' if world > 1
                     else f'--world_size {args.world_size} without a launcher would run one process; start '
                          f'{args.world_size} with torchrun --nproc_per_node={args.world_size} main.py ... (or srun)')
    if args.bce_target_thresh is not None and not args.bce_loss:
        parser.error('--bce-target-thresh needs --bce-loss')
    if args.seed + world - 1 > 2 ** 32 - 1:  # every rank seeds numpy with --seed + rank
        parser.error(f'--seed {args.seed} + rank exceeds 2**32 - 1 on {world} processes; use a smaller --seed')
    if args.cutmix_minmax is not None and not 0 < args.cutmix_minmax[0] < args.cutmix_minmax[1]:
        parser.error(f'--cutmix-minmax needs 0 < MIN < MAX <= 1, got {args.cutmix_minmax[0]} {args.cutmix_minmax[1]}')
    check_device(args.device, world, parser)


def check_device(device, world, parser):
    """--device: cpu, cuda or cuda:N; an existing GPU index when a GPU is present (a launcher assigns one GPU
    per process itself). cuda without a GPU falls back to the CPU (and says so)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ('cpu', 'cuda'):
        parser.error(f'--device {device!r}: expected cpu, cuda or cuda:N')
    if dev.type == 'cuda' and dev.index is not None and world == 1 and torch.cuda.is_available() \
            and dev.index >= torch.cuda.device_count():
        parser.error(f'--device {device}: this machine has {torch.cuda.device_count()} GPU(s) '
                     f'(cuda:0 .. cuda:{torch.cuda.device_count() - 1})')






def check_auto_augment(aa, parser):
    """--aa through timm's own policy parsers, dispatched on the prefix as timm's create_transform does."""
    from timm.data import auto_augment
    if aa in (None, '', 'none', 'None'):
        return
    build = (auto_augment.rand_augment_transform if aa.startswith('rand') else
             auto_augment.augment_and_mix_transform if aa.startswith('augmix') else auto_augment.auto_augment_transform)
    try:
        build(aa, {})
    except (AssertionError, ValueError, KeyError, IndexError) as e:
        detail = first_line(e) if str(e).strip() else 'not a valid policy string'
        parser.error(f'--aa {aa}: {detail}; use a timm policy such as rand-m9-mstd0.5-inc1, augmix-m5-w4-d2, '
                     f'original, v0, 3a, or none')


def not_a_file(path: str) -> str:
    """Why `path`, which is not a file, cannot be read as a checkpoint: 'no such file', or that it is a directory,
    naming the checkpoints in it (best.pth and checkpoint.pth first)."""
    if not os.path.isdir(path):
        return 'no such file'
    try:
        names = [n for n in os.listdir(path) if n.endswith(('.pth', '.safetensors')) and not n.startswith('.')]
    except OSError:
        names = []
    if not names:
        return 'a directory holding no checkpoint (.pth); pass a checkpoint file'
    names.sort(key=lambda n: (n not in ('best.pth', 'checkpoint.pth'), n))
    shown = ', '.join(os.path.join(path, n) for n in names[:4]) + (', ...' if len(names) > 4 else '')
    return f'a directory, not a checkpoint; pass one of the checkpoints in it: {shown}'






#: the flags that decide the evaluation transform; a checkpoint records them in its args
EVAL_TRANSFORM_FLAGS = ('input_size', 'eval_crop_ratio')


def check_recorded_model(args: argparse.Namespace, path: str, recorded: dict) -> None:
    """Refuse a --model other than the one checkpoint `path` records (`recorded`: its args), in one line, before
    the model is built and its FLOPs counted (seconds for XT, minutes for L); the weights would not load into
    it anyway. A checkpoint that records no model (a bare state dict) is checked when its weights load."""
    saved = recorded.get('model')
    if saved and str(saved).upper() != str(args.model).upper():
        raise CheckpointError(f'{path} is a checkpoint of --model {saved}, but this run has --model {args.model}: '
                              f'pass --model {saved}, or another checkpoint')


def override_note(flag: str, given: Any, recorded: Any, source: str) -> str:
    """The note every entry point prints when a flag of the evaluation transform given on the command line
    differs from the value the checkpoint ``source`` records (the command line wins); '' when they agree or
    one of them is missing."""
    if given is None or recorded is None or given == recorded:
        return ''
    return f'Note: {flag} {given} on the command line, {recorded} in {source}; using {given}'


def resolve_eval_transform(args: argparse.Namespace, path: str, recorded: dict) -> None:
    """--input-size and --eval-crop-ratio (None when not given): the command line's when given, else those the
    checkpoint `path` records in its command line `recorded` (the one --eval measures or a run resumes: evaluated
    as it was trained), else None: the model's (datasets.data_config). A given value that differs from the
    recorded one is printed with both."""
    taken, notes = [], []
    for key in EVAL_TRANSFORM_FLAGS:
        if key not in recorded:
            continue
        flag, given, saved = '--' + key.replace('_', '-'), getattr(args, key), recorded[key]
        try:
            saved = None if saved is None else (int if key == 'input_size' else float)(saved)
        except (TypeError, ValueError):
            continue
        if given is None:
            setattr(args, key, saved)
            if saved is not None:
                taken.append(f'{flag} {saved}')
        else:
            notes.append(override_note(flag, given, "none (the model's crop_pct)" if saved is None else saved, path))
    if taken:
        print(f"{' and '.join(taken)}: as recorded in {path} (pass the flag to choose another)")
    for note in filter(None, notes):
        print(note)


def resolve_train_mode(args: argparse.Namespace) -> str:
    """Set `args.train_mode` when neither --train-mode nor --no-train-mode was given, and say why it is what
    it is. The reference trains with model.train(not finetune): a fine-tune runs in eval mode throughout
    (BatchNorm statistics frozen, drop path and dropout off); a run from scratch in train mode."""
    if args.train_mode is not None:
        return f"{'on' if args.train_mode else 'off'} ({'--train-mode' if args.train_mode else '--no-train-mode'})"
    args.train_mode = not args.finetune
    if args.train_mode:
        return 'on'
    return ('off: --finetune runs in eval mode as the reference does (BatchNorm statistics frozen, no drop path '
            'or dropout); --train-mode trains in train mode')


def mixup_is_active(args: argparse.Namespace) -> bool:
    """Whether training mixes images (Mixup or CutMix): then targets are soft and the batch must be even."""
    return args.mixup > 0 or args.cutmix > 0 or args.cutmix_minmax is not None


def settings(kind: type[Settings], args: argparse.Namespace) -> Settings:
    """The settings object `kind` (a dataclass whose fields are named as flags' argparse destinations) of the
    command line `args`: the one place where the parsed flags are handed to the code below main.py."""
    return kind(**{f.name: getattr(args, f.name) for f in dataclasses.fields(kind)})


# --------------------------------------------------------------------------------------------------
# Whether one batch fits in memory
# --------------------------------------------------------------------------------------------------
#: Lower bounds of a NaLaFormer's activation memory, in fp32, from its widths. A training block keeps at least
#: this many values per token and channel for its backward (measured: 18.5 to 21.3 on the fast path, more on the
#: plain path; docs/training.md, "Sizes and memory"); with --grad-checkpointing it keeps its input alone (1).
BLOCK_SAVED_VALUES = 18
#: ... and the stem keeps at least this many bytes per input pixel per channel of its output (measured: 5.6 to 6.1).
STEM_SAVED_BYTES = 5


def bytes_per_pixel(model: str, training: bool, half: bool = False, recompute: bool = False) -> float | None:
    """A lower bound of the memory one image of NaLaFormer variant `model` takes per input pixel, in bytes:
    training, what the blocks and the stem keep for the backward (`recompute`: the blocks keep only their inputs,
    as with gradient checkpointing, or as a compiler may); evaluation, stage 1's q, k, v, g projection (4 C wide)
    and its input, both alive at once. `half`: autocast to bf16/fp16 (half of fp32's). None for a model that is not
    a NaLaFormer variant (nothing is estimated)."""
    arch = VARIANTS.get(str(model).upper())
    if arch is None:
        return None
    dims, depths = arch['embed_dims'], arch['depths']
    if training:
        per_token = 1 if recompute else BLOCK_SAVED_VALUES
        tokens = sum(depth * dim / (4 * 2 ** i) ** 2 for i, (depth, dim) in enumerate(zip(depths, dims)))
        estimate = 4 * per_token * tokens + STEM_SAVED_BYTES * dims[0]
    else:
        estimate = 4 * (4 + 1) * dims[0] / 4 ** 2
    return estimate / 2 if half else estimate


def device_memory(device: torch.device) -> tuple[int | None, str]:
    """(bytes one process's batch may take at most on `device`, in words): a GPU's total memory; on the CPU
    process.available_memory(). (None, '') where it cannot be read."""
    if device.type == 'cuda':
        if not torch.cuda.is_available():
            return None, ''
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return props.total_memory, f'the {gib(props.total_memory)} of cuda:{index} ({props.name})'
    memory, what = available_memory()
    return memory, f'the {gib(memory)} of {what} of this machine' if memory is not None else ''


def gib(n: float) -> str:
    """A byte count in GiB, or TiB/PiB/EiB when that large: '19.9 GiB'."""
    for unit in ('GiB', 'TiB', 'PiB'):
        if n < 1024 ** 4:
            return f'{n / 2 ** 30:.3g} {unit}'
        n /= 1024
    return f'{n / 2 ** 30:.3g} EiB'


def batch_too_big(*, what: str, model: str, per_pixel: float, pixels: int, batch: int, shape: str, memory: int,
                  memory_words: str) -> str:
    """'' when `batch` images of `pixels` pixels (`shape` in words, e.g. '384x384') at `per_pixel` bytes (a lower
    bound) fit in `memory`, else the part of the error line that says what they need against what there is."""
    need = per_pixel * pixels * batch
    if need <= memory:
        return ''
    return (f'{what} needs at least {gib(need)} ({model}: about {per_pixel:.0f} bytes per pixel of each image, '
            f"{batch} image{'s' if batch > 1 else ''} of {shape}), more than {memory_words}")


def largest_side(per_pixel: float, batch: int, memory: int, multiple: int = MIN_INPUT_SIZE) -> int:
    """The largest square side, a multiple of `multiple`, whose `batch` images fit in `memory` at `per_pixel`
    (0 when not even the smallest does)."""
    side = math.isqrt(int(memory / (per_pixel * batch)))
    return side - side % multiple


def val_batch_size(batch_size: int) -> int:
    """The validation batch of a --batch-size: 1.5 times as large, as DeiT's (evaluation keeps no activations)."""
    return int(1.5 * batch_size)


def model_input_size(model: str) -> int:
    """The input size (one side) of timm model `model` when --input-size is not given: its pretrained_cfg's, timm's
    default for a model without one (datasets.data_config reads the same)."""
    cfg = timm.models.get_pretrained_cfg(model) or timm.models.PretrainedCfg()
    return int(cfg.input_size[-1])


def check_batch_fits(args: argparse.Namespace, device: torch.device) -> None:
    """Refuse, in one line (FlagError), an --input-size at which one training batch (--batch-size) or one
    evaluation batch (val_batch_size) of the model cannot fit in the device's memory, by bytes_per_pixel's
    lower bound, naming the largest size and batch that would: before anything of that size is allocated. Models
    other than the NaLaFormer variants pass."""
    memory, memory_words = device_memory(device)
    half = args.amp is not None
    train = bytes_per_pixel(args.model, training=True, half=half, recompute=args.grad_checkpointing or args.compile)
    if memory is None or train is None:
        return
    size = args.input_size or model_input_size(args.model)
    batches = [] if args.eval else [('one training batch', train, lambda b: b)]
    batches.append(('one evaluation batch', bytes_per_pixel(args.model, training=False, half=half), val_batch_size))
    for what, per_pixel, images in batches:
        problem = batch_too_big(what=f'--input-size {size}: {what} (--batch-size {args.batch_size})',
                                model=args.model, per_pixel=per_pixel, pixels=size * size, shape=f'{size}x{size}',
                                batch=images(args.batch_size), memory=memory, memory_words=memory_words)
        if problem:
            side = largest_side(per_pixel, images(args.batch_size), memory)
            most = int(memory // (per_pixel * size * size))  # images of this size that fit
            batch = next((b for b in range(args.batch_size - 1, 0, -1) if images(b) <= most), 0)
            fixes = ([f'--input-size {side} or less'] if side >= MIN_INPUT_SIZE else []) + (
                [f'--batch-size {batch}'] if batch else [])
            raise FlagError(f"{problem}; use {' or '.join(fixes) or 'a smaller --input-size'}")
