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
import math
import os
import re
import signal
import sys
import time
import traceback
import warnings
from typing import Any, Optional, Sequence, Tuple

import timm
import torch

import checkpoint
import checkpoint_io
import datasets
import distributed
import engine
import eval_sets
import image_folder
import run_dir
import utils
from errors import FlagError, UserError, eprint, exception_chain, first_line
from models.nalaformer import VARIANTS
from weights import classifier_keys, finetune_from, load_model_weights, load_weights_into, select_weights


def add_bool_flag(parser: argparse.ArgumentParser, name: str, default: Optional[bool], help_on: str,
                  dest: Optional[str] = None) -> None:
    """--name / --no-name setting one boolean (the last one given wins), help text on --name."""
    # not timm.utils.add_bool_arg: it makes the pair exclusive (tools/smoke.py appends --model-ema to --no-model-ema)
    dest = dest or name.replace('-', '_')
    parser.add_argument(f'--{name}', action='store_true', dest=dest, help=help_on)
    parser.add_argument(f'--no-{name}', action='store_false', dest=dest)
    parser.set_defaults(**{dest: default})


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

# the schedules of timm's create_scheduler_v2 that fit a per-epoch step without a metric: 'plateau' needs a
# validation metric at every step, is deprecated by timm and cannot save its state in a checkpoint (a resumed
# run would restart it); 'none' builds no scheduler at all
SCHEDULERS = ('cosine', 'tanh', 'step', 'constant', 'multistep', 'poly', 'wsd', 'rsqrt')


class LauncherArgumentParser(argparse.ArgumentParser):
    """argparse whose bad command line ends in two lines instead of the page-long usage: a pointer to --help
    and the error, with the closest flag for a mistyped one (exit status 2, as argparse). Every process of a
    torchrun or srun job parses the same command line: rank 0 prints the two lines, the others exit silently."""

    def error(self, message: str):
        rank, world, _, _ = distributed.launch_env()
        if world > 1 and rank != 0:
            self.exit(2)
        self.exit(2, f'usage: {self.prog} [options]  (--help lists them)\n'
                     f'{self.prog}: error: {message}{self.did_you_mean(message)}\n')

    def did_you_mean(self, message: str) -> str:
        """' (did you mean --output_dir?)' when argparse's 'unrecognized arguments' names a flag close to a known
        one (several: 'did you mean --a for --x, --b for --y?'), else ''."""
        import difflib
        if not message.startswith('unrecognized arguments: '):
            return ''
        known = [s for a in self._actions for s in a.option_strings if s.startswith('--')]
        pairs = []
        for word in message.split(': ', 1)[1].split():
            flag = word.split('=', 1)[0]
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75) if flag.startswith('--') else []
            if close:
                pairs.append((close[0], flag))
        if len(pairs) == 1:
            return f' (did you mean {pairs[0][0]}?)'
        return f" (did you mean {', '.join(f'{a} for {b}' for a, b in pairs)}?)" if pairs else ''


#: data-loader workers per process when --num_workers is not given: enough for a GPU's input pipeline
#: (docs/performance.md), capped by this process's share of the node's CPUs
DEFAULT_NUM_WORKERS = 10


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask: what taskset, cgroups cpusets and SLURM allow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this OS (macOS)
        return os.cpu_count() or 1


def _leading_int(text: str) -> int:
    m = re.match(r'\d+', text or '')
    return int(m.group()) if m else 0


def cpus_per_process() -> Tuple[int, str]:
    """(CPUs this process may count on, how that share was found). The training processes of a node share its
    CPUs: torchrun starts LOCAL_WORLD_SIZE processes that all inherit its CPU set; SLURM gives each srun task
    SLURM_CPUS_PER_TASK CPUs (binding them or not), else the tasks on the node share the step's CPUs."""
    cpus = available_cpus()
    _, _, _, launcher = distributed.launch_env()
    env = os.environ
    if launcher == 'torchrun':
        n = max(1, _leading_int(env.get('LOCAL_WORLD_SIZE', '')) or 1)
        if n > 1:
            return cpus // n, f'the {cpus} CPUs of this process shared by the {n} processes on this node'
    elif launcher == 'slurm':
        per_task = _leading_int(env.get('SLURM_CPUS_PER_TASK', ''))
        if per_task:
            return min(cpus, per_task), f'SLURM_CPUS_PER_TASK={per_task}, {cpus} CPUs available to this process'
        n = max(1, _leading_int(env.get('SLURM_NTASKS_PER_NODE') or env.get('SLURM_STEP_TASKS_PER_NODE')
                                or env.get('SLURM_TASKS_PER_NODE', '')))
        if n > 1:
            return cpus // n, f'the {cpus} CPUs of this process shared by the {n} SLURM tasks on this node'
    return cpus, f'the {cpus} CPUs available to this process'


