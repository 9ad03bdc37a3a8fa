"""Control messages between the controller and the device workers, over the torchrun c10d store.

Protocol (all values are pickled dicts)::

    ctl/cmd/<device>/<n>   controller -> device, n = 0, 1, 2, ... ; the worker reads them in order
    ctl/wcmd/<device>/<n>  controller -> device's weight receiver thread (join the next broadcast)
    ctl/evt/<n>            any device -> controller; n comes from the atomic counter ctl/evt/count
    ctl/plan               the controller's start-up plan (homes, primary, run directory), read by all

Why the store: it exists before any process group, every rank already holds a connection to it, and
a blocking ``get`` is exactly "wait for my next command". Messages are small (prompts, samples,
timings); weights and gradients never pass through it -- they go over torch.distributed groups.
A worker executes its commands strictly in order, so a command sent while it is busy runs at its next
safe point (after the chunk or step in flight), and collectives are entered in the same order on
every member, which rules out deadlock.
"""

from __future__ import annotations

import pickle
from typing import Any, Dict

PREFIX = "ctl/"


class Mailbox:
    def __init__(self, store: Any):
        self.store = store
        self.sent: Dict[int, int] = {}
        self.read_events = 0
        self.read_commands = 0
        self.sent_weights: Dict[int, int] = {}
        self.read_weights = 0

    # controller side
    def send(self, device: int, message: dict) -> None:
        n = self.sent.get(device, 0)
        self.sent[device] = n + 1
        self.store.set(f"{PREFIX}cmd/{device}/{n}", pickle.dumps(message))

    def send_weights(self, device: int, message: dict) -> None:
        n = self.sent_weights.get(device, 0)
        self.sent_weights[device] = n + 1
        self.store.set(f"{PREFIX}wcmd/{device}/{n}", pickle.dumps(message))

    def next_event(self) -> dict:
        key = f"{PREFIX}evt/{self.read_events}"
        message = pickle.loads(self.store.get(key))  # blocks until some device posts it
        self.store.delete_key(key)
        self.read_events += 1
        return message

    def publish(self, name: str, value: Any) -> None:
        self.store.set(PREFIX + name, pickle.dumps(value))

    # worker side
    def next_command(self, device: int) -> dict:
        key = f"{PREFIX}cmd/{device}/{self.read_commands}"
        message = pickle.loads(self.store.get(key))
        self.store.delete_key(key)
        self.read_commands += 1
        return message

    def next_weights_command(self, device: int) -> dict:
        key = f"{PREFIX}wcmd/{device}/{self.read_weights}"
        message = pickle.loads(self.store.get(key))
        self.store.delete_key(key)
        self.read_weights += 1
        return message

    def post(self, message: dict) -> None:
        n = self.store.add(f"{PREFIX}evt/count", 1) - 1
        self.store.set(f"{PREFIX}evt/{n}", pickle.dumps(message))

    def read(self, name: str) -> Any:
        return pickle.loads(self.store.get(PREFIX + name))
