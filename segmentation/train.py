"""Train and evaluate UperNet on a NaLaFormer backbone for ADE20K semantic segmentation (DeiT-style script).

    python segmentation/train.py --model NALAFORMER_T --data-path /data/ADEChallengeData2016 --output_dir out/seg_t \\
        --pretrained output/t/best.pth
    torchrun --nproc_per_node=8 segmentation/train.py --model NALAFORMER_T --data-path ADE --output_dir out/seg_t
    python segmentation/train.py --eval --resume out/seg_t/checkpoint.pth --model NALAFORMER_T --data-path ADE

The defaults are mmseg's UperNet ADE20K recipe of Swin/ConvNeXt-style backbones: 160k iterations at a global
batch of 16 (8 processes x --batch-size 2), 512² crops, AdamW lr 6e-5, weight decay 0.01, poly schedule after a
linear warmup of 1500 iterations, auxiliary FCN head weighted 0.4, single-scale whole-image evaluation
(docs/segmentation.md). Runs from the repository root, as a plain process, under torchrun or srun; the same
command resumes from --output_dir/checkpoint.pth, also after a stop signal or SLURM's requeue warning.
"""
import argparse
import dataclasses
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or '.') == _HERE:  # `python segmentation/train.py`: the root's modules
    sys.path[0] = os.path.dirname(_HERE)
elif os.path.dirname(_HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(_HERE))

import timm  # noqa: E402
import torch  # noqa: E402

import cli  # noqa: E402
import cpu  # noqa: E402
import distributed  # noqa: E402
import exits  # noqa: E402
import loaders  # noqa: E402
import optim_step  # noqa: E402
import precision  # noqa: E402
import run_dir  # noqa: E402
import samplers  # noqa: E402
import saver  # noqa: E402
import signals  # noqa: E402
from checkpoint import args_to_dict  # noqa: E402
from errors import NonFiniteLossError, UserError, eprint  # noqa: E402
from image_folder import DataLayoutError  # noqa: E402
from segmentation import ade, backbone, miou, state  # noqa: E402
from segmentation.upernet import SegLoss  # noqa: E402
from train_state import preserved_rng  # noqa: E402


