"""Training-step speed and memory of Mask R-CNN over several backbones, the models stepped in turn in one process
(the detector detection/model.py builds: FPN 256, mmdet's heads and sampling, AdamW with the recipe's parameter
groups, the sum of the five losses), so that load changes on a shared machine hit every model alike; and the
detectors' FLOPs at 1280x800 as papers report them.

    python detection/benchmark.py --size 800 1333 -b 2 --device cpu --threads 2 --steps 3   # slow on a CPU
    python detection/benchmark.py --size 800 800 -b 2 --device cpu
    python detection/benchmark.py --size 800 1333 -b 2 --device cuda --amp bf16 --steps 20   # one GPU
    python detection/benchmark.py --flops                  # fvcore multiply-adds at 1280x800, backbone and the rest

Per model: parameters, the median of the timed steps as img/s, the first model's img/s over this one's, and the peak
tensor memory of one step above what was live before it (tools/timing.py). Every image of the batch
carries the same 12 boxes with masks (80 classes), so the RoI sampling has positives as on COCO. Backbones are
timm's features_only models without pretrained weights (Swin built for any input size); the speed does not depend on
the weights.
"""
import argparse
import json
import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or '.') == _HERE:  # `python detection/benchmark.py`: the root's modules
    sys.path[0] = os.path.dirname(_HERE)
elif os.path.dirname(_HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

from detection.model import build_detector, count_detector_flops  # noqa: E402
from run.errors import FlagParser  # noqa: E402
from tools.timing import peak_bytes, time_call  # noqa: E402
from training.optim import weight_decay_groups  # noqa: E402
from training.step import amp_dtype, autocast, set_tf32  # noqa: E402

DEFAULT_MODELS = 'NALAFORMER_T,swin_tiny_patch4_window7_224,convnext_tiny,pvt_v2_b2'


def synthetic_batch(batch_size: int, size: tuple[int, int], device: torch.device, boxes: int = 12):
    """`batch_size` random uint8 images of `size` (height, width), each with the same `boxes` boxes and masks."""
    g = torch.Generator().manual_seed(0)
    h, w = size
    xy = torch.rand(boxes, 2, generator=g) * torch.tensor([w * 0.7, h * 0.7])
    wh = (0.05 + torch.rand(boxes, 2, generator=g) * 0.25) * torch.tensor([w, h])
    box = torch.cat([xy, xy + wh], 1)
    masks = torch.zeros(boxes, h, w, dtype=torch.uint8)
    for m, (x0, y0, x1, y1) in zip(masks, box.int().tolist()):
        m[y0:y1, x0:x1] = 1
    target = {'boxes': box.to(device), 'labels': torch.randint(1, 81, (boxes,), generator=g).to(device),
              'masks': masks.to(device)}
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g).to(device) for _ in range(batch_size)]
    return images, [dict(target) for _ in range(batch_size)]


def detector_step(name: str, args: argparse.Namespace, device: torch.device):
    """A training step of Mask R-CNN over `name` on one fixed batch (optimizer included), and its parameters."""
    torch.manual_seed(0)
    model = build_detector(name, 80).to(device).train()
    optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.05), lr=1e-4)
    images, targets = synthetic_batch(args.batch_size, tuple(args.size), device)
    amp = amp_dtype(args.amp)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast(device, amp):
            loss = sum(model(images, targets).values())
        loss.backward()
        optimizer.step()

    return step, optimizer, sum(p.numel() for p in model.parameters())


def measure(args: argparse.Namespace) -> list[dict]:
    """One result per model: img/s of the median step, parameters, peak step memory."""
    device = torch.device(args.device)
    names = args.models.split(',')
    steps, optimizers, params = {}, {}, {}
    for name in names:
        steps[name], optimizers[name], params[name] = detector_step(name, args, device)
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
        peak = peak_bytes(steps[name], device) if args.memory else 0
        step_s = statistics.median(times[name])
        rows.append(dict(model=name, batch_size=args.batch_size, size=list(args.size), amp=args.amp or 'fp32',
                         device=str(device), threads=torch.get_num_threads(), params_m=params[name] / 1e6,
                         step_s_median=step_s, step_s_all=times[name], img_s=args.batch_size / step_s,
                         peak_step_mib=peak / 2 ** 20))
    return rows


def table(rows: list[dict]) -> str:
    """Per model: parameters, median step, img/s, peak step memory, and the first model's img/s (and memory) over
    this one's."""
    first = rows[0]
    h, w = first['size']
    lines = [f"Mask R-CNN training step, batch {first['batch_size']}, {w}x{h}, {first['amp']}, {first['device']} "
             f"({first['threads']} threads)",
             f"{'model':<30} {'params':>7} {'s/step':>7} {'img/s':>7} {'peak MiB':>8}  {first['model']} / this"]
    for r in rows:
        ratio = f"speed {first['img_s'] / r['img_s']:.2f}x" if r is not first else '-'
        if r is not first and r['peak_step_mib']:
            ratio += f", memory {first['peak_step_mib'] / r['peak_step_mib']:.2f}x"
        lines.append(f"{r['model']:<30} {r['params_m']:>6.1f}M {r['step_s_median']:>7.2f} {r['img_s']:>7.3f} "
                     f"{r['peak_step_mib']:>8.0f}  {ratio}")
    return '\n'.join(lines)


def flops_lines(models: str, size: tuple[int, int]) -> list[str]:
    """fvcore multiply-adds of each detector at `size` (height, width) as papers count them (model.FlopsForward)."""
    lines = []
    for name in models.split(','):
        flops = count_detector_flops(build_detector(name, 80), size)
        lines.append(f"{name}: {flops['total'] / 1e9:.1f} GFLOPs at {size[0]}x{size[1]} (backbone "
                     f"{flops['backbone'] / 1e9:.1f}, FPN and heads {(flops['total'] - flops['backbone']) / 1e9:.1f})")
    return lines


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    p = FlagParser(description=__doc__.split('\n')[0])
    p.add_argument('--models', default=DEFAULT_MODELS,
                   help='timm backbones, comma-separated; the first is the reference')
    p.add_argument('-b', '--batch-size', type=int, default=2)
    p.add_argument('--size', type=int, nargs=2, default=(800, 1333), metavar=('H', 'W'), help='image size')
    p.add_argument('--device', default='cpu')
    p.add_argument('--amp', choices=['fp16', 'bf16'], default=None)
    p.add_argument('--threads', type=int, default=None, help='torch CPU threads')
    p.add_argument('--warmup', type=int, default=1)
    p.add_argument('--steps', type=int, default=3, help='timed rounds (one step of every model each)')
    p.add_argument('--memory', action=argparse.BooleanOptionalAction, default=True,
                   help='measure the peak step memory (one more step per model)')
    p.add_argument('--output', default='', help='append the results as JSON lines to this file')
    p.add_argument('--flops', action='store_true', help="print each detector's FLOPs at --size (1280x800 default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.flops:
        size = (1280, 800) if '--size' not in (argv if argv is not None else sys.argv) else tuple(args.size)
        print('\n'.join(flops_lines(args.models, size)))
        return 0
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
