"""Train and evaluate Mask R-CNN (Faster R-CNN with --no-mask) on a NaLaFormer backbone for COCO detection and
instance segmentation.

    python detection/train.py --model NALAFORMER_T --data-path /data/coco --output_dir out/det_t \\
        --pretrained output/t/best.pth
    torchrun --nproc_per_node=8 detection/train.py --model NALAFORMER_T --data-path COCO --output_dir out/det_t
    python detection/train.py --eval --resume out/det_t/checkpoint.pth --data-path COCO

The default recipe is Mask R-CNN 1x as the Swin-style repositories run it (multi-scale 480-800 with the crop
policy, AdamW lr 1e-4, weight decay 0.05 without decay on norms and biases, 12 epochs with the LR x0.1 at epochs 8
and 11, a linear warmup of 500 iterations, a global batch of 16: 8 processes x --batch-size 2, test at 1333x800);
--recipe pvt-1x and 3x are the others (docs/detection.md). The LR is a function of the iteration, the batches
of the run's seed and iteration: a run stops and resumes anywhere inside an epoch. Box (and mask) AP is scored
with COCOeval after every epoch; best.pth keeps the best box AP. Runs from the repository root, as a plain
process, under torchrun or srun; the same command resumes from --output_dir/checkpoint.pth, also after a stop
signal or SLURM's requeue warning.
"""
import argparse
import dataclasses
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or '.') == _HERE:  # `python detection/train.py`: the root's modules
    sys.path[0] = os.path.dirname(_HERE)
elif os.path.dirname(_HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(_HERE))

import timm  # noqa: E402
import torch  # noqa: E402

import cli  # noqa: E402
import samplers  # noqa: E402
from detection import coco, evaluate  # noqa: E402
from detection.model import RECIPES, Recipe, build_detector, step_lr  # noqa: E402
from models import VARIANTS  # noqa: E402
from run import checkpoint, distributed, output_dir, process, resume  # noqa: E402
from run.checkpoint import TrainingParts  # noqa: E402
from run.errors import FlagError, UserError, unknown_model  # noqa: E402
from run.resume import preserved_rng, rng_state_entries  # noqa: E402
from run.weights import load_backbone_weights  # noqa: E402
from training import iterations, loaders  # noqa: E402
from training.image_folder import DataLayoutError, data_error_line  # noqa: E402
from training.optim import global_batch_warning, weight_decay_groups  # noqa: E402
from training.step import OptimizerStep, amp_dtype, count_bad_steps, set_tf32  # noqa: E402

TASK = 'detection'
#: the flags an evaluation or a resume takes from its checkpoint when the command line leaves them out (their
#: parser default is None), with the values a fresh run takes
RECORDED_DEFAULTS = {'model': 'NALAFORMER_T', 'recipe': '1x', 'mask': True, 'drop_path': None}
#: the flags that shape the model: a checkpoint loads only into a model built with the same (num_classes comes
#: from the annotation files)
MODEL_FLAGS = ('model', 'recipe', 'mask', 'num_classes')
#: the flags whose change since the checkpoint a resumed run notes (it follows the command line)
NOTED_FLAGS = ('batch_size', 'world_size', 'epochs', 'lr', 'seed')
#: the recipe fields the command line may override (None: the recipe's)
SCHEDULE = ('epochs', 'lr', 'weight_decay', 'lr_steps', 'warmup_iters')
#: the loss terms of the detector's training forward, in the order the progress line prints them
LOSS_NAMES = ('loss_objectness', 'loss_rpn_box_reg', 'loss_classifier', 'loss_box_reg', 'loss_mask')


def _builds_same(key: str, saved, given) -> bool:
    """Whether a checkpoint's model flag and this run's build the same model: recipes with the same heads."""
    if key == 'recipe':
        return saved in RECIPES and given in RECIPES and RECIPES[saved].heads == RECIPES[given].heads
    if key == 'model':
        return str(saved).upper() == str(given).upper()
    return saved == given


