"""Discrete-event simulation of RL clusters, driving the same policies as the live runtime."""
