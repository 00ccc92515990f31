"""β and the trust region inside slime (and miles, its fork with the same hooks), from the log-probs slime holds.

slime (THUDM/slime, commit 624b824a898ab0ec1fcb4d373004c7f3852bf515) offers two hooks, each a dotted path that
`slime.utils.misc.load_function` imports (module path, then the attribute):

- `--custom-tis-function-path phantomclip.integrations.slime.tis_function`: slime's `policy_loss_function`
  (slime/backends/megatron_utils/loss.py) calls it, with `--use-tis` or `--get-mismatch-metrics`, in every training
  rank and micro-batch, as `tis_func(args=, pg_loss=, train_log_probs=, rollout_log_probs=, loss_masks=,
  total_lengths=, response_lengths=)`: pg_loss is the clipped per-token loss of the micro-batch, concatenated over
  its samples ([ΣT]); train_log_probs, rollout_log_probs and loss_masks are lists, one 1-D tensor per sample (this
  rank's context-parallel share of it). It returns (pg_loss, the loss masks to use, metrics), each metric a
  per-token tensor shaped like pg_loss that slime reduces itself (`sum_of_sample_mean` over the pre-RS masks: a mean
  per sample, then over samples, across data- and context-parallel ranks). `tis_function` hands every argument to
  the TIS function the user would otherwise run (slime's `vanilla_tis_function`, or the dotted path in
  PHANTOMCLIP_SLIME_TIS_DELEGATE) and returns its loss and masks as they are; it only adds `phantomclip/*` metrics.
- `--custom-rollout-log-function-path phantomclip.integrations.slime.log_rollout`: slime/observability/
  rollout_metrics.py `log_rollout_data` calls it as `(rollout_id, args, samples, rollout_extra_metrics,
  rollout_time)` before its own logging, which runs unless it returns True. It runs once per rollout in the one
  RolloutManager actor (slime/ray/rollout.py `generate`), with the rollout's samples flattened; with
  PHANTOMCLIP_SLIME_ROLLOUTS_DIR set it also writes them as the rollout file TRL's RolloutRecorder writes
  (`record_rollout`), which `diagnose --rollouts` and its post-mortem read.

What the figures hold. train_log_probs are the actor's recompute at the sampling weights when slime made one
(batch["log_probs"]: the default, without `--use-rollout-logprobs`), so β = train − rollout is the mismatch alone,
exact per token. Without that recompute slime passes the current policy's log-probs (loss.py: "if not
train_log_probs_for_tis: ... log_probs"), and the figure is α + β (α = 0 on a step's first micro-batch only).
The TIS hook is given neither the advantages nor the current log-probs, so it cannot split a clip into α's and
β's: it gives the share of tokens whose β alone is outside the trust region, which with `--use-rollout-logprobs`
(the clip on π/μ) is where the clip reaches at α = 0. docs/slime.md: the flags, what runs where, each figure.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
from datetime import datetime, timezone
from pathlib import Path

import torch

from ..base.errors import IntegrationError
from ..maths.metrics import LOW_P, trust_region_split
from ..rollouts.record import EngineInfo, Header, RecordedSampling, RecordError, write_records
from ..rollouts.slime_dumps import slime_record

SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
"""the slime commit the hooks' signatures were read at (THUDM/slime, 2026-08-21)."""
MILES_COMMIT = "31f1ca961a94cb860cec3b2dea34ec332bfa8f76"
"""the miles commit read beside it (radixark/miles, 2026-08-21): the same two hooks and signatures
(miles/backends/training_utils/loss_hub/losses.py passes two more keyword arguments, parallel_state and max_seq_lens,
which tis_function hands on; miles/ray/rollout/metrics.py log_rollout_data), its own module paths."""
DEFAULT_DELEGATES = {"slime": "slime.backends.megatron_utils.loss.vanilla_tis_function",
                     "miles": "miles.backends.training_utils.loss_hub.corrections.vanilla_tis_function"}