def default_num_workers() -> Tuple[int, str]:
    """(--num_workers when not given, why): this process's share of the node's CPUs less one for the training
    process itself, at most DEFAULT_NUM_WORKERS and at least 1 (loading then overlaps the step even with a
    single CPU per process; --num_workers 0 loads in the training process). More workers than CPUs only
    compete for them (and PyTorch warns about it)."""
    share, how = cpus_per_process()
    n = max(1, min(DEFAULT_NUM_WORKERS, share - 1))
    return n, (f'{share} CPU(s) per process ({how}), one of them left to the training process; at most '
               f'{DEFAULT_NUM_WORKERS}, at least 1')


def get_args_parser():
    p = LauncherArgumentParser(prog='main.py', description='NaLaFormer training and evaluation (DeiT command line)')
    p.add_argument('--batch-size', default=128, type=POSITIVE_INT, help='batch size per process (recipe: 128 x 8)')
    p.add_argument('--epochs', default=300, type=int)
    p.add_argument('--bce-loss', action='store_true',
                   help="binary cross-entropy on the (mixed, smoothed) soft targets instead of soft-target CE")
    p.add_argument('--bce-target-thresh', type=float, default=None, metavar='T',
                   help='with --bce-loss: binarise the targets at this threshold (1 where target > T)')
    p.add_argument('--accum-steps', type=POSITIVE_INT, default=1, metavar='K',
                   help='accumulate the gradients of K batches per optimizer step (global batch = '
                        'batch x processes x K, for the LR and EMA scaling)')
    p.add_argument('--unscale-lr', action='store_true', help='do not scale --lr by global batch / 512')

    # Model
    p.add_argument('--model', default='NALAFORMER_T', type=str, metavar='MODEL')
    # None: not given; main() sets it (resolve_eval_transform): a checkpoint's recorded size, else the model's
    p.add_argument('--input-size', default=None, type=ranged(int, 8),
                   help="image size (default: 224, the model's; evaluating or resuming a checkpoint: the size "
                        "it records)")
    p.add_argument('--drop', type=RATE, default=0.0, metavar='PCT', help='dropout rate')
    p.add_argument('--drop-path', type=RATE, default=None, metavar='PCT',
                   help="drop path (stochastic depth) rate; default: the variant's own rate "
                        "(XT 0.1, T 0.1, S 0.15, B 0.4, L 0.55)")
    add_bool_flag(p, 'model-ema', True, 'keep an EMA of the weights (default on)')
    p.add_argument('--model-ema-decay', type=RATE, default=0.99996,
                   help='EMA decay at global batch 512; the decay used is this ** (global batch / 512)')
    p.add_argument('--model-ema-force-cpu', action='store_true')

    # Optimizer
    p.add_argument('--opt', default='adamw', type=str, metavar='OPTIMIZER')
    p.add_argument('--opt-eps', default=1e-8, type=float, metavar='EPSILON')
    p.add_argument('--opt-betas', default=None, type=float, nargs='+', metavar='BETA')
    p.add_argument('--clip-grad', type=POSITIVE, default=None, metavar='NORM')
    p.add_argument('--clip-mode', type=str, default='norm', choices=['norm', 'value', 'agc'])
    p.add_argument('--momentum', type=float, default=0.9, metavar='M')
    p.add_argument('--weight-decay', type=NON_NEGATIVE, default=0.05)
    p.add_argument('--layer-decay', type=ranged(float, 0, 1, lo_open=True), default=None,
                   help='layer-wise LR decay for fine-tuning: block i of n gets LR x decay^(n - i) (head: x1)')

    # Learning rate schedule
    p.add_argument('--sched', default='cosine', type=str, choices=SCHEDULERS)
    p.add_argument('--lr', type=POSITIVE, default=5e-4, metavar='LR', help='base LR at global batch 512')
    p.add_argument('--lr-noise', type=float, nargs='+', default=None, metavar='pct, pct')
    p.add_argument('--lr-noise-pct', type=float, default=0.67)
    p.add_argument('--lr-noise-std', type=float, default=1.0)
    p.add_argument('--warmup-lr', type=NON_NEGATIVE, default=1e-6)
    p.add_argument('--min-lr', type=NON_NEGATIVE, default=1e-5)
    p.add_argument('--decay-epochs', type=float, default=30)
    p.add_argument('--warmup-epochs', type=NON_NEGATIVE_INT, default=5)
    p.add_argument('--cooldown-epochs', type=int, default=10)
    p.add_argument('--decay-rate', '--dr', type=float, default=0.1)

    # Augmentation
    p.add_argument('--color-jitter', type=float, default=0.4, metavar='PCT')
    p.add_argument('--aa', type=str, default='rand-m9-mstd0.5-inc1', metavar='NAME')
    p.add_argument('--smoothing', type=RATE, default=0.1)
    p.add_argument('--train-interpolation', type=str, default='bicubic')
    add_bool_flag(p, 'repeated-aug', True, 'repeated augmentation x3 (RASampler, default on)')
    add_bool_flag(p, 'train-mode', None, 'model.train() while training (default: on, but off with --finetune, '
                  'as the reference fine-tunes)')
    p.add_argument('--ThreeAugment', action='store_true', help="DeiT III's three-augment (not supported, refused)")
    p.add_argument('--src', action='store_true', help="DeiT III's simple random crop (not supported, refused)")
    p.add_argument('--reprob', type=PROBABILITY, default=0.25, metavar='PCT')
    p.add_argument('--remode', type=str, default='pixel')
    p.add_argument('--recount', type=int, default=1)
    p.add_argument('--mixup', type=NON_NEGATIVE, default=0.8)
    p.add_argument('--cutmix', type=NON_NEGATIVE, default=1.0)
    p.add_argument('--cutmix-minmax', type=PROBABILITY, nargs=2, default=None, metavar=('MIN', 'MAX'),
                   help='CutMix box size range as fractions of the image side (overrides --cutmix alpha)')
    p.add_argument('--mixup-prob', type=PROBABILITY, default=1.0)
    p.add_argument('--mixup-switch-prob', type=PROBABILITY, default=0.5)
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
    p.add_argument('--data-set', default='IMNET', choices=datasets.DATA_SETS, type=str)
    p.add_argument('--inat-category', default='name', choices=datasets.INAT_CATEGORIES)
    p.add_argument('--eval-crop-ratio', default=None, type=ranged(float, 0, 1, lo_open=True),
                   help="evaluation: resize to input-size / ratio, then center-crop input-size "
                        "(default: the model's crop_pct, 0.875; evaluating or resuming a checkpoint: the "
                        "ratio it records)")
    p.add_argument('--strict-data', action='store_true', help='an undecodable image stops the run')
    p.add_argument('--follow-links', action='store_true',
                   help='follow directory links inside class folders (never loops)')
    p.add_argument('--eval-sets', nargs='+', default=[], metavar='[NAME=]PATH',
                   help='with --eval, also evaluate these sets '
                        '(class folders, ImageNet-V2 0..999 folders, or flat + label file)')
    p.add_argument('--real-labels', nargs='?', const='', default=None, metavar='REAL_JSON',
                   help="with --eval, also print ImageNet-ReaL accuracy (timm's bundled labels, or this real.json)")

    # Run
    p.add_argument('--output_dir', '--output-dir', dest='output_dir', default='',
                   help='where checkpoints and log.txt go (empty: save nothing)')
    p.add_argument('--device', default='cuda', help='cuda, cuda:N or cpu (cuda falls back to cpu without a GPU)')
    p.add_argument('--cpu-malloc', choices=['retain', 'system'], default='retain',
                   help='on the CPU, keep freed memory for reuse (retain: much faster steps, the process '
                        'keeps its peak memory) or use glibc as configured (system)')
    p.add_argument('--seed', default=0, type=ranged(int, 0, 2 ** 32 - 1))
    p.add_argument('--resume', default='',
                   help='resume from this checkpoint (default: output_dir/checkpoint.pth if present)')
    add_bool_flag(p, 'auto-resume', True, 'resume from output_dir/checkpoint.pth when it exists (default on)')
    p.add_argument('--start_epoch', '--start-epoch', dest='start_epoch', default=0, type=NON_NEGATIVE_INT, metavar='N')
    p.add_argument('--eval', action='store_true', help='evaluation only')
    add_bool_flag(p, 'dist-eval', None, 'split the validation set over the processes (exact: every image counted '
                                        'once); default on with several processes, --no-dist-eval: every process '
                                        'evaluates the whole set')
    p.add_argument('--num_workers', '--num-workers', dest='num_workers', default=None, type=NON_NEGATIVE_INT,
                   help=f'data-loader workers per process (default: the CPUs of each process, the node\'s '
                        f'divided by the processes on it, less one, at most {DEFAULT_NUM_WORKERS}, at least 1)')
    add_bool_flag(p, 'pin-mem', True, 'pin CPU memory in the data loader (GPU runs)', dest='pin_mem')
    p.add_argument('--print-freq', default=10, type=POSITIVE_INT)
    p.add_argument('--log-dir', default='', help='also write TensorBoard events here (rank 0; needs tensorboard)')
    p.add_argument('--save-freq', default=50, type=NON_NEGATIVE_INT,
                   help='keep a backup checkpoint every N epochs (0: none)')
    p.add_argument('--no-flops', dest='flops', action='store_false', help='skip the fvcore FLOPs count at start')
    p.add_argument('--max-bad-steps', default=20, type=NON_NEGATIVE_INT,
                   help='consecutive non-finite steps skipped before the run stops')

    # Precision and speed
    p.add_argument('--amp', nargs='?', const='fp16', default=None, choices=['fp16', 'bf16'],
                   help='mixed precision: fp16 (with GradScaler, the default of a bare --amp) or bf16')
    add_bool_flag(p, 'tf32', True, 'let fp32 matmuls/convolutions use TF32 on CUDA, as the reference '
                                   'trained (default on; --no-tf32: full fp32)')
    p.add_argument('--channels-last', action='store_true')
    p.add_argument('--compile', action='store_true', help='torch.compile the model')
    add_bool_flag(p, 'sync-bn', True, 'SyncBatchNorm in multi-GPU runs (default on)')

    # Distributed
    p.add_argument('--world_size', '--world-size', dest='world_size', default=1, type=POSITIVE_INT,
                   help='number of processes; set by the launcher (torchrun, srun), checked against it')
    p.add_argument('--dist_url', '--dist-url', dest='dist_url', default='env://')
    p.add_argument('--dist-timeout', default=1800, type=POSITIVE,
                   help='seconds a collective waits for a silent peer before the run stops')
    p.add_argument('--local_rank', '--local-rank', dest='local_rank', default=None, type=int,
                   help=argparse.SUPPRESS)

    # Output directory
    p.add_argument('--overwrite', action='store_true',
                   help='start a new run in an --output_dir that holds one: its checkpoints and log.txt are '
                        'deleted (without it such a run is refused; relaunching without flags resumes it)')
    p.add_argument('--no-lock', dest='lock', action='store_false',
                   help='do not lock --output_dir (by default a second training job in the same directory is '
                        'refused while the first runs; for filesystems whose locks misbehave)')

    compat = p.add_argument_group('compatibility', 'flags of the reference and DeiT command lines, accepted so '
                                                   'that those run; each changes nothing here (a note says why)')
    for flag, (dest, kwargs, why) in COMPATIBILITY_FLAGS.items():
        compat.add_argument(flag, dest=dest, help=why, **kwargs)
    return p


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


