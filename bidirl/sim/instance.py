"""One simulated rollout engine under continuous batching (vLLM-style), at sequence granularity.

Every running sequence advances one token per decode step; a step takes ``a + b * running``
seconds (:mod:`bidirl.perf.analytic`). The instance keeps a *progress* counter (decode steps done) and
the running sequences sorted by the progress at which they finish; between two finishes nothing
changes, so time advances segment by segment in a tight loop.

Work completes per prompt *group* (all G samples of one prompt), the unit a trainer can use, whatever
chunk of groups it was admitted with: the simulator is woken when a group's last sequence ends, not
at every sequence and not only when a whole chunk is done. Sequences beyond the KV capacity wait and
join as others finish (the prefill of a joining sequence pauses decoding briefly). ``pause`` models an
interruption (a weight load): decoding stops, running sequences keep their progress, and their KV is
recomputed with the new weights -- the whole context, prompt *and* the tokens generated so far, as
AReaL's interruptible rollout and veRL's partial rollout do. ``take`` and ``admit_continued`` move
requests in flight to another instance (migration), which pays the same re-prefill of their whole
contexts before they decode on. ``slow_down`` scales every decode step from now on (devices sharing
one host decode slower while a neighbour trains).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from typing import Deque, Dict, List, Optional, Tuple

Group = Tuple[int, int]  # (chunk, group index within the chunk)


class Instance:
    def __init__(self, step_a: float, step_b: float, capacity: int, prefill_s_per_seq: float,
                 recompute_s_per_token: float = 0.0):
        self.step_a, self.step_b, self.capacity, self.prefill = step_a, step_b, capacity, prefill_s_per_seq
        self.recompute_per_token = recompute_s_per_token  # re-prefill of generated tokens after a pause
        self.progress = 0.0
        self.clock = 0.0
        self.paused_until = 0.0
        self.running: List[Tuple[float, int, Group, float]] = []  # (finish progress, seq no, group, start), sorted
        self.waiting: Deque[Tuple[float, Group, float]] = deque()  # (tokens to generate, group, tokens generated)
        self.left: Dict[Group, int] = {}  # group -> sequences not finished
        self.done: List[Group] = []  # groups completed since the last finish_due
        self.epoch = 0  # bumped whenever the next completion time may have changed
        self.busy_s = 0.0  # time with at least one running sequence
        self.seq = itertools.count()
        self.slowdown = 1.0

    def step_time(self, running: int) -> float:
        return (self.step_a + self.step_b * running) * self.slowdown

    def slow_down(self, now: float, factor: float) -> bool:
        """Decode steps take ``factor`` times their own time from ``now`` on; True if that changed anything."""
        if factor == self.slowdown:
            return False
        self._advance(now)
        self.slowdown = factor
        self.epoch += 1
        return True

    def _advance(self, now: float) -> None:
        """Decode up to ``now``, finishing sequences (and completing groups) on the way."""
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

    def _finish(self, group: Group) -> None:
        self.left[group] -= 1
        if self.left[group] == 0:
            del self.left[group]
            self.done.append(group)

    def _join_waiting(self, now: float) -> None:
        joined, generated = 0, 0.0
        while self.waiting and len(self.running) < self.capacity:
            length, group, done = self.waiting.popleft()  # (a continued request generated ``done`` elsewhere)
            bisect.insort(self.running, (self.progress + length, next(self.seq), group, self.progress - done))
            joined, generated = joined + 1, generated + done
        if joined:  # prefill of each prompt, and a continued request's tokens too
            self.paused_until = max(now, self.paused_until) + joined * self.prefill + generated * self.recompute_per_token

    def admit(self, now: float, chunk: int, lengths: List[int], group_size: int = 0) -> None:
        """Sequences of ``chunk``: ``group_size`` consecutive lengths form a group (0: the chunk is one group)."""
        self._advance(now)
        size = group_size or len(lengths)
        for i, length in enumerate(lengths):
            group = (chunk, i // size)
            self.left[group] = self.left.get(group, 0) + 1
            self.waiting.append((length, group, 0.0))
        self._join_waiting(now)
        self.epoch += 1

    def groups_in_flight(self, now: float) -> List[Group]:
        """Groups with sequences running or waiting here at ``now``, in the order they were admitted."""
        self._advance(now)
        return list(self.left)

    def take(self, now: float, groups: List[Group]) -> List[Tuple[Group, float, float]]:
        """Removes every sequence of ``groups`` (running or waiting), as an abort does: returns each as
        (group, tokens still to generate, tokens generated so far). Waiting sequences take the room."""
        self._advance(now)
        wanted = set(groups)
        assert wanted <= set(self.left), "only groups in flight here can move"
        moved = [(g, finish - self.progress, self.progress - start) for finish, _, g, start in self.running if g in wanted]
        moved += [(g, length, done) for length, g, done in self.waiting if g in wanted]
        self.running = [entry for entry in self.running if entry[2] not in wanted]
        self.waiting = deque(entry for entry in self.waiting if entry[1] not in wanted)
        for group in wanted:
            del self.left[group]
        self._join_waiting(now)
        self.epoch += 1
        return moved

    def admit_continued(self, now: float, sequences: List[Tuple[Group, float, float]]) -> None:
        """Requests moved here (``take`` elsewhere) continue: each re-prefills its prompt and its
        generated tokens, then decodes what it has left."""
        self._advance(now)
        for group, left, done in sequences:
            self.left[group] = self.left.get(group, 0) + 1
            # whole decode steps: a request stopped part-way through a step has that step to do again
            # (and a sliver of a step left would finish at a time the clock cannot tell from now)
            self.waiting.append((max(1, math.ceil(left - 1e-6)), group, done))
        self._join_waiting(now)
        self.epoch += 1

    def pause(self, now: float, seconds: float) -> None:
        self._advance(now)
        generated = sum(self.progress - start for _, _, _, start in self.running)
        recompute = len(self.running) * self.prefill + generated * self.recompute_per_token  # whole contexts
        self.paused_until = max(now, self.paused_until) + seconds + recompute
        self.epoch += 1

    def next_finish(self) -> Optional[float]:
        """When the next group completes (or the next sequence, while sequences wait for KV space)."""
        if not self.running:
            return None
        t, progress, running = max(self.clock, self.paused_until), self.progress, len(self.running)
        remaining: Dict[Group, int] = {}
        for finish, _, group, _ in self.running:
            t += max(0.0, finish - progress) * self.step_time(running)
            progress, running = max(progress, finish), running - 1
            remaining[group] = remaining.get(group, self.left[group]) - 1
            if remaining[group] == 0 or self.waiting:
                return t
        return t

    def finish_due(self, now: float) -> List[Group]:
        """Advance to ``now``; returns the groups whose last sequence finished."""
        self._advance(now)
        done, self.done = self.done, []
        self.epoch += 1
        return done
