"""The torchrun entry of ``bidirl launch``: the runtime (:mod:`bidirl.runtime.main`) with the planner
plugged in for re-planning at run time (``cluster.replan_every``).

It sits above both, so that the runtime never imports the planner: the controller only receives a
function from a measured mean response length to a rollout-pool size, as the simulator does.
"""

from __future__ import annotations

import sys


def choose_for(cfg):
    from bidirl.planner import replanner

    return replanner(cfg, driver=cfg.live_driver())  # candidates simulated as this runtime runs them


if __name__ == "__main__":
    from bidirl.runtime.main import main

    sys.exit(main(sys.argv[1:], choose_for))
