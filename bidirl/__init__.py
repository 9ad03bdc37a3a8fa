"""bidirl: asynchronous, disaggregated RL post-training of LLMs with bidirectional device borrowing."""

__version__ = "0.1.0"
