"""A performance model fitted to a profile measured on the user's own devices (``bidirl profile``).

``profile.json`` holds the raw points and the fitted coefficients with their errors::

    decode    step(B, ctx) = a + b * B + c * B * ctx      least squares, no term below 0, over (batch, context) points
    prefill   seconds per prompt token
    requests  seconds per request beyond its prefill and decode steps (optional): chunks generated as a
              live device does it against the fits, and each request's scoring and reply
    train     step(tokens) = fixed + per_token * tokens    one device, gradients and optimizer step
    logprob   forward(tokens) = fixed + per_token * tokens  one device, log-probs only (optional)
    weights   load (into the rollout engine), publish (flatten + hand-off), bytes
    switch    into rollout (loads weights into the engine) and into training (a lookup)
    workload  the task's own response lengths under the pipeline's sampling settings (optional)
    co_running  how much slower decode and training run beside the other stage on the same host, and
              decode beside decode (optional; measured where the devices share one machine, e.g. CPU
              processes)
    step_overhead  a live train step's cost beyond its gradient passes and optimizer step (optional):
              per pulled micro-batch (its round trip to the device) and per step (the finish's own work)
    warmup    what a fresh engine's first chunk and a fresh trainer's first micro-batch take beyond the
              same work warm (optional): charged once per device, on its first use of the stage

Where ``co_running`` is present, training and log-prob times are charged at the speed measured beside
a decoding device (a trainer hardly ever runs alone: rollout devices decode whenever they are not
blocked), and the simulator slows each decoding instance by the decode factor exactly while a train
step runs (a rollout-bound run's trainer idles most of the time, so decode mostly runs alone), and by
``decode_beside_decode`` exactly while another instance decodes too (the larger where both).

:func:`load_profile` validates the file against this schema: a corrupt or incomplete profile is one
line naming the file and the key, never a traceback.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from bidirl.errors import BidirlError, read_json_document
from bidirl.perf.workload import Workload

SCHEMA = "bidirl.profile/1"
WEIGHT_KEYS = ("load_s", "publish_s", "bytes")  # a profile's ``weights`` block
SWITCH_KEYS = ("to_rollout_s", "to_train_s")  # and its ``switch`` block
WARMUP_KEYS = ("rollout_s", "train_s")  # and its optional ``warmup`` block
OVERHEAD_KEYS = ("per_micro_batch_s", "finish_s")  # and its optional ``step_overhead`` block


@dataclass
class Fit:
    """Coefficients of a linear fit and its error: relative RMS of (fit - measured) / measured."""

    coefficients: Dict[str, float]
    error: float
    points: List[Dict[str, float]] = field(default_factory=list)


@dataclass
class Profile:
    device: str
    decode: Fit  # a, b, c
    prefill: Fit  # per_token
    train: Fit  # fixed_s, per_token_s
    weights: Dict[str, float]  # load_s, publish_s, bytes
    switch: Dict[str, float]  # to_rollout_s, to_train_s
    capacity: int  # sequences one engine decodes at once
    workload: Optional[Dict[str, float]] = None
    meta: Dict[str, Any] = field(default_factory=dict)
    logprob: Optional[Fit] = None  # fixed_s, per_token_s (forward-only); absent in older profiles
    co_running: Optional[Dict[str, float]] = None  # decode, train: slowdown factors beside the other stage
    requests: Optional[Dict[str, Any]] = None  # per_request_s, and the chunks it was measured on
    warmup: Optional[Dict[str, Any]] = None  # rollout_s, train_s, and the timings they come from
    step_overhead: Optional[Dict[str, Any]] = None  # per_micro_batch_s, finish_s

    def model(self) -> "FittedModel":
        """The performance model of these measurements. (No recompute pass is added: the profile timed the
        live trainer, which takes proximal log-probs from the forward it trains with; ``sim.recompute_logprob``
        and ``sim.with_reference`` describe the analytic model.)"""
        return FittedModel(self)

    def measured_workload(self) -> Optional[Workload]:
        if not self.workload:
            return None
        fields = {k: v for k, v in self.workload.items() if k != "groups"}
        groups = tuple(tuple(int(n) for n in g) for g in self.workload.get("groups") or ())
        return Workload(name="measured", **fields, empirical=groups)

    def to_json(self) -> str:
        return json.dumps({"schema": SCHEMA, **asdict(self)}, indent=2)


class FittedModel:
    """:class:`~bidirl.perf.model.PerformanceModel` from a profile (times of the profiled device)."""

    def __init__(self, profile: Profile):
        self.profile = profile
        d, t = profile.decode.coefficients, profile.train.coefficients
        self.a, self.b, self.c = d["a"], d["b"], d["c"]
        # a fitted intercept below 0 (a noisy fit of points far from 0 tokens) is read as 0: a step has no
        # negative fixed time, and the simulator charges the intercept once per step and the rest per
        # streamed part, where a negative one was taken off every part (8 parts of 4,000 tokens cost 0.12 s
        # against 0.83 s whole, at -0.1 s)
        self.per_token, self.train_fixed = t["per_token_s"], max(0.0, t["fixed_s"])
        co = profile.co_running or {}
        self.decode_factor, self.train_factor = co.get("decode", 1.0), co.get("train", 1.0)
        self.decode_beside_decode = co.get("decode_beside_decode", 1.0)  # (older profiles: not measured)

    def decode_line(self, context: float, instance_devices: int = 1) -> Tuple[float, float]:
        one_device(instance_devices)
        return max(0.0, self.a), max(1e-9, self.b + self.c * context)  # a noisy fit never gives negative time

    def prefill_seconds_per_token(self, instance_devices: int = 1) -> float:
        one_device(instance_devices)
        return self.profile.prefill.coefficients["per_token"]

    def request_overhead_seconds(self) -> float:
        return (self.profile.requests or {}).get("per_request_s", 0.0)  # (older profiles: not measured)

    def warmup_seconds(self, stage: str) -> float:
        if stage == "rollout":  # the profile measured it, but the runtime pays it at start-up, before the run's
            return 0.0  # clock (bidirl.runtime.worker: warm_up_rollout), as a GPU engine's is (the analytic model)
        return (self.profile.warmup or {}).get(f"{stage}_s", 0.0)  # (older profiles: not measured)

    def micro_batch_overhead_seconds(self) -> float:
        return (self.profile.step_overhead or {}).get("per_micro_batch_s", 0.0)

    def step_overhead_seconds(self) -> float:
        return (self.profile.step_overhead or {}).get("finish_s", 0.0)

    def decode_slowdown_beside_training(self) -> float:
        return self.decode_factor

    def decode_slowdown_beside_decoding(self) -> float:
        return self.decode_beside_decode

    def max_concurrency(self, context: float, instance_devices: int = 1) -> int:
        one_device(instance_devices)
        return self.profile.capacity

    def __repr__(self) -> str:  # a stable key for the simulator's memoised bound: every measurement in it
        digest = hashlib.sha256(self.profile.to_json().encode()).hexdigest()[:16]
        return f"FittedModel({self.profile.device}, {digest}, {self.train_factor})"

    def train_compute_seconds(self, tokens: float, recompute_logprob: Optional[bool] = None) -> float:
        # the live trainer takes proximal log-probs from the forward it trains with: no recompute pass
        # unless asked for explicitly; a noisy fit never gives a negative time
        seconds = self.train_factor * max(0.0, self.train_fixed + self.per_token * tokens)
        if recompute_logprob and self.profile.logprob is not None:
            seconds += self.logprob_seconds(tokens)
        return seconds

    def logprob_seconds(self, tokens: float) -> float:
        """A forward-only log-prob pass over ``tokens`` (old/proximal or reference log-probs)."""
        if self.profile.logprob is None:
            raise ValueError("this profile has no forward-only log-prob fit: measure it again with `bidirl profile`")
        fit = self.profile.logprob.coefficients
        return self.train_factor * (max(0.0, fit["fixed_s"]) + fit["per_token_s"] * tokens)  # (as the train line)

    def allreduce_seconds(self, devices: int) -> float:
        return 0.0 if devices == 1 else 2 * (devices - 1) / devices * self.profile.weights["publish_s"]

    def gradient_return_seconds(self, devices: int) -> float:
        return devices * self.profile.weights["publish_s"]

    def sync_seconds(self, devices: int) -> float:
        return self.profile.weights["publish_s"] if devices > 1 else 0.0

    def load_seconds(self) -> float:
        return self.profile.weights["load_s"]

    def train_state_seconds(self) -> float:
        # fp32 weights and two AdamW moments: three times the published (flattened fp32) weights
        return 3 * self.profile.weights["publish_s"]

    def switch_seconds(self, to: str = "", instance_devices: int = 1) -> float:
        one_device(instance_devices)
        s = self.profile.switch
        return {"rollout": s["to_rollout_s"], "train": s["to_train_s"]}.get(to, max(s.values()))


def one_device(instance_devices: int) -> None:
    if instance_devices != 1:
        raise ValueError(f"a profile measures one-device rollout instances, not {instance_devices}-device ones: "
                         "use the analytic model for tensor-parallel instances")


# ---- fitting ------------------------------------------------------------------------------------


def least_squares(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> List[float]:
    """Coefficients x minimising |A x - y| (normal equations; a handful of unknowns)."""
    import numpy as np

    solution, *_ = np.linalg.lstsq(np.asarray(rows, dtype=float), np.asarray(targets, dtype=float), rcond=None)
    return [float(v) for v in solution]


def relative_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    terms = [((p - m) / m) ** 2 for p, m in zip(predicted, measured) if m > 0]
    return math.sqrt(sum(terms) / len(terms)) if terms else 0.0


def nonnegative_least_squares(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> List[float]:
    """Least squares with every coefficient >= 0. The optimum's non-zero coefficients are the plain least
    squares of their own columns, so the best non-negative one of those over every subset of columns is
    it: exact, and cheap for the two or three unknowns of these fits."""
    width, best = len(rows[0]), None
    for free in itertools.product((True, False), repeat=width):
        columns = [j for j in range(width) if free[j]]
        x = [0.0] * width
        if columns:
            solution = least_squares([[row[j] for j in columns] for row in rows], targets)
            if min(solution) < 0:
                continue
            for j, value in zip(columns, solution):
                x[j] = value
        residual = sum((sum(r * v for r, v in zip(row, x)) - y) ** 2 for row, y in zip(rows, targets))
        if best is None or residual < best[0]:
            best = (residual, x)
    return best[1]


def fit_decode(points: List[Dict[str, float]]) -> Fit:
    """``a + b*B + c*B*ctx`` with no term below 0: a decode step never gets faster with more sequences or
    longer contexts, so a negative term is timer noise traded between the terms (one profile read
    b=0.39 ms, c=-0.0011 ms where the next read b=0.19, c=+0.0001), which then decides the prediction
    wherever the running batch and context differ from the points'."""
    contexts = [p["context"] for p in points]
    if max(contexts) > 1.25 * min(contexts):
        rows = [(1.0, p["batch"], p["batch"] * p["context"]) for p in points]
        a, b, c = nonnegative_least_squares(rows, [p["step_s"] for p in points])
    else:  # contexts hardly vary: the context term cannot be told apart from the batch term
        (a, b), c = nonnegative_least_squares([(1.0, p["batch"]) for p in points], [p["step_s"] for p in points]), 0.0
    predicted = [a + b * p["batch"] + c * p["batch"] * p["context"] for p in points]
    return Fit({"a": a, "b": b, "c": c}, relative_error(predicted, [p["step_s"] for p in points]), points)


