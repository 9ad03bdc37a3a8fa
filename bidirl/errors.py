"""User-facing errors.

Anything a user can cause (a bad YAML key, a missing file, an impossible plan, a corrupt checkpoint)
is raised as a :class:`BidirlError` whose message is one line naming the culprit. The CLI prints that
line and exits with ``exit_code``; only ``--debug`` shows a traceback.
"""


class BidirlError(Exception):
    """An error caused by the user's input: printed as one line, exit code 2."""

    exit_code = 2


class ConfigError(BidirlError):
    """The pipeline YAML or a ``key=value`` override is invalid."""


class NotBuiltYet(BidirlError):
    """A stage or command that a later issue implements; says so instead of pretending."""

    exit_code = 3