def get_args_parser() -> argparse.ArgumentParser:
    """The command line; the defaults are the recipe (docs/segmentation.md)."""
    p = cli.LauncherArgumentParser('segmentation/train.py', description=__doc__.split('\n')[0], add_help=True)
    g = p.add_argument_group('Model')
    g.add_argument('--model', default='NALAFORMER_T', help='backbone: a NaLaFormer variant (any timm model builds)')
    g.add_argument('--pretrained', default='', help='classification checkpoint or release to start the backbone from')
    g.add_argument('--drop-path', type=cli.RATE, default=None, help="backbone drop path (default: the variant's)")
    g.add_argument('--channels', type=cli.POSITIVE_INT, default=512, help='UperNet channels')
    g.add_argument('--aux-weight', type=cli.NON_NEGATIVE, default=0.4, help='auxiliary FCN head loss weight (0: none)')
    g.add_argument('--num-classes', type=cli.POSITIVE_INT, default=150)
    g = p.add_argument_group('Schedule')
    g.add_argument('--iters', type=cli.POSITIVE_INT, default=160000)
    g.add_argument('--batch-size', type=cli.POSITIVE_INT, default=2, help='per process (8 x 2 = 16)')
    g.add_argument('--lr', type=cli.POSITIVE, default=6e-5)
    g.add_argument('--weight-decay', type=cli.NON_NEGATIVE, default=0.01)
    g.add_argument('--warmup-iters', type=cli.NON_NEGATIVE_INT, default=1500)
    g.add_argument('--warmup-ratio', type=cli.POSITIVE, default=1e-6)
    g.add_argument('--power', type=cli.POSITIVE, default=1.0, help='poly schedule power')
    g.add_argument('--min-lr', type=cli.NON_NEGATIVE, default=0.0)
    g.add_argument('--clip-grad', type=cli.POSITIVE, default=None)
    g.add_argument('--max-bad-steps', type=cli.NON_NEGATIVE_INT, default=20)
    g = p.add_argument_group('Data')
    g.add_argument('--data-path', default=None, help='the ADEChallengeData2016 folder')
    g.add_argument('--crop-size', type=cli.ranged(int, 32), default=512)
    g.add_argument('--img-scale', type=cli.POSITIVE_INT, nargs=2, default=(2048, 512), metavar=('LONG', 'SHORT'))
    g.add_argument('--ratio-range', type=cli.POSITIVE, nargs=2, default=(0.5, 2.0), metavar=('MIN', 'MAX'))
    g.add_argument('--cat-max-ratio', type=cli.ranged(float, 0, 1, lo_open=True), default=0.75)
    g.add_argument('--num_workers', '--num-workers', dest='num_workers', type=cli.NON_NEGATIVE_INT, default=None)
    g.add_argument('--pin-mem', action=argparse.BooleanOptionalAction, default=True)
    g = p.add_argument_group('Evaluation')
    g.add_argument('--eval', action='store_true', help='evaluate --resume (or --output_dir/checkpoint.pth) only')
    g.add_argument('--eval-mode', choices=['whole', 'slide'], default='whole')
    g.add_argument('--slide-stride', type=cli.POSITIVE_INT, default=341, help='slide mode: stride of the crops')
    g.add_argument('--eval-interval', type=cli.POSITIVE_INT, default=16000)
    g.add_argument('--eval-at-start', action='store_true', help='also evaluate the model before training')
    g.add_argument('--dist-eval', action=argparse.BooleanOptionalAction, default=None)
    g = p.add_argument_group('Run')
    g.add_argument('--output_dir', '--output-dir', dest='output_dir', default='')
    g.add_argument('--resume', default='')
    g.add_argument('--auto-resume', action=argparse.BooleanOptionalAction, default=True)
    g.add_argument('--overwrite', action='store_true')
    g.add_argument('--no-lock', dest='lock', action='store_false')
    g.add_argument('--save-interval', type=cli.POSITIVE_INT, default=16000)
    g.add_argument('--print-freq', type=cli.POSITIVE_INT, default=50)
    g.add_argument('--device', default='cuda')
    g.add_argument('--amp', nargs='?', const='fp16', default=None, choices=['fp16', 'bf16'])
    g.add_argument('--tf32', action=argparse.BooleanOptionalAction, default=True)
    g.add_argument('--sync-bn', action=argparse.BooleanOptionalAction, default=True)
    g.add_argument('--seed', type=cli.ranged(int, 0, 2 ** 32 - 1), default=0)
    g.add_argument('--cpu-malloc', choices=['retain', 'system'], default='retain')
    g.add_argument('--dist_url', '--dist-url', dest='dist_url', default='env://')
    g.add_argument('--dist-timeout', type=cli.POSITIVE, default=1800)
    g.add_argument('--local_rank', '--local-rank', dest='local_rank', type=int, default=None, help=argparse.SUPPRESS)
    return p


def validate_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Flags that cannot work together: argparse's two lines (exit 2) before anything starts."""
    if not timm.is_model(args.model):
        parser.error(f"unknown model '{args.model}' (a NaLaFormer variant, e.g. NALAFORMER_T)")
    if not args.data_path:
        parser.error('--data-path is required: the ADEChallengeData2016 folder (images/ and annotations/)')
    _, world, _, _ = distributed.launch_env()
    if args.dist_eval is None:
        args.dist_eval = world > 1
    rank0 = distributed.launch_env()[0] == 0
    for flag, path in (('--resume', args.resume), ('--pretrained', args.pretrained)):
        if path and rank0 and not os.path.isfile(path):
            parser.error(f'{flag} {path}: no such file')
    if args.eval and not run_dir.find_resume_path(cli.settings(run_dir.RunDirSettings, args)):
        parser.error('--eval needs a checkpoint: pass --resume PATH (or an --output_dir holding checkpoint.pth)')
    if args.ratio_range[0] > args.ratio_range[1]:
        parser.error(f'--ratio-range {args.ratio_range[0]} {args.ratio_range[1]}: MIN above MAX')
    if args.batch_size == 1 and not args.eval and not (world > 1 and str(args.device).startswith('cuda')
                                                       and args.sync_bn and torch.cuda.is_available()):
        parser.error('--batch-size 1: the pooling branch of UperNet normalises one value per channel, which '
                     'BatchNorm cannot train on; use --batch-size 2 or more per process (or SyncBatchNorm on GPUs)')
    cli.check_device(args.device, world, parser)