def fit_line(points: List[Dict[str, float]], x: str, y: str, names: Tuple[str, str]) -> Fit:
    """Least squares of ``y`` on ``x``, with the slope kept >= 0: work never gets faster as it grows,
    so a falling line is timer noise (points too close together to tell apart, as a tiny model's few
    trained samples are) -- the best line that does not fall is then flat, at the points' mean. And the
    intercept >= 0: a negative one (points far from x = 0) gives the best line through the origin."""
    intercept, slope = nonnegative_least_squares([(1.0, p[x]) for p in points], [p[y] for p in points])
    predicted = [intercept + slope * p[x] for p in points]
    return Fit({names[0]: intercept, names[1]: slope}, relative_error(predicted, [p[y] for p in points]), points)


def fit_workload(lengths_by_group: List[List[int]], prompt_tokens: float, cap: int,
                 rewards_by_group: Optional[List[List[float]]] = None) -> Dict[str, float]:
    """Log-normal fit of response lengths: between-group and within-group spread, as the presets have;
    and, given the rewards, the share of samples in groups whose rewards differ (the ones GRPO trains).

    The mean is of the lengths as generated, after the cap; a preset's ``mean_tokens`` is before it, so
    where many samples hit the cap the fitted workload is a little shorter than the real one."""
    logs = [[math.log(max(1, n)) for n in group] for group in lengths_by_group if group]
    means = [sum(g) / len(g) for g in logs]
    grand = sum(means) / len(means)
    between = math.sqrt(sum((m - grand) ** 2 for m in means) / max(1, len(means) - 1))
    within = math.sqrt(sum((v - m) ** 2 for g, m in zip(logs, means) for v in g) / max(1, sum(map(len, logs)) - len(logs)))
    flat = [n for group in lengths_by_group for n in group]
    fitted = {"prompt_tokens": round(prompt_tokens), "mean_tokens": sum(flat) / len(flat), "cap": cap,
              "prompt_sigma": round(between, 4), "sample_sigma": round(within, 4)}
    if rewards_by_group is not None:
        trained = sum(len(g) for g in rewards_by_group if len(set(g)) > 1)
        fitted["informative"] = round(max(trained, 1) / max(1, sum(map(len, rewards_by_group))), 4)
    fitted["groups"] = [list(g) for g in lengths_by_group if g]  # the simulator replays these
    return fitted


