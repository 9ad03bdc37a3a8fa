"""One simulated rollout engine under continuous batching (vLLM-style), at sequence granularity.

Every running sequence advances one token per decode step; a step takes ``a + b * running``
seconds (:mod:`bidirl.sim.perf`). Rather than simulating tokens, the instance keeps a *progress*
counter (decode steps done since it started) and each sequence's finish point on that counter, in a
heap: between two finishes nothing changes, so the next finish time is one multiplication away.
Sequences beyond the KV capacity wait and join as others finish (prefill of a joining sequence pauses
decoding briefly). ``pause`` models an interruption (a weight load): decoding stops, running sequences
keep their KV and progress, and a prefill recompute is charged, as AReaL's interruptible rollout does.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Deque, Dict, List, Optional, Tuple


class Instance:
    def __init__(self, step_a: float, step_b: float, capacity: int, prefill_s_per_seq: float):
        self.step_a, self.step_b, self.capacity, self.prefill = step_a, step_b, capacity, prefill_s_per_seq
        self.progress = 0.0
        self.clock = 0.0
        self.paused_until = 0.0
        self.running: List[Tuple[float, int, int]] = []  # (finish progress, seq no, chunk)
        self.waiting: Deque[Tuple[int, int]] = deque()  # (length, chunk)
        self.left: Dict[int, int] = {}  # chunk -> sequences not finished
        self.epoch = 0  # bumped whenever the next finish time may have changed
        self.busy_s = 0.0  # time with at least one running sequence
        self.seq = itertools.count()

    def step_time(self) -> float:
        return self.step_a + self.step_b * len(self.running)

    def _advance(self, now: float) -> None:
        start = max(self.clock, self.paused_until)
        if now > start and self.running:
            self.progress += (now - start) / self.step_time()
            self.busy_s += now - start
        self.clock = max(self.clock, now)

    def _join_waiting(self, now: float) -> None:
        joined = 0
        while self.waiting and len(self.running) < self.capacity:
            length, chunk = self.waiting.popleft()
            heapq.heappush(self.running, (self.progress + length, next(self.seq), chunk))
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
        if not self.running:
            return None
        start = max(self.clock, self.paused_until)
        return start + max(0.0, self.running[0][0] - self.progress) * self.step_time()

    def finish_due(self, now: float) -> List[int]:
        """Advance to ``now``; returns the chunks whose last sequence finished."""
        self._advance(now)
        done: List[int] = []
        while self.running and self.running[0][0] <= self.progress + 1e-6:
            _, _, chunk = heapq.heappop(self.running)
            self.left[chunk] -= 1
            if self.left[chunk] == 0:
                del self.left[chunk]
                done.append(chunk)
        self._join_waiting(now)
        self.epoch += 1
        return done
