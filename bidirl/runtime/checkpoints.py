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
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import yaml

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
    except (OSError, ValueError) as exc:  # (UnicodeDecodeError, JSONDecodeError: ValueErrors)
        return f"no readable {MANIFEST_FILE} ({type(exc).__name__})"
    if not isinstance(manifest, dict):
        return f"{MANIFEST_FILE} is a JSON {type(manifest).__name__}, not a mapping of each file to its size and sha256"
    if CONTROLLER_FILE not in manifest:
        return f"{CONTROLLER_FILE} is not in the manifest"
    for name, entry in manifest.items():
        if Path(name).is_absolute() or ".." in Path(name).parts:
            return f"{MANIFEST_FILE} names {name!r}, a file outside the checkpoint"
        if not (isinstance(entry, dict) and _whole(entry.get("bytes")) and isinstance(entry.get("sha256"), str)):
            return f"{MANIFEST_FILE}'s entry for {name} is {_shown(entry)}, not {{'bytes': <size>, 'sha256': <hex>}}"
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != entry["bytes"] or _sha256(f) != entry["sha256"]:
            return f"{name} does not match its checksum"
    return None


def latest_good(run_path: Path, warn: Callable[[str], None]) -> Optional[Checkpoint]:
    """The newest sealed checkpoint of a run that verifies; each newer one that does not is skipped
    with a warning. None when there is none. Its ``controller.json`` is read with :func:`read_state`: one
    that matches its manifest and still cannot be resumed (sealed over an edited file) is a
    :class:`BidirlError` naming the file and the field, not skipped (an older checkpoint would silently
    undo training the user may want)."""
    for path in reversed(sealed(Path(run_path) / FOLDER)):
        problem = verify(path)
        if problem is None:
            state = read_state(path)
            return Checkpoint(path, state["version"], state)
        warn(f"warning: checkpoint {path} skipped: {problem}")
    return None


# ---- what controller.json may hold --------------------------------------------------------------
# (a manifest only says the files are those sealed: a file edited and sealed again must not reach the
# resume as a KeyError or a TypeError after the run directory has been written to)
def _whole(value: Any, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _versions(value: Any, each: Callable[[Any], bool]) -> bool:
    """A mapping of version numbers (as JSON keys: decimal strings) to values ``each`` accepts."""
    return isinstance(value, dict) and all(isinstance(k, str) and k.isdigit() and each(v) for k, v in value.items())


def _cursor(value: Any) -> bool:
    return (isinstance(value, dict) and _whole(value.get("drawn")) and isinstance(value.get("redo"), list)
            and all(_whole(p) and p < value["drawn"] for p in value["redo"]))


WHOLE = (_whole, "a whole number >= 0")
STATE_FIELDS: Dict[str, Tuple[Callable[[Any], bool], str]] = {
    "version": WHOLE,
    "groups_per_step": (lambda v: _whole(v, 1), "a whole number >= 1"),
    "seed": (lambda v: isinstance(v, int) and not isinstance(v, bool), "a whole number"),
    "untrained_groups": WHOLE,
    "drawn_groups": WHOLE,
    "next_group": (lambda v: v is None or _whole(v), "a whole number >= 0"),
    "prompts": (_cursor, "{'drawn': <positions drawn>, 'redo': [<positions below it>]}"),
    "staleness": (lambda v: _versions(v, _whole), "a mapping of staleness to a count of groups"),
    "policy": (lambda v: isinstance(v, str), "a policy name"),
    "homes": (lambda v: isinstance(v, list) and bool(v) and all(h in {r.value for r in Role} for h in v),
              "a list of each device's home pool, 'rollout' or 'train'"),
    "primary": (_whole, "a device number"),
    "leaving": (lambda v: isinstance(v, list) and all(_whole(i) for i in v), "a list of device numbers"),
    "report": (lambda v: isinstance(v, dict), "a mapping"),
}
REQUIRED = ("version",)  # (latest_good's; check_compatible requires what a resume reads: RESUMED)
# what the resume reads unconditionally (Controller.resume_from, RunReport.resume); every checkpoint holds them
RESUMED = ("groups_per_step", "untrained_groups", "staleness", "report")
REPORT_FIELDS: Dict[str, Tuple[Callable[[Any], bool], str]] = {  # (RunReport.checkpoint_state: all of them)
    "snapshots": (lambda v: isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 and _whole(p[0])
                                                         and isinstance(p[1], str) for p in v),
                  "a list of [version, path] pairs"),
    "version_seconds": (lambda v: _versions(v, _number), "a mapping of versions to seconds"),
    "consumed_samples": WHOLE, "consumed_tokens": WHOLE, "replica_checks": WHOLE,
    "rl_seconds": (_number, "a number of seconds >= 0"),
}
PARTITION_FIELDS = ("policy", "homes", "primary", "leaving")