# ---- reading --------------------------------------------------------------------------------------


def load_profile(path: str | Path) -> Profile:
    """A validated profile; a bad file is one BidirlError naming the file and what is wrong."""
    path = Path(path)
    data = read_json_document(path, SCHEMA, "profile.json", "measure one with `bidirl profile PIPELINE`")
    try:
        fits = {name: _fit(data, name, keys) for name, keys in
                (("decode", ("a", "b", "c")), ("prefill", ("per_token",)), ("train", ("fixed_s", "per_token_s")))}
        weights = _numbers(data, "weights", WEIGHT_KEYS)
        switch = _numbers(data, "switch", SWITCH_KEYS)
        logprob = _fit(data, "logprob", ("fixed_s", "per_token_s")) if data.get("logprob") is not None else None
        for section, slope in (("prefill", "per_token"), ("train", "per_token_s"), ("logprob", "per_token_s")):
            fit = fits.get(section) or (logprob if section == "logprob" else None)
            if fit is not None and fit.coefficients[slope] < 0:  # (an intercept may be negative; a slope not)
                raise _Bad(f"{section}.coefficients.{slope}", "a finite number >= 0 (seconds per token)")
        capacity = data["capacity"]
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise _Bad("capacity", "a positive integer")
        workload = data.get("workload")
        if workload is not None:
            workload = _numbers(data, "workload", ("prompt_tokens", "mean_tokens", "cap", "prompt_sigma", "sample_sigma"))
            workload["prompt_tokens"], workload["cap"] = int(workload["prompt_tokens"]), int(workload["cap"])
            groups = data["workload"].get("groups")
            if groups is not None:
                if not (isinstance(groups, list) and groups and all(
                        isinstance(g, list) and g and all(isinstance(n, int) and n >= 1 for n in g) for g in groups)):
                    raise _Bad("workload.groups", "a list of groups of positive whole lengths")
                workload["groups"] = groups
            if "informative" in data["workload"]:  # optional: profiles before it train every sample
                workload.update(_numbers(data, "workload", ("informative",)))
                if not 0 < workload["informative"] <= 1:
                    raise _Bad("workload.informative", "a share above 0 and at most 1")
            if workload["mean_tokens"] <= 0 or workload["cap"] < 1:
                raise _Bad("workload.mean_tokens", "above 0 (and workload.cap at least 1)")
        co_running = _optional(data, "co_running", ("decode", "train"))
        if co_running is not None:
            if min(co_running["decode"], co_running["train"]) <= 0:
                raise _Bad("co_running.decode", "a slowdown factor above 0 (and co_running.train too)")
            if "decode_beside_decode" in data["co_running"]:  # optional: older profiles did not measure it
                co_running.update(_numbers(data, "co_running", ("decode_beside_decode",)))
                if co_running["decode_beside_decode"] <= 0:
                    raise _Bad("co_running.decode_beside_decode", "a slowdown factor above 0")
        requests = _optional(data, "requests", ("per_request_s",))
        warmup = _optional(data, "warmup", WARMUP_KEYS)
        step_overhead = _optional(data, "step_overhead", OVERHEAD_KEYS)
        meta = data.get("meta") or {}
        if not isinstance(meta, dict):
            raise _Bad("meta", "a mapping")
    except KeyError as exc:
        raise BidirlError(f"{path}: missing key {exc.args[0]!r}; measure it again with `bidirl profile`") from None
    except _Bad as exc:
        raise BidirlError(f"{path}: key '{exc.key}' must be {exc.expected}") from None
    return Profile(str(data.get("device", "?")), fits["decode"], fits["prefill"], fits["train"], weights, switch,
                   capacity, workload, dict(meta), logprob, co_running, requests, warmup,
                   step_overhead)


