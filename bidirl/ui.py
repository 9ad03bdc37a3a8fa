"""Console output: one rich console, progress bars that vanish when disabled or not on a terminal."""

from __future__ import annotations

import multiprocessing
import os
from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

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

        with _showing():
            yield advance


_live = [False]  # a bar or a spinner is on screen: rich draws one live display at a time


@contextmanager
def _showing() -> Iterator[None]:
    _live[0] = True
    try:
        yield
    finally:
        _live[0] = False


@contextmanager
def activity(description: str, enabled: bool = True) -> Iterator[Callable[[str], None]]:
    """A spinner, the time elapsed and a line of news, for work whose length is not known ahead (a plan's
    search: how many splits it simulates depends on what it finds). Yields ``show(news)``. It vanishes when
    done -- what the work found is printed after it -- and shows nothing where disabled or quiet, off a
    terminal, inside another bar or spinner (whose own line says what runs), or outside the main process
    (an experiment's worker processes would draw over each other)."""
    if not enabled or quiet() or _live[0] or not console.is_terminal or multiprocessing.parent_process() is not None:
        yield lambda news: None
        return
    columns = [SpinnerColumn(), TextColumn("[bold]{task.description}"), TimeElapsedColumn(),
               TextColumn("{task.fields[news]}")]
    with Progress(*columns, console=console, transient=True) as progress, _showing():
        task = progress.add_task(description, total=None, news="")
        yield lambda news: progress.update(task, news=news)