# --------------------------------------------------------------------------------------------------
def validate_args(args, parser):
    """Incompatible or impossible flags: argparse-style error before any process group or data loader.
    (Ranges of single flags are their argparse types.)"""
    if not timm.is_model(args.model):
        parser.error(f"unknown model '{args.model}'; known NaLaFormer variants: {', '.join(sorted(VARIANTS))} "
                     f"(any timm model name also works)")
    if args.distillation_type != 'none':
        if args.finetune and not args.eval:
            parser.error('--distillation-type with --finetune is not supported '
                         '(DeiT: "Finetuning with distillation not yet supported")')
        if not args.teacher_path:
            parser.error('--distillation-type needs --teacher-path: a local teacher checkpoint (nothing is downloaded)')
        if not timm.is_model(args.teacher_model):
            parser.error(f"unknown teacher model '{args.teacher_model}'")
    for flag, on in (('--cosub', args.cosub), ('--ThreeAugment', args.ThreeAugment), ('--src', args.src)):
        if on:
            parser.error(f'{flag} (DeiT III) is not supported by this engine (the recipe is DeiT\'s: --aa)')
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
    # see stops every rank with one line once they load it (run_dir.agree_on_resume_path, distributed.on_every_rank)
    rank0 = distributed.launch_env()[0] == 0
    for flag, path in (('--resume', args.resume), ('--finetune', args.finetune), ('--teacher-path', args.teacher_path)):
        if path and rank0 and not os.path.isfile(path):
            parser.error(f'{flag} {path}: ' + ('checkpoints must be local files: downloading is disabled'
                                               if checkpoint_io.is_url(path) else 'no such file'))
    if args.real_labels is not None and args.data_set != 'IMNET':
        parser.error(f'--real-labels: ImageNet-ReaL needs the 1000-class ImageNet validation set (--data-set IMNET), '
                     f'not --data-set {args.data_set}; drop --real-labels')
    if args.eval and not args.finetune and not run_dir.find_resume_path(args):
        parser.error('--eval needs a checkpoint: pass --resume PATH (or an --output_dir holding checkpoint.pth)')
    if args.resume and args.finetune:
        parser.error('--resume and --finetune exclude each other (resume continues a run; finetune starts a new one)')
    if args.log_dir:
        import tb_logger
        if tb_logger.tensorboard_missing():
            parser.error(tb_logger.tensorboard_missing())
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
    check_optimizer(args, parser)
    check_scheduler(args, parser)
    check_auto_augment(args.aa, parser)


