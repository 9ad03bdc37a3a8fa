"""Scheduling core in pure Python (no torch): device roles, cluster bookkeeping, policies, traces.

The live runtime (:mod:`bidirl.runtime`) and the simulator (:mod:`bidirl.sim`) drive the same policy
objects through one event/action interface:

* :mod:`~bidirl.sched.roles`      device roles and the state machine every driver enforces
* :mod:`~bidirl.sched.events`     events (driver -> policy) and actions (policy -> driver), closed sets
* :mod:`~bidirl.sched.cluster`    the shared bookkeeping: chunks, batches, versions, staleness, leases
* :mod:`~bidirl.sched.estimates`  what cost-aware policies believe work costs (modelled or measured)
* :mod:`~bidirl.sched.policy`     the policy interface and the one registry of policies by name
* :mod:`~bidirl.sched.policies`   static policies (sync/veRL, async/AReaL, verl-async, async-lend)
* :mod:`~bidirl.sched.borrowing`  lending policies (roll, streamrl, verl-dynamic, bidirl + ablations)
* :mod:`~bidirl.sched.assembly`   one run assembly for every driver: policy + Cluster from a run shape
* :mod:`~bidirl.sched.trace`      reading traces: time per state, idle ratios, switch overheads
"""

# The built-in policies register themselves by being defined: import them with the package, so the
# registry (bidirl.sched.policy.POLICIES) is complete whichever sched module is imported first.
from bidirl.sched import policies  # noqa: F401,E402  (first: the registry keeps definition order)
from bidirl.sched import borrowing  # noqa: F401,E402
