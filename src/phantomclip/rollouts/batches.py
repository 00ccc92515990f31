"""Rollout records as the engines' own output: the records of one measurement checked against the checkpoint and
packed batch by batch as `Rollout`s (and `Routes` where they carry the engine's experts), and an engine's Rollout
written back as records (`diagnose --save-rollouts`). The record format itself is rollouts/record.py's."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..engines.local import Rollout
from ..routing.routes import Routes, id_dtype
from .record import Header, Located, Record, RecordedSampling, RecordError, fail


@dataclass(frozen=True)
class ModelShape:
    """What a record is checked against: the checkpoint's vocabulary and context, and its MoE routing (None: dense)."""

    vocab: int
    context: int
    moe: tuple[int, int, int] | None = None
    """(MoE layers, experts, k) of an MoE model."""


@dataclass
class Batches:
    """The records of one measurement packed as the engines' own output is (`Rollout`, batch by batch), with what
    each sequence carried beside its tokens."""

    header: Header
    rollouts: list[Rollout]
    routes: list[Routes] | None
    """per batch, the engine's routes on the packed grid, where the records carry them."""
    steps: list[int | None]
    """per sequence: its step (or, without one, its weight version)."""
    advantages: list[float | None]
    """per sequence: its recorded advantage."""
    logprobs: str
    sampling: RecordedSampling | None
    trained: list[torch.Tensor] | None = None
    """per batch, [B_i, T_i] bool on the packed grid: the completion tokens the policy sampled (Record.loss_mask 1),
    where some record marks context tokens; None: every completion token."""
    nuclei: list[torch.Tensor] | None = None
    """per batch, [B_i, T_i, K_i] int32: the recorded nucleus of each completion token (Record.nucleus), −1 padded,
    where the records carry one; None: none recorded."""
    logp_trainer_recorded: list[torch.Tensor | None] | None = None
    """per batch, [B_i, T_i] float64 on the packed grid: the user's trainer's own log-prob of each completion token
    (Record.logp_trainer_recorded), NaN where a record has none (a batch without any: None); None: no record has."""


def pack_records(records: Iterator[Located], header: Header, shape: ModelShape, batch_size: int,
                 limit: int = 0) -> Batches:
    """Every record (at most `limit` of them; 0: all) checked against the model (`check_against_model`) and against
    the first record's log-prob kind and sampling (one distribution is measured at a time), then grouped into
    batches of `batch_size` as `Rollout`s. The file is read once, as a stream; what stays is the packed token lists,
    so nothing is scored before every record has passed its checks."""
    rollouts: list[Rollout] = []
    routes: list[Routes] = []
    extras: dict[str, list[torch.Tensor]] = {"trained": [], "nuclei": [], "trainer": []}
    steps: list[int | None] = []
    advantages: list[float | None] = []
    batch: list[Record] = []
    first: tuple[str, str, RecordedSampling | None] | None = None
    has_routes = has_nucleus = None
    for located in records:
        r, where = located.record, located.where
        check_against_model(r, where, shape)
        kind = (r.logprobs or header.logprobs, r.sampling or header.sampling)
        if first is None:
            first = (where, *kind)
        elif kind != first[1:]:
            raise fail(where, f"logprobs/sampling ({kind[0]}, {kind[1]}) differ from {first[0]}'s ({first[1]}, "
                               f"{first[2]}): one run measures one sampling distribution; split the file")
        if has_routes is None:
            has_routes, has_nucleus = r.routed_experts is not None, r.nucleus is not None
        elif has_routes != (r.routed_experts is not None) or has_nucleus != (r.nucleus is not None):
            name = "routed_experts" if has_routes != (r.routed_experts is not None) else "nucleus"
            raise fail(where, f"{name} is given for some records and not others: record it for every sequence or "
                               "for none")
        steps.append(r.step if r.step is not None else r.weight_version)
        advantages.append(r.advantage)
        batch.append(r)
        if len(batch) == batch_size:
            _close_batch(batch, rollouts, routes, kind, shape, extras)
        if limit and len(steps) == limit:
            break
    if batch:
        _close_batch(batch, rollouts, routes, first[1:], shape, extras)
    if first is None:
        raise RecordError("the rollout file holds a header and no record: nothing to measure")
    logprobs, sampling = first[1:]
    return Batches(header=header, rollouts=rollouts, routes=routes if has_routes else None, steps=steps,
                   advantages=advantages, logprobs=logprobs, sampling=sampling,
                   trained=extras["trained"] if any(t is not None for t in extras["trained"]) else None,
                   nuclei=extras["nuclei"] if has_nucleus else None,
                   logp_trainer_recorded=extras["trainer"] if any(t is not None for t in extras["trainer"]) else None)


