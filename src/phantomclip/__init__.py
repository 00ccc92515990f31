"""phantomclip: find, explain and fix the trainer/engine precision mismatch in RL fine-tuning."""

__version__ = "0.1.0"
SCHEMA_VERSION = 1
"""version of the JSON files this package writes (diagnose, trace, run config, experiment summary)."""
