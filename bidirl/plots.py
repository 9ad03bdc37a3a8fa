"""PNG plots of a run, drawn from its metrics.jsonl (matplotlib, no display needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List


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
