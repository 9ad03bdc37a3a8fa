"""Control messages between the controller and the device workers, over the torchrun c10d store.

Keys (values are the typed messages of :mod:`bidirl.runtime.protocol`, as data-only JSON:
:mod:`bidirl.runtime.wire`; nothing read from the store is ever unpickled)::

    ctl/cmd/<device>/<n>   controller -> device, n = 0, 1, 2, ... ; the worker reads them in order
    ctl/wcmd/<device>/<n>  controller -> device's weight receiver thread (join the next broadcast)
    ctl/evt/<n>            any device -> controller; n comes from the atomic counter ctl/evt/count
    ctl/plan               the controller's start-up Plan (homes, primary, run directory), read by all

Why the store: it exists before any process group, every rank already holds a connection to it, and
a blocking ``get`` is exactly "wait for my next command". Messages are small (prompts, samples,
timings); weights and gradients never pass through it -- they go over torch.distributed groups.
A worker executes its commands strictly in order, so a command sent while it is busy runs at its next
safe point (after the chunk or step in flight), and collectives are entered in the same order on
every member, which rules out deadlock.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Dict, Optional, Tuple

from bidirl.runtime.wire import decode, encode

PREFIX = "ctl/"
WAIT_SLICE_S = 1.0  # the longest a wait for a message holds off a Ctrl-C (Mailbox._arrived)


def _key(queue: str, n: int) -> str:
    """The store key of the ``n``-th message of ``queue``."""
    return f"{PREFIX}{queue}/{n}"


class Mailbox:
    def __init__(self, store: Any, interruptible: bool = False):
        self.store = store
        self.interruptible = interruptible  # waits in slices (_arrived): the controller's, for Ctrl-C
        self.sent: Dict[str, int] = {}  # queue -> messages written
        self.taken: Dict[str, int] = {}  # queue -> messages read
        self.peeked: Optional[Tuple[Tuple[str, int], Any]] = None  # (queue, n) -> its message, read, not taken

    def _put(self, queue: str, message: Any) -> None:
        n = self.sent.get(queue, 0)
        self.sent[queue] = n + 1
        self.store.set(_key(queue, n), encode(message))

    def _take(self, queue: str, timeout: Optional[float] = None) -> Any:
        n = self.taken.get(queue, 0)
        key = _key(queue, n)
        if self.peeked is not None and self.peeked[0] == (queue, n):  # (read already: peek_command)
            message = self.peeked[1]
        elif self._arrived(key, timeout):
            message = decode(self.store.get(key))
        else:
            return None  # nothing arrived in time
        self.store.delete_key(key)
        self.taken[queue] = n + 1
        return message

    def _arrived(self, key: str, timeout: Optional[float]) -> bool:
        """Waits for ``key`` (at most ``timeout`` seconds; None: as long as it takes). An ``interruptible``
        mailbox waits in slices of a second: a wait inside the store's C++ call holds off Python's signal
        handlers, so a Ctrl-C would reach the controller only when torchrun kills it, and it could not close
        the run directory. (Each slice that ends empty is a C++ warning: the controller logs errors only.)"""
        if timeout is None and not self.interruptible:
            return True  # (the get blocks until it is there, or the store's own timeout fails it)
        from torch.distributed import DistStoreError

        # (without a timeout, the store's own still fails a wait nothing ends: a dead peer fails the run)
        limit = time.monotonic() + (self.store.timeout.total_seconds() if timeout is None else timeout)
        while True:
            left = limit - time.monotonic()
            if self.interruptible:
                left = min(WAIT_SLICE_S, left)
            try:
                self.store.wait([key], datetime.timedelta(seconds=max(0.001, left)))
                return True
            except DistStoreError:  # (the store's timeout; a closed connection is another error, and raises)
                if time.monotonic() < limit:
                    continue
                if timeout is None:
                    raise DistStoreError(f"{key}: no message within the store's timeout "
                                         f"({self.store.timeout.total_seconds():g} s)") from None
                return False

    # controller side
    def send(self, device: int, message: Any) -> None:
        self._put(f"cmd/{device}", message)

    def send_weights(self, device: int, message: Any) -> None:
        self._put(f"wcmd/{device}", message)

    def next_event(self, timeout: Optional[float] = None) -> Any:
        """The next reply from any device; None if ``timeout`` seconds pass without one."""
        return self._take("evt", timeout)

    def publish(self, name: str, value: Any) -> None:
        self.store.set(PREFIX + name, encode(value))

    # worker side
    def next_command(self, device: int) -> Any:
        return self._take(f"cmd/{device}")

    def peek_command(self, device: int) -> Any:
        """The next command if it has arrived, left in the queue (None if not yet): without waiting."""
        queue = f"cmd/{device}"
        n = self.taken.get(queue, 0)
        if self.peeked is None or self.peeked[0] != (queue, n):
            key = _key(queue, n)
            if not self.store.check([key]):
                return None
            self.peeked = ((queue, n), decode(self.store.get(key)))
        return self.peeked[1]

    def next_weights_command(self, device: int) -> Any:
        return self._take(f"wcmd/{device}")

    def post(self, message: Any) -> None:
        n = self.store.add(f"{PREFIX}evt/count", 1) - 1
        self.store.set(f"{PREFIX}evt/{n}", encode(message))

    def read(self, name: str) -> Any:
        return decode(self.store.get(PREFIX + name))
