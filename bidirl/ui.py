"""Console output: one rich console, progress bars that vanish when disabled or not on a terminal."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True)


def say(message: str) -> None:
    console.print(message, highlight=False)


@contextmanager
def progress_bar(description: str, total: int, enabled: bool = True) -> Iterator[Callable[..., None]]:
    """Yields ``advance(n=1, **fields)``; ``fields`` (e.g. loss=0.3) are shown after the bar."""
    if not enabled:
        yield lambda n=1, **fields: None
        return
    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
    ]
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(description, total=total, info="")

        def advance(n: int = 1, **fields: float) -> None:
            info = "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
            progress.update(task, advance=n, info=info)

        yield advance
