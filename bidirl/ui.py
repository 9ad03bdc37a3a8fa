"""Console output: one rich console, progress bars that vanish when disabled or not on a terminal."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True)
# ``bidirl --quiet`` (for CI): no progress bars and no notes, in this process and in the processes it
# starts (torchrun's ranks inherit the environment); errors and results still print
QUIET_VARIABLE = "BIDIRL_QUIET"


def quiet() -> bool:
    return os.environ.get(QUIET_VARIABLE) == "1"


def say(message: str) -> None:
    if not quiet():
        console.print(message, highlight=False)


@contextmanager
def progress_bar(description: str, total: int, enabled: bool = True) -> Iterator[Callable[..., None]]:
    """Yields ``advance(n=1, **fields)``; ``fields`` (e.g. loss=0.3) are shown after the bar."""
    if not enabled or quiet():
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