def read_state(path: Path) -> Dict[str, Any]:
    """The ``controller.json`` of the sealed checkpoint ``path``, checked (:func:`check_state`), and its
    version the one the folder is named after; else one :class:`BidirlError` naming the file and field."""
    where = Path(path) / CONTROLLER_FILE
    try:
        state = json.loads(where.read_text())
    except (OSError, ValueError) as exc:  # (UnicodeDecodeError, JSONDecodeError: ValueErrors)
        raise BidirlError(f"{where}: not readable JSON ({type(exc).__name__}): the checkpoint cannot be "
                          "resumed from") from None
    check_state(state, where)
    if Path(path).name[1:].isdigit() and state["version"] != int(Path(path).name[1:]):
        raise BidirlError(f"{where}: 'version' is {state['version']}, but the checkpoint is {Path(path).name}: "
                          "the checkpoint cannot be resumed from")
    return state


def check_state(state: Any, where: Path, fields: Tuple[str, ...] = tuple(STATE_FIELDS),
                required: Tuple[str, ...] = REQUIRED) -> None:
    """Each of ``fields`` that ``state`` (a controller.json read from ``where``) holds has its shape, and
    ``required`` ones are there; else one :class:`BidirlError` naming the file and the field."""
    if not isinstance(state, dict):
        raise BidirlError(f"{where}: a JSON {type(state).__name__}, not the controller's state (a mapping): the "
                          "checkpoint cannot be resumed from")
    for key in fields:
        if key not in state:
            if key in required:
                raise BidirlError(f"{where}: no '{key}': the checkpoint cannot be resumed from")
            continue
        accepts, expected = STATE_FIELDS[key]
        if not accepts(state[key]):
            raise BidirlError(f"{where}: '{key}' is {_shown(state[key])}, not {expected}: the checkpoint cannot be "
                              "resumed from")
    if "report" in fields and isinstance(state.get("report"), dict):
        for key, (accepts, expected) in REPORT_FIELDS.items():
            if key not in state["report"] or not accepts(state["report"][key]):
                shown = _shown(state["report"][key]) if key in state["report"] else "missing"
                raise BidirlError(f"{where}: 'report.{key}' is {shown}, not {expected}: the checkpoint cannot be "
                                  "resumed from")


def _shown(value: Any, most: int = 40) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= most else text[:most - 3] + "..."


def check_compatible(checkpoint: Checkpoint, cfg: "PipelineConfig", finishing: bool = False) -> None:
    """The run ``cfg`` describes can continue from ``checkpoint``: the same model (:func:`check_same_model`),
    the same batch, and steps left to train -- or, ``finishing``, none left: a checkpoint of the last version
    from a run that died after training (in its final checkpoint or its evaluation), which resuming finishes."""
    where = checkpoint.path / CONTROLLER_FILE
    check_state(checkpoint.state, where, ("groups_per_step",), ("groups_per_step",))
    check_same_model(checkpoint, cfg)
    trained = checkpoint.state["groups_per_step"]
    if trained != cfg.train.prompts_per_step:
        raise BidirlError(f"{checkpoint.path}: the checkpoint trained {trained} prompts per step, this run is "
                          f"configured for {cfg.train.prompts_per_step} (train.prompts_per_step)")
    if checkpoint.version > cfg.train.steps or (checkpoint.version == cfg.train.steps and not finishing):
        raise BidirlError(f"{checkpoint.path}: the checkpoint is at version {checkpoint.version}, and train.steps="
                          f"{cfg.train.steps}: nothing is left to train (raise train.steps to continue)")
    check_state(checkpoint.state, where, RESUMED, RESUMED)  # (before torchrun, not as a KeyError inside it)
    if "prompts" not in checkpoint.state and "drawn_groups" not in checkpoint.state:
        raise BidirlError(f"{where}: no 'prompts' (nor the older 'drawn_groups'): the checkpoint cannot be resumed from")


