"""User-facing errors.

Anything a user can cause (a bad YAML key, a missing file, an impossible plan, a corrupt checkpoint)
is raised as a :class:`BidirlError` whose message is one line naming the culprit. The CLI prints that
line and exits with ``exit_code``; only ``--debug`` shows a traceback.
"""

import json
from pathlib import Path
from typing import Any, Dict


class BidirlError(Exception):
    """An error caused by the user's input: printed as one line, exit code 2."""

    exit_code = 2

    def __init__(self, message: str = "") -> None:
        # one line, whatever the culprit holds (a key or value typed with a newline in it)
        super().__init__(str(message).replace("\r", "\\r").replace("\n", "\\n"))


class RunFailed(BidirlError):
    """A run that started and then failed (a crashed rank, a lost peer): not bad input, exit code 1."""

    exit_code = 1


class Unrecoverable(BidirlError):
    """An error a restart of the worker group would meet again: the machine refuses what the run must do
    (a checkpoint that cannot be written on a full disk). Exit code 2, and torchrun's remaining restarts
    end at once (``bidirl.runtime.main``)."""


class ConfigError(BidirlError):
    """The pipeline YAML or a ``key=value`` override is invalid."""


class NotBuiltYet(BidirlError):
    """A stage or command that a later issue implements; says so instead of pretending."""

    exit_code = 3


def read_json_document(path: Path, schema: str, kind: str, remedy: str) -> Dict[str, Any]:
    """A JSON file that bidirl wrote (``{"schema": schema, ...}``), or one line naming the file and
    ``remedy`` (what to run to write it again); ``kind`` is the file's usual name."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise BidirlError(f"{path}: {kind} not found ({remedy})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BidirlError(f"{path}: not a readable {kind} ({type(exc).__name__}); {remedy}") from None
    if not isinstance(data, dict) or data.get("schema") != schema:
        raise BidirlError(f"{path}: 'schema' must be {schema!r}; this file was not written by bidirl ({remedy})")
    return data
