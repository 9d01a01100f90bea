"""Progress of a long command on a text stream (stderr), so that a run of minutes shows it is alive
while its report (stdout) stays as it was.

:func:`make_progress` picks the form from the stream: a terminal gets a ``rich`` progress bar
(a spinner and the elapsed time that move during a long step, the steps done, the time left);
anything else (a pipe, a log file, CI) gets plain lines, one per finished phase and step, each with
the time since the start. Lines for fast steps are thinned to about one a second (the last step
always gets one), so a GPU run of hundreds of steps writes a few lines, a CPU run of slow steps
one per step.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

__all__ = ["RunProgress", "LineProgress", "BarProgress", "make_progress", "format_seconds", "format_bytes"]


def format_seconds(s: float) -> str:
    """``0.42 s``, ``12.3 s``, ``2 min 05 s``, ``1 h 02 min``."""
    if s < 10:
        return f"{s:.2f} s"
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(int(round(s)), 60)
    if m < 60:
        return f"{m} min {sec:02d} s"
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min"


def format_bytes(n: float) -> str:
    """``512 B``, ``3.4 KiB``, ``1.25 MiB``, ``17.2 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class RunProgress:
    """What a run reports, and a reporter that shows nothing (``--quiet``)."""

    def note(self, text: str) -> None:
        """A fact about the run (its sizes, a warning), before or between its phases."""

    def begin(self, what: str) -> None:
        """A phase starts (``"prefill"``, ``"warm-up step"``, ``"check"``)."""

    def end(self, what: str, detail: str = "") -> None:
        """The phase ``what`` ended; ``detail`` says what it did."""

    def steps(self, total: int) -> None:
        """``total`` timed steps start."""

    def step(self, done: int, total: int, seconds: float) -> None:
        """Step ``done`` of ``total`` took ``seconds``."""

    def close(self) -> None:
        """The run ended (or failed): release the display."""


class LineProgress(RunProgress):
    """One line per event on ``stream``: ``<prefix>: <what> ... [<elapsed> elapsed]``."""

    #: a step line at most this often (seconds), except for the last step
    STEP_LINE_INTERVAL = 1.0

    def __init__(self, stream: TextIO, prefix: str = "serve-sim") -> None:
        self.stream, self.prefix = stream, prefix
        self.t0 = time.perf_counter()
        self._began: dict[str, float] = {}
        self._last_step_line = -float("inf")
        self._steps_t0 = self.t0

    def _line(self, text: str) -> None:
        print(f"{self.prefix}: {text}", file=self.stream, flush=True)

    def _elapsed(self) -> str:
        return format_seconds(time.perf_counter() - self.t0)

    def note(self, text: str) -> None:
        self._line(text)

    def begin(self, what: str) -> None:
        self._began[what] = time.perf_counter()
        self._line(f"{what} ...")

    def end(self, what: str, detail: str = "") -> None:
        took = time.perf_counter() - self._began.pop(what, self.t0)
        self._line(f"{what} done in {format_seconds(took)}{detail}  [{self._elapsed()} elapsed]")

    def steps(self, total: int) -> None:
        self._steps_t0 = time.perf_counter()

    def step(self, done: int, total: int, seconds: float) -> None:
        now = time.perf_counter()
        if done < total and now - self._last_step_line < self.STEP_LINE_INTERVAL:
            return
        self._last_step_line = now
        left = ""
        if done < total:
            left = f", about {format_seconds((now - self._steps_t0) / done * (total - done))} left"
        self._line(f"step {done}/{total}: {seconds * 1e3:.3f} ms  [{self._elapsed()} elapsed{left}]")


class BarProgress(RunProgress):
    """A ``rich`` progress bar on ``stream`` (a terminal): a row per phase, one for the steps."""

    def __init__(self, stream: TextIO) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.console = Console(file=stream, highlight=False)
        self.bar = Progress(
            SpinnerColumn(finished_text="[green]✓[/green]"),
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[count]}"),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._tasks: dict[str, Any] = {}
        self.bar.start()

    def note(self, text: str) -> None:
        self.bar.console.print(text, markup=False)

    def begin(self, what: str) -> None:
        self._tasks[what] = self.bar.add_task(what, total=None, count="", info="")

    def end(self, what: str, detail: str = "") -> None:
        task = self._tasks.pop(what, None)
        if task is None:
            task = self.bar.add_task(what, total=None, count="", info="")
        self.bar.update(task, total=1, completed=1, info=detail.lstrip(";:, "))
        self.bar.stop_task(task)

    def steps(self, total: int) -> None:
        self._tasks["steps"] = self.bar.add_task("decode steps", total=total, count=f"0/{total}", info="")

    def step(self, done: int, total: int, seconds: float) -> None:
        self.bar.update(self._tasks["steps"], completed=done, count=f"{done}/{total}", info=f"{seconds * 1e3:.3f} ms")

    def close(self) -> None:
        self.bar.stop()


def make_progress(stream: TextIO | None = None, prefix: str = "serve-sim") -> RunProgress:
    """A bar on a terminal, lines elsewhere (``stream``: default ``sys.stderr``)."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return BarProgress(stream)
    return LineProgress(stream, prefix)
