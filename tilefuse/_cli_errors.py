"""One-line command-line errors, shared by every ``python -m tilefuse`` command.

A command raises :class:`UsageError` for a bad argument (its parser, an :class:`ArgumentParser`, raises it for
argparse's own errors too); ``tilefuse.cli.main`` prints its message as one line to stderr and returns exit
status 2, never a traceback. This module imports nothing of tilefuse, so a command module anywhere below the
command line can import it.
"""
from __future__ import annotations

import argparse


class UsageError(Exception):
    """A bad command-line argument. The message is the whole line the user sees, e.g.
    ``python -m tilefuse demo: error: --repeat must be >= 1, got 0``."""


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors raise :class:`UsageError` (``PROG: error: MESSAGE``) instead of
    printing the usage and exiting; ``-h`` still prints the help and exits 0."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: error: {message}")

    def fail(self, message: str):
        """Raise the :class:`UsageError` of a check made after parsing, in the parser's own format."""
        self.error(message)


def one_line(message: str) -> str:
    """``message`` with its line breaks folded into spaces: what an error line prints."""
    return " ".join(message.split())
