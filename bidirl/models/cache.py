"""Model cache entries: a folder per prepared model, complete or absent, never half-written.

Every entry is built in a temporary sibling folder and renamed into place only when complete; its
``bidirl_model.json`` (written last) records where it came from and what it measured.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional

INFO_FILE = "bidirl_model.json"  # written last: its presence marks a complete cache entry


@dataclass
class PreparedModel:
    path: str  # a local model directory
    source: str
    info: Dict[str, Any] = field(default_factory=dict)
    reused: bool = False


def cache_key(parts: Dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def cached_entry(directory: Path) -> Optional[PreparedModel]:
    """A complete cache entry, or None (missing or half-written entries do not count)."""
    if (directory / INFO_FILE).is_file() and (directory / "config.json").is_file():
        info = read_info(directory)
        return PreparedModel(str(directory), info.get("source", "cache"), info, reused=True)
    return None


def write_entry(directory: Path, build: Callable[[Path], Dict[str, Any]]) -> PreparedModel:
    """Builds into a temporary sibling folder, writes the info file last, then renames into place.

    Two processes may build the same entry at once: every node's launcher of a multi-node run prepares
    its model, and a shared filesystem gives them one cache. The first to finish puts its entry in place;
    the other keeps that one and drops its own, since the first one's run may already be loading from it
    (replacing it would pull the folder from under those loads). Only an incomplete entry, left by an
    interrupted build, is replaced."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        info = build(tmp)
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2))
        if directory.exists() and cached_entry(directory) is None:
            shutil.rmtree(directory)  # an incomplete entry left by an interrupted run
        try:
            os.replace(tmp, directory)
        except OSError:  # a complete entry is there: a folder is not renamed onto a folder that holds files
            finished = cached_entry(directory)
            if finished is None:
                raise
            return finished
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return PreparedModel(str(directory), info.get("source", "cache"), info)


def read_info(directory: Path) -> Dict[str, Any]:
    try:
        return json.loads((directory / INFO_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
