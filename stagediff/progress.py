"""How a command shows a job's progress on stderr: a bar per stage with its ETA on a terminal, one plain line
per event otherwise (a log, a pipe). rich is imported only when bars are drawn. Stages count steps (`3/20`),
the raw frames count frames, an encoded result counts its size (`3.6 kB`)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TextIO

from stagediff.results import BytesReceived, Event, FramesReceived, Paused, Progress, Queued, Resumed

if TYPE_CHECKING:
    from rich.progress import ProgressColumn, Task, TaskID


def pause_line(event: Paused | Resumed) -> str:
    """The line that says a job's denoising paused (its state kept) or resumed."""
    if isinstance(event, Resumed):
        return f"{event.stage}: resumed at {event.step}/{event.total}"
    why = {
        "preempted": f"preempted by a higher priority job ({event.preemptions} so far)",
        "handoff": "its replica is shutting down; continuing on another",
    }.get(event.reason, event.reason)
    return f"{event.stage}: paused at {event.step}/{event.total}: {why}"


class PlainProgress:
    """Progress as one line per event on `stream`: for a log or a pipe."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        """Nothing to close: each line is written as its event arrives."""

    def __call__(self, event: Event) -> None:
        if isinstance(event, Queued):
            line = f"queued job {event.job_id} at position {event.position}"
        elif isinstance(event, Progress):
            line = f"{event.stage}: {event.step}/{event.total}"
        elif isinstance(event, FramesReceived):
            line = f"received frames {event.first_frame}..{event.first_frame + event.count - 1}"
        elif isinstance(event, BytesReceived):
            line = f"received bytes {event.offset}..{event.offset + event.count - 1}"
        elif isinstance(event, Paused | Resumed):
            line = pause_line(event)
        else:
            return
        print(line, file=self.stream, flush=True)


class RichProgress:
    """Progress on a terminal: a bar per stage with its steps, elapsed time and ETA, and the result's download."""

    def __init__(self, stream: TextIO) -> None:
        # Imported here: the other commands start without loading rich.
        from rich.console import Console
        from rich.progress import BarColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.progress import Progress as Bars

        self.bars = Bars(
            TextColumn("{task.description:<14}"),
            BarColumn(),
            _amount_column(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=Console(file=stream),
        )
        self.tasks: dict[str, TaskID] = {}
        self.received = 0

    def __enter__(self) -> RichProgress:
        self.bars.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bars.stop()

    def __call__(self, event: Event) -> None:
        if isinstance(event, Queued):
            self.bars.console.print(f"queued job {event.job_id} at position {event.position}", highlight=False)
        elif isinstance(event, Progress):
            self._bar(event.stage, event.total)
            self.bars.update(self.tasks[event.stage], completed=event.step, total=event.total)
        elif isinstance(event, FramesReceived):
            self._bar("frames", None)
            self.bars.advance(self.tasks["frames"], event.count)
        elif isinstance(event, Paused | Resumed):
            self.bars.console.print(pause_line(event), highlight=False)
        elif isinstance(event, BytesReceived):
            # The file's size is known only once it has all arrived: the bar counts bytes, with no total.
            self._bar("result", None, unit="bytes")
            self.received = event.offset + event.count
            self.bars.update(self.tasks["result"], completed=self.received)

    def _bar(self, name: str, total: int | None, unit: str = "") -> None:
        if name not in self.tasks:
            self.tasks[name] = self.bars.add_task(name, total=total, unit=unit)


def _amount_column() -> ProgressColumn:
    """The column that says how far a bar is: `3/20` steps, `9` frames, `3.6 kB` (or `3.6/7.2 kB`) of a file."""
    from rich.filesize import decimal
    from rich.progress import DownloadColumn, MofNCompleteColumn, ProgressColumn
    from rich.text import Text

    class AmountColumn(ProgressColumn):
        def __init__(self) -> None:
            super().__init__()
            self.counts = MofNCompleteColumn()
            self.sizes = DownloadColumn()

        def render(self, task: Task) -> Text:
            if task.fields.get("unit") != "bytes":
                return self.counts.render(task) if task.total is not None else Text(f"{int(task.completed)}")
            if task.total is None:
                return Text(decimal(int(task.completed)))
            return self.sizes.render(task)

    return AmountColumn()


def progress_display(quiet: bool, stream: TextIO | None = None) -> PlainProgress | RichProgress | None:
    """What shows a job's progress on `stream` (stderr): bars on a terminal, plain lines otherwise; None if quiet."""
    stream = sys.stderr if stream is None else stream
    if quiet:
        return None
    return RichProgress(stream) if stream.isatty() else PlainProgress(stream)
