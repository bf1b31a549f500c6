"""roll: reinforcement-learning post-training (RLVR, GRPO/PPO) for large language models."""

__version__ = "0.1.0"
