"""Reading device-role traces (``trace.jsonl``): time per state, idle ratio per pool, switch overheads.

A trace is a list of records ``{"t", "device", "from", "to", "role", "home", "version", "reason"}``,
one per state change, written identically by the live runtime and the simulator.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Dict, Iterable, List, Sequence, Tuple

Interval = Tuple[int, str, str, float, float]  # device, state, role served, start, end


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


def pool_idle_ratio(trace: Sequence[dict], end: float, homes: Dict[int, str]) -> Dict[str, float]:
    """Per home pool: fraction of its device-time spent idle (no work assigned, or blocked)."""
    total: Dict[str, float] = defaultdict(float)
    idle: Dict[str, float] = defaultdict(float)
    seen = set()
    for device, state, _role, start, stop in intervals(trace, end):
        seen.add(device)
        total[homes[device]] += stop - start
        if state == "idle":
            idle[homes[device]] += stop - start
    for device, home in homes.items():  # a device that never changed state was idle throughout
        if device not in seen:
            total[home] += end
            idle[home] += end
    return {home: round(idle[home] / total[home], 4) if total[home] else 0.0 for home in total}


def switch_overheads(trace: Sequence[dict]) -> List[Dict[str, float]]:
    """Each switch: drain (DRAINING), switch itself (SWITCHING) and the gap until first useful work."""
    out, open_switch = [], {}
    for record in trace:
        device, to = record["device"], record["to"]
        if to in ("draining", "switching") and device not in open_switch:
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
