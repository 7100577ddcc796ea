"""CPython 3.11's ``ast.parse`` can fail at random with ``SystemError: AST constructor recursion
depth mismatch`` (gh-106905) while another thread of the process compiles or builds an AST: the
AST validator's recursion counter is shared between threads. In the suite, worker threads left
by an earlier test of the same xdist process (Temporal workers, activity pools) are that other
thread. Nothing of gpufleet's behaviour is in it, so a parse that hits it is tried again; any
other error, and the same one three times, is raised as it is."""

from __future__ import annotations

import ast
import sys

RACE = "AST constructor recursion depth mismatch"
TRIES = 3


def install() -> None:
    if sys.version_info >= (3, 12) or getattr(ast.parse, "tried_again", False):
        return
    parse = ast.parse

    def parse_tried_again(*args, **kwargs):
        for attempt in range(1, TRIES + 1):
            try:
                return parse(*args, **kwargs)
            except SystemError as error:
                if RACE not in str(error) or attempt == TRIES:
                    raise

    parse_tried_again.tried_again = True
    ast.parse = parse_tried_again
