"""A TrainerCallback that records the wall time of every optimizer step (generation included in GRPO).

A helper, not run on its own: bench_trainer.py times TRL's steps with it (bench/RESULTS.md §4)."""

import time

from transformers import TrainerCallback


class StepClock(TrainerCallback):
    def __init__(self):
        self.times: list[float] = []

    def on_step_begin(self, args, state, control, **kw):
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self.t0)
