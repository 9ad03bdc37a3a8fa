"""``report.md`` and ``report.html``: what a person reads first in a run directory.

Written at the end of ``bidirl run`` and ``bidirl compare`` from the files the stages wrote (never from
memory, so it can be rebuilt): the plan chosen and why, the profile's fit, the run's throughput, each
pool's time by cause, switches and leases, held-out accuracy before and after, the learning curve and
the Gantt chart, the comparison table and its plots. ``report.html`` is the same page as one
self-contained file (images inlined), for sharing.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any, Dict, List, Optional


def read_json(path: Path) -> Optional[Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def image(run: Path, relative: str, alt: str) -> List[str]:
    return [f"![{alt}]({relative})", ""] if (run / relative).is_file() else []


def pools(breakdown: Dict[str, Dict[str, float]]) -> List[str]:
    causes = sorted({c for shares in breakdown.values() for c in shares})
    lines = ["| pool | " + " | ".join(causes) + " |", "|" + "---|" * (len(causes) + 1)]
    for pool, shares in sorted(breakdown.items()):
        lines.append(f"| {pool} | " + " | ".join(number(shares.get(c, 0), ".0%") for c in causes) + " |")
    return lines + [""]


def plan_section(run: Path) -> List[str]:
    plan = read_json(run / "plan.json")
    if not plan:
        return []
    lines = ["## Plan", "", f"**{plan.get('reason', '')}**", "",
             f"Predicted: {plan.get('predicted_samples_per_s', 0):.3g} samples/s, step "
             f"{plan.get('predicted_step_s', 0):.3g} s.", ""]
    alternatives = plan.get("alternatives") or []
    if alternatives:  # (the chosen split first, then the best others: planner._plan)
        def placement(a):  # (older plans name none: the plan's)
            return a.get("tail_placement", plan.get("tail_placement", "auto"))

        def staleness(a):  # (likewise)
            return a.get("staleness", plan.get("staleness"))

        placed = any(placement(a) != "auto" for a in alternatives)
        stale = len({staleness(a) for a in alternatives}) > 1  # (the planner chose among several)
        lines += [f"| split | rollout devices | devices per instance |{' staleness |' if stale else ''}"
                  f"{' older tails |' if placed else ''} samples/s | step s |",
                  "|---|---|---|" + ("---|" if stale else "") + ("---|" if placed else "") + "---|---|"]
        def chosen_by(a):  # (the staleness and placement columns, where shown)
            return (f" {number(staleness(a), 'g')} |" if stale else "") + (f" {placement(a)} |" if placed else "")

        lines += [f"| {'chosen' if i == 0 else 'alternative'} | {a.get('rollout_devices')} | "
                  f"{a.get('instance_devices', plan.get('instance_devices', 1))} |{chosen_by(a)} "
                  f"{a.get('samples_per_s', 0):.3g} | {a.get('step_s', 0):.3g} |" for i, a in enumerate(alternatives[:6])]
        lines.append("")
    return lines


def profile_section(run: Path) -> List[str]:
    profile = read_json(run / "profile.json")
    if not profile:
        return []
    errors = ", ".join(f"{k} {number(profile[k]['error'], '.1%')}" for k in ("decode", "prefill", "train")
                       if isinstance(profile.get(k), dict) and "error" in profile[k])
    return ["## Profile", "", f"Fit error (relative, of the fitted curve against the measured points): {errors}.", "",
            *image(run, "profile.png", "profile")]


def number(value: Any, spec: str = ".2f") -> str:
    """``value`` formatted, or "-" where the run wrote none (a NaN or infinity is written as JSON null)."""
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def run_section(run: Path, folder: str, title: str) -> List[str]:
    """A live run's figures: the launch stage's (``folder``: its own summary.json), or the train stage's
    (``folder`` empty: under ``train`` in the run's summary.json)."""
    summary = read_json(run / folder / "summary.json") if folder else (read_json(run / "summary.json") or {}).get("train")
    if not isinstance(summary, dict) or "samples_per_s" not in summary:
        return []
    prefix = f"{folder}/" if folder else ""
    homes = summary.get("homes", [])
    split = f"{homes.count('rollout')} rollout / {homes.count('train')} train" if "rollout" in homes else "colocated"
    lines = [f"## {title}", "",
             f"- policy **{summary.get('policy')}**, {split}, eta {summary.get('eta')}, {summary.get('steps')} steps",
             f"- **{summary['samples_per_s']} samples/s** over {summary.get('rl_seconds')} s of RL"]
    if summary.get("accuracy_start") is not None:
        lines.append(f"- held-out greedy accuracy **{number(summary['accuracy_start'], '.1%')} -> "
                     f"{number(summary.get('accuracy_end'), '.1%')}**"
                     + (f" on {summary['eval_problems']} held-out problems" if summary.get("eval_problems") else ""))
    switches = summary.get("switches", {})
    lines.append(f"- role switches: {switches.get('count', 0)}; leases: "
                 + (", ".join(f"{k} {v['leases']}" for k, v in summary.get("leases", {}).items()) or "none"))
    lines.append(f"- staleness of trained samples: {summary.get('staleness_histogram', {})}")
    lines += ["", "Device time by cause:", ""] + pools(summary.get("time_breakdown", {}))
    lines += image(run, prefix + "learning_curve.png", "learning curve") + image(run, prefix + "gantt.png", "Gantt chart")
    return lines


def simulate_section(run: Path) -> List[str]:
    """The simulate stage's table (``results.json``), its throughput chart and Gantt charts."""
    rows = read_json(run / "results.json")
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        return []
    best = max(r.get("samples_per_s") or 0 for r in rows) or 1.0
    lines = ["## Simulated policies", "",
             "| policy | split r/t | eta | samples/s | / best | step s | bound s | efficiency | switches |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r.get('policy')} | {r.get('split')} | {r.get('eta')} | {number(r.get('samples_per_s'))} | "
              f"{number((r.get('samples_per_s') or 0) / best)} | {number(r.get('step_s'))} | "
              f"{number(r.get('bound_step_s'))} | {number(r.get('efficiency'))} | {r.get('switches', 0)} |" for r in rows]
    lines += ["", "(bound: the policy-independent lower bound on the step; efficiency: bound / step)", ""]
    lines += image(run, "throughput.png", "simulated throughput")
    for r in rows:
        lines += image(run, f"gantt-{r.get('policy')}.png", f"Gantt chart, {r.get('policy')}")
    return lines


def compare_section(run: Path) -> List[str]:
    if not (run / "compare.md").is_file():
        return []
    return ["## Comparison", "", (run / "compare.md").read_text(), "",
            *image(run, "compare_throughput.png", "throughput"), *image(run, "compare_curves.png", "curves")]


def write_report(run: Path) -> Path:
    summary = read_json(run / "summary.json") or {}
    lines = [f"# {run.name}", "", f"Status **{summary.get('status', '?')}**; stages "
             f"{' -> '.join(summary.get('stages', [])) or '-'}; {summary.get('wall_s', '?')} s.", ""]
    evaluation = summary.get("evaluation")
    if evaluation:
        lines += [f"Base model held-out greedy accuracy: {number(evaluation.get('accuracy'), '.1%')} on "
                  f"{evaluation['problems']} problems.", ""]
    lines += profile_section(run) + plan_section(run)
    lines += run_section(run, "launch", "bidirl on the hot-switch runtime") + run_section(run, "", "Training run")
    lines += simulate_section(run) + compare_section(run)
    text = "\n".join(lines) + "\n"
    (run / "report.md").write_text(text)
    (run / "report.html").write_text(to_html(text, run))
    return run / "report.md"


def to_html(markdown: str, run: Path) -> str:
    """The subset of markdown :func:`write_report` writes, as one self-contained page."""
    body: List[str] = []
    table: List[List[str]] = []
    items: List[str] = []

    def inline(text: str) -> str:
        text = html.escape(text)
        parts = text.split("**")
        return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(parts))

    def flush() -> None:
        if table:
            head, rows = table[0], [r for r in table[1:] if not all(set(c) <= set("-: ") for c in r)]
            body.append("<table><tr>" + "".join(f"<th>{inline(c)}</th>" for c in head) + "</tr>"
                        + "".join("<tr>" + "".join(f"<td>{inline(c)}</td>" for c in r) + "</tr>" for r in rows)
                        + "</table>")
            table.clear()
        if items:
            body.append("<ul>" + "".join(f"<li>{inline(i)}</li>" for i in items) + "</ul>")
            items.clear()

    for line in markdown.splitlines():
        if line.startswith("|"):
            table.append([c.strip() for c in line.strip().strip("|").split("|")])
            continue
        if line.startswith("- "):
            items.append(line[2:])
            continue
        flush()
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{inline(line[level:].strip())}</h{level}>")
        elif line.startswith("![") and "](" in line:
            alt, src = line[2:].split("](", 1)
            data = base64.b64encode((run / src.rstrip(")")).read_bytes()).decode()
            body.append(f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">')
        elif line.strip():
            body.append(f"<p>{inline(line)}</p>")
    flush()
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse;"
             "font-size:90%}td,th{border:1px solid #ccc;padding:3px 6px}img{max-width:100%}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(run.name)}</title>"
            f"<style>{style}</style></head><body>" + "\n".join(body) + "</body></html>\n")
