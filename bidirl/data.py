"""Problems with verifiable numeric answers: GSM8K (hub id or local file) and reasoning-gym tasks.

Every source yields :class:`Problem` objects with one interface (question, reference answer, optional
worked solution), so the rest of bidirl never knows where a problem came from.

* GSM8K goes through the ``datasets`` library: a hub id such as ``openai/gsm8k`` (machines with
  internet) or a local ``.jsonl``/``.parquet`` file, or a folder holding ``{split}.jsonl``/``.parquet``,
  with ``question``/``answer`` fields; the reference is the number after ``####``. A single file holds
  both splits: its held-out problems are those whose question hash falls in the held-out bucket, as for
  reasoning-gym (a file read whole for both would evaluate on training problems).
* reasoning-gym tasks are procedural and seeded, so the CPU default needs no download. Train and
  held-out problems are drawn from one stream and split by a stable hash of the question text, so the
  held-out set never contains a training question even when the task's problem space is small. A
  drawn list is kept in ``data.cache_dir`` (JSON, keyed by everything that decides it), because
  drawing takes ~30 s where the task space is small and every process of a run reads the problems.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Deque, Dict, Iterable, List, Sequence, Tuple

from bidirl.config import DataConfig
from bidirl.errors import BidirlError
from bidirl.reward import reference_answer

HELD_OUT_BUCKETS = 10  # one bucket in ten of the question-hash space is held out for evaluation


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # the reference answer as text, e.g. "72"
    solution: str = ""  # a worked solution when the source has one


def load_problems(cfg: DataConfig, split: str) -> List[Problem]:
    """Problems for ``split`` ("train" or "test") as the data config describes them."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    size = cfg.train_size if split == "train" else cfg.eval_size
    if cfg.source == "gsm8k":
        return load_gsm8k(cfg.path, split)[:size]
    return cached_problems(cfg, split, size, lambda: load_reasoning_gym(cfg.task, cfg.task_config, cfg.seed, split, size))


CACHE_FORMAT = 1  # bump when what a cached list holds, or how it is drawn, changes


def cached_problems(cfg: DataConfig, split: str, size: int, draw: Callable[[], List[Problem]]) -> List[Problem]:
    """``draw()``, or the list it gave before for the same task, settings, seed, split, size and
    reasoning-gym version. A cache file that cannot be read is drawn again; one that cannot be written
    is skipped (the cache only saves time)."""
    if not cfg.cache_dir:
        return draw()
    from importlib.metadata import version

    key = json.dumps([CACHE_FORMAT, version("reasoning-gym"), cfg.task, cfg.task_config, cfg.seed, split, size],
                     sort_keys=True, default=str)
    path = Path(cfg.cache_dir) / f"{cfg.task}-{split}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    try:
        rows = json.loads(path.read_text())
        return [Problem(str(q), str(a), str(s)) for q, a, s in rows]
    except (OSError, ValueError, TypeError):  # not there yet, or not a list of triples: draw it
        pass
    problems = draw()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{uuid.uuid4().hex[:8]}.tmp")  # processes of one run may race: each its own
        tmp.write_text(json.dumps([[p.question, p.answer, p.solution] for p in problems]))
        tmp.replace(path)
    except OSError:
        pass
    return problems


def load_gsm8k(source: str, split: str) -> List[Problem]:
    """GSM8K from a local file/folder or a hub id, through ``datasets``."""
    rows = _load_rows(source, split)
    problems = []
    for index, row in enumerate(rows):
        if "question" not in row or "answer" not in row:
            raise BidirlError(f"{source}: row {index} lacks a 'question' or 'answer' field")
        try:
            answer = reference_answer(row["answer"])
        except ValueError as exc:
            raise BidirlError(f"{source}: row {index}: {exc}") from None
        problems.append(Problem(row["question"], _number_text(answer), row["answer"]))
    if Path(source).expanduser().is_file():  # one file, both splits: the held-out bucket is the test split
        return [p for p in problems if _is_held_out(p.question) == (split == "test")]
    return problems


def _load_rows(source: str, split: str) -> Any:
    import datasets

    datasets.disable_progress_bars()
    # (its json and parquet readers log their own "Failed to load JSON" / "Failed to read schema" line first:
    # ours below says it once)
    for reader in ("json.json", "parquet.parquet"):
        datasets.logging.get_logger(f"datasets.packaged_modules.{reader}").setLevel(datasets.logging.CRITICAL)
    path = Path(source).expanduser()
    if path.is_dir():
        candidates = [path / f"{split}.{ext}" for ext in ("jsonl", "json", "parquet")]
        found = [c for c in candidates if c.is_file()]
        if not found:
            raise BidirlError(f"{path}: no {split}.jsonl or {split}.parquet in this folder")
        path = found[0]
    if path.is_file():
        builder = "parquet" if path.suffix == ".parquet" else "json"
        try:
            return datasets.load_dataset(builder, data_files=str(path), split="train")
        except Exception as exc:  # datasets raises many types for a corrupt file
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]  # some carry no message
            raise BidirlError(f"{path}: cannot read as {builder} (empty or malformed?): {first}") from None
    if source.startswith((".", "/", "~")) or source.endswith((".jsonl", ".json", ".parquet")):
        raise BidirlError(f"{source}: data file not found")
    try:
        return datasets.load_dataset(source, "main", split=split)
    except Exception as exc:
        raise BidirlError(f"{source}: cannot load from the hub ({str(exc).splitlines()[0]})") from None