def check_against_model(r: Record, where: str, shape: ModelShape) -> None:
    """A record the checkpoint can score: its ids inside the vocabulary, prompt + completion inside the context, its
    routes of the model's MoE layers, experts and k (RecordError naming the field)."""
    for name, ids in (("prompt_ids", r.prompt_ids), ("completion_ids", r.completion_ids)):
        top = max(ids)
        if top >= shape.vocab:
            i = ids.index(top)
            raise fail(where, f"{name}[{i}] = {top} is outside the model's vocabulary ({shape.vocab} ids): these "
                               "tokens come from another tokenizer or model; give the checkpoint that sampled them")
    length = len(r.prompt_ids) + len(r.completion_ids)
    if length > shape.context:
        raise fail(where, f"prompt + completion is {length} tokens, longer than the model's context "
                           f"({shape.context}): give the checkpoint that sampled them")
    top = max((max(ids) for ids in r.nucleus or [] if ids), default=-1)
    if top >= shape.vocab:
        raise fail(where, f"nucleus names token {top}, outside the model's vocabulary ({shape.vocab} ids): give the "
                           "checkpoint that sampled these tokens")
    if r.routed_experts is None:
        return
    if shape.moe is None:
        raise fail(where, "routed_experts is given but the model has no MoE layers: give the MoE checkpoint that "
                           "sampled these tokens, or records without routes")
    layers, experts, k = shape.moe
    got = (len(r.routed_experts[0]), len(r.routed_experts[0][0]))
    if got != (layers, k):
        raise fail(where, f"routed_experts has {got[0]} layers x {got[1]} experts per position; the model routes "
                           f"{layers} MoE layers to k = {k} experts")
    top = max(max(max(layer) for layer in pos) for pos in r.routed_experts)
    if top >= experts:
        raise fail(where, f"routed_experts names expert {top}; the model has {experts} experts per layer")


def _close_batch(batch: list[Record], rollouts: list[Rollout], routes: list[Routes], kind: tuple,
                 shape: ModelShape, extras: dict[str, list]) -> None:
    """Pack the batch's records as a Rollout (and their routes, loss masks, nuclei and the trainer's recorded
    log-probs), then empty the batch."""
    rollouts.append(to_rollout(batch, *kind))
    if batch[0].routed_experts is not None:
        routes.append(routes_on_grid(batch, shape))
    extras["trained"].append(trained_on_grid(batch))
    if batch[0].nucleus is not None:
        extras["nuclei"].append(nuclei_on_grid(batch))
    extras["trainer"].append(trainer_on_grid(batch))
    batch.clear()


def _grid(records: list[Record]) -> tuple[int, int]:
    """(P, T) of the packed batch (`Rollout.pack`: prompts left-padded to P columns, completions from column P)."""
    P = max(len(r.prompt_ids) for r in records)
    return P, P + max(max(len(r.completion_ids) for r in records), 1)


def trained_on_grid(records: list[Record]) -> torch.Tensor | None:
    """[B, T] bool: True on the completion tokens whose loss_mask is 1 (every completion token of a record without
    one), False on context; None where no record marks context."""
    if all(r.loss_mask is None for r in records):
        return None
    P, T = _grid(records)
    keep = torch.zeros(len(records), T, dtype=torch.bool)  # [B, T]
    for b, r in enumerate(records):
        n = len(r.completion_ids)
        keep[b, P : P + n] = torch.tensor(r.loss_mask, dtype=torch.bool) if r.loss_mask is not None else True
    return keep