def check_device(device, world, parser):
    """--device: cpu, cuda or cuda:N; an existing GPU index when a GPU is present (a launcher assigns one GPU
    per process itself). cuda without a GPU falls back to the CPU (and says so)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ('cpu', 'cuda'):
        parser.error(f"--device {device!r}: expected cpu, cuda or cuda:N")
    if dev.type == 'cuda' and dev.index is not None and world == 1 and torch.cuda.is_available() \
            and dev.index >= torch.cuda.device_count():
        parser.error(f'--device {device}: this machine has {torch.cuda.device_count()} GPU(s) '
                     f'(cuda:0 .. cuda:{torch.cuda.device_count() - 1})')


def check_optimizer(args, parser):
    """--opt against timm's optimizer registry (an optional `lookahead_` prefix, as timm allows), then built
    once on a dummy parameter so that missing packages and bad --opt-betas/--opt-eps/--momentum show here."""
    import difflib

    from timm.optim import create_optimizer_v2, list_optimizers
    known = list_optimizers()
    name = args.opt.lower()
    base = name.removeprefix('lookahead_')
    if base not in known:
        close = difflib.get_close_matches(base, known, n=3)
        parser.error(f"--opt {args.opt}: unknown optimizer" + (f"; did you mean {', '.join(close)}?" if close else '')
                     + f" ({len(known)} names in timm.optim.list_optimizers(), e.g. adamw, sgd, lamb)")
    try:
        create_optimizer_v2(torch.nn.Linear(1, 1), opt=args.opt, lr=args.lr, weight_decay=args.weight_decay,
                            momentum=args.momentum, eps=args.opt_eps,
                            **({'betas': tuple(args.opt_betas)} if args.opt_betas else {}))
    except Exception as e:  # any failure here is a bad flag or a missing optional package
        parser.error(f'--opt {args.opt}: cannot build it with these flags ({first_line(e)})')


def check_scheduler(args, parser):
    """Build the --sched schedule once on a dummy optimizer: timm checks its flag combinations
    (e.g. wsd's --decay-epochs against --epochs) only when it is built."""
    try:
        build_lr_scheduler(args, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.lr))
    except (ValueError, AssertionError, TypeError) as e:
        parser.error(f'--sched {args.sched}: {first_line(e)}')


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
        parser.error(f"--aa {aa}: {detail}; use a timm policy such as rand-m9-mstd0.5-inc1, augmix-m5-w4-d2, "
                     f"original, v0, 3a, or none")