def lr_at(it: int, args: argparse.Namespace) -> float:
    """mmcv's poly schedule with linear warmup (by iteration): (lr - min_lr) (1 - it / iters)^power + min_lr,
    scaled during the first warmup_iters by 1 - (1 - it / warmup_iters)(1 - warmup_ratio)."""
    lr = (args.lr - args.min_lr) * (1 - it / args.iters) ** args.power + args.min_lr
    if it < args.warmup_iters:
        lr *= 1 - (1 - it / args.warmup_iters) * (1 - args.warmup_ratio)
    return lr


class IterationSampler(torch.utils.data.Sampler):
    """This rank's (epoch, index) keys from iteration `start` on, without end. Epoch e is torch's
    DistributedSampler order of epoch e (shuffled with seed + e, padded to a multiple of the processes) cut to
    whole batches, so iteration `it` is step it % steps of epoch it // steps, whatever was run before."""

    def __init__(self, n: int, world: int, rank: int, batch_size: int, seed: int, start: int = 0):
        self.n, self.world, self.rank, self.batch_size, self.seed, self.start = n, world, rank, batch_size, seed, start
        self.steps = -(-n // world) // batch_size  # whole batches per epoch

    def __iter__(self):
        epoch, skip = divmod(self.start, self.steps)
        while True:
            order = torch.utils.data.DistributedSampler(range(self.n), self.world, self.rank, shuffle=True,
                                                        seed=self.seed)
            order.set_epoch(epoch)
            for index in list(order)[skip * self.batch_size:self.steps * self.batch_size]:
                yield epoch, index
            epoch, skip = epoch + 1, 0


def build_data(args: argparse.Namespace) -> tuple[ade.ADE20K | None, ade.ADE20K]:
    """(training set or None for --eval, validation set); a wrong layout is one line."""
    try:
        pipeline = ade.TrainPipeline(crop=(args.crop_size, args.crop_size), img_scale=tuple(args.img_scale),
                                     ratio_range=tuple(args.ratio_range), cat_max_ratio=args.cat_max_ratio)
        train = None if args.eval else ade.ADE20K(args.data_path, ade.SPLITS['train'], args.num_classes, pipeline,
                                                  seed=args.seed)
        val = ade.ADE20K(args.data_path, ade.SPLITS['val'], args.num_classes, eval_scale=tuple(args.img_scale))
    except DataLayoutError as e:
        raise UserError(str(e)) from e
    return train, val


def build_loaders(args, train_set, val_set, start_iter: int):
    """(training batches from `start_iter` on, or None; validation loader of one image a batch, this rank's
    share with --dist-eval)."""
    world, rank = distributed.get_world_size(), distributed.get_rank()
    common = dict(num_workers=args.num_workers, pin_memory=args.pin_mem and str(args.device).startswith('cuda'),
                  worker_init_fn=signals.worker_init_fn)
    sampler_val = (samplers.DistributedEvalSampler(val_set, world, rank) if args.dist_eval and world > 1
                   else torch.utils.data.SequentialSampler(val_set))
    val = loaders.DataLoader(val_set, sampler=sampler_val, batch_size=1, **common)
    if train_set is None:
        return None, val
    sampler = IterationSampler(len(train_set), world, rank, args.batch_size, args.seed, start_iter)
    if sampler.steps == 0:
        raise UserError(f'the training set ({len(train_set)} images) gives no full batch of {args.batch_size} per '
                        f'process on {world} process(es); lower --batch-size')
    # its own generator: creating the iterator draws no number from the run's random stream (exact resume)
    train = loaders.DataLoader(train_set, sampler=sampler, batch_size=args.batch_size, drop_last=True,
                             generator=torch.Generator(), persistent_workers=False, **common)
    return train, val


def evaluate(args, model, val_loader, device, amp_dtype, stop_flag) -> dict:
    """The validation scores of `model` (one pass, exact over the processes with --dist-eval)."""
    try:
        with preserved_rng():
            return miou.evaluate(model, val_loader, args.num_classes, device, amp_dtype, args.eval_mode,
                                 args.crop_size, args.slide_stride, sum_over_ranks=args.dist_eval and args.distributed,
                                 stop_flag=stop_flag, print_freq=max(1, args.print_freq))
    except ade.LabelError as e:
        raise UserError(ade.error_line(e)) from e


def eval_record(result: dict, args, **extra) -> dict:
    """The log.txt line of an evaluation."""
    return {**extra, 'mIoU': result['mIoU'], 'mAcc': result['mAcc'], 'aAcc': result['aAcc'],
            'images': result['images'], 'eval_mode': args.eval_mode, 'IoU': result['IoU']}


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """A run: the process group, the data, the model, then --eval or training; returns the exit status."""
    validate_args(args, parser)
    process = distributed.init_distributed_mode(cli.settings(distributed.DistributedSettings, args))
    vars(args).update(dataclasses.asdict(process))
    if args.amp == 'bf16':  # on the process's own GPU
        precision.check_bf16(args.device)
    stop_flag = signals.StopFlag()
    stop_flag.install()
    device = torch.device(args.device)
    if device.type == 'cpu' and args.cpu_malloc == 'retain':
        cpu.retain_freed_cpu_memory()
    if args.num_workers is None:
        args.num_workers, why = cpu.default_num_workers()
        print(f'Data loader: {args.num_workers} workers per process ({why})')
    world, rank = distributed.get_world_size(), distributed.get_rank()
    print(f'Launcher: {args.launcher}, {world} process(es), device {device}')
    output = cli.settings(run_dir.RunDirSettings, args)
    resume_path = run_dir.agree_on_resume_path(output, device)
    timm.utils.random_seed(args.seed, rank)
    precision.set_tf32(device, args.tf32)
    run_dir.prepare_output_dir(output, device)
    train_set, val_set = build_data(args)
    print(f'Data: {len(train_set) if train_set is not None else "-"} training / {len(val_set)} validation images, '
          f'{args.num_classes} classes')

    model = backbone.build_segmentor(args.model, args.num_classes, args.channels, args.aux_weight > 0,
                                     args.drop_path, args.crop_size)
    if args.pretrained and not resume_path:
        print(distributed.on_every_rank(lambda: backbone.load_pretrained(model, args.pretrained, args.model),
                                        device, f'--pretrained {args.pretrained}'))
    n_parameters = sum(p.numel() for p in model.parameters())
    print(f'Model: UperNet ({args.channels} channels{", auxiliary FCN head" if args.aux_weight else ""}) over '
          f'{args.model}: {n_parameters / 1e6:.2f}M parameters')
    model.to(device)
    train_model, bare, _ = distributed.wrap_model(model, device, distributed=args.distributed, sync_bn=args.sync_bn,
                                                  compile=False)
    optimizer = torch.optim.AdamW(backbone.param_groups(bare, args.weight_decay), lr=args.lr, betas=(0.9, 0.999))
    amp_dtype = precision.amp_dtype(args.amp)
    scaler = torch.amp.GradScaler(device.type) if args.amp == 'fp16' else None
    checkpoints = state.SegCheckpoints(args.output_dir, args_to_dict(args), bare, optimizer, scaler, device,
                                       n_parameters)
    if args.eval:
        return evaluate_checkpoint(args, checkpoints, resume_path, bare, val_set, device, amp_dtype, stop_flag)
    resumed = checkpoints.resume(resume_path)
    # room for checkpoint.pth, its replacement while it is written and best.pth
    saver.check_room(args.output_dir, saver.checkpoint_bytes(bare, resume_path=resume_path), device)
    if resumed.ckpt is not None:
        print(f'Resumed from {resume_path}: continuing at iteration {resumed.start_iter} of {args.iters}')
        resumed.ckpt = None
    train_loader, val_loader = build_loaders(args, train_set, val_set, resumed.start_iter)
    step = optim_step.OptimizerStep(optimizer, device, amp_dtype, scaler, args.clip_grad)
    run = Run(args, train_model, bare, step, checkpoints, resumed, val_loader, device, amp_dtype, stop_flag)
    return train(run, optimizer, resumed.start_iter, train_loader)


def evaluate_checkpoint(args, checkpoints, path, model, val_set, device, amp_dtype, stop_flag) -> int:
    """--eval: the scores of the checkpoint's weights, printed and appended to --output_dir/log.txt."""
    ckpt = checkpoints.load(path)
    _, val_loader = build_loaders(args, None, val_set, 0)
    result = evaluate(args, model, val_loader, device, amp_dtype, stop_flag)
    if distributed.all_reduce_max([float(result['aborted'])], device)[0] > 0:  # on any process
        print(f'Evaluation stopped by {stop_flag.name() or "a stop signal on another rank"}: no mIoU reported')
        return exits.stopped_status(args.launcher, stop_flag, saved=False)
    print(miou.summary_line(result, args.eval_mode))
    checkpoints.append_log(eval_record(result, args, eval=path, iter=ckpt.get('iter')))
    return 0


class Run:
    """What the training loop works with: the flags, the model as trained (DDP) and as saved (bare), the optimizer
    step, the checkpoints, the loaders, the device and precision, the stop flag, and the best mIoU so far."""

    def __init__(self, args, train_model, bare, step, checkpoints, resumed, val_loader, device, amp_dtype, stop_flag):
        self.args, self.train_model, self.bare, self.step = args, train_model, bare, step
        self.checkpoints, self.val_loader, self.device = checkpoints, val_loader, device
        self.amp_dtype, self.stop_flag = amp_dtype, stop_flag
        self.best, self.best_iter, self.bad = resumed.best_miou, resumed.best_iter, resumed.bad_steps
        self.progress = Progress(args, resumed.start_iter)

    def extra(self) -> dict:
        """The checkpoint entries of the loop's own state."""
        return {'bad_steps': self.bad, 'best_miou': self.best, 'best_iter': self.best_iter}

    def stopped(self, done: int) -> int:
        """The line and exit status of a run a stop signal ended (its checkpoint is saved)."""
        print(f'Stopped by {self.stop_flag.name() or "a stop signal on another rank"} after iteration {done}; '
              f'checkpoint saved; run the same command again to resume')
        return exits.stopped_status(self.args.launcher, self.stop_flag)

    def count_bad(self, out, it: int) -> None:
        """Consecutive skipped steps (a non-finite loss, an fp16 overflow); too many end the run."""
        self.bad = self.bad + 1 if out.non_finite is not None or out.overflow else 0
        if out.non_finite is not None:
            eprint(f'warning: non-finite loss ({out.non_finite}) at iteration {it}; step skipped ({self.bad}/'
                   f'{self.args.max_bad_steps} consecutive)')
        if self.bad > self.args.max_bad_steps:
            raise NonFiniteLossError(f'{self.bad} consecutive skipped steps at iteration {it} (more than '
                                     f'--max-bad-steps {self.args.max_bad_steps}); stopped, the last checkpoint '
                                     f'is kept')

    def evaluate_and_save(self, done: int) -> bool:
        """Evaluate after `done` iterations, save checkpoint.pth (and best.pth when the mIoU improved), log the
        scores; True when a stop signal cut the evaluation short or arrived meanwhile, on any process."""
        _sync_bn_buffers(self.args, self.bare)
        result = evaluate(self.args, self.bare, self.val_loader, self.device, self.amp_dtype, self.stop_flag)
        self.train_model.train()
        # every process takes the same path below (log.txt's line is written in a collective)
        aborted, stop = (v > 0 for v in distributed.all_reduce_max(
            [float(result['aborted']), float(self.stop_flag.requested)], self.device))
        names, extra = ['checkpoint.pth'], self.extra()
        if not aborted:
            print(f'Iteration {done}: ' + miou.summary_line(result, self.args.eval_mode))
            record = eval_record(result, self.args, iter=done, train_loss=self.progress.take_mean(),
                                 lr=lr_at(done - 1, self.args))
            if result['mIoU'] > self.best:
                self.best, self.best_iter = result['mIoU'], done
                names.append('best.pth')
            extra.update(best_miou=self.best, best_iter=self.best_iter, log=record)
        self.checkpoints.save(done, names, extra)
        if not aborted:
            self.checkpoints.append_log(extra['log'])
        return aborted or stop


def train(run: Run, optimizer, start: int, train_loader) -> int:
    """Iterations `start` .. --iters: one optimizer step each, an evaluation and a checkpoint every
    --eval-interval, a checkpoint every --save-interval, and at a stop signal, which ends the run."""
    args = run.args
    criterion = SegLoss(args.aux_weight)
    if args.eval_at_start and start == 0:
        result = evaluate(args, run.bare, run.val_loader, run.device, run.amp_dtype, None)
        print('Before training: ' + miou.summary_line(result, args.eval_mode))
        run.checkpoints.append_log(eval_record(result, args, iter=0))
    run.train_model.train()
    batches = iter(train_loader)
    for it in range(start, args.iters):
        for group in optimizer.param_groups:
            group['lr'] = lr_at(it, args)
        try:
            images, labels = next(batches)
        except ade.LabelError as e:
            raise UserError(ade.error_line(e)) from e
        images, labels = images.to(run.device, non_blocking=True), labels.to(run.device, non_blocking=True).long()
        out = run.step(run.train_model, criterion, images, labels, it, None, stop_flag=run.stop_flag)
        run.count_bad(out, it)
        run.progress.add(it, out.losses, optimizer)
        done = it + 1
        if out.stop:
            run.checkpoints.save(done, ['checkpoint.pth'], run.extra())
            return run.stopped(done)
        if done % args.eval_interval == 0 or done == args.iters:
            if run.evaluate_and_save(done):
                return run.stopped(done)
        elif done % args.save_interval == 0:
            run.checkpoints.save(done, ['checkpoint.pth'], run.extra())
    return finish(args, run.bare, run.best, run.best_iter)


def _sync_bn_buffers(args, model) -> None:
    """Every rank holds rank 0's BatchNorm statistics before evaluating (DDP re-broadcasts them at every forward;
    with per-process BatchNorm they drift apart in between)."""
    if args.distributed:
        timm.utils.distribute_bn(model, distributed.get_world_size(), reduce=False)


def finish(args, bare, best: float, best_iter: int | None) -> int:
    """The end of a finished run: each rank's weight digest under DDP, the best mIoU."""
    if args.distributed:  # DDP keeps the weights identical: every rank says so
        print(f'[rank {distributed.get_rank()}] final weights sha256: {distributed.state_digest(bare.state_dict())}',
              force=True)
    print(f'Training done: best mIoU {best:.2f} at iteration {best_iter}')
    return 0


class Progress:
    """A progress line every --print-freq iterations: iteration, ETA, LR, mean loss since the last line, img/s.
    The losses stay on the device until a line is printed."""

    def __init__(self, args, start: int):
        self.args, self.start, self.t0 = args, start, time.time()
        self.losses: list[torch.Tensor] = []
        self.since_eval: list[float] = []
        self.t_line, self.it_line = self.t0, start

    def add(self, it: int, losses: torch.Tensor, optimizer) -> None:
        """Note iteration `it`'s losses; print the line when it is due."""
        self.losses.append(losses.detach().float().mean())
        done = it + 1
        if done % self.args.print_freq and done != self.args.iters:
            return
        values = torch.stack(self.losses).tolist()
        self.losses = []
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
        self.t_line, self.it_line = now, done

    def take_mean(self) -> float | None:
        """The mean training loss of the lines printed since the last call."""
        values, self.since_eval = self.since_eval, []
        return sum(values) / len(values) if values else None


def run(argv: list[str] | None = None) -> int:
    """The entry point: parse, run, and end as exits.finish says (one line per error)."""
    parser = get_args_parser()
    args = parser.parse_args(argv)
    return exits.finish(lambda: run_dir.leave_nothing_unused(lambda: main(args, parser), args.output_dir),
                        lambda: (args.num_workers, args.batch_size))


if __name__ == '__main__':
    sys.exit(run())
