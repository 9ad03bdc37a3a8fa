"""Periodic checkpoints of a live run, sealed atomically, and the latest good one to resume from.

Layout, inside the run directory::

    checkpoints/
        v00025/                 one sealed checkpoint per ``train.checkpoint_every`` versions (the last
            model.safetensors   ``train.keep_checkpoints`` are kept)
            config.json, tokenizer files
            optimizer.pt        optimizer and LR-schedule state, version, the trainer's RNG state
            controller.json     the controller's state at that version (see Controller.checkpoint_state)
            MANIFEST.json       size and sha256 of every other file
        .partial-v00030/        being written: nothing reads it, the next seal or resume removes it

How a checkpoint is written (so that a crash at any moment leaves the previous ones intact):

1. the primary trainer writes its files into ``.partial-vNNNNN`` (its own temporary folder, renamed);
2. the controller adds ``controller.json``, hashes every file into ``MANIFEST.json``, fsyncs each file
   and the folder, renames the folder to ``vNNNNN`` and fsyncs ``checkpoints/``;
3. only then are checkpoints beyond the last K removed.

Resuming takes the newest ``vNNNNN`` whose manifest verifies; one that does not (a torn copy, a flipped
bit, a file missing) is skipped with a warning and the one before it is used. The run resumes on the
partition the checkpoint was taken on (:func:`partition`), which re-planning may have moved away from
the configured split: every device loads the checkpoint, so each takes up its role as it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from bidirl.errors import BidirlError
from bidirl.sched.roles import Role

if TYPE_CHECKING:
    from bidirl.config import PipelineConfig

FOLDER = "checkpoints"
CONTROLLER_FILE = "controller.json"
MANIFEST_FILE = "MANIFEST.json"
PARTIAL_PREFIX = ".partial-"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    version: int
    state: Dict[str, Any]  # controller.json


def name_of(version: int) -> str:
    return f"v{version:05d}"


def partial_path(run_path: Path, version: int) -> Path:
    return Path(run_path) / FOLDER / f"{PARTIAL_PREFIX}{name_of(version)}"


def seal(partial: Path, controller_state: Dict[str, Any], keep: int) -> Path:
    """Steps 2 and 3 above: ``partial`` (the trainer's files) becomes a sealed checkpoint. A failure to
    write (disk full, unwritable folder) is one :class:`BidirlError` naming the checkpoint and saying
    which one stays the latest; the partial folder is removed and nothing sealed is touched."""
    partial = Path(partial)
    final = partial.with_name(partial.name[len(PARTIAL_PREFIX):])
    try:
        _write_synced(partial / CONTROLLER_FILE, json.dumps(controller_state, indent=1).encode())
        manifest = {str(f.relative_to(partial)): {"bytes": f.stat().st_size, "sha256": _sha256(f)}
                    for f in sorted(partial.rglob("*")) if f.is_file()}
        _write_synced(partial / MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
        for f in partial.rglob("*"):
            if f.is_file():
                _fsync(f)
        _fsync(partial)
        if final.exists():  # (a version sealed before a crash and written again after the resume)
            shutil.rmtree(final)
        os.replace(partial, final)
        _fsync(final.parent)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        previous = [c.name for c in sealed(partial.parent)]
        kept = f"the latest checkpoint stays {previous[-1]}" if previous else "no earlier checkpoint exists"
        raise BidirlError(f"checkpoint {final}: cannot write it ({exc.strerror or exc}); {kept}") from None
    prune(final.parent, keep)
    return final


def sealed(folder: Path) -> List[Path]:
    """Sealed checkpoints in ``folder``, oldest first (verified or not)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and p.name.startswith("v") and p.name[1:].isdigit())


def prune(folder: Path, keep: int) -> None:
    """Keeps the newest ``keep`` sealed checkpoints (0: all) and removes partial ones."""
    for p in Path(folder).glob(f"{PARTIAL_PREFIX}*"):
        shutil.rmtree(p, ignore_errors=True)
    if keep > 0:
        for old in sealed(folder)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def verify(path: Path) -> Optional[str]:
    """None when every file the manifest lists is there with its size and hash; else why not."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    except (OSError, ValueError) as exc:
        return f"no readable {MANIFEST_FILE} ({type(exc).__name__})"
    if CONTROLLER_FILE not in manifest:
        return f"{CONTROLLER_FILE} is not in the manifest"
    for name, entry in manifest.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != entry["bytes"] or _sha256(f) != entry["sha256"]:
            return f"{name} does not match its checksum"
    return None


def latest_good(run_path: Path, warn: Callable[[str], None]) -> Optional[Checkpoint]:
    """The newest sealed checkpoint of a run that verifies; each newer one that does not is skipped
    with a warning. None when there is none."""
    for path in reversed(sealed(Path(run_path) / FOLDER)):
        problem = verify(path)
        if problem is None:
            state = json.loads((path / CONTROLLER_FILE).read_text())
            return Checkpoint(path, int(state["version"]), state)
        warn(f"warning: checkpoint {path} skipped: {problem}")
    return None


def check_compatible(checkpoint: Checkpoint, cfg: "PipelineConfig", finishing: bool = False) -> None:
    """The run ``cfg`` describes can continue from ``checkpoint``: the same batch, and steps left to train
    -- or, ``finishing``, none left: a checkpoint of the last version from a run that died after training
    (in its final checkpoint or its evaluation), which resuming finishes."""
    trained = checkpoint.state["groups_per_step"]
    if trained != cfg.train.prompts_per_step:
        raise BidirlError(f"{checkpoint.path}: the checkpoint trained {trained} prompts per step, this run is "
                          f"configured for {cfg.train.prompts_per_step} (train.prompts_per_step)")
    if checkpoint.version > cfg.train.steps or (checkpoint.version == cfg.train.steps and not finishing):
        raise BidirlError(f"{checkpoint.path}: the checkpoint is at version {checkpoint.version}, and train.steps="
                          f"{cfg.train.steps}: nothing is left to train (raise train.steps to continue)")


def partition(checkpoint: Checkpoint, policy: str, devices: int) -> Optional[Tuple[List[Role], int]]:
    """The homes and primary trainer ``checkpoint`` was taken with, to resume a run of ``policy`` on
    ``devices`` devices on them; None where they do not apply -- another policy or device count, or a
    checkpoint from before they were kept (the run starts on the configured split). A checkpoint without
    its primary (older) gets its first home trainer: every trainer resumes the same state.

    Rollout devices that re-planning had picked to move to the train pool (``leaving``: they were
    draining their groups) start there: a resumed run has nothing in flight to drain, and every trainer
    loads the whole training state, so the move the run was waiting for is made at once."""
    state = checkpoint.state
    if state.get("policy") != policy or len(state.get("homes", ())) != devices:
        return None
    homes = [Role(home) for home in state["homes"]]
    for index in state.get("leaving", ()):
        if not 0 <= index < devices:
            raise ValueError(f"its re-planning moves ('leaving') name device {index} of {devices}")
        if homes[index] is Role.ROLLOUT:
            homes[index] = Role.TRAIN
    primary = state.get("primary", homes.index(Role.TRAIN) if Role.TRAIN in homes else 0)
    return homes, primary


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