#: the flags that decide the evaluation transform; a checkpoint records them in its args
EVAL_TRANSFORM_FLAGS = ('input_size', 'eval_crop_ratio')


def resolve_eval_transform(args: argparse.Namespace, path: str) -> None:
    """--input-size and --eval-crop-ratio (None when not given): the command line's when given, else those the
    checkpoint `path` records (the one --eval measures or a run resumes: evaluated as it was trained), else the
    model's. A given value that differs from the recorded one is printed with both. The checkpoint's args are
    read without loading its weights."""
    recorded = checkpoint.recorded_args(path) if path else {}
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
            notes.append(datasets.override_note(flag, given, "none (the model's crop_pct)" if saved is None
                                                else saved, path))
    if args.input_size is None:
        args.input_size = datasets.data_config(args.model)['input_size'][-1]
    if taken:
        print(f"{' and '.join(taken)}: as recorded in {path} (pass the flag to choose another)")
    for note in filter(None, notes):
        print(note)


def data_classes(dataset: Any) -> Optional[list]:
    """The class names of `dataset` in label order; None where its labels carry no names (a flat val/ labelled
    by class index) or it has none."""
    if getattr(dataset, 'numeric_labels', False):
        return None
    return getattr(dataset, 'classes', None)


def build_model(args, nb_classes):
    """The model with the number of classes and dropout of the command line; drop path from --drop-path,
    or the variant's own rate when --drop-path is not given."""
    extra = {} if args.drop_path is None else {'drop_path_rate': args.drop_path}
    return timm.create_model(args.model, pretrained=False, num_classes=nb_classes, drop_rate=args.drop, **extra)


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


def drop_path_rate(model) -> float:
    """The highest stochastic-depth probability in `model` (the rate of its last block), 0 without any."""
    return max((float(m.drop_prob) for m in model.modules() if hasattr(m, 'drop_prob')), default=0.0)


#: the --opt names whose torch optimizer has a fused CUDA kernel (torch.optim.Adam and AdamW)
FUSED_OPTIMIZERS = ('adam', 'adamw')


def build_optimizer(args, model):
    """timm optimizer with the command line's settings; --layer-decay scales each parameter group's LR by
    decay^(layers above it), layers as the model's group_matcher defines them.

    Adam/AdamW with every parameter on a GPU use torch's fused kernel: one kernel for all parameters, step
    counts kept on the GPU (the multi-tensor kernel reads each parameter's back to the host every step);
    its results differ from the multi-tensor kernel's by rounding only (docs/performance.md). Elsewhere
    torch's default, the multi-tensor kernel. A checkpoint's parameter groups carry the kernel choice of the
    run that wrote it; loading one keeps this run's choice."""
    from timm.optim import create_optimizer_v2
    fused = (args.opt.lower().removeprefix('lookahead_') in FUSED_OPTIMIZERS
             and all(p.is_cuda for p in model.parameters()))
    optimizer = create_optimizer_v2(model, opt=args.opt, lr=args.lr, weight_decay=args.weight_decay,
                                    momentum=args.momentum, eps=args.opt_eps, layer_decay=args.layer_decay,
                                    **({'betas': tuple(args.opt_betas)} if args.opt_betas else {}),
                                    **({'fused': True} if fused else {}))
    optimizer.register_load_state_dict_pre_hook(_keep_kernel_choice)
    return optimizer


