"""phantomclip: find, explain and fix the trainer/engine precision mismatch in RL fine-tuning."""

__version__ = "0.1.0"