def measured_with(cfg: Any) -> Dict[str, Any]:
    """The settings of a pipeline (a ``PipelineConfig``) that shape what its profile measures, kept in the
    profile's ``meta``: a pipeline that uses the profile with others is refused (:func:`check_profile_fits`)."""
    if cfg.data.source == "reasoning_gym":  # the task and its difficulty knobs set the response lengths
        data = {"data.task": cfg.data.task, "data.task_config": json.loads(json.dumps(cfg.data.task_config))}
    else:  # a local dataset by its name, not its full path (a profile made on another host still fits); a hub id as it is
        data = {"data.path": _by_name(cfg.data.path)}
    # the model and the engines set every cost measured: the tiny model by its shape (its seed only by the
    # lengths it answers with, which the task's settings above stand for)
    model = {"model.source": _by_name(cfg.model.source)}
    if cfg.model.source == "tiny":  # (key by key: a mismatch names the one that differs)
        model.update({f"model.tiny.{k}": v for k, v in asdict(cfg.model.tiny).items() if k != "seed"})
    return {"rollout.max_new_tokens": cfg.rollout.max_new_tokens, "rollout.group_size": cfg.rollout.group_size,
            "rollout.temperature": cfg.rollout.temperature, "data.source": cfg.data.source, **data, **model,
            "rollout.engine": cfg.rollout.engine, "train.engine": cfg.train.engine,
            "cluster.device_type": cfg.cluster.device_type}


