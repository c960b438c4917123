"""Progress of a long loop, shown the way its reader can see it: a tqdm bar when
stderr is a terminal, else an INFO log line now and then (a log file gets a few
readable lines, not a bar's carriage returns).

    with Progress("convert_imageset", total=len(entries), unit="images") as shown:
        for entry in shown.track(entries):
            ...
    with Progress("digits: train", total=10000, unit="images") as shown:
        shown.update(2000)

A context manager rather than a wrapping generator: the bar and the log
redirection end when the block does, also when it ends in an exception.

It lives in core, below every other layer of cct, so that cct.data (digits)
and the command line share this one decision.
"""
import logging
import sys
import time
from contextlib import ExitStack
from types import TracebackType
from typing import Any, Iterable, Iterator, List, Literal, Optional, TextIO, Type, TypeVar

log = logging.getLogger("cct.progress")
Item = TypeVar("Item")

STEPS = 10                 # log lines per loop of known length: one every tenth of the way
UNSIZED_EVERY = 1000       # items between log lines when the length is unknown


class Progress:
    """A count of done items towards `total` (None: unknown), labelled `what`.

    On a terminal `stream` (default sys.stderr): a tqdm bar, with log lines
    printed above it rather than through it. Otherwise: an INFO line on the
    "cct.progress" logger each `every` items (default: a tenth of `total`, or
    UNSIZED_EVERY when it is unknown) and one when the loop ends."""

    def __init__(self, what: str, total: Optional[int] = None, unit: str = "items", every: Optional[int] = None,
                 stream: Optional[TextIO] = None):
        self.what, self.total, self.unit = what, total, unit
        self.done = 0
        self._stream = sys.stderr if stream is None else stream
        self._every = every or (-(-total // STEPS) if total else UNSIZED_EVERY)
        self._next_line = self._every
        self._start = time.monotonic()
        self._bar = None
        self._cleanup = ExitStack()

    def __enter__(self) -> "Progress":
        if is_terminal(self._stream):
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm
            # Console log lines (the CLI's handler sits on "cct") go above the bar via tqdm.write.
            self._cleanup.enter_context(logging_redirect_tqdm(_console_loggers()))
            self._bar = self._cleanup.enter_context(
                tqdm(total=self.total, desc=self.what, unit=self.unit, file=self._stream, dynamic_ncols=True))
        return self

    def track(self, items: Iterable[Item]) -> Iterator[Item]:
        """Yield the items of `items`, counting each one done when the next is asked for."""
        for item in items:
            yield item
            self.update()

    def update(self, count: int = 1) -> None:
        self.done += count
        if self._bar is not None:
            self._bar.update(count)
        elif self.done >= self._next_line:
            self._next_line = (self.done // self._every + 1) * self._every
            if self.done != self.total:          # the end has its own line
                log.info("%s: %s, %.1f s", self.what, self._count(), self._seconds())

    def __exit__(self, error_type: Optional[Type[BaseException]], error: Optional[BaseException],
                 trace: Optional[TracebackType]) -> Literal[False]:
        self._cleanup.close()
        if self._bar is None and error_type is None:
            log.info("%s: %s done in %.1f s", self.what, self._count(), self._seconds())
        return False

    def _count(self) -> str:
        """'300/1000 images (30%)', or '300 images' when the total is unknown."""
        if self.total:
            return f"{self.done}/{self.total} {self.unit} ({100 * self.done // self.total}%)"
        return f"{self.done} {self.unit}"

    def _seconds(self) -> float:
        return time.monotonic() - self._start


def _console_loggers() -> List[logging.Logger]:
    """The root and "cct" loggers where they print to the console: tqdm's redirection
    adds its own handler to every logger it is given, which would print twice."""
    def prints_to_console(handler: logging.Handler) -> bool:
        return isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr)
    loggers = (logging.getLogger(), logging.getLogger("cct"))
    return [logger for logger in loggers if any(prints_to_console(h) for h in logger.handlers)]


def is_terminal(stream: Any) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):       # no isatty, or a closed stream
        return False
