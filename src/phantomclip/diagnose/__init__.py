"""`phantomclip diagnose`: before training, measure the trainer/engine gap for a model, an engine and a precision
contract. The job (job) over its config and typed records, the FP8 engine's part (fp8), knob advice (knobs), the
--fail-if gate (gates), the records a real engine wrote measured in place of sampling (recorded), a post-mortem over
a run's recorded steps, each against the weights that sampled it (postmortem, which_weights), and what it
prints (text, postmortem_text).

May import: base, precision, maths, models, runs, engines, routing, rollouts, answer.
"""

from .. import moved_names

__getattr__ = moved_names(__name__)