# What makes the checkpoint's weights load into the model this run builds, and be the same network.
# ``model.source`` names the architecture, the tokenizer and the KL reference model; for the tiny model the
# shape keys set every weight's shape (and the heads how they are read, the context the rotary embedding
# and vLLM allow). What may change: ``model.dtype`` (the trainer keeps fp32 master weights and optimizer
# state whatever it says: it is the compute precision, and the checkpoint loads into either), ``model.cache_dir``
# (where prepared models are kept), and the tiny model's SFT recipe and seed (they shape only the starting
# weights, which the checkpoint's replace -- with algorithm.kl_coef > 0 also the reference model, a change of
# the objective like any algorithm.* override, not of the network).
TINY_SHAPE_KEYS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                   "max_position_embeddings")


def check_same_model(checkpoint: Checkpoint, cfg: "PipelineConfig") -> None:
    """The model ``cfg`` configures is the one ``checkpoint`` trained, as its run's ``config.yaml`` (kept in
    the run directory, beside ``checkpoints/``) recorded it; else one :class:`BidirlError` naming the key.
    A key that config.yaml does not hold is not compared (nothing recorded to compare it with)."""
    if checkpoint.path.parent.name != FOLDER:
        return  # (a checkpoint outside a run directory: no config.yaml of its run)
    recorded = checkpoint.path.parent.parent / "config.yaml"
    try:
        text = recorded.read_text()
    except FileNotFoundError:
        return
    except (OSError, UnicodeDecodeError) as exc:
        raise BidirlError(f"{recorded}: not readable ({type(exc).__name__}), so the model {checkpoint.path} trained "
                          "cannot be checked against this run's") from None
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError:
        config = None
    model = config.get("model", {}) if isinstance(config, dict) else None
    tiny = model.get("tiny", {}) if isinstance(model, dict) else None
    if not isinstance(tiny, dict):
        raise BidirlError(f"{recorded}: not the run's resolved config (a YAML mapping with a 'model' section), so the "
                          f"model {checkpoint.path} trained cannot be checked against this run's")
    pairs = [("model.source", model.get("source"), cfg.model.source)]
    if cfg.model.source == "tiny" and model.get("source", "tiny") == "tiny":
        pairs += [(f"model.tiny.{key}", tiny.get(key), getattr(cfg.model.tiny, key)) for key in TINY_SHAPE_KEYS]
    for key, trained, configured in pairs:
        if trained is not None and not _same(key, trained, configured):
            raise BidirlError(f"{checkpoint.path}: the checkpoint trained a model with {key}={trained} (its run's "
                              f"config.yaml), this run is configured with {key}={configured}: a resume continues the "
                              "same model (start a new run to train another)")


def _same(key: str, trained: Any, configured: Any) -> bool:
    """Is the recorded value the configured one? For ``model.source`` a folder and a hub id may name one
    model (a hub model's local snapshot, a relative path typed from elsewhere): two folders are compared by
    their ``config.json``; a folder and a hub id, or a folder no longer there, cannot be told apart and pass
    (the weights' shapes are still checked as they load). Two built-in names, or two hub ids, must match."""
    if trained == configured:
        return True
    if key != "model.source" or not isinstance(trained, str) or {trained, configured} & {"tiny", "smollm2"}:
        return False
    folders = [Path(source).expanduser() for source in (trained, configured) if Path(source).expanduser().is_dir()]
    if len(folders) < 2:
        return not (_hub_id(trained) and _hub_id(configured))
    return _model_config(folders[0]) == _model_config(folders[1])


def _hub_id(source: str) -> bool:
    return not Path(source).expanduser().exists() and not source.startswith((".", "/", "~")) and source.count("/") == 1


def _model_config(folder: Path) -> Any:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None


def partition(checkpoint: Checkpoint, policy: str, devices: int) -> Optional[Tuple[List[Role], int]]:
    """The homes and primary trainer ``checkpoint`` was taken with, to resume a run of ``policy`` on
    ``devices`` devices on them; None where they do not apply -- another policy or device count, or a
    checkpoint from before they were kept (the run starts on the configured split). A checkpoint without
    its primary (older) gets its first home trainer: every trainer resumes the same state.

    Rollout devices that re-planning had picked to move to the train pool (``leaving``: they were
    draining their groups) start there: a resumed run has nothing in flight to drain, and every trainer
    loads the whole training state, so the move the run was waiting for is made at once."""
    state = checkpoint.state
    check_state(state, checkpoint.path / CONTROLLER_FILE, PARTITION_FIELDS, ())
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
