"""The scheduling-policy interface and the one registry of policies, by name.

A policy answers one question after every event: *given the cluster as it is now, what starts?*
Contract: ``decide(event, cluster)`` applies each action it takes to the bookkeeping at once
(``cluster.apply``, so later choices in the same decision see it) and returns them, in order, for the
driver -- the live runtime or the simulator -- to carry out. Policies hold no clocks and no engines,
so the same object drives a real run and a simulated one.

Adding a policy is one class in one file: subclass :class:`Policy` (or one of the policies in
:mod:`bidirl.sched.policies` / :mod:`bidirl.sched.borrowing`), give it a ``name`` (and ``aliases``),
say whether it ``needs_estimates``, implement ``decide``. Defining the class registers it; the CLI,
the config schema (``launch.mode``), the simulator and the live runtime then all know it. A policy
is constructed once, with an estimates provider it asks for current costs, and is never changed from
outside afterwards.
"""

from __future__ import annotations

from typing import ClassVar, Dict, List, Tuple, Type

from bidirl.sched import events as ev
from bidirl.sched.cluster import Cluster, TailPlacement
from bidirl.sched.estimates import NO_ESTIMATES, Estimates, EstimatesProvider
from bidirl.sched.replanning import NO_REPLANNING, Replanner
from bidirl.sched.roles import Role

POLICIES: Dict[str, Type["Policy"]] = {}  # name or alias -> class, in the order defined


class Policy:
    name: ClassVar[str] = ""  # a subclass that sets a name is registered under it
    aliases: ClassVar[Tuple[str, ...]] = ()
    needs_estimates: ClassVar[bool] = False  # cost-aware: decides with Estimates
    synchronous: ClassVar[bool] = False  # on-policy by construction: staleness is 0 whatever the config says
    deadlines: ClassVar[bool] = True  # staleness bounded per group (AReaL); False: counted only (veRL fully-async)
    # start a step's gradient work on the groups already done while those it must wait for generate (bidirl)
    streams_gradients: ClassVar[bool] = False
    migrates: ClassVar[bool] = False  # moves requests in flight (Migrate), where the driver can
    # which older tails keep new groups off a rollout device (fill_rollout; launch.tail_placement overrides)
    tail_placement: ClassVar[TailPlacement] = TailPlacement.DUE
    # the trainer of the system this policy stands for recomputes old/proximal log-probs in a forward pass
    # of its own (+2N FLOPs per token; what a simulation charges unless sim.recompute_logprob says):
    # veRL and AReaL do (several updates per batch); bidirl's own trainer does not (one optimizer step per
    # batch: the proximal log-probs come from the forward it trains with), nor does veRL's fully-async recipe
    recomputes_logprob: ClassVar[bool] = True
    # a baseline's honest label in comparisons: the published system whose scheduling it reproduces on
    # bidirl's runtime (not inherited, see style_of: bidirl, its ablations and async-lend have none)
    style: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            for key in (cls.name, *cls.__dict__.get("aliases", ())):  # aliases are not inherited
                if key in POLICIES and POLICIES[key].__qualname__ != cls.__qualname__:
                    raise ValueError(f"policy name '{key}' is taken by {POLICIES[key].__qualname__}")
                POLICIES[key] = cls

    repartitions: ClassVar[bool] = True  # has a partition that re-planning may change (not colocated)

    def __init__(self, estimates: EstimatesProvider = NO_ESTIMATES, batch_groups: int = 0, label: str = "",
                 replanner: Replanner = NO_REPLANNING):
        self.label = label or self.name  # the name it was asked for (an alias, say), for reports and errors
        if self.needs_estimates and estimates is NO_ESTIMATES:
            raise ValueError(f"policy '{self.label}' needs performance estimates (measured live, or the simulator's)")
        if replanner is not NO_REPLANNING and not self.repartitions:
            raise ValueError(f"policy '{self.label}' has no partition to re-plan (it is colocated: every device "
                             "generates, then trains); leave cluster.replan_every at 0 for it")
        self._estimates = estimates
        self.replanner = replanner
        self.batch_groups = batch_groups

    @property
    def estimates(self) -> Estimates:
        """The provider's current numbers (fixed for a model, moving averages when measured live)."""
        return self._estimates.current()

    def effective_eta(self, staleness: float) -> float:
        """The staleness bound this policy runs under: the configured one, or 0 if synchronous."""
        return 0.0 if self.synchronous else float(staleness)

    def homes(self, devices: int, rollout_devices: int) -> List[Role]:
        """The home pool of each device (the partition this policy starts from)."""
        if not 0 < rollout_devices < devices:
            raise ValueError(f"policy '{self.label}' needs 1..{devices - 1} rollout devices "
                             f"of cluster.devices={devices}, got {rollout_devices}")
        return [Role.ROLLOUT] * rollout_devices + [Role.TRAIN] * (devices - rollout_devices)

    def default_rollout_devices(self, devices: int) -> int:
        """The split used when none is given: half (a hand-picked static split)."""
        return max(1, devices // 2)

    def decide(self, event: ev.Event, cluster: Cluster) -> List[ev.Action]:
        raise NotImplementedError


def policy_names() -> Tuple[str, ...]:
    return tuple(POLICIES)


# Baselines that are not policies: real systems ``bidirl compare`` runs as they are (bidirl.peers), live only
PEERS = {"trl": "TRL GRPOTrainer (the real library; transformers generate, one process)"}


def baseline_names() -> Tuple[str, ...]:
    """The names ``bidirl compare --baselines`` takes: the published systems' names where a policy has one
    as an alias (``verl``, ``areal``), else the policy's name; each names a policy with a ``style``."""
    names = []
    for name, cls in POLICIES.items():
        if style_of(name) and name not in names:
            aliases = cls.__dict__.get("aliases", ())
            if name == cls.name and aliases:
                continue  # listed under its published name (the alias) instead
            names.append(name)
    return tuple(names)


def style_of(name: str) -> str:
    """The policy's own ``style`` (not inherited: a subclass of a baseline is not that baseline)."""
    return POLICIES[name].__dict__.get("style", "")


def build_policy(name: str, estimates: EstimatesProvider = NO_ESTIMATES, batch_groups: int = 0,
                 replanner: Replanner = NO_REPLANNING) -> Policy:
    """A policy by name or alias; cost-aware ones need an estimates provider."""
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy '{name}' (known: {', '.join(POLICIES)})")
    return POLICIES[name](estimates, batch_groups, label=name, replanner=replanner)
