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
        self.batch_s = 0.0  # sequence-seconds decoded: batch_s / busy_s is the decode batch, averaged over time
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
        """Decode up to ``now``, finishing sequences (and completing groups) on the way.

        (The simulator's innermost loop: attributes it reads on every segment are held in locals, and
        ``max`` and the decode step, ``step_time``, are written out -- the same arithmetic, in the same
        order.)"""
        t = self.clock if self.clock >= self.paused_until else self.paused_until
        running = self.running  # (the same list: ``_join_waiting`` inserts into it in place)
        step_a, step_b, slowdown, left, done = self.step_a, self.step_b, self.slowdown, self.left, self.done
        busy, batch, progress = self.busy_s, self.batch_s, self.progress
        # (``<=``: a finish less than one rounding step after the clock is due now, and its tick is at now)
        while t <= now and running:
            finish = running[0][0]
            n = len(running)
            step = (step_a + step_b * n) * slowdown  # step_time(len(running))
            reach = t + (finish - progress) * step if finish > progress else t + 0.0
            if reach > now:
                progress = self.progress = progress + (now - t) / step
                busy += now - t
                batch += (now - t) * n
                t = now
                break
            busy += reach - t
            batch += (reach - t) * n
            t = reach
            if finish > progress:  # progress = max(progress, finish)
                progress = self.progress = finish
            # every sequence finishing by now: the sorted list's first entries -- mostly one, taken without
            # the search
            limit = progress + 1e-9
            if len(running) > 1 and running[1][0] <= limit:
                ended = bisect.bisect_right(running, (limit, math.inf))
                finished = running[:ended]
                del running[:ended]
            else:
                finished = (running.pop(0),)
            for entry in finished:
                group = entry[2]  # one sequence fewer left; its group is done with the last
                if left[group] == 1:
                    del left[group]
                    done.append(group)
                else:
                    left[group] -= 1
            if self.waiting:
                self._join_waiting(t)
                if self.paused_until > t:
                    t = self.paused_until
        self.busy_s, self.batch_s = busy, batch
        if now > self.clock:
            self.clock = now

    def _join_waiting(self, now: float) -> None:
        """Waiting sequences join the decode batch, oldest first, while the KV cache has room."""
        running, waiting, progress = self.running, self.waiting, self.progress
        joined = min(len(waiting), self.capacity - len(running))
        if joined <= 0:
            return
        if joined == len(waiting):
            joining = list(waiting)
            waiting.clear()
        else:
            joining = [waiting.popleft() for _ in range(joined)]  # (a continued request generated ``done`` elsewhere)
        # appended, then sorted once: the sequence numbers make every entry distinct, so the order is the
        # one inserting them one by one would give (``joining`` first: zip draws no number past its end)
        running.extend([(progress + length, number, group, progress - done)
                        for (length, group, done), number in zip(joining, self.seq)])
        running.sort()
        generated = 0.0
        for _, _, done in joining:
            generated += done
        self._prefill(now, joined, generated)

    def _prefill(self, now: float, joined: int, generated: float) -> None:
        """Decoding pauses while ``joined`` sequences prefill their prompts, and a continued request its
        ``generated`` tokens too."""
        self.paused_until = max(now, self.paused_until) + joined * self.prefill + generated * self.recompute_per_token

    def admit(self, now: float, chunk: int, lengths: List[int], group_size: int = 0) -> None:
        """Sequences of ``chunk``: ``group_size`` consecutive lengths form a group (0: the chunk is one group)."""
        self._advance(now)
        size = group_size or len(lengths) or 1  # (or 1: an empty chunk has no group)
        left, waiting, running = self.left, self.waiting, self.running
        groups = [((chunk, first // size), lengths[first:first + size]) for first in range(0, len(lengths), size)]
        for group, mine in groups:
            left[group] = left.get(group, 0) + len(mine)
        if lengths and not waiting and len(running) + len(lengths) <= self.capacity:
            # every sequence joins at once: what queueing them for ``_join_waiting`` gives, without the queue
            # (the same entries, numbers and order; nothing generated before, so no tokens to re-prefill)
            progress, of_sequence = self.progress, []
            for group, mine in groups:
                of_sequence += [group] * len(mine)
            # (``lengths`` first: zip draws no sequence number past its end)
            running += [(progress + length, n, group, progress) for length, group, n in zip(lengths, of_sequence, self.seq)]
            running.sort()
            self._prefill(now, len(lengths), 0.0)
        else:
            for group, mine in groups:
                waiting.extend((length, group, 0.0) for length in mine)
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

    def warm_up(self, now: float, seconds: float) -> None:
        """A fresh engine's first work waits ``seconds`` (its warm-up); unlike a pause, nothing running is
        recomputed (whatever runs here already paid its prefill)."""
        self._advance(now)
        self.paused_until = max(now, self.paused_until) + seconds
        self.epoch += 1

    def pause(self, now: float, seconds: float) -> None:
        self._advance(now)
        generated = sum(self.progress - start for _, _, _, start in self.running)
        recompute = len(self.running) * self.prefill + generated * self.recompute_per_token  # whole contexts
        self.paused_until = max(now, self.paused_until) + seconds + recompute
        self.epoch += 1

    def next_finish(self) -> Optional[float]:
        """When the next group completes (or the next sequence, while sequences wait for KV space); now, if
        groups completed and were not reported yet (an advance other than the tick's -- a change of speed,
        an admission, a move -- reached the instant they finished, and the tick for it is stale)."""
        if self.done:
            return self.clock
        running = self.running
        if not running:
            return None
        # (called after every event that touched this instance: ``max`` and the step time written out)
        t = self.clock if self.clock >= self.paused_until else self.paused_until
        progress, n = self.progress, len(running)
        step_a, step_b, slowdown = self.step_a, self.step_b, self.slowdown
        if self.waiting:  # the first sequence to finish frees room for a waiting one
            finish = running[0][0]
            return t + (finish - progress) * ((step_a + step_b * n) * slowdown) if finish > progress else t
        left = self.left
        remaining: Dict[Group, int] = {}
        for finish, _, group, _ in running:
            if finish > progress:  # t += max(0, finish - progress) * step_time(n); progress = max(progress, finish)
                t += (finish - progress) * ((step_a + step_b * n) * slowdown)
                progress = finish
            n -= 1
            mine = remaining.get(group)
            mine = (left[group] if mine is None else mine) - 1
            if mine == 0:
                return t
            remaining[group] = mine
        return t

    def finish_due(self, now: float) -> List[Group]:
        """Advance to ``now``; returns the groups whose last sequence finished."""
        self._advance(now)
        done, self.done = self.done, []
        self.epoch += 1
        return done