def get_args_parser() -> argparse.ArgumentParser:
    """The command line; the defaults are the recipe's (docs/detection.md)."""
    p = cli.LauncherArgumentParser('detection/train.py', description=__doc__.split('\n')[0], add_help=True)
    g = p.add_argument_group('Model', 'with a checkpoint to evaluate or resume, --model, --recipe, --mask and '
                                      '--drop-path, when not given, take the values it records')
    g.add_argument('--model', default=None, help='backbone: a NaLaFormer variant, or any timm model with '
                                                  'features_only (default: NALAFORMER_T)')
    g.add_argument('--recipe', choices=sorted(RECIPES), default=None,
                   help="1x (default): Swin-style multi-scale; pvt-1x: PVT's single scale; 3x: 36 epochs; demo: "
                        "make det-demo's")
    g.add_argument('--mask', action=argparse.BooleanOptionalAction, default=None,
                   help='Mask R-CNN (default), or Faster R-CNN with --no-mask')
    g.add_argument('--pretrained', default='', help='classification checkpoint or release to start the backbone from')
    g.add_argument('--drop-path', type=cli.RATE, default=None, help="backbone drop path (default: the model's)")
    g = p.add_argument_group('Schedule', "the defaults are the --recipe's")
    g.add_argument('--epochs', type=cli.POSITIVE_INT, default=None)
    g.add_argument('--batch-size', type=cli.POSITIVE_INT, default=None, help="per process (default: the recipe's, "
                                                                            '2: 8 x 2 = 16)')
    g.add_argument('--lr', type=cli.POSITIVE, default=None)
    g.add_argument('--weight-decay', type=cli.NON_NEGATIVE, default=None)
    g.add_argument('--lr-steps', type=cli.POSITIVE_INT, nargs='+', default=None, metavar='EPOCH',
                   help='epochs from which the LR is multiplied by 0.1 once more')
    g.add_argument('--warmup-iters', type=cli.NON_NEGATIVE_INT, default=None)
    g.add_argument('--clip-grad', type=cli.POSITIVE, default=None)
    g.add_argument('--max-bad-steps', type=cli.NON_NEGATIVE_INT, default=20)
    g = p.add_argument_group('Data')
    g.add_argument('--data-path', default=None, help='the COCO folder: train2017/, val2017/, annotations/')
    g.add_argument('--num_workers', '--num-workers', dest='num_workers', type=cli.NON_NEGATIVE_INT, default=None)
    g.add_argument('--pin-mem', action=argparse.BooleanOptionalAction, default=True)
    g = p.add_argument_group('Evaluation')
    g.add_argument('--eval', action='store_true', help='evaluate --resume (or --output_dir/checkpoint.pth) only')
    g.add_argument('--show-dir', default='', help='with --eval: write each validation image with its predicted '
                                                  'boxes and masks there')
    g.add_argument('--eval-interval', type=cli.POSITIVE_INT, default=1, help='epochs between evaluations')
    g.add_argument('--dist-eval', action=argparse.BooleanOptionalAction, default=None)
    g = p.add_argument_group('Run')
    iterations.add_run_flags(g)
    g.add_argument('--save-interval', type=cli.NON_NEGATIVE_INT, default=0,
                   help='iterations between checkpoints besides those of the evaluations and stops (0: none)')
    return p


def check_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Flags that cannot work together: argparse's two lines (exit 2) before anything starts."""
    if args.model is not None and not timm.is_model(args.model):
        parser.error(unknown_model(args.model, VARIANTS, timm.list_models()))
    if not args.data_path:
        parser.error(f'--data-path is required: the COCO folder ({coco.LAYOUT})')
    iterations.check_run_flags(args, parser)


def take_flags(args: argparse.Namespace, path: str) -> Recipe:
    """The flags the command line leaves out: the recorded ones from the checkpoint `path` ('' for none) or
    RECORDED_DEFAULTS, then the schedule's from the recipe; returns the recipe with the command line's overrides."""
    resume.take_recorded_flags(args, path, RECORDED_DEFAULTS, task=TASK, recorded_flags=tuple(RECORDED_DEFAULTS),
                               model_flags=MODEL_FLAGS, same=_builds_same)
    recipe = RECIPES[args.recipe]
    if args.batch_size is None:
        args.batch_size = recipe.per_process
    for key in SCHEDULE:
        if getattr(args, key) is None:
            value = getattr(recipe, key)
            setattr(args, key, list(value) if isinstance(value, tuple) else value)
    return dataclasses.replace(recipe, epochs=args.epochs, lr=args.lr, weight_decay=args.weight_decay,
                               lr_steps=tuple(args.lr_steps), warmup_iters=args.warmup_iters)


