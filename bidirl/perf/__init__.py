"""Time-performance models in pure Python (no torch): what generation, training and weight movement
cost on a given device, and the response-length workloads they are evaluated on.

* :mod:`bidirl.perf.analytic` -- analytic models of hardware we do not have (peak FLOP/s, HBM
  bandwidth, MFU, model shape), calibrated on public figures; owns the ``sim.hardware`` and
  ``sim.model`` names.
* :mod:`bidirl.perf.workload` -- response-length distributions (long tails, caps, drift); owns the
  ``sim.workload`` names.

The simulator (:mod:`bidirl.sim`) times its work with them; configuration validates names against
their registries. Ground floor: imports nothing else from bidirl.
"""
