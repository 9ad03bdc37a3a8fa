"""PNG plots of a run, drawn from its metrics.jsonl (matplotlib, no display needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple


def read_metrics(path: Path) -> List[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_learning_curves(metrics_file: Path, out: Path) -> Path:
    """Sampled reward per step and held-out greedy accuracy, against step and wall-clock minutes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_file)
    train = [r for r in rows if "reward_mean" in r]
    evals = [r for r in rows if "eval_accuracy" in r and "stage" not in r]  # the RL loop's own evaluations
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "step", "step"), (axes[1], "time_s", "minutes")):
        scale = 60.0 if key == "time_s" else 1.0
        if train:
            ax.plot([r[key] / scale for r in train], [r["reward_mean"] for r in train], alpha=0.4,
                    label="sampled reward")
            ax.plot([r[key] / scale for r in train], _smooth([r["reward_mean"] for r in train]),
                    label="sampled reward (smoothed)")
        if evals:
            ax.plot([r[key] / scale for r in evals], [r["eval_accuracy"] for r in evals], "o-",
                    label="held-out greedy accuracy")
        ax.set_xlabel(label)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("reward / accuracy")
    axes[0].legend(loc="lower right")
    fig.suptitle(metrics_file.parent.name)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _smooth(values: List[float], window: int = 10) -> List[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def import_plotting() -> None:
    """What drawing needs imported (about 0.4 s), for a helper process to load ahead of the drawing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.collections  # noqa: F401
    import matplotlib.pyplot  # noqa: F401


# One colour per device state; idle is pale so that gaps stand out.
STATE_COLOURS = {"generating": "#2b83ba", "training": "#d7191c", "syncing": "#fdae61", "switching": "#7b3294",
                 "draining": "#c2a5cf", "evaluating": "#999999", "idle": "#f0f0f0"}


def plot_gantt(trace: List[dict], end: float, out: Path, title: str = "") -> Path:
    """Device states over time from a trace (live runtime or simulator): one row per device."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    from bidirl.sched.trace import intervals

    spans = intervals(trace, end)
    devices = sorted({d for d, *_ in spans}) or [0]
    homes = {r["device"]: r["home"] for r in trace}
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(devices) + 1.5))
    # state -> the rectangles of its spans on every device: one collection per state, not one per device
    # and state (adding a collection re-computes the axes' limits: a hundred of them took most of the time)
    rows: Dict[str, List[list]] = {}
    for device, state, _role, start, stop in spans:
        bottom, top = device - 0.4, device - 0.4 + 0.8
        rows.setdefault(state, []).append([(start, bottom), (start, top), (stop, top), (stop, bottom)])
    for state, bars in rows.items():  # (an array of rectangles: matplotlib makes their paths in bulk)
        ax.add_collection(PolyCollection(np.array(bars), facecolors=STATE_COLOURS.get(state, "black"), linewidth=0))
    ax.set_yticks(devices, [f"d{d} ({homes.get(d, '?')})" for d in devices])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_xlim(0, max(end, 1e-9))
    ax.legend(handles=[Patch(color=c, label=s) for s, c in STATE_COLOURS.items()], ncol=7,
              loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(devices) < 4 else -0.1), fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def bar_annotations(labels: List[str], values: List[float], base: Optional[str] = None) -> Tuple[str, List[str]]:
    """The bar chart's title and the ratio written above each bar: its value over ``base``'s (default the
    first label's); "-" where that base made nothing."""
    base = base if base in labels else labels[0]
    reference = values[labels.index(base)]
    return (f"above each bar: its samples/s over {base}'s",
            [f"{value / reference:.2f}x" if reference else "-" for value in values])


def plot_bars(labels: List[str], values: List[float], out: Path, ylabel: str, base: Optional[str] = None) -> Path:
    """One bar per label, each annotated with its value over ``base``'s (default the first label's), which
    the title names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    title, ratios = bar_annotations(labels, values, base)
    fig, ax = plt.subplots(figsize=(1.2 * len(labels) + 2, 4))
    bars = ax.bar(labels, values, color="#2b83ba")
    for bar, value, ratio in zip(bars, values, ratios):
        ax.annotate(ratio, (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom")
    ax.set_title(title, fontsize=9)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
