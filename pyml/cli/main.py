"""What every pyml command shares: its argument parser's manners and how it ends.

    def main(argv=None) -> int:
        args = build_parser().parse_args(argv)      # a cli.main.Parser
        return run_command("pyml-infer", run, args)

Exit codes: 0 done; 2 bad input - a PymlError (a file, a flag, a prompt), printed as one line
naming what is wrong, and argparse's own errors; 1 an internal error, also one line (with
--debug, the traceback instead); 130 interrupted (Ctrl-C, also when a Numba call turned it
into a SystemError). A closed stdout pipe (`pyml-infer ... | head -c 5`) ends the command
quietly with 141, the status of a program ended by SIGPIPE, as `yes | head` ends.
"""

from __future__ import annotations

import argparse
import os
import sys

from pyml.core import perf
from pyml.core.errors import PymlError, was_interrupted

EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 1, 130, 141


class Parser(argparse.ArgumentParser):
    """argparse with pyml's manners: errors in one line with exit code 2, and --debug on every command."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument("--debug", action="store_true", help="show tracebacks")

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def run_command(prog: str, run, args: argparse.Namespace) -> int:
    """`run(args)` -> exit code, with every way of failing turned into one line and a status."""
    debug = getattr(args, "debug", False)
    try:
        return run(args)
    except PymlError as e:
        if debug:
            raise
        say(f"{prog}: error: {one_line(e)}")
        return e.exit_code
    except KeyboardInterrupt:
        say(f"{prog}: interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except MemoryError:
        if debug:
            raise
        say(f"{prog}: error: out of memory")
        return EXIT_INTERNAL
    except Exception as e:
        if was_interrupted(e):  # Ctrl-C that a Numba call turned into a SystemError
            say(f"{prog}: interrupted")
            return EXIT_INTERRUPTED
        if debug:
            raise
        say(f"{prog}: internal error: {type(e).__name__}: {one_line(e)} (run with --debug for the traceback)")
        return EXIT_INTERNAL


def say(text: str) -> None:
    """One line on stderr, after the `[perf]` lines of what just ran."""
    perf.flush()
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr closed too: nothing left to tell
        pass


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush of a closed pipe raises nothing."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
