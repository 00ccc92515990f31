"""phantomclip: find, explain and fix the trainer/engine precision mismatch in RL fine-tuning."""

__version__ = "0.1.0"
SCHEMA_VERSION = 1
"""version of the JSON files this package writes (trace, run config, experiment summary; diagnose has its own)."""
DIAGNOSE_SCHEMA = 2
"""version of the diagnose JSON alone. 2: `drift`, `config.drift` and `config.knob_length` added, and the first
number under which `knobs`, `recipes.*.frameworks` and `recipes.*.split.batch` are written (schema-1 files may
lack them); readers take 1 and 2 and treat each of these keys as optional. Its own number, not SCHEMA_VERSION's:
only the diagnose file changed, and bumping the shared number would stamp every run directory, trace and
experiment written from now on as newer, so an older phantomclip would refuse files whose content did not change
(runs.read_json_object)."""
