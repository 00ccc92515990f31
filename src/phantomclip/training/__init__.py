"""phantomclip's own asynchronous GRPO trainer with the exact split of the ratio: the job (trainer) and its config,
the producer that samples with stale weights, the interventions of the reference analysis (the Plan a run follows),
reward tasks, and the experiments that run arms over seeds (experiments, experiment_text).

May import: base, precision, maths, models, engines, routing, runs.
"""
