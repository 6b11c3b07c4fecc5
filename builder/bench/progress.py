"""What mopt bench shows while it runs: a timestamped line per step on stderr, and on a terminal a
bar for the run in progress (rich; transient, so the lines stay readable after it)."""
from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress

from .load import Run

Measure = Callable[[Callable[[float], None]], Run]


class Progress:
    """LOG prints a line; RUN measures one run, passing it a callback for its elapsed fraction."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)

    def log(self, message: str) -> None:
        self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {escape(message)}")

    def run(self, title: str, measure: Measure) -> Run:
        if not self.console.is_terminal:
            return measure(lambda fraction: None)
        with RichProgress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                          console=self.console, transient=True) as bar:
            task = bar.add_task(escape(title), total=1.0)
            return measure(lambda fraction: bar.update(task, completed=fraction))
