"""Floating-point facts: dtype names, rounding to a storage dtype, spacing (ULP), steps to cross a boundary.

Who uses what: `parse_dtype` / `dtype_name` every command that takes or reports a dtype; `round_to` trace's
weights-only model; `ulp` the report's spacing figure; `steps_to_cross` states the rule that docs/metrics.md
(`sync/changed_share`) and `engine.LocalEngine.load_weights` cite, checked in tests/test_numerics.py. The share
of weights whose engine-precision value changes at a sync is counted in place by `engine.sync_weights`.

bf16 keeps 8 significant bits (7 stored + the implicit one), fp16 keeps 11, fp32 keeps 24. A value w in
[2^e, 2^(e+1)) therefore has spacing (ULP) 2^(e-7) in bf16: an update smaller than half of it is rounded
away by an engine that stores bf16 weights. That is why a slow learning rate leaves most engine weights
unchanged for many steps (an update of size eta reaches a bf16 neighbour after about |w| / (256 eta) steps).
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Short names accepted on the command line, mapped to torch dtypes."""


def parse_dtype(name: str) -> torch.dtype:
    """Map 'bf16' / 'bfloat16' / 'fp16' / 'float16' / 'fp32' / 'float32' to a torch dtype (ValueError otherwise)."""
    aliases = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
    key = aliases.get(name.strip().lower(), name.strip().lower())
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """Inverse of `parse_dtype` for the three supported dtypes."""
    return {v: k for k, v in DTYPES.items()}[dtype]


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round x to `dtype` (round-to-nearest-even, as torch casts do) and return it in x's dtype."""
    return x.to(dtype).to(x.dtype)


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing between x (rounded to `dtype`) and the next representable value away from zero, in fp64.

    For normal numbers ulp = 2^(floor(log2|x|) - (mantissa bits)); subnormals use the smallest exponent.
    """
    info = torch.finfo(dtype)
    mant_bits = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[dtype]
    xr = x.to(dtype).double().abs()
    min_exp = torch.log2(torch.tensor(info.tiny, dtype=torch.float64))
    exp = torch.floor(torch.log2(xr.clamp_min(info.tiny)))
    return torch.pow(2.0, torch.maximum(exp, min_exp) - mant_bits)


def steps_to_cross(w: float, eta: float, dtype: torch.dtype = torch.bfloat16) -> float:
    """Steps of constant size eta before |w| reaches the next `dtype` value: ceil(ulp(w)/2 / eta).

    Rounding to nearest needs half a spacing, so for bf16 this is about |w| / (256 eta) (spacing ~ |w| / 128).
    """
    spacing = ulp(torch.tensor([w], dtype=torch.float64), dtype).item()
    return float(torch.ceil(torch.tensor(spacing / 2 / eta)).item())
