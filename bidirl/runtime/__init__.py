"""The live multi-process runtime: one controller and N hot device workers, started by torchrun."""
