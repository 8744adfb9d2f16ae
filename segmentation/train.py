"""Train and evaluate UperNet (or Semantic FPN) on a NaLaFormer backbone for ADE20K semantic segmentation.

    python segmentation/train.py --model NALAFORMER_T --data-path /data/ADEChallengeData2016 --output_dir out/seg_t \\
        --pretrained output/t/best.pth
    torchrun --nproc_per_node=8 segmentation/train.py --model NALAFORMER_T --data-path ADE --output_dir out/seg_t
    python segmentation/train.py --eval --resume out/seg_t/checkpoint.pth --model NALAFORMER_T --data-path ADE

The defaults are mmseg's UperNet ADE20K recipe of Swin/ConvNeXt-style backbones: 160k iterations at a global
batch of 16 (8 processes x --batch-size 2), 512² crops, AdamW lr 6e-5, weight decay 0.01, poly schedule after a
linear warmup of 1500 iterations, auxiliary FCN head weighted 0.4, single-scale whole-image evaluation
(docs/segmentation.md); --decoder fpn: Semantic FPN's 80k recipe (lr 1e-4, weight decay 1e-4, poly power 0.9, no
warmup, no auxiliary head). Runs from the repository root, as a plain process, under torchrun or srun; the same
command resumes from --output_dir/checkpoint.pth, also after a stop signal or SLURM's requeue warning.
"""
import argparse
import os
import sys
import time
from collections.abc import Mapping

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or '.') == _HERE:  # `python segmentation/train.py`: the root's modules
    sys.path[0] = os.path.dirname(_HERE)
elif os.path.dirname(_HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(_HERE))

import timm  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

import cli  # noqa: E402
import samplers  # noqa: E402
from models import VARIANTS  # noqa: E402
from run import checkpoint, distributed, output_dir, process  # noqa: E402
from run.checkpoint import TrainingParts  # noqa: E402
from run.errors import FlagError, UserError, unknown_model  # noqa: E402
from run.resume import preserved_rng, rng_state_entries, take_recorded_flags  # noqa: E402
from run.weights import load_backbone_weights  # noqa: E402
from segmentation import ade, miou, state, upernet  # noqa: E402
from segmentation.upernet import SegLoss  # noqa: E402
from training import iterations, loaders  # noqa: E402
from training.image_folder import DataLayoutError, data_error_line  # noqa: E402
from training.optim import global_batch_warning, weight_decay_groups  # noqa: E402
from training.step import OptimizerStep, amp_dtype, count_bad_steps, set_tf32  # noqa: E402

#: the recipe's values of the flags that an evaluation or a resume takes from its checkpoint (state.RECORDED_FLAGS):
#: their parser default is None (not given); run.resume.take_recorded_flags fills in the checkpoint's value or these
#: and the schedule's flags (SCHEDULE), whose parser default is None too: they follow the decoder's recipe
RECIPE = {'decoder': 'upernet', 'model': 'NALAFORMER_T', 'num_classes': 150, 'channels': 512, 'aux_weight': 0.4,
          'drop_path': None, 'crop_size': 512, 'img_scale': (2048, 512), 'ratio_range': (0.5, 2.0),
          'cat_max_ratio': 0.75, 'eval_mode': 'whole', 'slide_stride': 341,
          'iters': 160000, 'lr': 6e-5, 'weight_decay': 0.01, 'power': 1.0, 'warmup_iters': 1500,
          'eval_interval': 16000, 'save_interval': 16000}
#: what --decoder fpn changes: the Semantic FPN 80k recipe of the PVT-style repositories (docs/segmentation.md)
FPN_RECIPE = {'channels': 128, 'aux_weight': 0.0, 'iters': 80000, 'lr': 1e-4, 'weight_decay': 1e-4, 'power': 0.9,
              'warmup_iters': 0, 'eval_interval': 8000, 'save_interval': 8000}
SCHEDULE = ('iters', 'lr', 'weight_decay', 'power', 'warmup_iters', 'eval_interval', 'save_interval')
RECIPE_GLOBAL_BATCH = 16  # images per optimizer step of both recipes (8 GPUs x 2)
RECORDED_HELP = 'with a checkpoint to evaluate or resume, {}, when not given, take the values it records'


def recipe(decoder: str | None) -> dict:
    """The recipe's defaults for `decoder` (UperNet's when None)."""
    return {**RECIPE, **FPN_RECIPE} if decoder == 'fpn' else dict(RECIPE)


