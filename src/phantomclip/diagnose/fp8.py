"""diagnose with an FP8 engine (--engine-quant): the plain engine's reading of the FP8 engine's samples, and the
figures that set the FP8 engine beside it (the result's 'fp8' key, docs/metrics.md 'FP8 engines').

β = logp − logp_engine splits exactly per token into three differences of two forwards that differ in one thing:
β_precision = logp − the plain shadow (the trainer's recipe), β_quant = the plain shadow − the FP8 shadow (the
quantisers alone: same weights, dtype and kernels) and β_kernel = the FP8 shadow − the FP8 engine (the engine's decode
path). Each is a difference of two fp32 values, exact in float64, and the partial sums telescope, so they add up to β
bit for bit (tests/test_diagnose_fp8.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..engines.local import LocalEngine, Rollout
from ..maths.metrics import mean_or_nan, trust_region_split
from ..precision.recipes import without_quant
from .config import DiagnoseConfig
from .knobs import knob_figures


def plain_engine_reads(cfg: DiagnoseConfig, master, matmul: str, rollouts: list[Rollout], stop: tuple[int, ...],
                       progress) -> list[Rollout]:
    """The FP8 engine's rollouts read by the same local engine without the quantisers (teacher-forced through its
    decode path, `LocalEngine.rescore`, batch by batch with each batch's sampling settings): the plain engine's
    log-probs of the same samples, as it would have reported them had it sampled them."""
    engine = LocalEngine(master, recipe=without_quant(cfg.engine_recipe()), matmul=matmul)
    task = progress.add_task(f"reading the samples with the {engine.recipe.name} engine", total=len(rollouts))
    reads = []
    for i, r in enumerate(rollouts):
        reads.append(engine.rescore(r, cfg.sampling(i, stop)))
        progress.advance(task)
    return reads


def fp8_figures(cfg: DiagnoseConfig, trainer_logp: dict[str, torch.Tensor], *, engine: torch.Tensor,
                shadow: torch.Tensor, plain_shadow: torch.Tensor, plain_engine: torch.Tensor | None, shadow_name: str,
                mask: torch.Tensor, stats: Callable[[torch.Tensor, torch.Tensor], dict]) -> dict:
    """The 'fp8' figures. trainer_logp: each --trainer recipe's log-probs [n, T]; engine, shadow: the FP8 engine's and
    the FP8 shadow's; plain_shadow, plain_engine: the same without the quantisers (plain_engine None where the engine
    cannot read given tokens through its decode path, vLLM: the figures against it are then None; β's split
    β_precision + β_quant + β_kernel needs only the shadows; `recipes_fp8_shadow`, each recipe against the FP8
    shadow, is β_precision + β_quant: what matching the engine's kernels would leave); `stats(a, b)`: diagnose's split
    figures of a − b over the run's tokens. `trust_region.pushed_out` counts the first recipe's tokens outside the
    trust region that β − β_quant would have kept inside: what the quantisation costs, token by token."""
    first = cfg.trainer[0]
    beta = (trainer_logp[first] - engine).double()  # [n, T] against the FP8 engine
    beta_quant = (plain_shadow - shadow).double()  # [n, T]
    ok = mask & torch.isfinite(beta) & torch.isfinite(beta_quant)  # [n, T]
    eps = (cfg.epsilon, cfg.epsilon_high)
    with_q, without_q = trust_region_split(beta[ok], *eps), trust_region_split((beta - beta_quant)[ok], *eps)
    outside, outside_without = with_q[0] | with_q[1], without_q[0] | without_q[1]  # [N] each
    return {
        "engine_recipe": shadow_name, "plain_recipe": without_quant(cfg.engine_recipe()).name,
        "beta_quant": stats(plain_shadow, shadow),
        "engines": None if plain_engine is None else stats(plain_engine, engine),
        "kernel_plain": None if plain_engine is None else stats(plain_shadow, plain_engine),
        "recipes_plain_engine": (None if plain_engine is None else
                                 {name: stats(logp, plain_engine) for name, logp in trainer_logp.items()}),
        # β_precision + β_quant: each recipe against the FP8 shadow, what matching the kernels alone would leave
        "recipes_fp8_shadow": {name: stats(logp, shadow) for name, logp in trainer_logp.items()},
        "trust_region": {
            "recipe": first, "outside": mean_or_nan(outside.double()),
            "outside_without_quant": mean_or_nan(outside_without.double()),
            "pushed_out": mean_or_nan((outside & ~outside_without).double()),
            "pulled_in": mean_or_nan((outside_without & ~outside).double()),
        },
        "knobs_plain_engine": (None if plain_engine is None else knob_figures(
            trainer_logp[first] - plain_engine, mask, cfg.knob_settings(), cfg.keep_share,
            cfg.knob_length or cfg.max_tokens)),
    }
