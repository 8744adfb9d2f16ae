"""How many images per second main.py's training transform gives per DataLoader worker.

    python tools/loader_speed.py --make-photos /tmp/photos --data-loading /tmp/photos   # JPEGs of real photos
    OMP_NUM_THREADS=1 python tools/loader_speed.py --data-loading /data/imagenet/train --data-workers 0 1 2 -b 32

``--data-loading DIR`` reads the ImageFolder DIR through main.py's train transform with the recipe's flags
(every default) at ``--input-size``: first in this process, one image after another (what one DataLoader
worker does with a core of its own: images per second of wall time and per second of CPU time, and the CPU
ms per image), then through DataLoaders with ``--data-workers`` workers (time to the first batch of a fresh
iterator, img/s after it). main.py's workers stop at the uint8 crop (the device normalises and erases); the
CPU time of the whole transform on the CPU (ToTensor, Normalize, RandomErasing in the worker) is given too.
``--make-photos DIR`` first writes 200 JPEGs cut from scikit-learn's sample photos at ImageNet's sizes,
``--make-jpegs DIR`` 200 noise-like ones (which decode several times slower than photos).
"""
import argparse
import os
import statistics
import sys
import time
from typing import Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `python tools/X.py` too

from run.errors import FlagParser
from tools import timing
from tools.synthetic import make_jpegs, make_photo_jpegs


def _transform_times(dataset) -> tuple:
    """(wall s, process CPU s, per-image thread CPU s) of loading every item of ``dataset`` in this process."""
    import resource
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu0, start = usage.ru_utime + usage.ru_stime, time.perf_counter()
    per_image = []
    for i in range(len(dataset)):
        thread_start = time.thread_time()
        dataset[i]
        per_image.append(time.thread_time() - thread_start)
    wall = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return wall, usage.ru_utime + usage.ru_stime - cpu0, per_image


def data_loading(args: argparse.Namespace) -> dict:
    """img/s of main.py's train transform (default recipe flags) on the ImageFolder ``args.data_loading``:
    in this process (what one DataLoader worker does with a core of its own: images per second of
    wall time and per second of CPU time), then through DataLoaders with ``--data-workers`` workers
    (time to the first batch of a fresh iterator and img/s after it). main.py's workers stop at the uint8
    crop (the device normalises and erases); the CPU time of the whole transform on the CPU (ToTensor,
    Normalize, RandomErasing in the worker) is given too."""
    from torchvision.datasets import ImageFolder

    size = (list(args.input_size) * 2)[0]
    dataset = ImageFolder(args.data_loading, transform=timing.recipe_train_transform(size, uint8=True))
    torch.manual_seed(0)
    dataset[0]
    wall, cpu, per_image = _transform_times(dataset)
    _, cpu_float, _ = _transform_times(ImageFolder(args.data_loading, transform=timing.recipe_train_transform(size)))
    ms = sorted(1e3 * t for t in per_image)
    quantiles = {f'p{q}': ms[min(len(ms) - 1, int(q / 100 * len(ms)))] for q in (10, 50, 90, 99)}
    result = dict(data=args.data_loading, images=len(dataset), input_size=size,
                  threads=torch.get_num_threads(), one_worker_img_s_wall=len(dataset) / wall,
                  one_worker_img_s_cpu=len(dataset) / cpu, image_cpu_ms_mean=statistics.mean(ms),
                  image_cpu_ms=quantiles, cpu_transform_img_s_cpu=len(dataset) / cpu_float, loaders=[])
    print(f"train transform to uint8 (main.py's workers), {len(dataset)} images, in-process: "
          f'{len(dataset) / wall:.1f} img/s (wall), {len(dataset) / cpu:.1f} img/s per CPU second; CPU ms per '
          f'image: mean {statistics.mean(ms):.2f}, ' + ', '.join(f'{k} {v:.2f}' for k, v in quantiles.items()))
    print(f'the same with ToTensor, Normalize and RandomErasing on the CPU: {len(dataset) / cpu_float:.1f} img/s '
          f'per CPU second')
    for workers in args.data_workers or [0, 2]:
        loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True,
                                             num_workers=workers)
        start = time.perf_counter()
        batches = iter(loader)
        next(batches)
        first = time.perf_counter() - start
        start, seen = time.perf_counter(), 0
        for images, _ in batches:
            seen += images.shape[0]
        rate = seen / (time.perf_counter() - start) if seen else float('nan')
        result['loaders'].append(dict(workers=workers, batch_size=args.batch_size, first_batch_s=first, img_s=rate))
        print(f'DataLoader, {workers} workers, batch {args.batch_size}: first batch after {first:.2f} s, '
              f'then {rate:.1f} img/s')
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = FlagParser(prog='tools/loader_speed.py', description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--data-loading', default=None, metavar='DIR',
                        help="img/s of main.py's train transform per DataLoader worker on the ImageFolder DIR")
    parser.add_argument('--make-jpegs', default=None, metavar='DIR',
                        help='first write 200 photo-like 500x375 JPEGs (quality 90) into DIR as an ImageFolder')
    parser.add_argument('--make-photos', default=None, metavar='DIR',
                        help="first write 200 JPEGs cut from scikit-learn's sample photos at ImageNet's sizes "
                             '(long side 500, short 333..400, quality 90) into DIR as an ImageFolder')
    parser.add_argument('--data-workers', type=int, nargs='+', default=None,
                        help='DataLoader worker counts timed by --data-loading (default 0 2)')
    parser.add_argument('--batch-size', '-b', type=int, default=32)
    parser.add_argument('--input-size', type=int, nargs='+', default=[224], help='side (a second value is ignored)')
    parser.add_argument('--threads', type=int, default=None, help='torch.set_num_threads (CPU)')
    timing.add_json_arg(parser)
    args = parser.parse_args(argv)
    if not (args.data_loading or args.make_jpegs or args.make_photos):
        parser.error('give --data-loading DIR (an ImageFolder to time), or --make-photos DIR / --make-jpegs DIR to '
                     'write one first')
    return args


def main(argv: Sequence[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.make_jpegs:
        make_jpegs(args.make_jpegs)
        print(f'wrote 200 JPEGs under {args.make_jpegs}')
    if args.make_photos:
        make_photo_jpegs(args.make_photos)
        print(f'wrote 200 JPEGs of photos under {args.make_photos}')
    if not args.data_loading:
        return None
    result = data_loading(args)
    timing.write_jsonl(args.json, [result])
    return result


if __name__ == '__main__':
    main()