"""each framework's own TIS function, the one it runs without --custom-tis-function-path."""
LOGGERS = {"slime": ("slime.observability.logging_utils", "slime.observability.metric_utils"),
           "miles": ("miles.utils.tracking_utils.tracking", "miles.utils.metric_utils")}
"""where each framework's rollout logging finds `log(args, metrics, step_key)` and `compute_rollout_step(args,
rollout_id)` (slime/observability/rollout_metrics.py, miles/ray/rollout/metrics.py)."""
DELEGATE_ENV = "PHANTOMCLIP_SLIME_TIS_DELEGATE"
"""the dotted path of the TIS function to delegate to when it is not slime's vanilla one (e.g. slime's
`slime.backends.megatron_utils.loss.icepop_function` or examples.train_infer_mismatch_helper.mis's)."""
ROLLOUTS_ENV = "PHANTOMCLIP_SLIME_ROLLOUTS_DIR"
"""a directory: `log_rollout` writes each rollout there as a rollout file, `step-{rollout_id:06d}.jsonl` (unset: no
file). One process writes it (slime's RolloutManager), so the name has no rank, as AsyncRolloutRecorder's."""
_PREFIX = "phantomclip/"


def framework() -> str:
    """'slime' or 'miles': the one installed (slime first; the PyPI package named "slime" is another project, so
    slime is recognised by its training backend), or one line saying neither is."""
    for name, probe in (("slime", "slime.backends.megatron_utils"), ("miles", "miles.backends.training_utils")):
        try:
            if importlib.util.find_spec(probe) is not None:
                return name
        except (ImportError, ValueError):  # a parent that is another package, or a module without a spec
            continue
    raise IntegrationError("neither slime nor miles is importable here: run inside the training job's environment, "
                           f"or name the TIS function to apply in {DELEGATE_ENV}")


def _delegate():
    """The TIS function the user's run would call, imported as slime's load_function imports a path."""
    path = os.environ.get(DELEGATE_ENV) or DEFAULT_DELEGATES[framework()]
    module, _, name = path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        raise IntegrationError(f"{DELEGATE_ENV}={path!r} could not be imported: give the dotted path of the TIS "
                               f"function to apply (slime's own is {DEFAULT_DELEGATES['slime']})") from None
    if fn is tis_function:
        raise IntegrationError(f"{DELEGATE_ENV} names phantomclip's own tis_function: name the TIS function it "
                               "should hand the loss to")
    return fn


def beta_token_metrics(train_log_probs: list[torch.Tensor], rollout_log_probs: list[torch.Tensor],
                       loss_masks: list[torch.Tensor], masks_after: list[torch.Tensor], eps_low: float,
                       eps_high: float) -> dict[str, torch.Tensor]:
    """Per-token `phantomclip/*` tensors ([ΣT], the samples concatenated, slime's layout for pg_loss):

    beta                      train − rollout (fp32, as slime computes its own tis)
    beta_abs                  |β|
    beta_outside_trust_region 1 where β < log(1 − ε_low) or β > log(1 + ε_high), else 0
    rs_removed                1 where the TIS function's masks dropped a token the loss masks held (rejection)

    slime averages each over a sample's masked tokens, then over samples (its per-sample convention)."""
    train = torch.cat(train_log_probs, dim=0).detach()  # [ΣT]
    rollout = torch.cat(rollout_log_probs, dim=0).detach()  # [ΣT]
    beta = train - rollout  # [ΣT]
    below, above = trust_region_split(beta, eps_low, eps_high)  # [ΣT] each
    before = torch.cat(loss_masks, dim=0).bool()  # [ΣT]
    after = torch.cat(masks_after, dim=0).bool()  # [ΣT]
    return {f"{_PREFIX}beta": beta, f"{_PREFIX}beta_abs": beta.abs(), f"{_PREFIX}beta_outside_trust_region":
            (below | above).to(beta.dtype), f"{_PREFIX}rs_removed": (before & ~after).to(beta.dtype)}


