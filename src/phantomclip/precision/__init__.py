"""How a forward pass is computed: the precision recipes (weight dtype, autocast, modules kept in fp32, the emulated
low-precision matmul), the trainer's scoring forward (per-token log-probs and entropies), and the emulated FP8
quantisers with the names a vLLM build gives them.

May import: base.
"""
