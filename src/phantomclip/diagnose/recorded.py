"""`diagnose --rollouts FILE`: the tokens a real engine sampled, and the log-probs it gave them, measured in place of
phantomclip's own sampling (docs/rollouts.md).

The file says what it can of the engine and the sampling (rollouts.Header); those settings replace the flags', since
they are what happened (`recorded_config`). The records become the same `Sampled` the engines' samples become
(`read_sampled`), after every record has passed its checks, and from there every recipe, split, table, answer and gate
runs unchanged. One check needs the model's own log-probs: a record of another checkpoint (`check_belongs`), made on
the first recipe scored, before the others.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass

import torch

from ..base.files import printable
from ..base.numerics import dtype_name, parse_dtype
from ..maths.metrics import mean_or_nan, mismatch_stats, phantom_clip_mask, quantile_or_nan
from ..models.load import LoadedModel
from ..precision.fp8_vllm import PLAIN, QUANT_NAMES
from ..precision.recipes import engine_quants
from ..rollouts.batches import ModelShape, pack_records, records_from_rollout
from ..rollouts.readers import evaluation_files, read_rollouts, rollout_dumps_beside_train_dumps
from ..rollouts.record import Header, RecordedSampling, RecordError
from ..routing.routes import EXPERT_KEYS, routers
from .config import DiagnoseConfig
from .records import Sampled, concat_batches, sampled_from_rollouts

RECORD_MISMATCH = 0.5
"""a record whose median |β| against the engine-dtype shadow exceeds this (in nats) was not sampled from this
checkpoint: matched weights give a median |β| of 0.01-0.03 in bf16 and a mean of about 0.19 with an FP8 engine
(docs/results.md), so 0.5 is over 15x the bf16 median and 2.5x the FP8 mean, while another checkpoint, model or chat
template moves most tokens by a nat or more. A median, so a few tokens far out (low-probability ones, β's heavy tail)
cannot trip it."""
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_topk")
"""where a transformers MoE config keeps k, the experts per token."""
@dataclass(frozen=True)
class Peeked:
    """What the file says before its records are read: the header and the first record's log-prob kind and
    sampling (the run's; `pack_records` holds every other record to them)."""

    header: Header
    logprobs: str
    sampling: RecordedSampling | None
    nucleus: bool = False
    """the first record carries the engine's top-p nucleus (slime's rollout_top_p_token_ids)."""


def peek(path: str) -> Peeked:
    """The header and the first record's settings, reading one record."""
    header, records = read_rollouts(path)
    first = next(records, None)
    if first is None:
        raise RecordError(f"{path}: holds no record: nothing to measure")
    r = first.record
    return Peeked(header=header, logprobs=r.logprobs or header.logprobs, sampling=r.sampling or header.sampling,
                  nucleus=r.nucleus is not None)


RECORDED_FLAGS = ("engine_dtype", "engine_quant", "logprobs_mode", "temperature", "top_p", "top_k", "min_p")
"""the settings a rollout file may record and a user may type: a typed one fills what the file did not record, and
must agree with what it did (`contradiction`)."""


def contradiction(cfg: DiagnoseConfig, key: str, typed: str, recorded: str) -> RecordError:
    """The one refusal of a typed flag that the file contradicts, naming both: the flag and its value, the file and
    its field and value (`recorded`, 'engine.dtype \'bfloat16\''). What the file recorded is what happened; a flag
    that says otherwise is a slip, never dropped without a word."""
    flag = "--" + key.replace("_", "-")
    return RecordError(f"{flag} {typed}: {printable(cfg.rollouts)} records {recorded}, the setting its tokens were "
                       "sampled with; drop the flag")


def recorded_config(cfg: DiagnoseConfig, peeked: Peeked) -> tuple[DiagnoseConfig, list[str]]:
    """The config with what the file recorded in place of the flags (engine dtype, FP8 quantisers, sampling, which
    log-probs), and a note for each setting the file did not record. A flag the user typed (cfg.typed_flags) fills a
    setting the file did not record and must equal one it did (`contradiction`). 'raw' log-probs are of the
    temperature-1, full-vocabulary distribution whatever the sampling was, so they are measured at temperature 1
    without truncation unless the sampling was exactly that; 'tempered' ones are the full vocabulary at the
    sampling's temperature, the column diagnose calls logp_engine ('raw' in its --logprobs-mode), and 'processed'
    ones the renormalised column."""
    engine, notes, typed = peeked.header.engine, [], set(cfg.typed_flags)
    evals = evaluation_files(cfg.rollouts) if os.path.isdir(cfg.rollouts) else []
    if evals:
        notes.append(f"left out {len(evals)} evaluation dump(s) ({', '.join(printable(p.name) for p in evals[:3])}"
                     f"{', ...' if len(evals) > 3 else ''}): another sampling than the training steps'; diagnose one "
                     "on its own with --rollouts FILE")
    beside = rollout_dumps_beside_train_dumps(cfg.rollouts) if os.path.isdir(cfg.rollouts) else []
    if beside:
        notes.append(f"left out {len(beside)} --save-debug-rollout-data dump(s): the train-data dumps beside them "
                     "hold the same samples with the trainer's log-probs; diagnose one on its own with --rollouts FILE")
    change = {"logprobs_mode": "processed" if peeked.logprobs == "processed" else "raw"}
    if "logprobs_mode" in typed and cfg.logprobs_mode != change["logprobs_mode"]:
        raise contradiction(cfg, "logprobs_mode", cfg.logprobs_mode, f"logprobs {peeked.logprobs!r}")
    if engine.dtype:
        try:
            change["engine_dtype"] = dtype_name(parse_dtype(engine.dtype))
        except ValueError:
            raise RecordError(f"{printable(cfg.rollouts)}: engine.dtype {engine.dtype!r}: use bfloat16, float16 or "
                              "float32 (the dtype the engine computed in)") from None
        if "engine_dtype" in typed and dtype_name(parse_dtype(cfg.engine_dtype)) != change["engine_dtype"]:
            raise contradiction(cfg, "engine_dtype", cfg.engine_dtype, f"engine.dtype {engine.dtype!r}")
    else:
        notes.append(f"the engine's dtype is not recorded: the shadow is {cfg.engine_dtype} (--engine-dtype)")
    quants = [q for q in (_quant(cfg.rollouts, arg, getattr(engine, arg)) for arg in QUANT_NAMES) if q]
    if any(getattr(engine, arg) for arg in QUANT_NAMES):
        if "engine_quant" in typed and set(engine_quants(cfg.engine_quant)) != set(quants):
            said = ", ".join(f"engine.{arg} {getattr(engine, arg)!r}" for arg in QUANT_NAMES if getattr(engine, arg))
            raise contradiction(cfg, "engine_quant", cfg.engine_quant or "''", said)
        change["engine_quant"] = ",".join(quants)
    elif cfg.engine_quant:  # typed (the default is none): the file says nothing of FP8
        notes.append(f"the engine's FP8 arguments are not recorded: measured with --engine-quant {cfg.engine_quant}")
    s = recorded_sampling(cfg, peeked, notes)
    if peeked.nucleus and s.top_p >= 1:
        raise RecordError(f"{cfg.rollouts}: its records carry the engine's top-p nucleus (slime's "
                          "rollout_top_p_token_ids), so their log-probs are renormalised over it: give the run's "
                          "--top-p (slime's --rollout-top-p) and --temperature (--rollout-temperature)")
    if peeked.nucleus:
        notes.append("log-probs renormalised over the nucleus the engine recorded, on the trainer's side too, as "
                     "slime's trainer computes them")
    if peeked.logprobs == "raw" and s != RecordedSampling(top_p=s.top_p, top_k=s.top_k, min_p=s.min_p):
        notes.append(f"raw log-probs are of the temperature-1 distribution: measured at temperature 1, not the "
                     f"sampling's {s.temperature:g}, over the full vocabulary")
        s = RecordedSampling()
    change.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p)
    return dataclasses.replace(cfg, **change), notes


SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p")
"""the sampling settings a file may record and a user may type."""


def recorded_sampling(cfg: DiagnoseConfig, peeked: Peeked, notes: list[str]) -> RecordedSampling:
    """The sampling the tokens were drawn with: the file's; where it has none, the flags typed (cfg.typed_flags,
    noted); a typed flag that contradicts the file is refused, and 'tempered' or 'processed' log-probs with neither
    are refused (their distribution depends on the sampling)."""
    given = {k: getattr(cfg, k) for k in cfg.typed_flags if k in SAMPLING_FLAGS}
    s = peeked.sampling
    if s is not None:
        for key, value in given.items():
            if value != getattr(s, key):
                raise contradiction(cfg, key, f"{value:g}", f"{key} {getattr(s, key):g}")
        return s
    if given:
        notes.append("the sampling settings are not recorded: measured at the flags' "
                     + ", ".join(f"{k} {getattr(cfg, k):g}" for k in SAMPLING_FLAGS))
        return RecordedSampling(**{k: getattr(cfg, k) for k in SAMPLING_FLAGS})
    if peeked.logprobs != "raw":
        raise RecordError(f"{cfg.rollouts}: {peeked.logprobs} log-probs without their sampling settings: give the "
                          "run's --temperature (and --top-p, --top-k, --min-p where it truncated), or record them in "
                          "the file's header ('sampling')")
    notes.append("the sampling settings are not recorded: raw log-probs are measured at temperature 1 over the full "
                 "vocabulary, as they are defined")
    return RecordedSampling()


def _quant(path: str, arg: str, value: str) -> str:
    """phantomclip's FP8 quantiser for vLLM's `arg`=`value`; '' for none; RecordError for one it does not emulate."""
    key = (value or "").strip().lower()
    if key in PLAIN:
        return ""
    if key not in QUANT_NAMES[arg]:
        raise RecordError(f"{path}: engine.{arg} {value!r} is not one phantomclip emulates (it knows "
                          f"{', '.join(QUANT_NAMES[arg])}), so its β_quant cannot be split off; remove the field from "
                          "the header to measure β against the shadow without quantisers")
    return QUANT_NAMES[arg][key]


def record_shape(lm: LoadedModel) -> ModelShape:
    """The checkpoint's vocabulary, context and MoE routing, which every record is checked against."""
    model = lm.model
    moe = None
    found = routers(model) if any(getattr(model.config, k, None) for k in EXPERT_KEYS) else []
    if found:
        experts = next(int(getattr(model.config, k)) for k in EXPERT_KEYS if getattr(model.config, k, None))
        k = next(int(getattr(model.config, key)) for key in TOP_K_KEYS if getattr(model.config, key, None))
        moe = (len(found), experts, k)
    return ModelShape(vocab=model.get_input_embeddings().weight.shape[0], context=lm.context_length, moe=moe)


def read_sampled(cfg: DiagnoseConfig, lm: LoadedModel) -> Sampled:
    """Every record of cfg.rollouts but the canary's (at most cfg.n; 0: all), checked and packed in batches of
    cfg.batch_size, as the `Sampled` an engine's samples become; its `info` names the engine as recorded."""
    t0 = time.perf_counter()
    header, records = read_rollouts(cfg.rollouts_part or cfg.rollouts)
    records = (r for r in records if not r.record.canary)  # the probe is read on its own (diagnose/canary.py)
    if cfg.rollouts_step is not None:
        records = (r for r in records if record_step(r.record) == cfg.rollouts_step)
    batches = pack_records(records, header, record_shape(lm), cfg.batch_size, cfg.n)
    info = {**engine_info(cfg, header, len(batches.steps)), "logprobs": batches.logprobs}
    measured = cfg.logprobs_mode if cfg.sampling(0).truncated else None  # as diagnose.measured_column
    sampled = sampled_from_rollouts(batches.rollouts, lm.tokenizer.pad_token_id, measured, info,
                                    time.perf_counter() - t0, trained=batches.trained, routes=batches.routes,
                                    recorded=batches)
    batches.rollouts = []  # packed: their token and log-prob lists (60-110 bytes a token) are not kept to the end
    return sampled


def record_step(r) -> int | None:
    """A record's step, or its weight version where it has no step (what a post-mortem groups by)."""
    return r.step if r.step is not None else r.weight_version


def phantom_shares(recipes: dict[str, dict], logp: dict[str, torch.Tensor], logp_engine: torch.Tensor,
                   mask: torch.Tensor, sampled: Sampled, eps: tuple[float, float]) -> None:
    """Where every record carries its advantage: each recipe's `phantom_share_at_alpha0`, the share of its tokens
    whose PPO clip fires on β alone (metrics.phantom_clip_mask with each sequence's advantage on its tokens)."""
    adv = sampled.recorded.advantages if sampled.recorded is not None else []
    if not adv or any(a is None for a in adv):
        return
    advantages = torch.tensor(adv, dtype=torch.float64)[:, None].expand(mask.shape)  # [n, T]
    for name, lp in logp.items():
        beta = (lp - logp_engine).double()  # [n, T]
        ok = mask & torch.isfinite(beta)  # [n, T]
        clipped = phantom_clip_mask(beta[ok], advantages[ok], *eps)  # [N]
        recipes[name]["phantom_share_at_alpha0"] = mean_or_nan(clipped.double())


RECORDED_BETA_KEYS = ("tokens", "beta_mean", "beta_abs_mean", "beta_abs_p99", "beta_abs_max", "outside_trust_region")
"""the figures of β as the user's trainer computed it (`recorded_trainer`), as each recipe's of the same name."""


def recorded_trainer(cfg: DiagnoseConfig, sampled: Sampled,
                     pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict | None:
    """Where records carry the user's trainer's own log-probs (Record.logp_trainer_recorded: slime's
    --save-debug-train-data): β as that trainer computed it (its log-probs − the engine's, on the same loss-mask
    tokens, with this run's trust region), and per recipe the gap Δ = theirs − our re-score of that recipe in the
    engine's column (`pairs`: recipe -> (ours, the engine's) [n, T], job.measured_pair): what their machine's kernels
    and precision give that this machine's recipe does not. None where no record carries them."""
    grids = sampled.recorded.logp_trainer_recorded if sampled.recorded is not None else None
    if grids is None:
        return None
    theirs = concat_batches([g if g is not None else torch.full(p["input_ids"].shape, math.nan, dtype=torch.float64,
                                                                 device=p["input_ids"].device)
                             for g, p in zip(grids, sampled.packed)])  # [n, T] float64, NaN: not recorded
    engine = next(iter(pairs.values()))[1].double()  # [n, T] the column the engine recorded, the same for every recipe
    have = sampled.mask & torch.isfinite(theirs) & torch.isfinite(engine)  # [n, T]
    stats = mismatch_stats(theirs, engine, have, cfg.epsilon, cfg.epsilon_high, cfg.seq_mask_cap)
    gaps = {}
    for name, (ours, _) in pairs.items():
        ok = have & torch.isfinite(ours)  # [n, T]
        delta = (theirs - ours.double())[ok]  # [N]
        gaps[name] = {"tokens": int(ok.sum()), "mean": mean_or_nan(delta), "abs_mean": mean_or_nan(delta.abs()),
                      "abs_max": delta.abs().max().item() if delta.numel() else math.nan}
    return {"source": sampled.info.get("source", ""), "tokens_of_run": int(sampled.mask.sum()),
            "beta": {k: stats[k] for k in RECORDED_BETA_KEYS}, "gap": gaps}


def engine_info(cfg: DiagnoseConfig, header: Header, sequences: int) -> dict:
    """The engine as the file recorded it, in the keys every engine's describe() has ('kind', 'dtype') and the
    record's own."""
    e = header.engine
    return {"kind": "recorded", "name": e.name or "an unnamed engine", "version": e.version, "dtype": cfg.engine_dtype,
            "logprobs_mode": cfg.logprobs_mode, "quantization": e.quantization, "kv_cache_dtype": e.kv_cache_dtype,
            "device": e.device, "source": header.source, "model": header.model, "recorded_at": header.recorded_at,
            "file": cfg.rollouts, "sequences_read": sequences, "startup_seconds": 0.0, "notes": cfg.recorded_notes}


def check_belongs(cfg: DiagnoseConfig, logp_shadow: torch.Tensor, logp_engine: torch.Tensor, mask: torch.Tensor,
                  shadow: str) -> None:
    """Refuse (RecordError) records whose median |β| against the shadow exceeds RECORD_MISMATCH: they were not
    sampled from this checkpoint (or not at the recorded temperature), so nothing they give is a mismatch."""
    ok = mask & torch.isfinite(logp_engine) & torch.isfinite(logp_shadow)  # [n, T]
    median = quantile_or_nan((logp_shadow - logp_engine)[ok].abs().double(), 0.5)
    if median > RECORD_MISMATCH:
        raise RecordError(
            f"{cfg.rollouts}: median |β| {median:.3f} over {int(ok.sum())} tokens against the {shadow} shadow of "
            f"{cfg.model}, far above any precision gap (> {RECORD_MISMATCH:g}; matched weights give 0.01-0.03): these "
            "tokens were not sampled from this checkpoint (another step's weights, another model or chat template), "
            "or not at the recorded temperature; give the checkpoint that sampled them")


def save_rollouts(cfg: DiagnoseConfig, prep, rollouts: list, routes: list | None, info: dict) -> None:
    """--save-rollouts: what the engine sampled, written as a rollout file (atomically) that `diagnose --rollouts`
    measures again later, on another machine or checkpoint: the column the engine computed (vLLM's logprobs_mode;
    the local engine's processed one, exact at any temperature), the sampling, the engine and the device."""
    from datetime import datetime, timezone

    from .. import __version__
    from ..base.devices import describe_device
    from ..precision.fp8_vllm import installed_build
    from ..rollouts.record import EngineInfo, write_records

    logprobs = info.get("logprobs_mode", "processed")
    vllm_names = {quant: value for arg, names in QUANT_NAMES.items() for value, quant in names.items()
                  if value in ("fp8", "fp8_per_channel", "fp8_per_block")}
    quants = cfg.engine_recipe().quant
    build = installed_build() if info["kind"] == "vllm" else None
    engine = EngineInfo(
        name=build.package if build else "phantomclip-local", version=build.version if build else __version__,
        dtype=cfg.engine_dtype, device=describe_device(prep.device)["name"],
        quantization=next((vllm_names[q] for q in quants if q in vllm_names), ""),
        kv_cache_dtype="fp8" if "fp8-kv" in quants else "")
    s = cfg.sampling(0)
    header = Header(source="phantomclip diagnose", model=cfg.model, engine=engine, logprobs=logprobs,
                    sampling=RecordedSampling(s.temperature, s.top_p, s.top_k, s.min_p),
                    recorded_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    records = [r for i, rollout in enumerate(rollouts)
               for r in records_from_rollout(rollout, logprobs, routes[i] if routes else None)]
    write_records(cfg.save_rollouts, header, records)

