"""Errors that end a run with one line and a non-zero exit status (no stack trace), and how that line is
written: the cause of a failed write, a URL where a local file was expected, the closest name to a mistyped one,
and the command line's two-line flag errors (docs/troubleshooting.md lists the messages)."""
import argparse
import difflib
import errno
import os
import sys
from typing import Iterable


class UserError(Exception):
    """A problem the user can fix (bad flag, bad file, bad checkpoint): printed as one line."""

    exit_code = 1


class FlagError(UserError):
    """A flag that cannot apply to the data or files it meets (found after parsing): exit 2, as argparse."""

    exit_code = 2


class CheckpointError(UserError):
    pass


class CheckpointWriteError(UserError):
    pass


class NonFiniteLossError(UserError):
    pass


class PeerLostError(UserError):
    """Another process of the job died or stopped answering."""


class BadSampleError(RuntimeError):
    """An image file could not be decoded and --strict-data is on; str() names the file. Raised in a data-loader
    worker (training/image_folder.py) and ended in one line by process.finish."""


def exception_chain(e: BaseException):
    """The exception and everything it was raised from or while handling."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty)."""
    msg = str(e).strip().splitlines()
    return msg[0] if msg else type(e).__name__


def write_failure_reason(e: BaseException) -> str:
    """The cause of a failed write: the OSError anywhere in the chain (torch.save reports a failed
    write as 'unexpected pos'), else the first line of the error."""
    for c in exception_chain(e):
        if isinstance(c, OSError) and c.errno:
            return 'no space left on device' if c.errno == errno.ENOSPC else os.strerror(c.errno)
    return first_line(e)


def is_url(path: str) -> bool:
    """Whether a checkpoint flag names a URL (nothing is downloaded: checkpoints are local files)."""
    return path.startswith(('http://', 'https://'))


def eprint(*a) -> None:
    """Print to stderr on every rank (error lines)."""
    sys.stderr.write(' '.join(str(x) for x in a) + '\n')
    sys.stderr.flush()


def _folded(name: str) -> str:
    return name.lower().replace('-', '_')


def closest_name(word: str, known: Iterable[str], cutoff: float = 0.75) -> str | None:
    """The name of `known` that `word` most likely meant: the first one equal to it up to case and '-' for '_'
    (nalaformer-t: NALAFORMER_T), else difflib's closest with a similarity of at least `cutoff`; None if none."""
    by_folded: dict[str, str] = {}
    for name in known:
        by_folded.setdefault(_folded(name), name)
    if _folded(word) in by_folded:
        return by_folded[_folded(word)]
    close = difflib.get_close_matches(_folded(word), list(by_folded), n=1, cutoff=cutoff)
    return by_folded[close[0]] if close else None


def unknown_model(name: str, variants: Iterable[str], others: Iterable[str] = ()) -> str:
    """The error line of an unknown model name: the closest of `variants` (the NaLaFormer variants) and `others`
    (e.g. every timm model, where those work too) as a 'did you mean', then the variants."""
    variants = list(variants)
    close = closest_name(name, [*variants, *others])
    return (f"unknown model '{name}'" + (f' (did you mean {close}?)' if close else '')
            + f"; the NaLaFormer variants are {', '.join(variants)}")


class FlagParser(argparse.ArgumentParser):
    """argparse whose bad command line ends in two lines instead of the page-long usage: a pointer to --help
    and the error, with the closest flag for a mistyped one (exit status 2, as argparse). main.py, the
    segmentation trainer and every tool parse with it."""

    def error(self, message: str):
        self.exit(2, f'usage: {self.prog} [options]  (--help lists them)\n'
                     f'{self.prog}: error: {message}{self.did_you_mean(message)}\n')

    def did_you_mean(self, message: str) -> str:
        """' (did you mean --output_dir?)' when argparse's 'unrecognized arguments' names a flag close to a known
        one (several: 'did you mean --a for --x, --b for --y?'), else ''."""
        if not message.startswith('unrecognized arguments: '):
            return ''
        known = [s for a in self._actions for s in a.option_strings if s.startswith('--')]
        pairs = []
        for word in message.split(': ', 1)[1].split():
            flag = word.split('=', 1)[0]
            close = closest_name(flag, known) if flag.startswith('--') else None
            if close:
                pairs.append((close, flag))
        if len(pairs) == 1:
            return f' (did you mean {pairs[0][0]}?)'
        return f" (did you mean {', '.join(f'{a} for {b}' for a, b in pairs)}?)" if pairs else ''
