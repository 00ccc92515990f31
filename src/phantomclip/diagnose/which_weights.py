"""Which weights sampled these records: each recorded step's records scored against every candidate checkpoint, the
best match named with its margin over the next (docs/rollouts.md, "Engine or learning").

A record's log-probs are the engine's at the weights it sampled with. Scored by the engine-dtype shadow of those same
weights, they differ only by the precision and kernel gap (a median |β| of 0.01-0.03 nats in bf16 on the bundled
model); scored by weights some optimizer steps away, they carry the policy's move α as well (a median of 0.22-0.32
nats at 10-20 steps on the same run, docs/results.md). So the checkpoint whose shadow gives the smallest median |β|
is the one that sampled, and one well above the run's matched level did not. The rule here:

  floor     = the smallest median over every (step, candidate) pair, at least MATCH_FLOOR: the run's matched level
  could     = the candidates of a step whose median is at most MATCH_MARGIN x floor
  matched   one candidate could, and it is the step's own checkpoint (or the only model given)
  served    one candidate could and it is another checkpoint: the engine served those weights at this step (stale
            weights when it is an earlier step, mislabelled or swapped checkpoints when a later one)
  ambiguous several could (the policy moved less than the gap between them): the step's own, else the nearest
  missing   none could: no candidate sampled these records, so what is measured against any of them holds α too

Cost: MATCH_SEQUENCES sequences a step, one no-grad shadow forward a candidate; each candidate is loaded once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..base.console import progress_bar
from ..maths.metrics import quantile_or_nan
from ..rollouts.batches import pack_records
from ..rollouts.readers import read_rollouts
from ..rollouts.record import Located
from .config import DiagnoseConfig
from .job import measured_pair, prepare, score_recipe, settled
from .recorded import engine_info, record_shape, record_step
from .records import sampled_from_rollouts

MATCH_SEQUENCES = 8
"""sequences of each step scored against every candidate: a median over a few hundred tokens is steady to a few
percent, far finer than the 8x between matched and 10-steps-away weights that it has to tell apart."""
MATCH_MARGIN = 2.0
"""a candidate could have sampled a step when its median |β| is within this factor of the run's matched level: the
matched medians of one run's steps vary by well under 2x (0.01-0.03 nats in bf16), a step of policy change at a
CPU-sized learning rate is below the gap and stays ambiguous, ten steps are 8x above it."""
MATCH_FLOOR = 0.005
"""the least matched level, in nats: an engine that shares the shadow's kernels (phantomclip's local engine at its
own dtype) gives medians near 0, and a factor of a near-zero floor would call every other checkpoint's tokens
unmatched; 0.005 is below any real engine's bf16 gap (0.01-0.03) and far above fp32 rounding."""
VERDICTS = ("matched", "served", "ambiguous", "missing")


@dataclass
class Match:
    """One step's answer: the median |β| of its sample against each candidate, and which of them sampled it."""

    step: int
    expected: int | None
    """the candidate the step would be measured against by name: its own checkpoint, else the nearest earlier one
    (None: --model, no checkpoints)."""
    medians: dict[int | None, float]
    """candidate (a checkpoint's step; None for --model) -> the median |β| of this step's sample against its shadow."""
    verdict: str = ""
    sampled_by: int | None = None
    """the candidate that sampled the records (verdicts matched, served, ambiguous); for missing, `expected`."""
    margin: float = float("nan")
    """the next candidate's median over the best one's (at least the matched level): how clearly the best one is the
    sampler."""
    alpha: dict = field(default_factory=dict)
    """where the step's own checkpoint exists and another sampled: the policy's move between the two on the sample
    (mean |α| and the share of tokens it alone puts outside the trust region), what the trainer's ratio carries."""


def sample_by_step(path: str, steps: list[int], per_step: int,
                   canary: bool = False) -> tuple[object, dict[int, list[Located]]]:
    """(the header, the first `per_step` records of each step: the run's, or with `canary` the probe's), in one read of
    the input."""
    header, records = read_rollouts(path)
    kept: dict[int, list[Located]] = {s: [] for s in steps}
    for located in records:
        if bool(located.record.canary) != canary:
            continue
        s = record_step(located.record)
        if s in kept and len(kept[s]) < per_step:
            kept[s].append(located)
    return header, kept


