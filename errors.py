"""Errors that end a run with one line and a non-zero exit status (no stack trace), and how that line is
written (docs/usage.md lists the messages)."""
import sys


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


def eprint(*a) -> None:
    """Print to stderr on every rank (error lines)."""
    sys.stderr.write(' '.join(str(x) for x in a) + '\n')
    sys.stderr.flush()