def _by_name(source: str) -> str:
    """A local folder or file by its name (a profile made on another host still fits); anything else as it is."""
    path = Path(source).expanduser()
    return path.resolve().name if path.exists() else source


def check_profile_fits(profile: Profile, path: Any, settings: Dict[str, Any]) -> None:
    """A profile measured the lengths of one task's responses at one cap and group size (and their
    costs): used with other ``settings`` (key -> the pipeline's value), its workload describes another
    run. One line naming the first setting that differs; profiles that did not record them pass."""
    for key, value in settings.items():
        if key in profile.meta and profile.meta[key] != value:
            raise BidirlError(f"sim.profile={path}: measured with {key}={profile.meta[key]}, but the pipeline has "
                              f"{key}={value}; profile again with `bidirl profile PIPELINE` or set it back")


class _Bad(Exception):
    def __init__(self, key: str, expected: str):
        self.key, self.expected = key, expected


def _numbers(data: Dict[str, Any], section: str, keys: Sequence[str]) -> Dict[str, float]:
    block = data[section]
    if not isinstance(block, dict):
        raise _Bad(section, "a mapping")
    out = {}
    for key in keys:
        value = block[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise _Bad(f"{section}.{key}", "a finite number >= 0")
        out[key] = float(value)
    return out


def _optional(data: Dict[str, Any], section: str, keys: Sequence[str]) -> Optional[Dict[str, Any]]:
    """A section older profiles did not measure (None where absent): as written, with ``keys`` checked as
    numbers -- first, so a section that is not a mapping is one line rather than the merge's TypeError."""
    if data.get(section) is None:
        return None
    checked = _numbers(data, section, keys)
    return {**data[section], **checked}


def _fit(data: Dict[str, Any], section: str, keys: Sequence[str]) -> Fit:
    block = data[section]
    if not isinstance(block, dict) or not isinstance(block.get("coefficients"), dict):
        raise _Bad(f"{section}.coefficients", "a mapping")
    coefficients = {}
    for key in keys:
        value = block["coefficients"][key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _Bad(f"{section}.coefficients.{key}", "a finite number")
        coefficients[key] = float(value)
    error, points = block.get("error", 0.0), block.get("points", [])
    if isinstance(error, bool) or not isinstance(error, (int, float)):
        raise _Bad(f"{section}.error", "a number")
    if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
        raise _Bad(f"{section}.points", "a list of mappings")
    return Fit(coefficients, float(error), points)