def load_reasoning_gym(
    task: str, task_config: Dict[str, Any], seed: int, split: str, size: int
) -> List[Problem]:
    """``size`` distinct problems of a reasoning-gym task, disjoint between train and test."""
    import reasoning_gym

    want_held_out = split == "test"
    problems: List[Problem] = []
    seen = set()
    draw_seed = seed
    while len(problems) < size:
        batch = _rg_dataset(reasoning_gym, task, task_config, draw_seed, max(4 * size, 256))
        for item in batch:
            question = item["question"]
            if question in seen or _is_held_out(question) != want_held_out:
                continue
            seen.add(question)
            problems.append(Problem(question, str(item["answer"]), _rg_solution(item)))
            if len(problems) == size:
                break
        draw_seed += 7919  # the task space may be small: stop once a new draw adds nothing
        if draw_seed > seed + 7919 * 20:
            break
    if not problems:
        raise BidirlError(f"reasoning-gym task '{task}' produced no {split} problems")
    return problems


def _rg_dataset(reasoning_gym: Any, task: str, task_config: Dict[str, Any], seed: int, size: int) -> Any:
    try:
        return reasoning_gym.create_dataset(task, seed=seed, size=size, **dict(task_config))
    except (ValueError, TypeError, AssertionError, KeyError) as exc:
        raise BidirlError(f"data.task '{task}' with task_config {dict(task_config)}: {exc}") from None


def _rg_solution(item: Dict[str, Any]) -> str:
    meta = item.get("metadata") or {}
    return str(meta.get("answer_cot") or meta.get("solution") or meta.get("cot")
               or worked_chain(str(meta.get("expression", ""))))


_CHAIN_RE = re.compile(r"-?\d+(?:\s*[+-]\s*\d+)+")


def worked_chain(expression: str) -> str:
    """The steps of a chain of integer additions and subtractions, left to right:
    ``"4 - 1 - 7"`` -> ``"4-1=3, 3-7=-4"``; ``""`` for anything else (no steps to show)."""
    expression = expression.strip()
    if not _CHAIN_RE.fullmatch(expression):
        return ""
    terms = re.findall(r"[+-]?\s*\d+", expression)
    value = int(terms[0].replace(" ", ""))
    steps = []
    for term in terms[1:]:
        term = term.replace(" ", "")
        new = value + int(term)
        steps.append(f"{value}{term[0]}{term[1:]}={new}")
        value = new
    return ", ".join(steps)


def _is_held_out(question: str) -> bool:
    digest = hashlib.sha256(question.encode()).digest()
    return digest[0] % HELD_OUT_BUCKETS == 0


def _number_text(value: Any) -> str:
    return str(value.numerator) if value.denominator == 1 else str(float(value))


class PromptSampler:
    """Cycles through the training problems, reshuffled every epoch (seeded). Each problem drawn has a
    *position*: its place in that seeded stream (0, 1, 2, ...). A resumed run names the positions drawn
    but not trained before its checkpoint (:meth:`resume`), and those are drawn again first."""

    def __init__(self, problems: Sequence[Problem], seed: int):
        self.problems, self.rng, self.order = list(problems), random.Random(seed), []
        self.drawn = 0  # positions of the stream drawn so far
        self.redo: Deque[Tuple[int, Problem]] = deque()  # (position, problem) to draw again, first

    def next(self, count: int) -> List[Problem]:
        return [problem for _, problem in self.take(count)]

    def take(self, count: int) -> List[Tuple[int, Problem]]:
        """The next ``count`` problems with their positions: those to draw again first, then new ones."""
        batch = [self.redo.popleft() for _ in range(min(count, len(self.redo)))]
        while len(batch) < count:
            batch.append(self._new())
        return batch

    def _new(self) -> Tuple[int, Problem]:
        self._refill()
        self.drawn += 1
        return self.drawn - 1, self.problems[self.order.pop()]

    def resume(self, drawn: int, redo: Iterable[int] = ()) -> None:
        """Continues a run that drew ``drawn`` positions, of which ``redo`` were not trained (they were in
        flight or waiting at its checkpoint): those are drawn again, in order, before position ``drawn``,
        so no position of the stream is skipped and none is trained twice. (On a sampler that drew nothing.)"""
        assert not self.drawn and not self.redo, "resume a sampler before drawing from it"
        wanted = sorted(set(redo))
        if wanted and not 0 <= wanted[0] <= wanted[-1] < drawn:
            raise ValueError(f"positions to draw again must lie in 0..{drawn - 1}, got {wanted[0]}..{wanted[-1]}")
        for position in wanted:  # (the stream replayed up to each: positions are drawn in order)
            self.skip(position - self.drawn)
            self.redo.append(self._new())
        self.skip(drawn - self.drawn)

    def skip(self, count: int) -> None:
        """Advances past ``count`` positions exactly as drawing them would."""
        self.drawn += max(0, count)
        while count > 0:
            self._refill()
            taken = min(count, len(self.order))
            del self.order[len(self.order) - taken:]
            count -= taken

    def _refill(self) -> None:
        """A new epoch, shuffled, once the last one is drawn."""
        if not self.order:
            self.order = list(range(len(self.problems)))
            self.rng.shuffle(self.order)