def tis_function(args, *, pg_loss: torch.Tensor, train_log_probs: list[torch.Tensor],
                 rollout_log_probs: list[torch.Tensor], loss_masks: list[torch.Tensor], **kwargs):
    """slime's --custom-tis-function-path hook: the user's TIS function's (pg_loss, masks, metrics), unchanged, plus
    `beta_token_metrics` under phantomclip/*. The trust region is slime's clip: args.eps_clip, and
    args.eps_clip_high (slime falls back to eps_clip when it is None, utils/arguments.py)."""
    out_loss, out_masks, metrics = _delegate()(args=args, pg_loss=pg_loss, train_log_probs=train_log_probs,
                                               rollout_log_probs=rollout_log_probs, loss_masks=loss_masks, **kwargs)
    eps_high = args.eps_clip_high if getattr(args, "eps_clip_high", None) is not None else args.eps_clip
    with torch.no_grad():
        ours = beta_token_metrics(train_log_probs, rollout_log_probs, loss_masks, out_masks, args.eps_clip, eps_high)
    return out_loss, out_masks, {**metrics, **ours}


def rollout_figures(samples) -> dict[str, float]:
    """`phantomclip/rollout/*` from the engine's side alone (before any trainer forward): tokens with a log-prob,
    logp_engine_mean, and lowp_share, the share of tokens the engine sampled at probability < LOW_P (0.1), where
    β is largest (DESIGN.md section 1: up to 50x larger on low-probability tokens). Samples are slime's Sample
    objects (slime/utils/types.py: rollout_log_probs, loss_mask over the response tokens); a sample without log-probs
    is counted in samples_without_logprobs (slime's engine returns them with its log-prob option on)."""
    values, missing = [], 0
    for sample in samples:
        logp = getattr(sample, "rollout_log_probs", None)
        if not logp:
            missing += 1
            continue
        lp = torch.tensor(logp, dtype=torch.float64)  # [T]
        mask = getattr(sample, "loss_mask", None)
        if mask is not None:
            if len(mask) != len(logp):
                raise IntegrationError(f"a slime sample has {len(logp)} rollout log-probs and a loss mask of "
                                       f"{len(mask)}: they must cover the same response tokens")
            lp = lp[torch.tensor(mask, dtype=torch.bool)]
        values.append(lp)
    lp = torch.cat(values) if values else torch.zeros(0, dtype=torch.float64)  # [N]
    n = lp.numel()
    return {f"{_PREFIX}rollout/tokens": n, f"{_PREFIX}rollout/samples_without_logprobs": missing,
            f"{_PREFIX}rollout/logp_engine_mean": lp.mean().item() if n else math.nan,
            f"{_PREFIX}rollout/lowp_share": (lp.exp() < LOW_P).double().mean().item() if n else math.nan}


def _sglang_setting(args, name: str) -> str:
    """One of slime's --sglang-* settings (SGLang's own ServerArgs, prefixed: slime/backends/sglang_utils/
    arguments.py); '' where unset or 'auto' (the checkpoint's dtype, not known here)."""
    value = getattr(args, name, None)
    return "" if value is None or str(value).strip().lower() in ("", "auto", "none") else str(value)


