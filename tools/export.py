"""Export a NaLaFormer to ONNX, TorchScript or a torch.export program, and check it against PyTorch.

    python tools/export.py --model NALAFORMER_XT --format onnx --output xt.onnx --dynamic
    python tools/export.py --model NALAFORMER_XT --checkpoint ckpt.pth --format torchscript --output xt.pt
    python tools/export.py --model NALAFORMER_XT --format exported-program --output xt.pt2 --dynamic

Exporters and tracers record the model's plain path (standard ops only; ``models.ops.use_plain_ops``),
which computes the same numbers as the fast path PyTorch runs. The model is exported in eval mode from
a random input of ``--input-size``; with ``--dynamic`` batch, height and width stay free (batch 2 is
traced, so that the batch is not specialised to 1). The exported file is then loaded and run
(ONNX with ONNX Runtime) on that input and, with ``--dynamic``, on a second batch size and resolution;
the largest absolute difference from the PyTorch model's output is printed. Exit status 1 if it is
above ``--tolerance``. Each phase (build, export, parity run) is printed as it starts; the export of a
torch.export-based format takes about a minute for XT on a laptop CPU.

Without ``--checkpoint`` the model has random weights drawn under ``--seed`` (default 0), so two runs
export the same model. An ONNX file holds its weights inside (one self-contained file) unless they
exceed ONNX's 2 GB protobuf limit; then they go to ``FILE.data`` next to it, which is printed and
must be kept beside the ``.onnx`` file.
"""
import argparse
import os
import sys
import time
import warnings
from typing import Callable, Sequence

import timm
import torch
import torch.nn as nn
from timm.models import load_state_dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `python tools/X.py` too

from models import VARIANTS  # importing models registers the variants
from models.compat import dynamo_onnx_export_error, export_dim, export_program_error
from run.errors import FlagParser, unknown_model

FORMATS = ('onnx', 'torchscript', 'exported-program')
INPUT_NAME, OUTPUT_NAME = 'images', 'logits'
#: ONNX files are protobuf messages, which cannot exceed 2 GiB; larger weights go to an external data file
ONNX_PROTOBUF_LIMIT = 2 ** 31


def model_to_export(name: str, checkpoint: str | None = None, seed: int = 0) -> nn.Module:
    """The variant in eval mode; with a checkpoint (a state dict or a training checkpoint, EMA weights
    preferred), its weights, loaded strictly, with the number of classes of its head; without one,
    random weights drawn under ``seed``."""
    if not checkpoint:
        torch.manual_seed(seed)
        return timm.create_model(name).eval()
    state = load_state_dict(checkpoint, use_ema=True)
    num_classes = state['head.weight'].shape[0] if 'head.weight' in state else 0
    model = timm.create_model(name, num_classes=num_classes)
    model.load_state_dict(state, strict=True)
    return model.eval()


def example_inputs(input_size: int, dynamic: bool) -> list[torch.Tensor]:
    """The export input (batch 2 when dynamic, else 1) and, when dynamic, a check input with another
    batch size and a non-square resolution."""
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2 if dynamic else 1, 3, input_size, input_size, generator=gen)]
    if dynamic:
        inputs.append(torch.randn(3, 3, input_size + 32, input_size, generator=gen))
    return inputs


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (what an exported file stores)."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def export_model(model: nn.Module, x: torch.Tensor, fmt: str, path: str, dynamic: bool = False,
                 legacy_onnx: bool = False) -> list[str]:
    """Write ``model`` traced on ``x`` to ``path`` as ``fmt`` (one of ``FORMATS``); with ``dynamic``,
    batch, height and width are free. ``legacy_onnx`` selects the TorchScript-based ONNX exporter.
    Returns the files written: ``path``, and for ONNX weights over the 2 GB limit ``path + '.data'``."""
    batch_hw = {0: 'batch', 2: 'height', 3: 'width'}
    external = fmt == 'onnx' and not legacy_onnx and weight_bytes(model) >= ONNX_PROTOBUF_LIMIT
    dims = {i: export_dim(name) for i, name in batch_hw.items()}
    with torch.no_grad(), warnings.catch_warnings():
        # TorchScript and the legacy ONNX exporter are deprecated by PyTorch but still what many
        # deployments read; their warnings (and the tracer's notes on Python numbers) are expected here.
        warnings.simplefilter('ignore', FutureWarning)
        warnings.simplefilter('ignore', DeprecationWarning)
        warnings.simplefilter('ignore', torch.jit.TracerWarning)
        if fmt == 'onnx' and legacy_onnx:
            axes = {INPUT_NAME: batch_hw, OUTPUT_NAME: {0: 'batch'}} if dynamic else None
            torch.onnx.export(model, (x,), path, dynamo=False, input_names=[INPUT_NAME],
                              output_names=[OUTPUT_NAME], dynamic_axes=axes)
        elif fmt == 'onnx':
            if dynamo_onnx_export_error():
                raise RuntimeError(dynamo_onnx_export_error())
            # the exporter's default writes the weights to path + '.data' whatever their size; a file
            # copied without it cannot be loaded, so keep them inside whenever ONNX allows
            torch.onnx.export(model, (x,), path, dynamo=True, verbose=False, input_names=[INPUT_NAME],
                              output_names=[OUTPUT_NAME], dynamic_shapes=(dims,) if dynamic else None,
                              external_data=external)
        elif fmt == 'torchscript':
            torch.jit.save(torch.jit.trace(model, x), path)
        elif fmt == 'exported-program':
            if export_program_error():
                raise RuntimeError(export_program_error())
            torch.export.save(torch.export.export(model, (x,), dynamic_shapes=(dims,) if dynamic else None), path)
        else:
            raise ValueError(f'unknown format {fmt!r}; choose one of {FORMATS}')
    return [path, path + '.data'] if external else [path]