def check_sizes(args: argparse.Namespace, recipe: Recipe, device: torch.device) -> None:
    """Refuse, in one line (FlagError), a --batch-size whose training batch at the recipe's largest image cannot fit
    in the device's memory, by the backbone's lower bound (cli.bytes_per_pixel; FPN and heads come on top), before
    anything of that size is allocated. Backbones other than the NaLaFormer variants pass."""
    memory, words = cli.device_memory(device)
    per_pixel = cli.bytes_per_pixel(args.model, training=True, half=args.amp is not None)
    if memory is None or per_pixel is None or args.eval:
        return
    long, short = recipe.pipeline.max_size, max(recipe.pipeline.scales)
    problem = cli.batch_too_big(
        what=f'--batch-size {args.batch_size}: one training batch of --recipe {args.recipe}', model=args.model,
        per_pixel=per_pixel, pixels=long * short, batch=args.batch_size, shape=f'up to {long}x{short}', memory=memory,
        memory_words=words)
    if problem:
        most = int(memory // (per_pixel * long * short))
        fix = f'--batch-size {most}' if most else 'a device with more memory'
        raise FlagError(f'{problem}; use {fix} (and more processes for the global batch)')


def coco_datasets(args: argparse.Namespace, recipe: Recipe) -> tuple[coco.CocoDetection | None, coco.CocoDetection]:
    """(training set or None for --eval, validation set); a wrong layout or annotation file is one line, as are
    a training and a validation file with other categories."""
    try:
        train = None if args.eval else coco.CocoDetection(args.data_path, coco.SPLITS['train'], recipe.pipeline,
                                                          masks=args.mask, seed=args.seed)
        val = coco.CocoDetection(args.data_path, coco.SPLITS['val'], test_scale=recipe.test_scale, masks=False)
    except DataLayoutError as e:
        raise UserError(data_error_line(e)) from e
    if train is not None and train.cat_ids != val.cat_ids:
        raise UserError(f'{train.ann_file} and {val.ann_file} list other categories ({len(train.cat_ids)} and '
                        f'{len(val.cat_ids)}, ids {train.cat_ids[:5]}... and {val.cat_ids[:5]}...); use the '
                        f'annotation files of one data set')
    return train, val


def coco_loaders(args, train_set, val_set, start_iter: int, total_iters: int | None):
    """(training batches from `start_iter` to `total_iters`, or None; validation loader of one image a batch, this
    rank's share with --dist-eval)."""
    world, rank = distributed.get_world_size(), distributed.get_rank()
    common = dict(num_workers=args.num_workers, pin_memory=args.pin_mem and str(args.device).startswith('cuda'),
                  worker_init_fn=process.worker_init_fn, collate_fn=coco.collate)
    sampler_val = (samplers.DistributedEvalSampler(val_set, world, rank) if args.dist_eval and world > 1
                   else torch.utils.data.SequentialSampler(val_set))
    val = loaders.DataLoader(val_set, sampler=sampler_val, batch_size=1, **common)
    if train_set is None:
        return None, val
    sampler = coco.GroupedBatchSampler(train_set.aspect_groups(), args.batch_size, world, rank, args.seed,
                                       start=start_iter, end=total_iters)
    # its own generator: creating the iterator draws no number from the run's random stream (exact resume)
    train = loaders.DataLoader(train_set, batch_sampler=sampler, generator=torch.Generator(), persistent_workers=False,
                               **common)
    return train, val


def steps_per_epoch(args, train_set) -> int:
    """Optimizer steps of an epoch at this run's batch and number of processes (coco.GroupedBatchSampler's)."""
    return coco.GroupedBatchSampler(train_set.aspect_groups(), args.batch_size, distributed.get_world_size()).steps


def evaluate_detector(args, model, val_loader, device, amp, stop_flag, show=None) -> dict:
    """Box (and mask) AP of `model` (one pass, exact over the processes with --dist-eval)."""
    val = val_loader.dataset
    with preserved_rng():
        return evaluate.evaluate(model, val_loader, val.coco, val.label_to_category, device, mask=args.mask,
                                 amp_dtype=amp, stop_flag=stop_flag, print_freq=max(1, args.print_freq), show=show)


def eval_record(result: dict, **extra) -> dict:
    """The log.txt line of an evaluation: COCOeval's six figures per type, the images scored and the detections
    made on them."""
    return {**extra, **{k: v for k, v in result.items() if k.startswith(('box_', 'mask_'))},
            'images': result['images'], 'detections': result['detections']}


def print_scores(result: dict, prefix: str = '') -> None:
    """COCOeval's lines, then 'box AP XX.X  mask AP XX.X'."""
    print('\n'.join(result['lines']))
    print(prefix + evaluate.summary_line(result))


def shower(args, val_set):
    """--show-dir's callback for evaluate.predict: each image with its detections, named as the image."""
    if not args.show_dir:
        return None
    index = {image_id: i for i, image_id in enumerate(val_set.image_ids)}

    def show(image_id: int, det: dict) -> None:
        path = val_set.image_path(index[image_id])
        name = os.path.splitext(os.path.basename(path))[0] + '.png'
        evaluate.save_detections(os.path.join(args.show_dir, name), path, {k: v.cpu() for k, v in det.items()},
                                 val_set.class_names)
    return show


def evaluate_detector_checkpoint(args, checkpoints, path, *, val_set, amp, stop_flag) -> int:
    """--eval: the AP of the checkpoint's weights, printed and appended to --output_dir/log.txt."""
    model, device = checkpoints.parts.model, checkpoints.device
    ckpt = resume.load_iteration_checkpoint(path, checkpoints, MODEL_FLAGS, _builds_same)
    if args.show_dir:
        distributed.on_every_rank(lambda: output_dir.prepare_show_dir(args.show_dir), device,
                                  f'--show-dir {args.show_dir}')
    _, val_loader = coco_loaders(args, None, val_set, 0, None)
    result = evaluate_detector(args, model, val_loader, device, amp, stop_flag, shower(args, val_set))
    if result['aborted']:
        print(f'Evaluation stopped by {stop_flag.name() or "a stop signal on another rank"}: no AP reported')
        return process.stopped_status(args.launcher, stop_flag, saved=False)
    print_scores(result)
    checkpoints.append_log(eval_record(result, eval=path, iter=ckpt.get('iter')))
    return 0


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """A run: the process group, the data, the model, then --eval or training; returns the exit status."""
    check_flags(args, parser)
    device, stop_flag = iterations.start_run(args)
    world, rank = distributed.get_world_size(), distributed.get_rank()
    output = cli.settings(output_dir.OutputDirSettings, args)
    resume_path = output_dir.agree_on_resume_path(output, device)
    recipe = distributed.on_every_rank(lambda: take_flags(args, resume_path), device, f'--resume {resume_path}')
    check_sizes(args, recipe, device)
    timm.utils.random_seed(args.seed, rank)
    set_tf32(device, args.tf32)
    output_dir.prepare_output_dir(output, device)
    train_set, val_set = coco_datasets(args, recipe)
    args.num_classes = len(val_set.cat_ids)
    dropped = ''
    if train_set is not None:
        dropped = ' (left out of training: ' + ', '.join(f'{n} {why}' for why, n in train_set.dropped.items()) + ')'
    print(f'Data: {len(train_set) if train_set is not None else "-"} training / {len(val_set)} validation images, '
          f'{args.num_classes} classes{dropped}')
    model = build_detector(args.model, args.num_classes, mask=args.mask, heads=recipe.heads, drop_path=args.drop_path)
    if args.pretrained and not resume_path:
        print(distributed.on_every_rank(
            lambda: load_backbone_weights(model.backbone.body, args.pretrained, args.model, TASK), device,
            f'--pretrained {args.pretrained}'))
    n_parameters = sum(p.numel() for p in model.parameters())
    print(f'Model: {"Mask" if args.mask else "Faster"} R-CNN with FPN over {args.model}, recipe {args.recipe}: '
          f'{n_parameters / 1e6:.2f}M parameters')
    model.to(device)
    train_model, _, _ = distributed.wrap_model(LossForward(model), device, distributed=args.distributed,
                                               sync_bn=args.sync_bn, compile=False)
    groups = weight_decay_groups(model, args.weight_decay, decay_all=recipe.norm_bias_decay)
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=recipe.betas)
    amp = amp_dtype(args.amp)
    scaler = torch.amp.GradScaler(device.type) if args.amp == 'fp16' else None
    checkpoints = checkpoint.IterationCheckpoints(
        task=TASK, output_dir=args.output_dir, parts=TrainingParts(model, optimizer=optimizer, loss_scaler=scaler),
        run_args=checkpoint.args_to_dict(args), n_parameters=n_parameters, device=device)
    if args.eval:
        return evaluate_detector_checkpoint(args, checkpoints, resume_path, val_set=val_set, amp=amp,
                                            stop_flag=stop_flag)
    steps = steps_per_epoch(args, train_set)
    resumed = resume.resume_iteration_run(resume_path, checkpoints, model_flags=MODEL_FLAGS, noted_flags=NOTED_FLAGS,
                                          best_key='best_box_ap', score_key='box_AP', same=_builds_same)
    # room for checkpoint.pth, its replacement while it is written and best.pth
    checkpoint.check_room(args.output_dir, checkpoint.checkpoint_bytes(model, resume_path=resume_path), device)
    if resumed.ckpt is not None:
        resumed.start_iter = continued_iteration(resumed.ckpt, steps)
        due = '; its evaluation, which the stop left due, comes first' if resumed.eval_due else ''
        print(f'Resumed from {resume_path}: continuing at iteration {resumed.start_iter} of {args.epochs * steps}'
              f'{due}')
        resumed.ckpt = None
    output_dir.save_args(args.output_dir, checkpoints.run_args, device)
    line = global_batch_warning(batch_size=args.batch_size, world=world, recipe_batch=recipe.batch_size)
    if line:
        print(line)
    train_loader, val_loader = coco_loaders(args, train_set, val_set, resumed.start_iter, args.epochs * steps)
    step = OptimizerStep(optimizer, device, amp_dtype=amp, scaler=scaler, clip_grad=args.clip_grad)
    run = Run(args, recipe=recipe, steps=steps, train_model=train_model, step=step, checkpoints=checkpoints,
              resumed=resumed, val_loader=val_loader, amp=amp, stop_flag=stop_flag)
    return run.train(optimizer, train_loader, resumed.eval_due)