def trainer_on_grid(records: list[Record]) -> torch.Tensor | None:
    """[B, T] float64: each completion token's logp_trainer_recorded at its column, NaN elsewhere and on records
    without one; None where no record of the batch has one."""
    if all(r.logp_trainer_recorded is None for r in records):
        return None
    P, T = _grid(records)
    out = torch.full((len(records), T), math.nan, dtype=torch.float64)  # [B, T]
    for b, r in enumerate(records):
        if r.logp_trainer_recorded is not None:
            out[b, P : P + len(r.completion_ids)] = torch.tensor(r.logp_trainer_recorded, dtype=torch.float64)
    return out


def nuclei_on_grid(records: list[Record]) -> torch.Tensor:
    """[B, T, K] int32: the nucleus of the completion token at each column (−1 padded to K, the largest nucleus;
    −1 everywhere else)."""
    P, T = _grid(records)
    K = max(max((len(ids) for ids in r.nucleus), default=0) for r in records)
    out = torch.full((len(records), T, max(K, 1)), -1, dtype=torch.int32)  # [B, T, K]
    for b, r in enumerate(records):
        for t, ids in enumerate(r.nucleus):
            out[b, P + t, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return out


def to_rollout(records: list[Record], logprobs: str, sampling: RecordedSampling | None) -> Rollout:
    """The records as an engine's Rollout: the recorded log-probs in their own column, the other column NaN where it
    differs (truncation on; rebuilt from the shadow's kept mass, as for vLLM: diagnose.reference) and equal where it
    cannot (no truncation: both columns are the same numbers)."""
    truncated = sampling is not None and (sampling.top_p < 1 or sampling.top_k > 0 or sampling.min_p > 0)
    measured = [list(r.logp_engine) for r in records]
    other = [[math.nan] * len(m) for m in measured] if truncated else measured
    raw, processed = (measured, other) if logprobs == "raw" else (other, measured)
    return Rollout(prompt_ids=[r.prompt_ids for r in records], completion_ids=[r.completion_ids for r in records],
                   logp_engine=raw, logp_engine_processed=processed,
                   finished=[bool(r.finished) for r in records])


def routes_on_grid(records: list[Record], shape: ModelShape) -> Routes:
    """The records' routes on the packed batch's [B, T] grid (`Rollout.pack`: prompts left-padded to the widest, P
    columns, completions from column P): position q of a sequence with a prompt of p tokens sits at column P − p + q.
    Weights and margins are not recorded (zeros, NaN): replay recomputes the weights from the router's own logits."""
    layers, experts, k = shape.moe
    P = max(len(r.prompt_ids) for r in records)
    T = P + max(max(len(r.completion_ids) for r in records), 1)
    ids = torch.zeros(layers, len(records), T, k, dtype=id_dtype(experts))  # [layers, B, T, k]
    valid = torch.zeros(len(records), T, dtype=torch.bool)  # [B, T]
    for b, r in enumerate(records):
        start = P - len(r.prompt_ids)
        given = torch.tensor(r.routed_experts, dtype=torch.long)  # [positions, layers, k]
        cols = slice(start, start + given.shape[0])
        ids[:, b, cols] = given.permute(1, 0, 2).to(ids.dtype)  # [layers, positions, k]
        valid[b, cols] = True
    return Routes(ids=ids, weights=torch.zeros(ids.shape), margin=torch.full(ids.shape[:3], math.nan), valid=valid)


def records_from_rollout(rollout: Rollout, logprobs: str, routes: Routes | None = None,
                         step: int | None = None) -> list[Record]:
    """An engine's Rollout as records (the measured log-prob column, and the routes of each sequence's prompt +
    completion but its last position, where the engine captured them): what `diagnose --save-rollouts` writes."""
    column = rollout.logp_engine if logprobs == "raw" else rollout.logp_engine_processed
    P = rollout.prompt_width
    out = []
    for b, (prompt, completion) in enumerate(zip(rollout.prompt_ids, rollout.completion_ids)):
        given = None
        if routes is not None:
            cols = torch.arange(P - len(prompt), P + len(completion) - 1)  # [positions] every routed position
            cols = cols[routes.valid[b, cols]]
            given = routes.ids[:, b, cols].permute(1, 0, 2).long().tolist()  # [positions, layers, k]
        out.append(Record(prompt_ids=list(prompt), completion_ids=list(completion), logp_engine=list(column[b]),
                          step=step, routed_experts=given or None,
                          finished=rollout.finished[b] if rollout.finished else None))
    return out