class DecoderRecipe(Mapping):
    """recipe(args.decoder), read at each look-up: run.resume.take_recorded_flags fills in --decoder first, so the
    defaults of the other flags are those of the decoder it settled on."""

    def __init__(self, args: argparse.Namespace):
        self.args = args

    def __getitem__(self, key: str):
        return recipe(self.args.decoder)[key]

    def __iter__(self):
        return iter(RECIPE)

    def __len__(self) -> int:
        return len(RECIPE)


def take_flags(args: argparse.Namespace, path: str) -> None:
    """The flags the command line leaves out: the recorded ones from the checkpoint `path` ('' for none) or the
    recipe of the decoder (run.resume.take_recorded_flags), then the schedule's from the decoder's recipe."""
    take_recorded_flags(args, path, DecoderRecipe(args), task=upernet.TASK, recorded_flags=state.RECORDED_FLAGS,
                        model_flags=state.MODEL_FLAGS, same=state.builds_same)
    for key in SCHEDULE:
        if getattr(args, key) is None:
            setattr(args, key, recipe(args.decoder)[key])


def _default(key: str) -> str:
    """'(default: 512; --decoder fpn: 128)' for --help."""
    def shown(value) -> str:
        return ' '.join(map(str, value)) if isinstance(value, tuple) else str(value)
    fpn = f'; --decoder fpn: {shown(FPN_RECIPE[key])}' if key in FPN_RECIPE else ''
    return f'(default: {shown(RECIPE[key])}{fpn})'


def get_args_parser() -> argparse.ArgumentParser:
    """The command line; the defaults are the recipe (docs/segmentation.md)."""
    p = cli.LauncherArgumentParser('segmentation/train.py', description=__doc__.split('\n')[0], add_help=True)
    g = p.add_argument_group('Model', RECORDED_HELP.format(
        '--decoder, --model, --drop-path, --channels, --aux-weight and --num-classes'))
    g.add_argument('--decoder', choices=['upernet', 'fpn'], default=None,
                   help=f'UperNet (160k recipe) or Semantic FPN (80k recipe: its schedule defaults) '
                        f'{_default("decoder")}')
    g.add_argument('--model', default=None, help=f'backbone: a NaLaFormer variant (any timm model builds) '
                                                  f'{_default("model")}')
    g.add_argument('--pretrained', default='', help='classification checkpoint or release to start the backbone from')
    g.add_argument('--drop-path', type=cli.RATE, default=None, help="backbone drop path (default: the variant's)")
    g.add_argument('--channels', type=cli.POSITIVE_INT, default=None,
                   help=f"UperNet's channels, or Semantic FPN head's (its neck has 256) {_default('channels')}")
    g.add_argument('--aux-weight', type=cli.NON_NEGATIVE, default=None,
                   help=f'auxiliary FCN head loss weight (0: none) {_default("aux_weight")}')
    g.add_argument('--num-classes', type=cli.POSITIVE_INT, default=None, help=_default('num_classes'))
    g = p.add_argument_group('Schedule', "the defaults are the --decoder's recipe")
    g.add_argument('--iters', type=cli.POSITIVE_INT, default=None, help=_default('iters'))
    g.add_argument('--batch-size', type=cli.POSITIVE_INT, default=2, help='per process (8 x 2 = 16)')
    g.add_argument('--lr', type=cli.POSITIVE, default=None, help=_default('lr'))
    g.add_argument('--weight-decay', type=cli.NON_NEGATIVE, default=None, help=_default('weight_decay'))
    g.add_argument('--warmup-iters', type=cli.NON_NEGATIVE_INT, default=None, help=_default('warmup_iters'))
    g.add_argument('--warmup-ratio', type=cli.POSITIVE, default=1e-6)
    g.add_argument('--power', type=cli.POSITIVE, default=None, help=f'poly schedule power {_default("power")}')
    g.add_argument('--min-lr', type=cli.NON_NEGATIVE, default=0.0)
    g.add_argument('--clip-grad', type=cli.POSITIVE, default=None)
    g.add_argument('--max-bad-steps', type=cli.NON_NEGATIVE_INT, default=20)
    g = p.add_argument_group('Data', RECORDED_HELP.format(
        '--crop-size, --img-scale, --ratio-range and --cat-max-ratio'))
    g.add_argument('--data-path', default=None, help='the ADEChallengeData2016 folder')
    g.add_argument('--crop-size', type=cli.ranged(int, 32), default=None, help=_default('crop_size'))
    g.add_argument('--img-scale', type=cli.POSITIVE_INT, nargs=2, default=None, metavar=('LONG', 'SHORT'),
                   help=_default('img_scale'))
    g.add_argument('--ratio-range', type=cli.POSITIVE, nargs=2, default=None, metavar=('MIN', 'MAX'),
                   help=_default('ratio_range'))
    g.add_argument('--cat-max-ratio', type=cli.ranged(float, 0, 1, lo_open=True), default=None,
                   help=_default('cat_max_ratio'))
    g.add_argument('--num_workers', '--num-workers', dest='num_workers', type=cli.NON_NEGATIVE_INT, default=None)
    g.add_argument('--pin-mem', action=argparse.BooleanOptionalAction, default=True)
    g = p.add_argument_group('Evaluation', RECORDED_HELP.format('--eval-mode and --slide-stride'))
    g.add_argument('--eval', action='store_true', help='evaluate --resume (or --output_dir/checkpoint.pth) only')
    g.add_argument('--eval-mode', choices=['whole', 'slide'], default=None, help=_default('eval_mode'))
    g.add_argument('--slide-stride', type=cli.POSITIVE_INT, default=None,
                   help=f'slide mode: stride of the crops {_default("slide_stride")}')
    g.add_argument('--aug-test', action='store_true',
                   help="with --eval: mmseg's multi-scale (0.5 to 1.75 of --img-scale) + flip test")
    g.add_argument('--show-dir', default='', metavar='DIR',
                   help="with --eval: write DIR/<image name>.png for each validation image, the image beside its "
                        "prediction in mmseg's ADE20K colours (as mmseg's test.py --show-dir)")
    g.add_argument('--eval-interval', type=cli.POSITIVE_INT, default=None, help=_default('eval_interval'))
    g.add_argument('--eval-at-start', action='store_true', help='also evaluate the model before training')
    g.add_argument('--dist-eval', action=argparse.BooleanOptionalAction, default=None)
    g = p.add_argument_group('Run')
    iterations.add_run_flags(g)
    g.add_argument('--save-interval', type=cli.POSITIVE_INT, default=None, help=_default('save_interval'))
    return p


