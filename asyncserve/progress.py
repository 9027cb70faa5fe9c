"""Progress of long start-up work (loading a model, preloading adapters, the step profile): a one-line
bar redrawn in place on a terminal, else a log line every few seconds, so a log file shows that the
work moves without one line per tensor."""
from __future__ import annotations

import logging
import sys
import time
from typing import Callable, TextIO

log = logging.getLogger("asyncserve.progress")

BAR_WIDTH = 30
REDRAW_S = 0.1        # a terminal's bar is redrawn at most this often
LOG_EVERY_S = 5.0     # without a terminal, one log line per this


class Progress:
    """progress(done, total) as work advances (from any one thread); close() when it ends, finished or
    not. Says nothing for work that ends within LOG_EVERY_S without a terminal."""

    def __init__(self, what: str, unit: str, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.what, self.unit = what, unit
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty()
        self.clock = clock
        self.start = self.last = clock()
        self.done = self.total = 0
        self.shown = False              # something was written or logged

    def __call__(self, done: int, total: int) -> None:
        self.done, self.total = done, total
        now = self.clock()
        due = REDRAW_S if self.tty else LOG_EVERY_S
        if now - self.last >= due or (self.tty and done >= total):
            self.last = now
            self._show(now)

    def _show(self, now: float) -> None:
        share = self.done / self.total if self.total else 1.0
        if self.tty:
            filled = int(BAR_WIDTH * share)
            self.stream.write(f"\r{self.what} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {self.done}/{self.total} "
                              f"{self.unit} {now - self.start:.0f} s")
            self.stream.flush()
        else:
            log.info("%s: %d/%d %s (%.0f%%), %.0f s", self.what, self.done, self.total, self.unit, 100 * share,
                     now - self.start)
        self.shown = True

    def close(self) -> None:
        """End the bar's line on a terminal; a last log line where earlier ones were logged."""
        if not self.shown:
            return
        self._show(self.clock())
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