def _keep_kernel_choice(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """Optimizer load_state_dict pre-hook: the loaded parameter groups take this optimizer's kernel
    settings (fused, foreach) instead of those of the run that saved them."""
    kernel = {k: optimizer.defaults[k] for k in ('fused', 'foreach') if k in optimizer.defaults}
    return {**state_dict, 'param_groups': [{**group, **kernel} for group in state_dict['param_groups']]}


def build_lr_scheduler(args, optimizer):
    """timm scheduler stepped per epoch; call `.step(epoch)` at the START of epoch `epoch`, so that
    epoch e runs at the LR of epoch e (warmup from --warmup-lr over --warmup-epochs, then cosine)."""
    from timm.scheduler import create_scheduler_v2
    lr_scheduler, _ = create_scheduler_v2(
        optimizer, sched=args.sched, num_epochs=args.epochs, decay_epochs=args.decay_epochs,
        cooldown_epochs=args.cooldown_epochs, decay_rate=args.decay_rate,
        min_lr=args.min_lr, warmup_lr=args.warmup_lr, warmup_epochs=args.warmup_epochs, noise=args.lr_noise,
        noise_pct=args.lr_noise_pct, noise_std=args.lr_noise_std, noise_seed=args.seed, step_on_epochs=True)
    return lr_scheduler


def mixup_is_active(args: argparse.Namespace) -> bool:
    """Whether training mixes images (Mixup or CutMix): then targets are soft and the batch must be even."""
    return args.mixup > 0 or args.cutmix > 0 or args.cutmix_minmax is not None


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


def count_flops(model, input_size):
    """fvcore FLOPs (multiply-adds) of one image (models.flops.count_flops); None if fvcore fails.
    The model is counted where it is."""
    from models.flops import count_flops as fvcore_flops
    try:
        return fvcore_flops(model, input_size)
    except Exception as e:  # FLOPs are information only
        print(f'(fvcore FLOP count failed: {first_line(e)})')
        return None


def build_loaders(args, dataset_train, dataset_val):
    import samplers
    world, rank = distributed.get_world_size(), distributed.get_rank()
    sampler_train = loader_train = None  # evaluation only: no training set
    if dataset_train is None:
        pass
    elif args.repeated_aug:
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
    # Workers stay from one epoch to the next, and each epoch's workers are seeded from the RNG state at the
    # start of the epoch, which the checkpoint holds, so a resumed epoch replays the same augmentations
    # (utils.PersistentDataLoader)
    common = dict(num_workers=args.num_workers, pin_memory=pin, worker_init_fn=utils.worker_init_fn)
    if dataset_train is not None:
        loader_train = utils.PersistentDataLoader(dataset_train, sampler_train, batch_size=args.batch_size,
                                                  drop_last=True, **common)
    loader_val = utils.PersistentDataLoader(dataset_val, sampler_val, batch_size=int(1.5 * args.batch_size),
                                            drop_last=False, **common)
    return sampler_train, loader_train, loader_val


def data_facts(dataset_train: Any, dataset_val: Any, loader_train: Any) -> dict:
    """What every rank must see alike of the data (distributed.check_same_everywhere): the classes, the number of
    training and validation images and of training batches per epoch."""
    import hashlib
    classes = getattr(dataset_train if dataset_train is not None else dataset_val, 'classes', None) or []
    digest = hashlib.sha256('\n'.join(map(str, classes)).encode()).hexdigest()[:8]
    facts = {'classes': f'{len(classes)} (sha256 {digest})', 'validation images': len(dataset_val)}
    if dataset_train is not None:
        facts.update({'training images': len(dataset_train), 'training batches per epoch': len(loader_train)})
    return facts


def tensorboard_logger(args: argparse.Namespace, device: Any) -> Any:
    """Rank 0's TensorBoard writer with --log-dir (None on the other ranks and without it). Every rank calls
    this: a writer that cannot start stops them all with one line instead of leaving them waiting for rank 0."""
    if not args.log_dir:
        return None
    import tb_logger
    return distributed.on_rank0(lambda: tb_logger.TensorBoardLogger(args.log_dir), device,
                                f'--log-dir {args.log_dir}: cannot write TensorBoard events there')


def stopped_exit_status(args: argparse.Namespace, stop_flag: Any) -> int:
    """Exit status of a training run that a stop signal ended after saving its checkpoint: 128 + the signal for
    a plain process (a scheduler sees it was stopped, not finished); 0 under a launcher (torchrun, srun), where
    every rank stopped together and saved: a non-zero status would make torchrun --max-restarts start the
    group again (inside an allocation that is ending, or against a user's SIGTERM) and srun
    --kill-on-bad-exit tear down the step. The `Stopped by ...` line says what happened."""
    return 0 if args.launcher != 'none' else 128 + int(stop_flag.signum or signal.SIGTERM)


def accuracy_line(stats: dict, n_images: int, tag: str = '', label: str = '') -> str:
    """The accuracy line of one evaluation of the validation set of `n_images` images."""
    line = f"Accuracy of the {tag}network{label} on the {stats['n']} test images: {stats['acc1']:.2f}%"
    if stats['n'] != n_images or stats.get('seen', stats['n']) != n_images:
        line += f" (evaluated {stats['n']} of {n_images} images; undecodable ones excluded)"
    return line


def evaluate_with_ema(args: argparse.Namespace, loader_val: Any, eval_model: torch.nn.Module, model_ema: Any,
                      eval_ema: Optional[torch.nn.Module], device: torch.device, amp_dtype: Optional[torch.dtype],
                      sum_over_ranks: bool, stop_flag: Any) -> Tuple[dict, Optional[dict]]:
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
                        eval_model: torch.nn.Module, loader_val: Any, extra_sets: Sequence[Tuple[str, Any]],
                        real: Any, device: torch.device, amp_dtype: Optional[torch.dtype], stop_flag: Any) -> int:
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
        return 128 + int(stop_flag.signum or signal.SIGTERM)
    extra = [(name, ds, engine.evaluate_models(  # build_loaders: only its validation loader is used
        datasets.device_loader(build_loaders(args, ds, ds)[2], args, device), runners, device, amp_dtype,
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
    validate_args(args, parser)
    train_mode = resolve_train_mode(args)
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
        args.num_workers, why = default_num_workers()
        print(f'Data loader: {args.num_workers} workers per process (the default: {why}; --num_workers N sets it)')
    for note in compatibility_notes(args):
        print(note)
    # before the data: the validation transform is the checkpoint's own unless the command line names one
    resume_path = run_dir.agree_on_resume_path(args, device)  # rank 0 decides, every rank checks its own view
    resolve_eval_transform(args, resume_path)
    print(json.dumps({k: v for k, v in checkpoint.args_to_dict(args).items()}, default=str))

    from timm.data import Mixup
    from timm.utils import distribute_bn, random_seed

    from losses import DistillationLoss

    random_seed(args.seed, rank)  # torch, numpy and python seeded with --seed + rank
    if device.type == 'cuda':
        torch.backends.cudnn.benchmark = True
    engine.set_tf32(device, args.tf32)

    output_dir = args.output_dir
    run_dir.prepare_output_dir(args, device)

    # ---------------- data ----------------
    try:
        # evaluation only never lists the training set (train/ may be absent); its classes come from val
        # uint8 images: the loaders normalise them on the device (datasets.DeviceLoader)
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
    sampler_train, loader_train, loader_val = build_loaders(
        args, dataset_train, dataset_val if real is None else eval_sets.WithIndex(dataset_val))
    loader_val = datasets.device_loader(loader_val, args, device)
    if loader_train is not None:
        loader_train = datasets.device_loader(loader_train, args, device)
    if not args.eval and len(loader_train) == 0:
        raise UserError(f'the training set ({len(dataset_train)} images) gives no full batch of {args.batch_size} '
                        f'per process on {world} process(es); lower --batch-size')
    n_train = f'{len(dataset_train)} train / ' if dataset_train is not None else ''
    print(f'Data: {args.data_set}, {n_train}{len(dataset_val)} val images, {nb_classes} classes')
    distributed.check_same_everywhere(data_facts(dataset_train, dataset_val, loader_train), device,
                                      f'every node must see the same --data-path {args.data_path} (a shared '
                                      f'filesystem or identical copies)')

    mixup_fn = None
    mixup_active = mixup_is_active(args)
    if mixup_active:
        mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, cutmix_minmax=args.cutmix_minmax,
                         prob=args.mixup_prob, switch_prob=args.mixup_switch_prob, mode=args.mixup_mode,
                         label_smoothing=args.smoothing, num_classes=nb_classes)

    # ---------------- model ----------------
    print(f'Creating model: {args.model}')
    model = build_model(args, nb_classes)
    if not args.eval:  # drop path, EMA, schedule: training only
        print(f'Drop path rate: {drop_path_rate(model):.3g} '
              + ('(--drop-path)' if args.drop_path is not None else f"({args.model}'s default)"))
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
        flops = count_flops(model, args.input_size)
        if flops is not None:
            print(f'fvcore FLOPs at 1x3x{args.input_size}x{args.input_size}: {flops / 1e9:.3f} G')
    model.to(device)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)

    global_batch = args.batch_size * world * args.accum_steps  # images per optimizer step
    model_ema = None
    if args.model_ema and not args.eval:  # --eval measures the EMA weights the checkpoint holds
        decay = args.model_ema_decay ** (global_batch / 512.0)
        model_ema = engine.ModelEma(model, decay=decay, device='cpu' if args.model_ema_force_cpu else None)
        print(f'Model EMA: decay {decay:.8g} (= {args.model_ema_decay} ** ({global_batch} / 512))')

    train_model, model_without_ddp, eval_model = wrap_model(args, model, device)
    eval_ema = torch.compile(model_ema.module) if args.compile and model_ema is not None else None

    if not args.unscale_lr:
        args.lr = args.lr * global_batch / 512.0
    optimizer = build_optimizer(args, model_without_ddp)
    lr_scheduler = build_lr_scheduler(args, optimizer)
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
        classes=data_classes(dataset_val if args.eval else dataset_train),
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
    step = engine.OptimizerStep(optimizer, device, amp_dtype, loss_scaler, args.clip_grad, args.clip_mode,
                                args.accum_steps)
    settings = engine.TrainSettings(channels_last=args.channels_last, print_freq=args.print_freq,
                                    max_bad_steps=args.max_bad_steps, train_mode=args.train_mode)
    random_erasing = datasets.batch_random_erasing(args, device)  # the train transform's, on the device

    tb = tensorboard_logger(args, device)
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
            return stopped_exit_status(args, stop_flag)
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
            return stopped_exit_status(args, stop_flag)

    if args.distributed:  # every rank reports a digest of its weights: DDP keeps them identical
        digest = distributed.state_digest(model_without_ddp.state_dict())
        print(f'[rank {rank}] final weights sha256: {digest}', force=True)
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
    return isinstance(e, RuntimeError) and distributed.is_dist_avail_and_initialized() and any(
        s in msg for s in ('Connection closed by peer', 'Connection reset', 'Broken pipe', 'timed out',
                           'Timed out', 'ProcessGroupGloo', 'gloo', 'NCCL', 'Socket Timeout'))


def _dead_loader_worker(e: BaseException) -> str:
    """'a data-loader worker (pid N) was killed by signal Killed' (or '... exited unexpectedly') when a DataLoader
    worker died under `e` (torch reports it as a RuntimeError naming the pid), else ''."""
    for c in exception_chain(e):
        if not isinstance(c, RuntimeError):
            continue
        killed = re.search(r'DataLoader worker \(pid (\d+)\) is killed by signal: ([^.\n]+)', str(c))
        if killed:
            return f'a data-loader worker (pid {killed.group(1)}) was killed by signal {killed.group(2).strip()}'
        exited = re.search(r'DataLoader worker \(pid\(s\) ([\d, ]+)\) exited unexpectedly', str(c))
        if exited:
            return f'a data-loader worker (pid {exited.group(1).strip()}) exited unexpectedly'
    return ''


def _dead_loader_worker_after(e: BaseException) -> str:
    """_dead_loader_worker for the error `e` that ended a run, also when a worker's death showed first as
    another error (a connection reset while a batch was received from it). A DataLoader's SIGCHLD handler
    raises its RuntimeError at whatever line runs when a worker dies, even while this error is reported:
    it is switched off here, and torch's own check of the workers asked directly."""
    try:
        if hasattr(signal, 'SIGCHLD'):
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        found = _dead_loader_worker(e)
        if not found:
            from torch.utils.data._utils.signal_handling import _error_if_any_worker_fails
            _error_if_any_worker_fails()
    except RuntimeError as late:  # the handler fired first, or the check found a dead worker
        return _dead_loader_worker(late)
    return found


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


def run(argv=None):
    # DDP warns once when a depthwise conv's weight gradient comes out channels-last (layout only, harmless)
    warnings.filterwarnings('ignore', message='Grad strides do not match bucket view strides')
    parser = get_args_parser()
    args = parser.parse_args(argv)
    from image_folder import BadSampleError
    code = 0
    try:
        code = main_or_clean_up(args, parser)
    except UserError as e:
        prefix = f'[rank {distributed.get_rank()}] ' if distributed.get_world_size() > 1 else ''
        eprint(f'{prefix}error: {e}')
        code = e.exit_code
    except BadSampleError as e:  # --strict-data: raised in a loader worker, re-raised here
        # from a worker, the message is the last line of the worker's traceback
        eprint(f"error: {str(e).strip().splitlines()[-1].split('BadSampleError: ', 1)[-1]}")
        # the failed epoch's loader workers ignore SIGTERM, so a normal exit would wait for them forever
        sys.stdout.flush()
        os._exit(1)
    except KeyboardInterrupt:
        eprint('interrupted')
        code = 130
    except Exception as e:
        worker = _dead_loader_worker_after(e)
        if worker:  # the out-of-memory killer's usual victim; its traceback says nothing useful
            eprint(f'[rank {distributed.get_rank()}] error: {worker}, most likely for lack of memory (the '
                   f'out-of-memory killer): use fewer --num_workers (now {args.num_workers}) or a smaller '
                   f'--batch-size (now {args.batch_size}); the same command resumes from the last checkpoint')
            sys.stdout.flush()
            os._exit(1)  # the other workers of the loader ignore SIGTERM: do not wait for them
        if _is_peer_failure(e):
            eprint(f'[rank {distributed.get_rank()}] error: lost contact with the other processes '
                   f'({first_line(e)}); another rank probably died or stopped - see its log')
            sys.stdout.flush()
            os._exit(1)  # do not wait in process-group shutdown for a dead peer
        # An unexpected error: show it, then leave at once. Its traceback keeps the data loaders alive,
        # and their workers ignore SIGTERM (so a stop signal reaches only this process), so a normal
        # interpreter exit would wait for them forever. Checkpoints are written atomically: nothing is lost.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if distributed.is_dist_avail_and_initialized():
        if code == 0:
            torch.distributed.destroy_process_group()
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return code


if __name__ == '__main__':
    sys.exit(run())