def same_point_of_epoch(done: int, saved_steps: int, steps: int) -> int:
    """Where `done` iterations of epochs of `saved_steps` steps continue in epochs of `steps` (another batch or
    number of processes): the same epoch, after the share of it that was done."""
    epoch, into = divmod(done, saved_steps)
    return epoch * steps + min(steps, round(into * steps / saved_steps))


def continued_iteration(ckpt: dict, steps: int) -> int:
    """The iteration a resumed run continues at: the checkpoint's, moved into this run's epochs when it recorded
    epochs of another length (a relaunch on another number of processes), with a note."""
    done, saved_steps = int(ckpt['iter']), int(ckpt.get('steps_per_epoch') or steps)
    if saved_steps == steps:
        return done
    start = same_point_of_epoch(done, saved_steps, steps)
    print(f'Note: the checkpoint ran epochs of {saved_steps} steps, this run has {steps} (another global batch): '
          f'iteration {done} continues as iteration {start}, at the same point of epoch {done // saved_steps}')
    return start


class LossForward(torch.nn.Module):
    """The module DDP wraps: the detector's training forward on one (images, targets) batch, its loss terms."""

    def __init__(self, detector: torch.nn.Module):
        super().__init__()
        self.detector = detector

    def forward(self, batch: tuple[list, list]) -> dict:
        images, targets = batch
        return self.detector(images, targets)


