"""The ``sdp`` command line: one parser, subcommands contributed by each package.

Each subcommand lives beside the code it drives (``masklab/cli.py`` for ``design``/``inspect``, ...)
and exposes ``register(subparsers)``, which adds its parser and sets ``func`` to a callable
``func(args) -> int``; `COMMAND_MODULES` names each command's module, so that a command imports
only its own (a rank of ``sdp train`` parses its arguments too). This module only dispatches and
turns user-input errors into one clear line on stderr and a non-zero exit; it deliberately holds no
command logic.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import importlib.metadata
import os
import sys
from collections.abc import Sequence

from sdp_train.errors import EXIT_USAGE

# Order is the order shown in --help. Set SDP_DEBUG=1 to see the traceback of a user error.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "masklab.cli",
    "theory.cli",
    "sdp_train.cli.train",
    "sdp_train.cli.compare",
    "sdp_train.cli.plan",
    "sdp_train.cli.estimate",
    "sdp_train.cli.data",
    "sdp_train.cli.eval",
    "sdp_train.cli.store",
)
# The module that registers each command: a command's parser is built without importing the
# others (``sdp verify`` loads scipy.optimize, which every rank of ``sdp train`` would pay for).
COMMAND_MODULES: dict[str, str] = {
    "design": "masklab.cli", "inspect": "masklab.cli", "verify": "theory.cli", "train": "sdp_train.cli.train",
    "compare": "sdp_train.cli.compare", "plan": "sdp_train.cli.plan", "estimate": "sdp_train.cli.estimate",
    "data": "sdp_train.cli.data", "eval": "sdp_train.cli.eval", "store": "sdp_train.cli.store",
}


def _is_user_error(exc: BaseException) -> bool:
    """Errors that mean "the input is wrong": reported as one line, never as a traceback.

    OSErrors count when they are about a path the user named (missing, a directory where a file is
    needed or the reverse, already there, no permission, a name too long); others (disk full, ...)
    keep their traceback.
    """
    path_errors = (FileNotFoundError, IsADirectoryError, NotADirectoryError, FileExistsError, PermissionError)
    return (isinstance(exc, (ValueError, TypeError, *path_errors))
            or isinstance(exc, OSError) and exc.errno in (errno.ENAMETOOLONG, errno.ELOOP, errno.EROFS))


def _reports_interrupt() -> bool:
    """Whether this process says "interrupted": one line per job, not one per rank.

    Ctrl-C reaches every process of the terminal's group. A rank that ``sdp train``'s own launcher
    started leaves the line to that launcher; under another launcher (torchrun) rank 0 says it.
    """
    from sdp_train.trainer.rundir import LOCKED_ENV

    if "RANK" not in os.environ:
        return True
    return os.environ["RANK"] == "0" and LOCKED_ENV not in os.environ


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``sdp`` parser. Given the `argv` it will parse, only the named command's module is
    imported; without a known command (``sdp --help``, a typo) every command is registered."""
    parser = argparse.ArgumentParser(
        prog="sdp",
        description="Subnetwork Data Parallelism: design masks, verify them, train with them.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    command = next((a for a in argv if not a.startswith("-")), None) if argv is not None else None
    modules = (COMMAND_MODULES[command],) if command in COMMAND_MODULES else SUBCOMMAND_MODULES
    for module_name in modules:
        importlib.import_module(module_name).register(subparsers)
    for sub in (parser, *subparsers.choices.values()):
        sub.allow_abbrev = False  # ``--step`` is not ``--steps``: a typo must fail, not guess
        for action in sub._actions:
            if action.type in (int, float):
                action.type = _ascii_number(action.type)
    return parser


def _ascii_number(parse: type[int] | type[float]):
    """`parse` (``int`` or ``float``) for every numeric flag, refusing digits other than ASCII 0-9.

    Python's ``int("٣")`` is 3 and ``float("١.٥")`` 1.5: ``--workers ٣`` started 3 workers.
    """
    def number(text: str) -> int | float:
        if not text.isascii():
            raise argparse.ArgumentTypeError(f"invalid {parse.__name__} value: {text!r} (only the ASCII digits "
                                             f"0-9 make numbers)")
        return parse(text)

    number.__name__ = parse.__name__
    return number


def _version() -> str:
    try:
        return importlib.metadata.version("sdp-toolkit")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        if _reports_interrupt():
            print(f"sdp {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if not _is_user_error(exc) or os.environ.get("SDP_DEBUG"):
            raise
        message = " ".join(str(exc).splitlines())  # one line even when a path or value holds a newline
        line = f"sdp {args.command}: error: {message}"
        if not _left_to_launcher(line):
            print(line, file=sys.stderr)
        return EXIT_USAGE


def _left_to_launcher(line: str) -> bool:
    """Whether this process is a rank of ``sdp train``'s own launcher and has left `line` for it.

    That launcher prints the line once for the job and exits 2 (`sdp_train.trainer.launch.launch_local`), as
    when it finds the error itself; a rank under another launcher (torchrun) prints it.
    """
    from sdp_train.trainer.launch import leave_error_to_launcher
    from sdp_train.trainer.rundir import LOCKED_ENV

    return "RANK" in os.environ and LOCKED_ENV in os.environ and leave_error_to_launcher(line)


def rank_main() -> None:
    """Entry point of a rank process that a launcher started (``python -m sdp_train.cli`` under torchrun).

    Once `main` has returned, the run's files are complete (summary.json is written and fsynced
    last) and nothing is left to do but exit. The process then ends at once, without interpreter
    shutdown: torch's DTensor caches keep FSDP's process groups referenced, and a gloo thread
    still running during shutdown aborts the process (``terminate called without an active
    exception``, SIGABRT), which made about one finished run in six exit as failed.
    """
    from sdp_train.parallel.dist import under_torchrun

    code = main()
    if not under_torchrun():
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

