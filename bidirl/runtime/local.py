"""One device in this process: the controller and a worker joined by an in-process mailbox.

This is how ``bidirl run`` trains (``cluster.devices=1``): the very controller, policy and worker that
``bidirl launch`` runs over torchrun, with commands executed synchronously when the controller waits
for a message. One code path for the single-process loop and the runtime, not two.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Dict, Optional

from bidirl.config import PipelineConfig
from bidirl.errors import BidirlError
from bidirl.rundir import RunDir


class LocalMailbox:
    """The :class:`~bidirl.runtime.mailbox.Mailbox` interface without a store: the worker runs on demand."""

    def __init__(self) -> None:
        self.values: Dict[str, Any] = {}
        self.commands: deque = deque()
        self.events: deque = deque()
        self.worker: Any = None

    def publish(self, name: str, value: Any) -> None:
        self.values[name] = value

    def read(self, name: str) -> Any:
        return self.values[name]

    def send(self, device: int, message: Any) -> None:
        self.commands.append(message)

    def post(self, message: Any) -> None:
        self.events.append(message)

    def next_event(self, timeout: Optional[float] = None) -> Any:  # (one device: nothing is lent, nothing expires)
        while not self.events:
            if not self.commands:
                raise BidirlError("the controller waits for a message but sent no command (scheduler stalled)")
            self.worker.serve_one(self.commands.popleft())
        return self.events.popleft()


def train_in_process(cfg: PipelineConfig, run: RunDir, model_path: str, rollout: Any = None) -> Dict[str, Any]:
    from bidirl.runtime.controller import Controller
    from bidirl.runtime.worker import Worker

    if cfg.cluster.devices != 1:
        raise BidirlError(f"the train stage runs one device in this process (cluster.devices={cfg.cluster.devices}); "
                          "use `bidirl launch` for several devices")
    from transformers import AutoTokenizer

    mailbox = LocalMailbox()
    controller = Controller(cfg, mailbox, run, 1, AutoTokenizer.from_pretrained(model_path))
    mailbox.worker = Worker(cfg, mailbox, 0, 1, model_path, rollout=rollout)  # reads the controller's plan
    return controller.run_all()
