"""The pure maths every job shares: the GRPO objective and its rollout corrections with one range per knob (loss), the
figures of the ratio and the mismatch in it (metrics), and each RL framework's own figures by its own definition
with its published bars (frameworks). Tensors in, numbers out; no model, no file.

May import: base.
"""