def check_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Flags that cannot work together: argparse's two lines (exit 2) before anything starts."""
    if args.model is not None and not timm.is_model(args.model):
        parser.error(unknown_model(args.model, VARIANTS, timm.list_models()))
    if not args.data_path:
        parser.error('--data-path is required: the ADEChallengeData2016 folder (images/ and annotations/)')
    world = iterations.check_run_flags(args, parser)
    if args.aug_test and not args.eval:
        parser.error('--aug-test is a test of a checkpoint: use it with --eval (training evaluates single-scale, '
                     'as mmseg)')
    if args.ratio_range is not None and args.ratio_range[0] > args.ratio_range[1]:
        parser.error(f'--ratio-range {args.ratio_range[0]} {args.ratio_range[1]}: MIN above MAX')
    if args.batch_size == 1 and not args.eval and not (world > 1 and str(args.device).startswith('cuda')
                                                       and args.sync_bn and torch.cuda.is_available()):
        parser.error('--batch-size 1: the pooling branch of UperNet normalises one value per channel, which '
                     'BatchNorm cannot train on; use --batch-size 2 or more per process (or SyncBatchNorm on GPUs)')
    cli.check_device(args.device, world, parser)


#: the most elongated image --img-scale's memory check allows for: no side more than 4 times the other
MAX_ASPECT = 4


