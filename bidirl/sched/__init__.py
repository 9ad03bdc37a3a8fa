"""Scheduling core in pure Python (no torch): device roles, cluster bookkeeping, policies, traces.

The live runtime (:mod:`bidirl.runtime`) and the simulator drive the same policy objects.
"""
