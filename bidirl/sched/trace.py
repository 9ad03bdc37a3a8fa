"""Reading device-role traces (``trace.jsonl``): time per state, idle ratio per pool, idle time by
cause, switch overheads.

A trace is a list of records ``{"t", "device", "from", "to", "role", "home", "version", "reason"}``,
one per state change, written identically by the live runtime and the simulator (the shared
bookkeeping writes them). A record into ``idle`` also carries ``cause``; when an idle device's cause
changes, an ``idle -> idle`` record says so.

Where a pool's device-time goes (:func:`time_breakdown`), the same categories in both drivers:

* ``busy``       generating or training (useful work);
* ``tail``       idle, waiting for work elsewhere to finish (a batch's last sequences, the run's end), and a
                 train step's device that computes nothing while the step goes on (``waits``);
* ``admission``  idle, blocked by the staleness bound;
* ``switching``  changing role; ``draining``: finishing work before a switch;
* ``syncing``    loading new weights;
* ``no_reason``  idle although it could work: the policy started nothing.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

Interval = Tuple[int, str, str, float, float]  # device, state, role served, start, end

TAIL, ADMISSION, NO_REASON = "tail", "admission", "no_reason"
CATEGORIES = ("busy", TAIL, ADMISSION, "switching", "draining", "syncing", NO_REASON)
_BUSY_STATES = ("generating", "training", "evaluating")
_IDLE_CATEGORIES = (TAIL, ADMISSION, NO_REASON)  # the IDLE state, by cause


def intervals(trace: Sequence[dict], end: float) -> List[Interval]:
    """(device, state, role, start, end) for every stretch a device spent in one state."""
    current: Dict[int, Tuple[str, str, float]] = {}
    out: List[Interval] = []
    for record in trace:
        device = record["device"]
        if device in current:
            state, role, since = current[device]
            out.append((device, state, role, since, record["t"]))
        else:  # first record: the device was idle since time 0
            out.append((device, record["from"], record["role"], 0.0, record["t"]))
        current[device] = (record["to"], record["role"], record["t"])
    out.extend((device, state, role, since, end) for device, (state, role, since) in current.items())
    return [i for i in out if i[4] > i[3]]


def pool_idle_ratio(trace: Sequence[dict], end: float, homes: Dict[int, str],
                    waits: Optional[Dict[str, float]] = None) -> Dict[str, float]:
    """Per home pool: fraction of its device-time spent idle (no work assigned, or blocked: the idle
    categories of :func:`time_breakdown`, ``waits`` included). ``homes``: each device's home when the run
    started; a device that re-planning moves is charged to each pool for the time it belonged there (its
    records carry its home)."""
    return _idle_ratio(pool_seconds(trace, end, homes, waits))


def time_breakdown(trace: Sequence[dict], end: float, homes: Dict[int, str],
                   waits: Optional[Dict[str, float]] = None) -> Dict[str, Dict[str, float]]:
    """Per home pool: the fraction of its device-time in each of :data:`CATEGORIES` (they add up to 1)."""
    return _shares(pool_seconds(trace, end, homes, waits))


def idle_and_breakdown(trace: Sequence[dict], end: float, homes: Dict[int, str],
                       waits: Optional[Dict[str, float]] = None) -> Tuple[Dict[str, float], Dict[str, Dict[str, float]]]:
    """:func:`pool_idle_ratio` and :func:`time_breakdown` together, from one walk of the trace (what a
    run's summary reports, in both drivers)."""
    seconds = pool_seconds(trace, end, homes, waits)
    return _idle_ratio(seconds), _shares(seconds)


def _idle_ratio(seconds: Dict[str, Dict[str, float]]) -> Dict[str, float]:
    return {home: round(sum(parts[c] for c in _IDLE_CATEGORIES) / total, 4) if (total := sum(parts.values())) else 0.0
            for home, parts in seconds.items()}


def _shares(seconds: Dict[str, Dict[str, float]]) -> Dict[str, Dict[str, float]]:
    out = {}
    for home, parts in seconds.items():
        total = sum(parts.values()) or 1.0
        out[home] = {category: round(value / total, 4) for category, value in parts.items()}
    return out


def pool_seconds(trace: Sequence[dict], end: float, homes: Dict[int, str],
                 waits: Optional[Dict[str, float]] = None) -> Dict[str, Dict[str, float]]:
    """Per home pool: device-seconds in each of :data:`CATEGORIES`. ``homes``: each device's home when the
    run started (a device that re-planning moves is charged to each pool in turn).

    ``waits``: device-seconds, per home pool, that a train step's devices held the TRAINING state with
    nothing to compute -- waiting for groups still generating (a streamed step), for the step's last
    micro-batches on another device, or for a home trainer back from a lease. Both drivers count them
    (the trace cannot tell), and they move from busy to tail."""
    pools = sorted(set(homes.values()) | {r["home"] for r in trace if "home" in r})
    seconds: Dict[str, Dict[str, float]] = {home: dict.fromkeys(CATEGORIES, 0.0) for home in pools}
    current: Dict[int, Tuple[str, float]] = {device: (NO_REASON, 0.0) for device in homes}
    current_state: Dict[int, str] = {device: "idle" for device in homes}
    training: Dict[str, float] = defaultdict(float)  # seconds in the TRAINING state, per home pool
    home_now = dict(homes)
    for record in trace:
        device = record["device"]
        category, since = current[device]
        seconds[home_now[device]][category] += record["t"] - since
        training[home_now[device]] += record["t"] - since if current_state[device] == "training" else 0.0
        home_now[device] = record.get("home", home_now[device])
        to = record["to"]
        category = "busy" if to in _BUSY_STATES else record.get("cause", NO_REASON) if to == "idle" else to
        current[device], current_state[device] = (category, record["t"]), to
    for device, (category, since) in current.items():
        seconds[home_now[device]][category] += max(0.0, end - since)
        training[home_now[device]] += max(0.0, end - since) if current_state[device] == "training" else 0.0
    for home, waited in (waits or {}).items():
        if home in seconds:
            # (a wait is time spent in the TRAINING state: never more, up to rounding of the clocks)
            moved = min(waited, training[home])
            seconds[home]["busy"] -= moved
            seconds[home][TAIL] += moved
    return seconds


def switch_overheads(trace: Sequence[dict]) -> List[Dict[str, float]]:
    """Each switch followed by work: drain (DRAINING), switch itself (SWITCHING) and the gap until first
    useful work. A switch straight back without work in between (a lease that found its work gone) is
    left out, and the next switch is timed from its own start."""
    out, open_switch = [], {}
    for record in trace:
        device, to = record["device"], record["to"]
        if to in ("draining", "switching") and (device not in open_switch or "switch_end" in open_switch[device]):
            open_switch[device] = {"device": device, "start": record["t"], "drain_s": 0.0, "to": record["role"]}
        entry = open_switch.get(device)
        if entry is None:
            continue
        if record["from"] == "draining":
            entry["drain_s"] = record["t"] - entry["start"]
        if record["from"] == "switching":
            entry["switch_s"] = record["t"] - entry["start"] - entry["drain_s"]
            entry["switch_end"] = record["t"]
        if to in ("generating", "training") and "switch_end" in entry:
            entry["first_work_s"] = record["t"] - entry["switch_end"]
            out.append(open_switch.pop(device))
    return out


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else 0.0


def steady_step_s(version_times: Sequence[float], warmup: int = 3, updates_per_step: int = 1) -> float:
    """Mean step time after the first ``warmup`` steps (the pipeline filling up, engines warming up),
    from the times each version came to exist; the plain mean for runs too short to skip any. With
    ``updates_per_step`` u > 1 (veRL fully-async's local updates: a version per update, a step per u of
    them) a step ends at every u-th version, as ``step_s`` counts it."""
    version_times = version_times[updates_per_step - 1 :: updates_per_step]
    steps = len(version_times) - 1
    if steps < 1:
        return 0.0
    first = warmup if steps > warmup + 1 else 0
    return (version_times[-1] - version_times[first]) / (steps - first)