def check_sizes(args: argparse.Namespace, device: torch.device) -> None:
    """Refuse, in one line (FlagError), a --crop-size whose training batch or an --img-scale whose evaluation image
    cannot fit in the device's memory, before anything of that size is allocated: the backbone's lower bound
    (cli.bytes_per_pixel; the decoder comes on top) and, in evaluation, the logits at the image's size (one value
    per class and pixel). The evaluation image is the smallest --img-scale gives an image of aspect ratio up to
    MAX_ASPECT. Backbones other than the NaLaFormer variants pass."""
    memory, words = cli.device_memory(device)
    half = args.amp is not None
    train = cli.bytes_per_pixel(args.model, training=True, half=half)
    if memory is None or train is None:
        return
    crop = args.crop_size
    problem = '' if args.eval else cli.batch_too_big(
        what=f'--crop-size {crop}: one training batch (--batch-size {args.batch_size})', model=args.model,
        per_pixel=train, pixels=crop * crop, batch=args.batch_size, shape=f'{crop}x{crop}', memory=memory,
        memory_words=words)
    if problem:
        side, most = cli.largest_side(train, args.batch_size, memory), int(memory // (train * crop * crop))
        fixes = ([f'--crop-size {side} or less'] if side >= cli.MIN_INPUT_SIZE else []) + (
            [f'--batch-size {most}'] if 0 < most < args.batch_size else [])
        raise FlagError(f"{problem}; use {' or '.join(fixes) or 'a smaller --crop-size'}")
    long, short = max(args.img_scale), min(args.img_scale)
    pixels = min(short * short, long * long // MAX_ASPECT)
    logits = (2 if half else 4) * args.num_classes
    per_pixel = logits if args.eval_mode == 'slide' else max(logits, cli.bytes_per_pixel(args.model, False, half))
    problem = cli.batch_too_big(
        what=f'--img-scale {args.img_scale[0]} {args.img_scale[1]}: one evaluation image',
        model=f'{args.model} with {args.num_classes} classes',
        per_pixel=per_pixel, pixels=pixels, batch=1, shape=f'at least {pixels} pixels (aspect ratio up to '
                                                           f'{MAX_ASPECT}:1)', memory=memory, memory_words=words)
    if problem:
        factor = (memory / (per_pixel * pixels)) ** 0.5
        raise FlagError(f'{problem}; use --img-scale {int(args.img_scale[0] * factor)} '
                        f'{int(args.img_scale[1] * factor)} or less')


def poly_lr(it: int, args: argparse.Namespace) -> float:
    """mmcv's poly schedule with linear warmup (by iteration): (lr - min_lr) (1 - it / iters)^power + min_lr,
    scaled during the first warmup_iters by 1 - (1 - it / warmup_iters)(1 - warmup_ratio)."""
    lr = (args.lr - args.min_lr) * (1 - it / args.iters) ** args.power + args.min_lr
    if it < args.warmup_iters:
        lr *= 1 - (1 - it / args.warmup_iters) * (1 - args.warmup_ratio)
    return lr




def seg_datasets(args: argparse.Namespace) -> tuple[ade.ADE20K | None, ade.ADE20K]:
    """(training set or None for --eval, validation set); a wrong layout is one line."""
    try:
        pipeline = ade.TrainPipeline(crop=(args.crop_size, args.crop_size), img_scale=tuple(args.img_scale),
                                     ratio_range=tuple(args.ratio_range), cat_max_ratio=args.cat_max_ratio)
        train = None if args.eval else ade.ADE20K(args.data_path, ade.SPLITS['train'], args.num_classes, pipeline,
                                                  seed=args.seed)
        val = ade.ADE20K(args.data_path, ade.SPLITS['val'], args.num_classes, eval_scale=tuple(args.img_scale),
                         eval_ratios=ade.AUG_RATIOS if args.aug_test else None)
    except DataLayoutError as e:
        raise UserError(str(e)) from e
    return train, val


def seg_loaders(args, train_set, val_set, start_iter: int):
    """(training batches from `start_iter` on, or None; validation loader of one image a batch, this rank's
    share with --dist-eval)."""
    world, rank = distributed.get_world_size(), distributed.get_rank()
    common = dict(num_workers=args.num_workers, pin_memory=args.pin_mem and str(args.device).startswith('cuda'),
                  worker_init_fn=process.worker_init_fn)
    sampler_val = (samplers.DistributedEvalSampler(val_set, world, rank) if args.dist_eval and world > 1
                   else torch.utils.data.SequentialSampler(val_set))
    val = loaders.DataLoader(val_set, sampler=sampler_val, batch_size=1, **common)
    if train_set is None:
        return None, val
    sampler = samplers.IterationSampler(len(train_set), world, rank, args.batch_size, args.seed, start_iter)
    if sampler.steps == 0:
        raise UserError(f'the training set ({len(train_set)} images) gives no full batch of {args.batch_size} per '
                        f'process on {world} process(es); lower --batch-size')
    # its own generator: creating the iterator draws no number from the run's random stream (exact resume)
    train = loaders.DataLoader(train_set, sampler=sampler, batch_size=args.batch_size, drop_last=True,
                             generator=torch.Generator(), persistent_workers=False, **common)
    return train, val


def evaluate_segmentor(args, model, val_loader, device, amp_dtype, stop_flag, show=None) -> dict:
    """The validation scores of `model` (one pass, exact over the processes with --dist-eval); `show` receives each
    prediction this process scores (miou.evaluate)."""
    try:
        with preserved_rng():
            return miou.evaluate(model, val_loader, args.num_classes, device, amp_dtype=amp_dtype, mode=args.eval_mode,
                                 crop=args.crop_size, stride=args.slide_stride,
                                 sum_over_ranks=args.dist_eval and args.distributed, stop_flag=stop_flag,
                                 print_freq=max(1, args.print_freq), class_names=val_loader.dataset.classes,
                                 show=show)
    except ade.LabelError as e:
        raise UserError(data_error_line(e)) from e


def eval_record(result: dict, args, **extra) -> dict:
    """The log.txt line of an evaluation: the scores, then each class's IoU and Acc keyed by its name."""
    return {**extra, 'mIoU': result['mIoU'], 'mAcc': result['mAcc'], 'aAcc': result['aAcc'],
            'images': result['images'], 'eval_mode': args.eval_mode, 'aug_test': args.aug_test,
            **miou.class_record(result)}


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """A run: the process group, the data, the model, then --eval or training; returns the exit status."""
    check_flags(args, parser)
    device, stop_flag = iterations.start_run(args)
    rank = distributed.get_rank()
    output = cli.settings(output_dir.OutputDirSettings, args)
    resume_path = output_dir.agree_on_resume_path(output, device)
    # the flags the command line leaves out: the checkpoint's (its command line only is read), else the recipe's
    distributed.on_every_rank(lambda: take_flags(args, resume_path), device, f'--resume {resume_path}')
    check_sizes(args, device)
    timm.utils.random_seed(args.seed, rank)
    set_tf32(device, args.tf32)
    output_dir.prepare_output_dir(output, device)
    if args.show_dir:
        distributed.on_every_rank(lambda: output_dir.prepare_show_dir(args.show_dir), device,
                                  f'--show-dir {args.show_dir}')
    train_set, val_set = seg_datasets(args)
    print(f'Data: {len(train_set) if train_set is not None else "-"} training / {len(val_set)} validation images, '
          f'{args.num_classes} classes')
    if train_set is not None:
        check_validation_labels(args, val_set, device)

    model = upernet.build_segmentor(args.model, args.num_classes, args.channels, args.aux_weight > 0,
                                     args.drop_path, args.crop_size, decoder=args.decoder)
    if args.pretrained and not resume_path:
        print(distributed.on_every_rank(
            lambda: load_backbone_weights(model.backbone, args.pretrained, args.model, upernet.TASK), device,
            f'--pretrained {args.pretrained}'))
    n_parameters = sum(p.numel() for p in model.parameters())
    print(f'Model: {model.description} over {args.model}: {n_parameters / 1e6:.2f}M parameters')
    model.to(device)
    train_model, bare, _ = distributed.wrap_model(model, device, distributed=args.distributed, sync_bn=args.sync_bn,
                                                  compile=False)
    optimizer = torch.optim.AdamW(weight_decay_groups(bare, args.weight_decay), lr=args.lr, betas=(0.9, 0.999))
    amp = amp_dtype(args.amp)
    scaler = torch.amp.GradScaler(device.type) if args.amp == 'fp16' else None
    checkpoints = checkpoint.IterationCheckpoints(
        task=upernet.TASK, output_dir=args.output_dir, parts=TrainingParts(bare, optimizer=optimizer,
                                                                            loss_scaler=scaler),
        run_args=checkpoint.args_to_dict(args), n_parameters=n_parameters, device=device)
    if args.eval:
        return evaluate_seg_checkpoint(args, checkpoints, resume_path, val_set=val_set, amp_dtype=amp,
                                       stop_flag=stop_flag)
    resumed = state.resume_from(resume_path, checkpoints)
    # room for checkpoint.pth, its replacement while it is written and best.pth
    checkpoint.check_room(args.output_dir, checkpoint.checkpoint_bytes(bare, resume_path=resume_path), device)
    if resumed.ckpt is not None:
        due = '; its evaluation, which the stop left due, comes first' if resumed.eval_due else ''
        print(f'Resumed from {resume_path}: continuing at iteration {resumed.start_iter} of {args.iters}{due}')
        resumed.ckpt = None
    output_dir.save_args(args.output_dir, checkpoints.run_args, device)
    warn_global_batch(args)
    train_loader, val_loader = seg_loaders(args, train_set, val_set, resumed.start_iter)
    step = OptimizerStep(optimizer, device, amp_dtype=amp, scaler=scaler, clip_grad=args.clip_grad)
    run = Run(args, train_model=train_model, step=step, checkpoints=checkpoints, resumed=resumed,
              val_loader=val_loader, amp_dtype=amp, stop_flag=stop_flag)
    return train(run, optimizer, resumed.start_iter, train_loader, resumed.eval_due)


def check_validation_labels(args, val_set, device) -> None:
    """Every validation label map checked before training as the evaluations will read it (its image's size, its
    values: ade.check_labels), each process a share: a bad one ends the run with its one line now, not at the
    first evaluation; so does a validation set without one labelled pixel (there would be no mIoU to measure)."""
    world, rank = distributed.get_world_size(), distributed.get_rank()

    def check() -> int:
        try:
            return ade.check_labels(val_set.pairs[rank::world], args.num_classes)
        except ade.LabelError as e:
            raise UserError(data_error_line(e)) from e

    labelled = distributed.on_every_rank(check, device, 'checking the validation label maps')
    if distributed.all_reduce_max([float(labelled > 0)], device)[0] == 0:
        raise UserError(f'--data-path {args.data_path}: no validation label map holds a class (every pixel is 0, '
                        f'"other", or 255, both ignored), so there is no mIoU to measure; label maps hold the '
                        f'classes as 1..{args.num_classes}')


def evaluate_seg_checkpoint(args, checkpoints, path, *, val_set, amp_dtype, stop_flag) -> int:
    """--eval: the scores of the checkpoint's weights, printed and appended to --output_dir/log.txt."""
    model, device = checkpoints.parts.model, checkpoints.device
    ckpt = state.load_checkpoint_weights(path, checkpoints)
    _, val_loader = seg_loaders(args, None, val_set, 0)
    show = PredictionPictures(args.show_dir, val_set) if args.show_dir else None
    result = evaluate_segmentor(args, model, val_loader, device, amp_dtype, stop_flag, show)
    if distributed.all_reduce_max([float(result['aborted'])], device)[0] > 0:  # on any process
        print(f'Evaluation stopped by {stop_flag.name() or "a stop signal on another rank"}: no mIoU reported')
        return process.stopped_status(args.launcher, stop_flag, saved=False)
    print(miou.class_table(result))
    print(miou.summary_line(result, args.eval_mode))
    if show is not None:
        print(f"Pictures of the {result['images']} images (each beside its prediction): {args.show_dir}")
    checkpoints.append_log(eval_record(result, args, eval=path, iter=ckpt.get('iter')))
    return 0


class PredictionPictures:
    """--show-dir's `show` for miou.evaluate: the picture of validation image `index` of `dataset` (the image as
    read from disk beside its prediction, ade.prediction_picture) written to `directory`/<image file stem>.png."""

    def __init__(self, directory: str, dataset: ade.ADE20K):
        self.directory, self.dataset = directory, dataset
        self.colours = ade.palette(dataset.num_classes)

    def __call__(self, index: int, prediction: torch.Tensor) -> None:
        image_path = self.dataset.pairs[index][0]
        picture = ade.prediction_picture(ade.decode_image(image_path), prediction.cpu().numpy(), self.colours)
        path = os.path.join(self.directory, os.path.splitext(os.path.basename(image_path))[0] + '.png')
        try:
            Image.fromarray(picture).save(path)
        except OSError as e:
            raise UserError(f'--show-dir: cannot write {path} ({e.strerror or e}); free space there or choose '
                            f'another folder') from e


class Run(iterations.IterationLoop):
    """What the training loop works with: the flags, the model as trained (DDP) and as saved (bare: the one
    `checkpoints` saves), the optimizer step, the checkpoints (and their device), the validation loader, the
    precision, the stop flag (IterationLoop's stop and data-error handling), and the best mIoU so far."""

    def __init__(self, args, *, train_model, step, checkpoints, resumed, val_loader, amp_dtype, stop_flag):
        super().__init__(args, stop_flag)
        self.train_model, self.bare, self.step = train_model, checkpoints.parts.model, step
        self.checkpoints, self.val_loader, self.device = checkpoints, val_loader, checkpoints.device
        self.amp_dtype = amp_dtype
        self.best, self.best_iter, self.bad = resumed.best, resumed.best_iter, resumed.bad_steps
        self.last = resumed.last  # of the last evaluation
        self.progress = IterationProgress(args, resumed.start_iter, resumed.progress)

    def extra(self, eval_due: bool = False) -> dict:
        """The checkpoint entries of the loop's own state (collective: every rank's random-number state is gathered):
        ``rng_state``, ``bad_steps``, ``best_miou`` and ``best_iter``, ``eval_due`` (the evaluation of the saved
        iteration is still to be done: the resumed run does it first) and ``progress`` (segmentation/state.py)."""
        return {**rng_state_entries(), 'bad_steps': self.bad, 'best_miou': self.best, 'best_iter': self.best_iter,
                'eval_due': eval_due, 'progress': self.progress.state()}

    def save(self, done: int, eval_due: bool = False) -> None:
        """checkpoint.pth after `done` iterations."""
        self.checkpoints.save(done, self.extra(eval_due), [checkpoint.LAST])

    def evaluate_and_save(self, done: int) -> int | None:
        """Save checkpoint.pth with the evaluation of `done` iterations due (a stop or a failure while it runs
        loses neither the training nor the evaluation), evaluate, save checkpoint.pth again with the scores (and
        best.pth when the mIoU improved), log them. Returns the exit status when a stop signal on any process cut
        the evaluation short (its checkpoint keeps it due) or arrived meanwhile, else None."""
        _sync_bn_buffers(self.args, self.bare)
        self.save(done, eval_due=True)
        result = evaluate_segmentor(self.args, self.bare, self.val_loader, self.device, self.amp_dtype,
                                    self.stop_flag)
        self.train_model.train()
        # every process takes the same path below (log.txt's line is written in a collective)
        aborted, stop = (v > 0 for v in distributed.all_reduce_max(
            [float(result['aborted']), float(self.stop_flag.requested)], self.device))
        if aborted:
            return self.stopped(done, eval_due=True)
        print(miou.class_table(result))
        print(f'Iteration {done}: ' + miou.summary_line(result, self.args.eval_mode))
        record = eval_record(result, self.args, iter=done, train_loss=self.progress.take_mean(),
                             lr=poly_lr(done - 1, self.args))
        names, self.last = [checkpoint.LAST], result['mIoU']
        if result['mIoU'] > self.best:
            self.best, self.best_iter = result['mIoU'], done
            names.append(checkpoint.BEST)
        self.checkpoints.save(done, {**self.extra(), 'log': record}, names)
        self.checkpoints.append_log(record)
        return self.stopped(done) if stop else None


def train(run: Run, optimizer, start: int, train_loader, eval_due: bool = False) -> int:
    """Iterations `start` .. --iters (after the evaluation of `start` when it is `eval_due`): one optimizer step
    each, an evaluation and a checkpoint every --eval-interval, a checkpoint every --save-interval, and at a
    stop signal or an unreadable training batch, which end the run."""
    args = run.args
    criterion = SegLoss(args.aux_weight)
    if args.eval_at_start and start == 0:
        result = evaluate_segmentor(args, run.bare, run.val_loader, run.device, run.amp_dtype, None)
        print(miou.class_table(result))
        print('Before training: ' + miou.summary_line(result, args.eval_mode))
        run.checkpoints.append_log(eval_record(result, args, iter=0))
    code = run.evaluate_and_save(start) if eval_due else None
    if code is not None:
        return code
    run.train_model.train()
    batches = iter(train_loader)
    batch = run.next_batch(batches) if start < args.iters else None
    run.raise_data_error(start, saved=False)
    for it in range(start, args.iters):
        for group in optimizer.param_groups:
            group['lr'] = poly_lr(it, args)
        images, labels = (t.to(run.device, non_blocking=True) for t in batch)
        # the next batch is read before this step, whose agreement ends every process when one cannot read it
        batch = run.next_batch(batches) if it + 1 < args.iters else None
        out = run.step(run.train_model, criterion, images, labels.long(), it, None, stop_flag=run.request)
        run.bad = count_bad_steps(run.bad, out, it, args.max_bad_steps)
        run.progress.add(it, out.losses, optimizer, labels)
        done = it + 1
        due = done % args.eval_interval == 0 or done == args.iters
        if out.stop:
            run.save(done, eval_due=due)
            run.raise_data_error(done, saved=True)
            return run.stopped(done, eval_due=due)
        code = run.evaluate_and_save(done) if due else None
        if code is not None:
            return code
        if not due and done % args.save_interval == 0:
            run.save(done)
    return training_done(run)


def warn_global_batch(args) -> None:
    """A warning when the images per optimizer step are not the recipe's 16 (training.optim.global_batch_warning)."""
    line = global_batch_warning(batch_size=args.batch_size, world=distributed.get_world_size(),
                                recipe_batch=RECIPE_GLOBAL_BATCH)
    if line:
        print(line)


def _sync_bn_buffers(args, model) -> None:
    """Every rank holds rank 0's BatchNorm statistics before evaluating (DDP re-broadcasts them at every forward;
    with per-process BatchNorm they drift apart in between)."""
    if args.distributed:
        timm.utils.distribute_bn(model, distributed.get_world_size(), reduce=False)


def training_done(run: Run) -> int:
    """The end of a finished run: each rank's weight digest under DDP, the mIoU of the final weights (the
    evaluation of the last iteration) and the best one."""
    run.print_digest(run.bare)
    last = '-' if run.last is None else f'{run.last:.2f}'
    print(f'Training done: mIoU {last} at the last iteration ({run.args.iters}), best mIoU {run.best:.2f} at '
          f'iteration {run.best_iter}')
    return 0


class IterationProgress:
    """A progress line every --print-freq iterations: iteration, ETA, LR, mean loss since the last line, img/s;
    once, a note when a line's batches held no labelled pixel (the loss is then 0). The losses and the labelled
    pixel counts stay on the device until a line is printed. `state()` is what a checkpoint keeps of it (the
    losses not yet in a log line), `saved` such a state to continue from."""

    def __init__(self, args, start: int, saved: dict | None = None):
        self.args, self.start, self.t0 = args, start, time.time()
        saved = saved or {}
        # the iterations since the last line: those of a resumed checkpoint (numbers), then this run's (tensors)
        self.carried: list[float] = list(saved.get('losses', []))
        self.carried_labelled = int(saved.get('labelled', 0))
        self.losses: list[torch.Tensor] = []
        self.labelled: list[torch.Tensor] = []
        self.since_eval: list[float] = list(saved.get('since_eval', []))  # the lines since the last evaluation
        self.t_line, self.it_line = self.t0, start
        self.noted = False

    def state(self) -> dict:
        """The losses (and labelled pixels) of the iterations since the last line, the losses of the lines since
        the last evaluation."""
        return {'losses': self._window_losses(), 'labelled': self._window_labelled(),
                'since_eval': list(self.since_eval)}

    def _window_losses(self) -> list[float]:
        return self.carried + (torch.stack(self.losses).tolist() if self.losses else [])

    def _window_labelled(self) -> int:
        return self.carried_labelled + (int(torch.stack(self.labelled).sum()) if self.labelled else 0)

    def add(self, it: int, losses: torch.Tensor, optimizer, labels: torch.Tensor) -> None:
        """Note iteration `it`'s losses and the labelled pixels of its batch; print the line when it is due."""
        self.losses.append(losses.detach().float().mean())
        self.labelled.append((labels != ade.IGNORE_INDEX).sum())
        done = it + 1
        if done % self.args.print_freq and done != self.args.iters:
            return
        values, labelled = self._window_losses(), self._window_labelled()
        self.carried, self.carried_labelled, self.losses, self.labelled = [], 0, [], []
        finite = [v for v in values if v == v and abs(v) != float('inf')]
        self.since_eval += finite
        now = time.time()
        rate = (done - self.it_line) / max(now - self.t_line, 1e-9)
        eta = (self.args.iters - done) / max(rate, 1e-9)
        images = rate * self.args.batch_size * distributed.get_world_size()
        loss = sum(finite) / len(finite) if finite else float('nan')
        eta_text = time.strftime('%H:%M:%S', time.gmtime(eta)) if eta < 86400 else f'{eta / 86400:.1f} days'
        print(f'Iter [{done}/{self.args.iters}]  eta: {eta_text}  lr: {optimizer.param_groups[0]["lr"]:.3g}  '
              f'loss: {loss:.4f}  img/s: {images:.1f}', flush=True)
        if not labelled and not self.noted:
            self.noted = True
            print(f'Note: the training batches of iterations {self.it_line + 1}..{done} hold no labelled pixel '
                  f'(every label is 0, "other", or 255, both ignored): their loss is 0 and nothing is learnt; '
                  f'label maps hold the classes as 1..{self.args.num_classes}')
        self.t_line, self.it_line = now, done

    def take_mean(self) -> float | None:
        """The mean training loss of the lines printed since the last call."""
        values, self.since_eval = self.since_eval, []
        return sum(values) / len(values) if values else None


def run(argv: list[str] | None = None) -> int:
    """The entry point: parse, run, and end in one line per error (training.iterations.run_script)."""
    return iterations.run_script(get_args_parser(), main, argv)


if __name__ == '__main__':
    sys.exit(run())