class Run(iterations.IterationLoop):
    """What the training loop works with: the flags and recipe, the steps of an epoch, the model as trained (DDP)
    and as saved (bare: the one `checkpoints` saves), the optimizer step, the checkpoints, the validation loader,
    the precision, the stop flag (IterationLoop's stop and data-error handling), the best box AP so far and the loss
    terms since the last progress line."""

    def __init__(self, args, *, recipe, steps, train_model, step, checkpoints, resumed, val_loader, amp, stop_flag):
        super().__init__(args, stop_flag)
        self.recipe, self.steps, self.total = recipe, steps, args.epochs * steps
        self.train_model, self.bare, self.step = train_model, checkpoints.parts.model, step
        self.checkpoints, self.val_loader, self.device = checkpoints, val_loader, checkpoints.device
        self.amp = amp
        self.best, self.best_iter, self.bad, self.last = resumed.best, resumed.best_iter, resumed.bad_steps, \
            resumed.last
        progress = resumed.progress or {}
        self.carried = [list(r) for r in progress.get('window', [])]  # rows of a resumed run not yet printed
        self.rows: list[torch.Tensor] = []  # this run's rows: the total loss, then each of LOSS_NAMES present
        self.since_eval = list(progress.get('since_eval', []))  # the total losses of the lines since the last eval
        self.names: list[str] = list(progress.get('names', []))
        self.t_line, self.it_line = time.time(), resumed.start_iter

    def criterion(self, batch, losses: dict, targets) -> torch.Tensor:
        """The training loss: the sum of the detector's loss terms, each kept for the progress line."""
        if not self.names:
            self.names = [n for n in LOSS_NAMES if n in losses] + sorted(set(losses) - set(LOSS_NAMES))
        total = sum(losses[n] for n in self.names)
        self.rows.append(torch.stack([total.detach().float(), *(losses[n].detach().float() for n in self.names)]))
        return total

    def window(self) -> list[list[float]]:
        return self.carried + (torch.stack(self.rows).tolist() if self.rows else [])

    def extra(self, eval_due: bool = False) -> dict:
        """The checkpoint entries of the loop's own state (collective: every rank's random-number state is gathered):
        ``rng_state``, ``bad_steps``, ``best_box_ap`` and ``best_iter``, ``eval_due`` (the evaluation of the saved
        iteration is still to be done: the resumed run does it first), ``steps_per_epoch`` and ``progress`` (the
        loss terms not yet in a progress line, the losses since the last evaluation)."""
        return {**rng_state_entries(), 'bad_steps': self.bad, 'best_box_ap': self.best, 'best_iter': self.best_iter,
                'eval_due': eval_due, 'steps_per_epoch': self.steps,
                'progress': {'window': self.window(), 'since_eval': list(self.since_eval), 'names': self.names}}

    def save(self, done: int, eval_due: bool = False) -> None:
        self.checkpoints.save(done, self.extra(eval_due), [checkpoint.LAST])

    def progress(self, done: int, optimizer) -> None:
        """The progress line every --print-freq iterations and at an epoch's end."""
        if done % self.args.print_freq and done % self.steps:
            return
        rows, self.carried, self.rows = self.window(), [], []
        finite = [r for r in rows if all(v == v and abs(v) != float('inf') for v in r)]
        self.since_eval += [r[0] for r in finite]
        means = [sum(c) / len(finite) for c in zip(*finite)] if finite else [float('nan')] * (len(self.names) + 1)
        now = time.time()
        rate = (done - self.it_line) / max(now - self.t_line, 1e-9)
        eta = (self.total - done) / max(rate, 1e-9)
        eta_text = time.strftime('%H:%M:%S', time.gmtime(eta)) if eta < 86400 else f'{eta / 86400:.1f} days'
        images = rate * self.args.batch_size * distributed.get_world_size()
        terms = '  '.join(f'{n.removeprefix("loss_")}: {v:.4f}' for n, v in zip(self.names, means[1:]))
        epoch, into = divmod(done - 1, self.steps)
        lr = optimizer.param_groups[0]['lr']
        print(f'Epoch [{epoch + 1}][{into + 1}/{self.steps}]  eta: {eta_text}  lr: {lr:.3g}  loss: {means[0]:.4f}  '
              f'{terms}  img/s: {images:.1f}', flush=True)
        self.t_line, self.it_line = now, done

    def evaluate_and_save(self, done: int) -> int | None:
        """Save checkpoint.pth with the evaluation of `done` iterations due, evaluate, save checkpoint.pth again
        with the scores (and best.pth when the box AP improved), log them. Returns the exit status when a stop
        cut the evaluation short (its checkpoint keeps it due) or arrived meanwhile, else None."""
        if self.args.distributed:  # rank 0's BatchNorm statistics everywhere (they drift apart without SyncBN)
            timm.utils.distribute_bn(self.bare, distributed.get_world_size(), reduce=False)
        self.save(done, eval_due=True)
        result = evaluate_detector(self.args, self.bare, self.val_loader, self.device, self.amp, self.stop_flag)
        self.train_model.train()
        stop = distributed.all_reduce_max([float(self.stop_flag.requested)], self.device)[0] > 0
        if result['aborted']:
            return self.stopped(done, eval_due=True)
        epoch = -(-done // self.steps)
        print_scores(result, prefix=f'Epoch {epoch} (iteration {done}): ')
        since, self.since_eval = self.since_eval, []
        record = eval_record(result, epoch=epoch, iter=done, train_loss=sum(since) / len(since) if since else None,
                             lr=step_lr(done - 1, self.steps, self.recipe))
        names, self.last = [checkpoint.LAST], result['box_AP']
        if result['box_AP'] > self.best:
            self.best, self.best_iter = result['box_AP'], done
            names.append(checkpoint.BEST)
        self.checkpoints.save(done, {**self.extra(), 'log': record}, names)
        self.checkpoints.append_log(record)
        return self.stopped(done) if stop else None

    def train(self, optimizer, train_loader, eval_due: bool = False) -> int:
        """Iterations from the resumed one to the last (after the evaluation of the resumed one when it is
        `eval_due`): one optimizer step each, an evaluation and a checkpoint every --eval-interval epochs and at the
        end, a checkpoint every --save-interval iterations, and at a stop signal or an unreadable training batch,
        which end the run."""
        args, start = self.args, self.it_line
        code = self.evaluate_and_save(start) if eval_due else None
        if code is not None:
            return code
        self.train_model.train()
        batches = iter(train_loader)
        batch = self.next_batch(batches) if start < self.total else None
        self.raise_data_error(start, saved=False)
        for it in range(start, self.total):
            for group in optimizer.param_groups:
                group['lr'] = step_lr(it, self.steps, self.recipe)
            images, targets = batch
            images = [im.to(self.device, non_blocking=True) for im in images]
            targets = [{k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in t.items()}
                       for t in targets]
            # the next batch is read before this step, whose agreement ends every process when one cannot read it
            batch = self.next_batch(batches) if it + 1 < self.total else None
            out = self.step(self.train_model, self.criterion, (images, targets), targets, it, None,
                            stop_flag=self.request)
            self.bad = count_bad_steps(self.bad, out, it, args.max_bad_steps)
            done = it + 1
            self.progress(done, optimizer)
            due = done == self.total or (done % self.steps == 0 and (done // self.steps) % args.eval_interval == 0)
            if out.stop:
                self.save(done, eval_due=due)
                self.raise_data_error(done, saved=True)
                return self.stopped(done, eval_due=due)
            code = self.evaluate_and_save(done) if due else None
            if code is not None:
                return code
            if not due and args.save_interval and done % args.save_interval == 0:
                self.save(done)
        return self.done()

    def done(self) -> int:
        """The end of a finished run: each rank's weight digest under DDP, the box AP of the final weights and the
        best one."""
        self.print_digest(self.bare)
        last = '-' if self.last is None else f'{self.last:.1f}'
        print(f'Training done: box AP {last} at the last iteration ({self.total}), best box AP {self.best:.1f} at '
              f'iteration {self.best_iter}')
        return 0


def run(argv: list[str] | None = None) -> int:
    """The entry point: parse, run, and end in one line per error (training.iterations.run_script)."""
    return iterations.run_script(get_args_parser(), main, argv)


if __name__ == '__main__':
    sys.exit(run())
