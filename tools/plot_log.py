"""Training curves from one or more ``log.txt`` files, on one figure.

    python tools/plot_log.py output/demo                       # -> output/demo/curves.png
    python tools/plot_log.py runs/a runs/b -o curves.png       # several runs, one colour each

Each argument is an output directory holding ``log.txt`` (or the log file itself): one JSON object
per line with ``epoch``, ``n_parameters``, ``train_lr``, ``train_loss``, ``test_loss``, ``test_acc1``,
``test_acc5`` (``test_acc3`` for 3 classes) and optionally ``test_ema_*``, as main.py writes it. Panels: loss
(train solid, test dashed), learning rate, top-1 (model solid, EMA dotted when logged). Blank lines are
skipped; a missing, empty or malformed log stops with one line naming the file (and line).
"""
import argparse
import json
import math
import os
import sys
from typing import Any, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `python tools/X.py` too

from run.errors import FlagParser  # noqa: E402

#: (panel title, y label, [(key, line style, legend suffix)])
PANELS: list[tuple[str, str, list[tuple[str, str, str]]]] = [
    ('loss', 'loss', [('train_loss', '-', 'train'), ('test_loss', '--', 'test')]),
    ('learning rate', 'train_lr', [('train_lr', '-', '')]),
    ('top-1 accuracy', 'top-1 (%)', [('test_acc1', '-', 'model'), ('test_ema_acc1', ':', 'EMA')]),
]

PLOTTED_KEYS = tuple(key for _, _, keys in PANELS for key, _, _ in keys)


class LogError(ValueError):
    """A log that cannot be plotted; the message is one line naming the file (and line)."""


def log_path(path: str) -> str:
    """``DIR/log.txt`` for a directory, the path itself for a file."""
    return os.path.join(path, 'log.txt') if os.path.isdir(path) else path


def read_log(path: str) -> list[dict[str, Any]]:
    """Parse one log.txt (or DIR/log.txt) into its records, in file order."""
    if not os.path.exists(path):
        raise LogError(f'{path}: no such directory or file')
    path = log_path(path)
    if not os.path.isfile(path):
        raise LogError(f'{path}: no such file')
    records = []
    with open(path, encoding='utf-8') as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line.rstrip('\r\n'))
            except json.JSONDecodeError as exc:
                raise LogError(f'{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})') from None
            if not isinstance(rec, dict):
                raise LogError(f'{path}:{lineno}: expected a JSON object, got {type(rec).__name__}')
            if not isinstance(rec.get('epoch'), (int, float)) or isinstance(rec.get('epoch'), bool):
                raise LogError(f'{path}:{lineno}: no numeric "epoch"')
            for key in PLOTTED_KEYS:
                value = rec.get(key)
                if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
                    raise LogError(f'{path}:{lineno}: "{key}" is not a number: {value!r}')
            records.append(rec)
    if not records:
        raise LogError(f'{path}: empty (no epoch logged)')
    return records


def series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(epochs, values) of ``key`` over the records that have it (None counts as absent)."""
    pairs = [(float(r['epoch']), float(r[key])) for r in records if r.get(key) is not None]
    return [e for e, _ in pairs], [v for _, v in pairs]


def run_labels(paths: Sequence[str]) -> list[str]:
    """Short legend names: the directory name, made unique by adding parents when needed."""
    parts = [os.path.normpath(os.path.abspath(os.path.dirname(log_path(p)))).split(os.sep) for p in paths]
    depth = 1
    while depth < max(len(p) for p in parts):
        labels = [os.sep.join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
        depth += 1
    return [os.sep.join(p) for p in parts]


def plot_runs(runs: Sequence[tuple[str, Sequence[dict[str, Any]]]], out: str | None = None):
    """Plot ``runs`` = [(label, records)]; save to ``out`` if given; return the Figure.

    Panels without any data say so instead of staying silently empty; lr uses a log scale when all
    values are positive."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.8), layout='constrained')
    for ax, (title, ylabel, keys) in zip(axes, PANELS):
        plotted: list[float] = []
        for i, (label, records) in enumerate(runs):
            for key, style, suffix in keys:
                x, y = series(records, key)
                if not x:
                    continue
                ax.plot(x, y, style, color=f'C{i % 10}', marker='o' if len(x) == 1 else None, ms=3,
                        label=f'{label} {suffix}'.strip(), gid=f'{label}|{key}')
                plotted += y
        if not plotted:
            ax.text(0.5, 0.5, 'not logged', ha='center', va='center', transform=ax.transAxes, color='gray')
        elif title == 'learning rate' and all(v > 0 and math.isfinite(v) for v in plotted):
            ax.set_yscale('log')
        ax.set_title(title)
        ax.set_xlabel('epoch')
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if plotted:
            ax.legend(fontsize=7)
    if out:
        fig.savefig(out, dpi=110)
        plt.close(fig)
    return fig


def main(argv: Sequence[str] | None = None) -> str:
    p = FlagParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('dirs', nargs='+', metavar='OUTPUT_DIR', help='output directory with log.txt (or a log file)')
    p.add_argument('-o', '--output', default=None,
                   help='PNG to write (default: OUTPUT_DIR/curves.png for one run, ./curves.png for several)')
    args = p.parse_args(argv)
    try:
        runs = list(zip(run_labels(args.dirs), [read_log(d) for d in args.dirs]))
    except LogError as exc:
        sys.exit(f'plot_log: error: {exc}')
    out = args.output or (os.path.join(os.path.dirname(log_path(args.dirs[0])) or '.', 'curves.png')
                          if len(args.dirs) == 1 else 'curves.png')
    plot_runs(runs, out)
    for label, records in runs:
        last = records[-1]
        acc = ', '.join(f'{k} {last[k]:.2f}' for k in ('test_acc1', 'test_ema_acc1') if last.get(k) is not None)
        print(f'{label}: {len(records)} epoch(s), last epoch {last["epoch"]}' + (f', {acc}' if acc else ''))
    print(f'wrote {out}')
    return out


if __name__ == '__main__':
    main()