def rollout_header(args, nucleus: bool) -> Header:
    """The rollout file's header from slime's args: the checkpoint (--hf-checkpoint), SGLang's dtype and FP8
    arguments where set (checked as diagnose reads them, recorders.check_engine, at the first rollout; an unset
    dtype is the checkpoint's and stays unset), the sampling (--rollout-temperature, --rollout-top-p, --rollout-top-k;
    slime/utils/arguments.py defaults 1.0, 1.0, -1) and which log-probs SGLang returns: over the nucleus where slime
    recorded one ('processed'), the logits before temperature with SGLANG_RETURN_ORIGINAL_LOGPROB set ('raw'),
    else after temperature over the full vocabulary ('tempered', SGLang's default; docs/rollouts.md)."""
    from .recorders import check_engine  # only when recording: it imports transformers

    dtype, quant, kv = (_sglang_setting(args, f"sglang_{k}") for k in ("dtype", "quantization", "kv_cache_dtype"))
    check_engine("slime's --sglang-* settings", dtype or "bfloat16", quant, kv)  # an unset dtype stays unset
    original = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").strip().lower() in ("1", "true")
    top_k = int(getattr(args, "rollout_top_k", -1))
    return Header(source="slime (phantomclip log_rollout)", model=str(getattr(args, "hf_checkpoint", None) or ""),
                  engine=EngineInfo(name="sglang", dtype=dtype, quantization=quant, kv_cache_dtype=kv),
                  logprobs="processed" if nucleus else "raw" if original else "tempered",
                  sampling=RecordedSampling(temperature=float(getattr(args, "rollout_temperature", 1.0)),
                                            top_p=float(getattr(args, "rollout_top_p", 1.0)), top_k=max(top_k, 0)),
                  recorded_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def record_rollout(rollout_id: int, args, samples, out_dir) -> tuple[Path | None, int]:
    """One rollout's samples as the rollout file `{out_dir}/step-{rollout_id:06d}.jsonl` (rollouts/record.py, written
    atomically by write_records): per sample, as slime's dumps are read (rollouts.slime_dumps.slime_record, from
    `Sample.to_dict()`), step = rollout_id, weight_version its last engine call's. A sample without log-probs is left
    out (counted in rollout_figures), and so is one the record refuses (a positive or non-finite log-prob, no
    response), as TRL's recorder leaves out rows it cannot record. Not filled: `advantage` (slime normalises the
    rewards into advantages after this hook, in the trainer's conversion: slime/ray/rollout.py
    `_convert_samples_to_train_data`). Returns (the file, or None where no sample was recorded; samples refused)."""
    from .recorders import check_out_dir

    check_out_dir(ROLLOUTS_ENV, out_dir)
    records, refused = [], 0
    for i, sample in enumerate(samples):
        d = sample.to_dict() if hasattr(sample, "to_dict") else dict(vars(sample))
        if d.get("rollout_log_probs") is None or len(d["rollout_log_probs"]) == 0:
            continue
        try:
            records.append(slime_record(d, f"rollout {rollout_id} sample {i}", int(rollout_id)))
        except RecordError:
            refused += 1
    if not records:
        return None, refused
    header = rollout_header(args, nucleus=any(r.nucleus is not None for r in records))
    path = Path(out_dir) / f"step-{int(rollout_id):06d}.jsonl"
    write_records(path, header, records)
    return path, refused


def log_rollout(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool:
    """slime's --custom-rollout-log-function-path hook; returns False, so slime's own logging runs after it.

    With a metrics dict from the rollout function, `rollout_figures` go into it and slime's logging writes them
    with its own (rollout_metrics.py: `log_dict = {**(rollout_extra_metrics or {})}`). Without one (None, the
    default of RolloutFnTrainOutput.metrics, slime/rollout/base_types.py), they are written the way slime writes its
    own: `log(args, figures, step_key="rollout/step")` at `compute_rollout_step(args, rollout_id)`, from the modules
    LOGGERS names for the framework installed. With ROLLOUTS_ENV set, the rollout is written first
    (`record_rollout`), and samples_not_recorded counts those with log-probs the record refused."""
    figures = rollout_figures(samples)
    if os.environ.get(ROLLOUTS_ENV):
        _, refused = record_rollout(rollout_id, args, samples, os.environ[ROLLOUTS_ENV])
        figures[f"{_PREFIX}rollout/samples_not_recorded"] = refused
    if isinstance(rollout_extra_metrics, dict):
        rollout_extra_metrics.update(figures)
        return False
    logger, steps = (importlib.import_module(m) for m in LOGGERS[framework()])
    step = steps.compute_rollout_step(args, rollout_id)
    logger.log(args, {**figures, "rollout/step": step}, step_key="rollout/step")
    return False
