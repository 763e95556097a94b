"""Progress on long work, on one line of stderr: nodes measured of the total, configurations
weighed, time elapsed.

Shown only where someone watches: when stderr is a terminal (`compile(..., progress=None)`, the
default), always with `progress=True`, never with `progress=False`. The line is rewritten in
place (a carriage return) at most ten times a second, and cleared when the work is done.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """One line of progress on `stream` (stderr), when `enabled` (None: when it is a terminal)."""

    def __init__(self, enabled: bool | None = None, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.start = time.perf_counter()
        self.stage = ""          # what is being done, e.g. "configuration 2 of 6"
        self.shown_at = 0.0
        self.width = 0

    def doing(self, what: str) -> None:
        """Say what comes next (shown at once)."""
        self.stage = what
        self._show(what, force=True)

    def nodes(self, done: int, total: int) -> None:
        """A node was measured: `done` of `total` in this run of the graph."""
        self._show(f"{self.stage}: measuring node {done} of {total}", force=done == total)

    def finish(self) -> None:
        """Clear the line."""
        if self.enabled and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()

    def _show(self, text: str, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not force and now - self.shown_at < 0.1):
            return
        self.shown_at = now
        line = f"fxpipe: {text} ({now - self.start:.1f} s)"
        self.stream.write("\r" + line.ljust(self.width))
        self.stream.flush()
        self.width = max(self.width, len(line))
