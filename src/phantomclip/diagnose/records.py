"""The diagnose job's typed records, which its phases pass from one to the next (diagnose/job.py reads top to bottom
over them): the prepared model, what the engine sampled (or a rollout file recorded), each recipe's scores, the
reference columns every recipe is compared with, and the figures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..engines.drift import Drift
from ..engines.local import Rollout
from ..models.load import LoadedModel
from ..rollouts.batches import Batches
from ..routing.routes import Routes


@dataclass
class Prepared:
    """The model and the n prompts to sample from, checked against the context, with the settings resolved."""

    lm: LoadedModel
    prompt_ids: list[list[int]]
    """n prompts (the prompt set reused in order when n exceeds it)."""
    engine_dtype: torch.dtype
    matmul: str
    """the --matmul mode as given ('auto' is resolved per dtype where a model is laid out: recipes.resolve_matmul)."""
    truncation: tuple[int, float, float] | None
    """(top_k, top_p, min_p) when sampling truncates the distribution, else None."""
    device: torch.device
    """where the model, the local engine and scoring run (--device); figures are computed on the host."""


@dataclass
class Sampled:
    """What the engine sampled, packed for scoring, and which of its two log-prob columns it measured."""

    packed: list[dict[str, torch.Tensor]]
    """one `Rollout.pack` per batch: input_ids, attention_mask, completion_mask [B_i, T_i]."""
    mask: torch.Tensor  # [n, T] bool: sampled completion tokens
    logp_engine: torch.Tensor  # [n, T] full-vocabulary log-probs (vLLM 'raw'); NaN where not reported
    logp_engine_processed: torch.Tensor  # [n, T] renormalised over the kept tokens (vLLM 'processed')
    measured: Literal["raw", "processed"] | None
    """'raw' or 'processed': the one column the engine computed (the other is rebuilt); None: both are its own."""
    nonfinite: int
    """sampled tokens for which the engine gave no finite log-prob (left out of every figure)."""
    info: dict
    """the engine's describe()."""
    seconds: float
    """wall time of sampling (engine start-up excluded)."""
    drift: Drift | None = None
    """--drift: the same weights pushed K times into the engine before it closed, and the gap after each push."""
    logp_engine_plain: torch.Tensor | None = None  # [n, T] --engine-quant: the same tokens read by the plain engine
    routes: list[Routes] | None = None
    """MoE models: the experts the engine chose as it decoded (--routing, local engine), or as a rollout file
    recorded them, per batch (routing/routes.py)."""
    recorded: Batches | None = None
    """--rollouts: what the records carried beside their tokens (steps, advantages); None for sampled tokens."""


@dataclass
class Scored:
    """One recipe's view of the sampled tokens."""

    logp: torch.Tensor  # [n, T]
    entropy: torch.Tensor  # [n, T]
    log_kept: torch.Tensor  # [n, T] log S, the mass truncated sampling keeps under this recipe (0 without truncation)
    seconds: float
    """wall time of laying the model out for the recipe and scoring."""
    logp_alone: torch.Tensor | None = None  # [n, T] the `alone_rows` scored one at a time, unpadded; 0 elsewhere
    seconds_alone: float = 0.0
    """wall time of scoring those rows alone (`score_alone`)."""
    routes: list[Routes] | None = None
    """MoE models: the experts this recipe's forward chose, per batch (where the engine's were captured)."""


@dataclass
class Reference:
    """What every recipe is compared with: both engine columns and the shadow (the trainer's own forward in the
    engine's dtype), which splits β into a precision part (recipe vs shadow) and a kernel part (shadow vs engine)."""

    logp_engine: torch.Tensor  # [n, T]
    logp_engine_processed: torch.Tensor  # [n, T]
    logp_shadow: torch.Tensor  # [n, T]
    shadow: str
    """the shadow's recipe name."""
    rebuilt: str | None
    """the engine column rebuilt from the shadow's log S ('logp_engine' or 'logp_engine_processed'), if any."""
    logp_plain_shadow: torch.Tensor | None = None  # [n, T] FP8 engines: the shadow without the quantisers
    logp_engine_plain: torch.Tensor | None = None  # [n, T] FP8 engines: the plain engine's log-probs of the tokens


@dataclass
class Figures:
    """The statistics of every trainer recipe against the engine, and the per-token arrays behind them."""

    kernel: dict
    """shadow against engine: the kernel part of β, the same for every recipe."""
    recipes: dict[str, dict]
    per_token: dict[str, dict[str, list]]
    knobs: dict
    """the knob advice (knobs.knob_figures) on the first trainer recipe's β, naming it."""
    fp8: dict | None = None
    """--engine-quant: the FP8 engine beside the plain engine on the same samples, and β_quant (`fp8_figures`)."""
    routing: dict | None = None
    """MoE models: the route table (`route_phase`, routing.route_figures)."""
    recorded_trainer: dict | None = None
    """--rollouts whose records carry the user's trainer's own log-probs: its β and its gap to each recipe
    (recorded.recorded_trainer)."""


def sampled_from_rollouts(rollouts: list[Rollout], pad_id: int, measured: Literal["raw", "processed"] | None,
                          info: dict, seconds: float, trained: list[torch.Tensor | None] | None = None,
                          **extra) -> Sampled:
    """An engine's batches (sampled, or read from a rollout file) packed for scoring, as one `Sampled`: the mask and
    both engine columns as [n, T] tensors, and the sampled tokens without a finite log-prob in either counted.
    `measured`: the column the engine computed (None: both); `trained`: per batch, the completion tokens the policy
    sampled ([B_i, T_i] bool, rollouts.Batches.trained; None: all), the others kept as context and never scored;
    `extra`: Sampled's optional fields."""
    packed = [r.pack(pad_id) for r in rollouts]
    for p, keep in zip(packed, trained or []):
        if keep is not None:
            p["completion_mask"] &= keep  # [B_i, T_i]: context tokens stay in the input, out of every figure
    mask = concat_batches([p["completion_mask"] for p in packed])  # [n, T]
    logp_engine = concat_batches([p["logp_engine"] for p in packed])  # [n, T]
    logp_engine_processed = concat_batches([p["logp_engine_processed"] for p in packed])  # [n, T]
    nonfinite = mask & ~torch.isfinite(logp_engine) & ~torch.isfinite(logp_engine_processed)  # [n, T]
    return Sampled(packed=packed, mask=mask, logp_engine=logp_engine, logp_engine_processed=logp_engine_processed,
                   measured=measured, nonfinite=int(nonfinite.sum()), info=info, seconds=seconds, **extra)


def concat_batches(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Stack [B_i, T_i] batches into one [ΣB_i, max T_i] tensor, right-padding with zeros."""
    T = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, T - t.shape[1])) for t in tensors])
