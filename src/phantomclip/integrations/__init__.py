"""phantomclip inside the stacks people train with: TRL's GRPOTrainer (trl, with the figures over every rank: ranks, and
the policy's full weights under DDP, FSDP, ZeRO-3 and LoRA: weights), TRL's AsyncGRPOTrainer (trl_async), verl (verl:
a registered loss and the driver's rollout correction) and slime/miles (slime: its TIS and rollout-log hooks),
recorders that write a run's rollouts as files diagnose reads (recorders), and trainer config files read into
diagnose's settings (configs).

May import: base, precision, maths, models, engines, routing, rollouts.
"""
