"""Training-step speed and memory of UperNet (or Semantic FPN: --decoder fpn) over several backbones at 512², the
models stepped in turn in one process (what segmentation/train.py runs: UperNet with 512 channels, the auxiliary
FCN head, AdamW, the loss of both heads), so that load changes on a shared machine hit every model alike.

    python segmentation/upernet_benchmark.py --models NALAFORMER_T,swin_tiny_patch4_window7_224,convnext_tiny \\
        -b 2 --device cpu --threads 2
    python segmentation/upernet_benchmark.py -b 8 --device cuda --amp bf16 --steps 20     # one GPU
    python segmentation/upernet_benchmark.py --pipeline 32    # the data pipeline alone: img/s of one loader process
    python segmentation/upernet_benchmark.py --macs           # fvcore multiply-adds of each model, backbone and head,
                                                              # at --size² and at 512x2048 (--macs-size)
    python segmentation/upernet_benchmark.py --macs --decoder fpn --channels 128   # Semantic FPN's

Per model: parameters, the median of the timed steps as img/s, its ratio to the first model, and the peak
tensor memory of one step above what was live before it (``tools.timing.peak_bytes``, the measure of the
tools/ benchmarks: the CUDA allocator's peak on a GPU, the profiler's allocation record on a CPU). Backbones
are timm's features_only models (Swin is built for the crop size), without pretrained weights; the speed does
not depend on the weights.
"""
import argparse
import json
import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or '.') == _HERE:
    sys.path[0] = os.path.dirname(_HERE)
elif os.path.dirname(_HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

from run.errors import FlagParser  # noqa: E402
from segmentation.upernet import SegLoss, build_segmentor  # noqa: E402
from tools.timing import peak_bytes, time_call  # noqa: E402
from training.optim import weight_decay_groups  # noqa: E402
from training.step import amp_dtype, autocast, set_tf32  # noqa: E402

DEFAULT_MODELS = 'NALAFORMER_T,swin_tiny_patch4_window7_224,convnext_tiny'


def upernet_step(name: str, args: argparse.Namespace, device: torch.device):
    """A training step of the segmentor (--decoder) over `name` on one fixed batch (optimizer included), and its
    parameters."""
    torch.manual_seed(0)
    model = build_segmentor(name, 150, channels=args.channels, img_size=args.size, aux=args.decoder == 'upernet',
                            decoder=args.decoder).to(device).train()
    optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.01), lr=6e-5)
    criterion = SegLoss(0.4)
    x = torch.randn(args.batch_size, 3, args.size, args.size, device=device)
    y = torch.randint(0, 150, (args.batch_size, args.size, args.size), device=device)
    amp = amp_dtype(args.amp)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast(device, amp):
            loss = criterion(x, model(x), y)
        loss.backward()
        optimizer.step()

    return step, optimizer, sum(p.numel() for p in model.parameters())


def measure(args: argparse.Namespace) -> list[dict]:
    """One result per model: img/s of the median step, parameters, peak step memory."""
    device = torch.device(args.device)
    names = args.models.split(',')
    steps, optimizers, params = {}, {}, {}
    for name in names:
        steps[name], optimizers[name], params[name] = upernet_step(name, args, device)
        for _ in range(args.warmup):
            steps[name]()
        print(f'{name}: built, {args.warmup} warm-up step(s)', flush=True)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(args.steps):
        for name in names[i % len(names):] + names[:i % len(names)]:  # a rotating order
            times[name].append(time_call(steps[name], device, 1, warmup=0)[0])
        print(f'round {i + 1} of {args.steps}: ' + ', '.join(f'{n} {times[n][-1]:.2f}s' for n in names), flush=True)
    rows = []
    for name in names:
        optimizers[name].zero_grad(set_to_none=True)
        peak = peak_bytes(steps[name], device)
        step_s = statistics.median(times[name])
        rows.append(dict(model=name, decoder=args.decoder, batch_size=args.batch_size, size=args.size,
                         channels=args.channels,
                         amp=args.amp or 'fp32',
                         device=str(device), threads=torch.get_num_threads(), params_m=params[name] / 1e6,
                         step_s_median=step_s, step_s_all=times[name], img_s=args.batch_size / step_s,
                         peak_step_mib=peak / 2 ** 20))
    return rows


