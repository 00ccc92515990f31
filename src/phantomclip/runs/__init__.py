"""Run directories that lose nothing: what a training run writes (config.json, metrics.jsonl, samples, atomic
checkpoints and weight snapshots) and how it resumes (rundir), and the one check of a run's files before anything
uses them (checks). Training writes them; trace --run, the report and the command line read them.

May import: base.
"""

from .. import moved_names

__getattr__ = moved_names(__name__)