def run_exported(fmt: str, path: str, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Load the exported file and run it on each input (ONNX with ONNX Runtime on the CPU)."""
    if fmt == 'onnx':
        import onnxruntime
        session = onnxruntime.InferenceSession(path, providers=['CPUExecutionProvider'])
        return [torch.from_numpy(session.run(None, {INPUT_NAME: x.numpy()})[0]) for x in inputs]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter('ignore', FutureWarning)  # torch.jit.load is deprecated, see export_model
        module = torch.jit.load(path) if fmt == 'torchscript' else torch.export.load(path).module()
        return [module(x) for x in inputs]


def check_export(model: nn.Module, fmt: str, path: str, input_size: int = 224, dynamic: bool = False,
                 legacy_onnx: bool = False, log: Callable[[str], None] = lambda msg: None) \
        -> list[tuple[tuple[int, ...], float]]:
    """Export, reload, run, and return (input shape, max |exported - PyTorch|) for each check input;
    ``log`` receives a line as each phase starts and ends."""
    inputs = example_inputs(input_size, dynamic)
    start = time.perf_counter()
    log(f'exporting to {path} ({fmt}{", legacy exporter" if legacy_onnx else ""}'
        f'{", dynamic batch/height/width" if dynamic else ""}) ...')
    files = export_model(model, inputs[0], fmt, path, dynamic, legacy_onnx)
    log(f'wrote {" and ".join(files)} in {time.perf_counter() - start:.0f} s'
        + (f'; keep {os.path.basename(files[1])} next to {os.path.basename(path)}: it holds the weights'
           if len(files) > 1 else ''))
    log(f'running the exported file on {len(inputs)} input(s) and comparing with PyTorch ...')
    with torch.no_grad():
        expected = [model(x) for x in inputs]
    got = run_exported(fmt, path, inputs)
    return [(tuple(x.shape), (g - e).abs().max().item()) for x, g, e in zip(inputs, got, expected)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = FlagParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', default='NALAFORMER_XT', help='variant (default NALAFORMER_XT)')
    parser.add_argument('--checkpoint', default=None, help='weights: a state dict or a training checkpoint')
    parser.add_argument('--format', required=True, choices=FORMATS)
    parser.add_argument('--output', required=True, help='file to write')
    parser.add_argument('--dynamic', action='store_true', help='free batch size, height and width')
    parser.add_argument('--input-size', type=int, default=224, help='side of the export input (default 224)')
    parser.add_argument('--legacy-onnx', action='store_true',
                        help='ONNX through the TorchScript-based exporter instead of torch.export')
    parser.add_argument('--tolerance', type=float, default=1e-4,
                        help='largest accepted |exported - PyTorch| (default 1e-4)')
    parser.add_argument('--seed', type=int, default=0,
                        help='seed of the random weights when no --checkpoint is given (default 0)')
    args = parser.parse_args(argv)
    if args.model.upper() not in VARIANTS:
        parser.error('--model: ' + unknown_model(args.model, VARIANTS))
    if args.input_size < 32:
        parser.error(f'--input-size must be at least 32 (the network has stride 32), got {args.input_size}')
    if args.format == 'exported-program' and not args.output.endswith('.pt2'):
        parser.error(f'--output {args.output}: an exported program is saved as a .pt2 file; name it *.pt2')
    if args.legacy_onnx and args.format != 'onnx':
        parser.error('--legacy-onnx applies to --format onnx only')
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        parser.error(f'--output {args.output}: directory {out_dir} does not exist; create it first')
    if args.checkpoint and not os.path.isfile(args.checkpoint):
        parser.error(f'--checkpoint {args.checkpoint}: no such file')
    if args.format == 'onnx' and not args.legacy_onnx and dynamo_onnx_export_error():
        parser.error(dynamo_onnx_export_error())
    if args.format == 'exported-program' and export_program_error():
        parser.error(export_program_error())
    if args.format == 'onnx':
        missing = [m for m in ('onnx', 'onnxscript', 'onnxruntime') if not _importable(m)]
        if missing:
            parser.error(f'--format onnx needs {", ".join(missing)}: pip install {" ".join(missing)}')
    def log(msg: str) -> None:
        print(msg, flush=True)

    log(f'building {args.model} with ' + (f'the weights of {args.checkpoint}' if args.checkpoint
                                         else f'random weights (--seed {args.seed}; no --checkpoint given)'))
    try:
        model = model_to_export(args.model, args.checkpoint, args.seed)
    except (RuntimeError, KeyError, ValueError) as e:
        parser.error(f'cannot load --checkpoint {args.checkpoint} into {args.model}: '
                     f'{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}')
    results = check_export(model, args.format, args.output, input_size=args.input_size, dynamic=args.dynamic,
                           legacy_onnx=args.legacy_onnx, log=log)
    worst = max(err for _, err in results)
    for shape, err in results:
        print(f'input {"x".join(map(str, shape))}: max |exported - PyTorch| = {err:.2e}')
    if worst > args.tolerance:
        print(f'error: the exported model differs from PyTorch by {worst:.2e} > --tolerance {args.tolerance:g}')
        return 1
    return 0


def _importable(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


if __name__ == '__main__':
    sys.exit(main())