def pipeline_speed(n: int) -> str:
    """img/s of one process (one thread) through the training and the evaluation pipeline, on `n` synthetic
    scenes of ADE20K's typical size (512x683 JPEGs) written to a temporary folder."""
    import tempfile

    from segmentation import ade, scenes
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        scenes.make_scenes(root, n_train=n, n_val=1, size=(512, 683))
        train = ade.ADE20K(root, 'training', scenes.NUM_CLASSES, ade.TrainPipeline())
        val = ade.ADE20K(root, 'training', scenes.NUM_CLASSES)
        train[(0, 0)]
        t0 = time.perf_counter()
        for i in range(n):
            train[(1, i)]
        t1 = time.perf_counter()
        for i in range(n):
            val[i]
        t2 = time.perf_counter()
    return (f'one process, one thread, {n} 512x683 JPEGs: training pipeline {n / (t1 - t0):.1f} img/s '
            f'({1000 * (t1 - t0) / n:.0f} ms/img), evaluation pipeline {n / (t2 - t1):.1f} img/s')


def macs_lines(args: argparse.Namespace) -> list[str]:
    """fvcore multiply-adds of one image through each model in eval mode (the auxiliary head is not run there),
    at --size² and at --macs-size (height, width: 512x2048, the size mmseg's get_flops and the papers report),
    and how they split between the backbone and the head (the neck included)."""
    from models.flop_count import count_flops
    head = 'UperNet head' if args.decoder == 'upernet' else 'Semantic FPN neck and head'
    lines = []
    for size in dict.fromkeys([(args.size, args.size), tuple(args.macs_size)]):
        for name in args.models.split(','):
            model = build_segmentor(name, 150, channels=args.channels, img_size=size, aux=False, decoder=args.decoder)
            total, trunk = count_flops(model, size), count_flops(model.backbone, size)
            lines.append(f'{name}: {total / 1e9:.2f} GMACs at {size[0]}x{size[1]} (backbone {trunk / 1e9:.2f}, '
                         f'{head} {(total - trunk) / 1e9:.2f})')
    return lines


def table(rows: list[dict]) -> str:
    """The results as a table: per model its parameters, median step, img/s, peak step memory, and the first
    model's img/s and memory divided by this one's."""
    first = rows[0]
    decoder = 'Semantic FPN' if first.get('decoder') == 'fpn' else 'UperNet'
    lines = [f"{decoder} ({first.get('channels', 512)} channels) training step, batch {first['batch_size']}, "
             f"{first['size']}x{first['size']}, {first['amp']}, "
             f"{first['device']} ({first['threads']} threads)",
             f"{'model':<30} {'params':>7} {'s/step':>7} {'img/s':>7} {'peak MiB':>8}  {first['model']} / this"]
    for r in rows:
        ratio = (f"speed {first['img_s'] / r['img_s']:.2f}x, memory {first['peak_step_mib'] / r['peak_step_mib']:.2f}x"
                 if r is not first else '-')
        lines.append(f"{r['model']:<30} {r['params_m']:>6.1f}M {r['step_s_median']:>7.2f} {r['img_s']:>7.3f} "
                     f"{r['peak_step_mib']:>8.0f}  {ratio}")
    return '\n'.join(lines)


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    p = FlagParser(description=__doc__.split('\n')[0])
    p.add_argument('--models', default=DEFAULT_MODELS,
                   help='timm backbones, comma-separated; the first is the reference')
    p.add_argument('-b', '--batch-size', type=int, default=2)
    p.add_argument('--size', type=int, default=512)
    p.add_argument('--decoder', choices=['upernet', 'fpn'], default='upernet',
                   help='UperNet (with its auxiliary head when training) or Semantic FPN')
    p.add_argument('--channels', type=int, default=512,
                   help="the head's channels (the recipes': UperNet 512, Semantic FPN 128)")
    p.add_argument('--device', default='cpu')
    p.add_argument('--amp', choices=['fp16', 'bf16'], default=None)
    p.add_argument('--threads', type=int, default=None, help='torch CPU threads')
    p.add_argument('--warmup', type=int, default=1)
    p.add_argument('--steps', type=int, default=5, help='timed rounds (one step of every model each)')
    p.add_argument('--output', default='', help='append the results as JSON lines to this file')
    p.add_argument('--pipeline', type=int, default=0, metavar='N',
                   help='time the data pipeline alone on N synthetic ADE-sized images instead')
    p.add_argument('--macs', action='store_true', help='print fvcore multiply-adds of each model instead')
    p.add_argument('--macs-size', type=int, nargs=2, default=(512, 2048), metavar=('H', 'W'),
                   help='--macs: also at this height and width (default: 512 2048)')
    args = p.parse_args(argv)
    if args.macs:
        print('\n'.join(macs_lines(args)))
        return 0
    if args.pipeline:
        print(pipeline_speed(args.pipeline))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    set_tf32(args.device)  # CUDA: TF32 matmuls and convolutions, as training runs
    rows = measure(args)
    print(table(rows))
    if args.output:
        with open(args.output, 'a') as f:
            for r in rows:
                f.write(json.dumps({**r, 'date': time.strftime('%Y-%m-%d')}) + '\n')
    return 0


if __name__ == '__main__':
    sys.exit(main())
