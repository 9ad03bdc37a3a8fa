"""One simulated rollout engine under continuous batching (vLLM-style), at sequence granularity.

Every running sequence advances one token per decode step; a step takes ``a + b * running``
seconds (:mod:`bidirl.perf.analytic`). The instance keeps a *progress* counter (decode steps done) and the
running sequences sorted by the progress at which they finish; between two finishes nothing changes,
so time advances segment by segment in a tight loop, and the simulator is woken only when a whole
*chunk* completes (not at every sequence). Sequences beyond the KV capacity wait and join as others
finish (prefill of a joining sequence pauses decoding briefly). ``pause`` models an interruption (a
weight load): decoding stops, running sequences keep their progress, and a prefill recompute is
charged, as AReaL's interruptible rollout does.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from typing import Deque, Dict, List, Optional, Tuple


class Instance:
    def __init__(self, step_a: float, step_b: float, capacity: int, prefill_s_per_seq: float):
        self.step_a, self.step_b, self.capacity, self.prefill = step_a, step_b, capacity, prefill_s_per_seq
        self.progress = 0.0
        self.clock = 0.0
        self.paused_until = 0.0
        self.running: List[Tuple[float, int, int]] = []  # (finish progress, seq no, chunk), sorted
        self.waiting: Deque[Tuple[int, int]] = deque()  # (length, chunk)
        self.left: Dict[int, int] = {}  # chunk -> sequences not finished
        self.done: List[int] = []  # chunks completed since the last finish_due
        self.epoch = 0  # bumped whenever the next completion time may have changed
        self.busy_s = 0.0  # time with at least one running sequence
        self.seq = itertools.count()

    def step_time(self, running: int) -> float:
        return self.step_a + self.step_b * running

    def _advance(self, now: float) -> None:
        """Decode up to ``now``, finishing sequences (and completing chunks) on the way."""
        t = max(self.clock, self.paused_until)
        while t < now and self.running:
            finish = self.running[0][0]
            step = self.step_time(len(self.running))
            reach = t + max(0.0, finish - self.progress) * step
            if reach > now:
                self.progress += (now - t) / step
                self.busy_s += now - t
                t = now
                break
            self.busy_s += reach - t
            t, self.progress = reach, max(self.progress, finish)
            while self.running and self.running[0][0] <= self.progress + 1e-9:
                self._finish(self.running.pop(0)[2])
            if self.waiting:
                self._join_waiting(t)
                t = max(t, self.paused_until)
        self.clock = max(self.clock, now)

    def _finish(self, chunk: int) -> None:
        self.left[chunk] -= 1
        if self.left[chunk] == 0:
            del self.left[chunk]
            self.done.append(chunk)

    def _join_waiting(self, now: float) -> None:
        joined = 0
        while self.waiting and len(self.running) < self.capacity:
            length, chunk = self.waiting.popleft()
            bisect.insort(self.running, (self.progress + length, next(self.seq), chunk))
            joined += 1
        if joined:
            self.paused_until = max(now, self.paused_until) + joined * self.prefill

    def admit(self, now: float, chunk: int, lengths: List[int]) -> None:
        self._advance(now)
        self.left[chunk] = len(lengths)
        self.waiting.extend((length, chunk) for length in lengths)
        self._join_waiting(now)
        self.epoch += 1

    def pause(self, now: float, seconds: float) -> None:
        self._advance(now)
        recompute = len(self.running) * self.prefill  # KV of running sequences rebuilt with new weights
        self.paused_until = max(now, self.paused_until) + seconds + recompute
        self.epoch += 1

    def next_finish(self) -> Optional[float]:
        """When the next chunk completes (or the next sequence, while sequences wait for KV space)."""
        if not self.running:
            return None
        t, progress, running = max(self.clock, self.paused_until), self.progress, len(self.running)
        remaining: Dict[int, int] = {}
        for finish, _, chunk in self.running:
            t += max(0.0, finish - progress) * self.step_time(running)
            progress, running = max(progress, finish), running - 1
            remaining[chunk] = remaining.get(chunk, self.left[chunk]) - 1
            if remaining[chunk] == 0 or self.waiting:
                return t
        return t

    def finish_due(self, now: float) -> List[int]:
        """Advance to ``now``; returns the chunks whose last sequence finished."""
        self._advance(now)
        done, self.done = self.done, []
        self.epoch += 1
        return done
