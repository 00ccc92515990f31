"""The canary: engine state or learning, told apart by a fixed probe (docs/rollouts.md, "Engine or learning").

A run's own tokens change as the policy learns, so β measured on them can grow for two reasons: the engine's state
(weights not updated after a sync, a prefix cache kept across an update: the engine no longer holds what the trainer
synced) or learning (the policy moves toward tokens where the precision gap is larger). The canary holds the tokens
still: at every weight sync the engine reads the same fixed sequences (integrations.recorders.record_canary:
teacher-forced at temperature 1), and here each step's reading is scored by the engine-dtype shadow of that step's
own checkpoint. With the engine holding the synced weights, the two differ by the precision and kernel gap alone, the
same at every step whatever the policy learned: flat. A step whose canary is well above the run's lowest canary level
(CANARY_MARGIN x, the rule which_weights uses for the run's records) is engine state at that sync. Where the canary
stays flat and β on the run's own tokens grows, learning did it (`trace --run` shows on which tokens).

Cost: reading the documented probe (recorders.default_probe: 4 x 32 tokens) is one teacher-forced pass per sync in the
engine (bench/benchmarks/bench_canary.py measures it against a step's sampling).
"""

from __future__ import annotations

import dataclasses

import torch

from ..maths.metrics import quantile_or_nan
from .config import DiagnoseConfig
from .which_weights import MATCH_FLOOR, MATCH_MARGIN, candidate_logps, sample_by_step

CANARY_MARGIN = MATCH_MARGIN
"""a step's canary is engine state when its median |β| is above this factor of the run's lowest canary level: the
precision gap of one engine on one probe varies far less between syncs than that, and an engine holding other
weights than the trainer's reads the probe tenths of a nat to nats away."""
PER_STEP = 64
"""canary records kept per step at most (a probe is small; a larger file is read in part)."""


def canary_cfg(cfg: DiagnoseConfig) -> DiagnoseConfig:
    """The run's config for reading the probe: temperature 1, no truncation, raw log-probs (how it was recorded)."""
    return dataclasses.replace(cfg, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, logprobs_mode="raw",
                               rollouts_step=None)


def canary_rows(cfg: DiagnoseConfig, steps: list[int], candidates: dict[int | None, str]) -> dict[int, dict] | None:
    """step -> the canary's figures at that step (None when the records hold no canary): its tokens, mean and median
    |β| against the step's own checkpoint, and `state` ('flat', 'jump', or 'not judged' without the step's own
    checkpoint)."""
    header, kept = sample_by_step(cfg.rollouts, steps, PER_STEP, canary=True)
    if not any(kept.values()):
        return None
    c = canary_cfg(cfg)
    rows: dict[int, dict] = {}
    for step, located in kept.items():
        if not located:
            rows[step] = {"tokens": 0, "state": "not recorded"}
        elif step not in candidates:
            rows[step] = {"tokens": 0, "state": "not judged"}  # the trainer's weights at this sync are not given
    scored = {s: candidate_logps(c, candidates[s], header, {s: kept[s]})[s] for s in steps if s not in rows}
    for step, (logp_engine, logp_shadow, mask) in scored.items():
        ok = mask & torch.isfinite(logp_engine) & torch.isfinite(logp_shadow)  # [n, T]
        size = (logp_shadow - logp_engine)[ok].abs().double()  # [N] |β|
        rows[step] = {"tokens": int(ok.sum()), "beta_abs_mean": float(size.mean()) if size.numel() else None,
                      "beta_abs_median": quantile_or_nan(size, 0.5)}
    judged = [r["beta_abs_median"] for r in rows.values() if r.get("beta_abs_median") is not None]
    level = max(min(judged), MATCH_FLOOR) if judged else MATCH_FLOOR
    for r in rows.values():
        if r.get("beta_abs_median") is not None:
            r["state"] = "jump" if r["beta_abs_median"] > CANARY_MARGIN * level else "flat"
            r["level"] = level
    return dict(sorted(rows.items()))