def candidate_logps(cfg: DiagnoseConfig, model: str, header, samples: dict[int, list[Located]]) -> dict:
    """step -> (the engine's and the shadow's log-probs [n, T] in the column the engine measured, the mask), scored
    by the engine-dtype shadow of `model`, loaded once for every step."""
    c = dataclasses.replace(cfg, model=model, rollouts_step=None)
    prep = prepare(c, lambda *a, **k: None)
    shadow = c.engine_recipe().name
    out = {}
    with progress_bar(None) as progress:
        for step, located in samples.items():
            batches = pack_records(iter(located), header, record_shape(prep.lm), cfg.batch_size)
            info = engine_info(c, header, len(batches.steps))
            sampled = sampled_from_rollouts(batches.rollouts, prep.lm.tokenizer.pad_token_id,
                                            c.logprobs_mode if c.sampling(0).truncated else None, info, 0.0,
                                            recorded=batches)
            scored = score_recipe(c, prep, sampled, shadow, True, progress)
            logp_shadow, logp_engine = measured_pair(c, sampled, scored)
            out[step] = (logp_engine, logp_shadow, sampled.mask)
    return out


def median_abs(logp_engine: torch.Tensor, logp_shadow: torch.Tensor, mask: torch.Tensor) -> float:
    ok = mask & torch.isfinite(logp_engine) & torch.isfinite(logp_shadow)  # [n, T]
    return quantile_or_nan((logp_shadow - logp_engine)[ok].abs().double(), 0.5)


def match_steps(cfg: DiagnoseConfig, steps: list[int], candidates: dict[int | None, str],
                expected: dict[int, int | None]) -> dict[int, Match]:
    """Each step's Match against every candidate (step -> model path; None: --model alone), by the rule above."""
    cfg = settled(dataclasses.replace(cfg, rollouts_step=None))
    header, samples = sample_by_step(cfg.rollouts, steps, MATCH_SEQUENCES)
    scored = {c: candidate_logps(cfg, model, header, samples) for c, model in candidates.items()}
    matches = {s: Match(step=s, expected=expected[s], medians={c: median_abs(*scored[c][s]) for c in candidates})
               for s in steps}
    floor = max(min(m for match in matches.values() for m in match.medians.values()), MATCH_FLOOR)
    for match in matches.values():
        decide_sampler(match, floor)
        own = match.step if match.step in candidates else None
        if match.verdict in ("served", "missing") and own is not None and match.sampled_by != own:
            match.alpha = alpha_figures(scored[own][match.step], scored[match.sampled_by][match.step], cfg)
    return matches


def decide_sampler(match: Match, floor: float) -> None:
    """The verdict of one step (module docstring), the candidate that sampled it and the margin."""
    ranked = sorted(match.medians, key=lambda c: match.medians[c])
    best = ranked[0]
    if len(ranked) > 1:
        match.margin = match.medians[ranked[1]] / max(match.medians[best], floor)
    could = [c for c in ranked if match.medians[c] <= MATCH_MARGIN * floor]
    if not could:
        match.verdict, match.sampled_by = "missing", match.expected
    elif len(could) == 1:
        match.sampled_by = could[0]
        match.verdict = "matched" if could[0] == match.expected else "served"
    else:
        match.verdict = "ambiguous"
        match.sampled_by = match.expected if match.expected in could else could[0]


def alpha_figures(own: tuple, sampler: tuple, cfg: DiagnoseConfig) -> dict:
    """α = log π_shadow(own weights) − log π_shadow(sampling weights) on the sample's tokens: the policy's move the
    trainer's ratio carries beside β when the engine sampled other weights than the step's own."""
    from ..maths.metrics import mean_or_nan, trust_region_split

    _, logp_own, mask = own
    _, logp_sampler, _ = sampler
    ok = mask & torch.isfinite(logp_own) & torch.isfinite(logp_sampler)  # [n, T]
    alpha = (logp_own - logp_sampler)[ok].double()  # [N]
    below, above = trust_region_split(alpha, cfg.epsilon, cfg.epsilon_high)
    return {"tokens": int(ok.sum()), "alpha_abs_mean": mean_or_nan(alpha.abs()),
            "outside_trust_region": mean_or_nan((below | above).double())}


def match_row(match: Match) -> dict:
    """The post-mortem row's `weights` entry (docs/metrics.md)."""
    return {"verdict": match.verdict, "sampled_by": match.sampled_by, "expected": match.expected,
            "margin": match.margin, "medians": {("model" if c is None else str(c)): m
                                                for c, m in sorted(match.medians.items(), key=lambda kv: (
                                                    kv[0] is not None, kv[0] or 0))},
            "alpha": match.alpha or None}
