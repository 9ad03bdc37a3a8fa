"""torchrun, as ``bidirl launch`` runs it: ``python -m bidirl.runtime.elastic <torchrun arguments>``.

The same elastic agent (restarts after a dead process included), but when the worker group finally
fails it ends with one line per failed rank -- which process, how it died, how to resume -- instead of
torchrun's multi-line report and traceback. A rank that failed on a user error has already printed its
own ``error (rank R): ...`` line.
"""

from __future__ import annotations

import os
import sys
from typing import Dict


def describe_failures(failures: Dict[int, object], restarts: int) -> str:
    """One line: every failed rank (0 is the controller, R > 0 device R - 1) and how it ended."""
    parts = []
    for rank, failure in sorted(failures.items()):
        who = "the controller (rank 0)" if rank == 0 else f"device {rank - 1} (rank {rank})"
        code = getattr(failure, "exitcode", None)
        how = (f"was killed by {failure.signal_name()}" if code is not None and code < 0
               else f"exited with code {code}")
        parts.append(f"{who} {how}")
    run = os.environ.get("BIDIRL_RUN_PATH", "")
    tail = f"; its checkpoints (if any) resume with --resume {run}" if run else ""
    return f"the runtime failed after {restarts} restart(s): {', '.join(parts)}{tail}"


def main(argv: list) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    try:
        run(args)
    except ChildFailedError as exc:
        print(f"error: {describe_failures(exc.failures, args.max_restarts)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
