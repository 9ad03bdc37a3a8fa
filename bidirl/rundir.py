"""One run directory per run: resolved config, metrics JSONL, plots, a short summary, W&B files.

Layout::

    runs/<name>-<YYYYmmdd-HHMMSS>/
        config.yaml      the fully resolved config (schema defaults <- YAML <- overrides)
        metrics.jsonl    one JSON object per logged step
        summary.json     final figures, machine-readable
        summary.md       the same for a person
        wandb/           W&B files (offline mode by default; `wandb sync` uploads them later)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from bidirl.config import PipelineConfig, to_yaml
from bidirl.errors import BidirlError


# Set by a pipeline run or a comparison while its stages start other runs (the launch stage's runtime,
# each compared policy): their W&B runs join its group.
WANDB_GROUP_VARIABLE = "BIDIRL_WANDB_GROUP"


class RunDir:
    # after a resume, W&B already holds the rows of the steps (and evaluations) past the checkpoint from
    # the attempt that crashed, and W&B cannot take rows back: the resumed attempt's rows carry
    # ``attempt`` (1 after the first resume, ...) so the two can be told apart; metrics.jsonl sets the
    # lost ones aside instead (``resumed``)
    attempt = 0

    def __init__(self, cfg: PipelineConfig, root: Optional[Path] = None, path: Optional[str | Path] = None):
        """A new ``<root or output_dir>/<name>-<stamp>``, or exactly ``path`` (a stage's folder inside a
        pipeline's run directory), which must not exist yet."""
        try:
            if path is None:
                self.path = new_run_path(cfg, root)
                self.path.mkdir(parents=True)
            else:
                self.path = Path(path)
                self.path.mkdir(parents=True, exist_ok=False)
        except OSError as exc:  # output_dir is a file, lies under one, or is not writable
            where = path or (root or cfg.output_dir)
            raise BidirlError(f"output_dir={where}: cannot create a run directory there ({exc.strerror or exc})") \
                from None
        (self.path / "config.yaml").write_text(to_yaml(cfg))
        self._metrics = open(self.path / "metrics.jsonl", "a", buffering=1)
        try:
            self._wandb = _start_wandb(cfg, self.path)
        except BidirlError:
            self._metrics.close()
            shutil.rmtree(self.path)  # no half-made run directory for a run that never started
            raise
        # ``started``: the metrics' clock (time_s), which a training run restarts when its RL begins;
        # ``opened``: this process's, for the summary's wall_s
        self.started = self.opened = time.time()

    @classmethod
    def existing(cls, cfg: PipelineConfig, path: Path) -> "RunDir":
        """An existing run directory, to run some of its stages again (``bidirl run --from``): its
        metrics are appended to, its ``config.yaml`` kept (the config of this re-run goes beside it), and
        a new W&B run joins the directory's group."""
        stamp = time.strftime('%Y%m%d-%H%M%S')
        return cls._reopen(cfg, Path(path), f"config.rerun-{stamp}.yaml", rerun=stamp)

    @classmethod
    def resumed(cls, cfg: PipelineConfig, path: str | Path, version: int) -> "RunDir":
        """A run directory whose run continues from its checkpoint at ``version``: metrics rows of later
        steps (trained before a crash, then lost with it) and evaluations (the resumed run evaluates every
        snapshot again) move to ``metrics.rolled-back.jsonl``, so every step appears once; the resumed
        config goes beside the original; W&B resumes the same run."""
        # held-out evaluations are logged after training, all of them again by the resumed run
        _roll_back(Path(path) / "metrics.jsonl", lambda row: row.get("step", 0) <= version and "eval_accuracy" not in row)
        # (logging.record_batches: one line per optimizer step, step k making version k + 1)
        _roll_back(Path(path) / "batches.jsonl", lambda row: row["step"] < version)
        return cls._reopen(cfg, Path(path), f"config.resumed-{time.strftime('%Y%m%d-%H%M%S')}.yaml", resume=True)

    @classmethod
    def _reopen(cls, cfg: PipelineConfig, path: Path, config_name: str, **wandb: Any) -> "RunDir":
        """An existing run directory, appended to: this config beside its own, its metrics, W&B."""
        run = cls.__new__(cls)
        run.path = path
        (path / config_name).write_text(to_yaml(cfg))
        run._metrics = open(path / "metrics.jsonl", "a", buffering=1)
        if wandb.get("resume"):
            run.attempt = len(list(path.glob("config.resumed-*.yaml")))
        try:
            run._wandb = _start_wandb(cfg, path, **wandb)
        except BidirlError:
            run._metrics.close()
            raise
        run.started = run.opened = time.time()
        return run

    def log(self, step: int, time_s: Optional[float] = None, **metrics: Any) -> None:
        """One metrics row; ``time_s`` defaults to now (pass it for something measured earlier)."""
        row = {"step": step, "time_s": round(time.time() - self.started, 3) if time_s is None else time_s, **metrics}
        self._metrics.write(json.dumps(finite(row), allow_nan=False) + "\n")
        if self._wandb is not None:
            attempt = {"attempt": self.attempt} if self.attempt else {}
            self._wandb.log({**{k: v for k, v in row.items() if isinstance(v, (int, float))}, **attempt})

    def table(self, name: str, columns: List[str], rows: List[List[Any]]) -> None:
        """A table for W&B (the comparison); the run directory has its own copy (compare.json/md)."""
        if self._wandb is not None:
            import wandb

            self._wandb.log({name: wandb.Table(columns=columns, data=rows)})

    def finish(self, summary: Dict[str, Any]) -> None:
        summary = {"run_dir": str(self.path), "wall_s": round(time.time() - self.opened, 1), **summary}
        _write_atomic(self.path / "summary.json", json.dumps(finite(summary), indent=2, default=str, allow_nan=False))
        lines = [f"# {self.path.name}", ""] + _markdown_items(summary)
        _write_atomic(self.path / "summary.md", "\n".join(lines) + "\n")
        if self._wandb is not None:  # the figures and the final numbers, as metrics.jsonl/summary.json hold them
            import wandb

            images = {png.stem: wandb.Image(str(png)) for png in sorted(self.path.glob("*.png"))}
            if images:
                self._wandb.log(images)
            self._wandb.summary.update({k: v for k, v in _flat(summary).items() if isinstance(v, (int, float, str))})
        self.close()

    def finish_after(self, failure: BaseException, summary: Optional[Dict[str, Any]] = None) -> None:
        """Closes a run that ``failure`` ended: status ``interrupted`` for Ctrl-C, ``failed`` with the error's
        line otherwise. A full disk must not hide ``failure``, which the caller raises next: that write
        is given up."""
        interrupted = isinstance(failure, KeyboardInterrupt)
        ended: Dict[str, Any] = {"status": "interrupted" if interrupted else "failed"}
        if not interrupted:
            line = next((line.strip() for line in str(failure).splitlines() if line.strip()), "")
            ended["error"] = f"{type(failure).__name__}: {line}"[:300] if line else type(failure).__name__
        try:
            self.finish({**(summary or {}), **ended})
        except OSError:
            with contextlib.suppress(OSError):  # (closing flushes the metrics to the same full disk)
                self.close()

    def close(self) -> None:
        self._metrics.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def check_output_dir(cfg: PipelineConfig) -> None:
    """``output_dir`` can hold run directories: the error ``RunDir`` would give, before any work is done."""
    path = Path(cfg.output_dir)
    for ancestor in [path, *path.parents]:
        if ancestor.exists():
            if not ancestor.is_dir():
                raise BidirlError(f"output_dir={cfg.output_dir}: cannot create a run directory there "
                                  f"({ancestor} is not a directory)")
            return


def new_run_path(cfg: PipelineConfig, root: Optional[Path] = None) -> Path:
    """``<root or output_dir>/<name>-<stamp>``, unused so far (not created)."""
    return _unique(Path(root or cfg.output_dir) / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")


def _start_wandb(cfg: PipelineConfig, path: Path, resume: bool = False, rerun: str = "") -> Any:
    """``resume``: continue the directory's own W&B run; ``rerun``: a new run of the same directory."""
    if cfg.logging.wandb_mode == "disabled":
        return None
    import wandb
    from omegaconf import OmegaConf

    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        run = wandb.init(
            project=cfg.logging.wandb_project,
            name=path.name,
            group=os.environ.get(WANDB_GROUP_VARIABLE) or path.name,  # a pipeline's or compare's runs, together
            dir=str(path),
            mode=cfg.logging.wandb_mode,
            # a resumed run continues its own W&B run; a re-run of some stages is a new one
            id=_wandb_id(path) + (f"-{rerun}" if rerun else ""), resume="allow" if resume else None,
            config=OmegaConf.to_container(OmegaConf.structured(cfg)),
        )
        # every metric is plotted against the run's own step, logged as a value: W&B's internal step only
        # grows, and it dropped what was logged at an earlier one -- the held-out evaluations, logged
        # after training at steps 0, eval_every, ... (all but the last)
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        return run
    except Exception as exc:  # e.g. online mode without an API key fails at once
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BidirlError(f"logging.wandb_mode={cfg.logging.wandb_mode}: W&B did not start ({first})") from None


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinity made None (JSON ``null``): Python writes them as ``NaN`` and
    ``Infinity``, which are not JSON, and strict readers (jq, most languages) refuse the whole file."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def _wandb_id(path: Path) -> str:
    """One W&B run id per run directory (its name, and a hash of where it is: names repeat across roots)."""
    import hashlib

    digest = hashlib.sha1(str(Path(path).resolve()).encode()).hexdigest()[:8]
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in Path(path).name)[-40:] + "-" + digest


def _flat(items: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a/b": 1}`` (W&B summary keys; the staleness histogram, idle shares...)."""
    out: Dict[str, Any] = {}
    for key, value in items.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _markdown_items(items: Dict[str, Any], indent: str = "") -> list:
    lines = []
    for key, value in items.items():
        if isinstance(value, dict):
            lines += [f"{indent}- **{key}**"] + _markdown_items(value, indent + "  ")
        else:
            lines.append(f"{indent}- **{key}**: {value}")
    return lines


def _unique(base: Path) -> Path:
    candidate, n = base, 1
    while candidate.exists():
        candidate, n = base.with_name(f"{base.name}-{n}"), n + 1
    return candidate


def _roll_back(path: Path, keep: Callable[[dict], bool]) -> None:
    """Rows of the JSON-lines file ``path`` that ``keep`` rejects move to ``<name>.rolled-back.jsonl``. A
    last line cut short (the process died writing it) goes there too, as it is; a bad line before the
    last is an error naming the file."""
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    kept, later = [], []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except ValueError:
            if number < len(lines):
                raise BidirlError(f"{path}:{number}: not a JSON row; the run directory was changed by hand or is "
                                  "damaged") from None
            later.append(line)  # torn by a crash mid-write
            continue
        (kept if keep(row) else later).append(line)
    if later:
        with open(path.with_name(path.stem + ".rolled-back.jsonl"), "a") as out:
            out.write("\n".join(later) + "\n")
    _write_atomic(path, "".join(line + "\n" for line in kept))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
