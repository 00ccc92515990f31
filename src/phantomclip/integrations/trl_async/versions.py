"""Which weight version each token of TRL's async trainer was sampled at, how many syncs later it can be trained,
and the copies of the policy kept for every version a trained token may have (integrations.trl_async).

How stale a trained sample can be, read from trl 1.16 (trl/experimental/async_grpo/async_grpo_trainer.py) and
accelerate 1.x (accelerate/data_loader.py `DataLoaderDispatcher.__iter__`):
- TRL filters staleness when a sample is *dequeued*: `RolloutQueueDataset.__iter__` drops a sample whose
  `model_version` is more than `max_staleness` behind the trainer's version at that moment.
- The main process drives the dataloader through accelerate's dispatcher (`dispatch_batches=True`), which fetches
  micro-batch j + 1 before it yields micro-batch j, and the Trainer's `get_batch_samples` takes all G
  (`gradient_accumulation_steps`) micro-batches of a step before the step trains: the fetch of micro-batch j runs in
  the fetch phase of the step that trains micro-batch j − 1.
- The planner decides when a dequeued sample joins a micro-batch. `FixedCountBatcher` (token_budget <= 0) dequeues
  exactly the samples of the micro-batch it builds. `TokenBudgetBatcher` (token_budget > 0, or None: vLLM's
  max_model_len, TRL's default) dequeues one sample too many: the one that fits in no row closes the micro-batch,
  is held across the yield, and opens the next one. A sample of micro-batch j is then dequeued while micro-batch
  j − 1 is fetched, in the fetch phase of the step that trains micro-batch j − 2.
- `_sync_weight` bumps `model_version` at train begin (version 1) and at the end of every W-th optimizer step
  (`weight_sync_steps`, `StepIntervalCallback.on_step_end`).
Micro-batch j trains at step ⌊j/G⌋, at version 1 + ⌊⌊j/G⌋/W⌋; it was dequeued c fetches earlier at most (c = 1 fixed
count, 2 token budget), during step ⌊(j − c)/G⌋. The syncs in between number at most ⌈c / (G·W)⌉, attained (j the
first micro-batch of a step that follows a sync), so a sample TRL accepts at `max_staleness` S trains at

    staleness_bound = S + ⌈c / (G·W)⌉    (S + 1 with the fixed-count planner; S + 2 with the token budget at G = W = 1)

and the integration keeps a copy for each of the bound + 1 versions a trained token may have (tests/
test_trl_async_staleness.py: both planners, 1 and 2 processes, the bound reached and never passed).
"""

from __future__ import annotations

import math
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

from ...base.errors import IntegrationError
from ..weights import build_shadow, check_supported, full_weights, sharded_root

VERSION_KEY = "pc_sample_version"
"""the batch field the integration adds: each row's samples' versions, in `segment_id` order, −1 padded."""

PLANNER_FETCHES = {"fixed_count": 1, "token_budget": 2}
"""planner -> how many micro-batch fetches before its own a sample may be dequeued (c above, counting its own)."""


def planner_of(args) -> str:
    """The planner TRL's get_train_dataloader picks (async_grpo_trainer.py lines 1437-1448): the token budget when
    `token_budget` > 0 or None (filled from the server's max_model_len, always > 0), else the fixed count."""
    return "token_budget" if args.token_budget is None or args.token_budget > 0 else "fixed_count"


def staleness_bound(args) -> int:
    """The largest staleness at the loss (trained version − sample version) TRL 1.16's flow allows (module doc). A
    max_staleness below 0 or a step count below 1 is refused (IntegrationError naming the field): -3 gave a bound of
    -1, a staleness no token has."""
    from ...base.errors import check_number

    check_number("staleness_bound: max_staleness", args.max_staleness, 0, integer=True, error=IntegrationError)
    for name in ("gradient_accumulation_steps", "weight_sync_steps"):
        check_number(f"staleness_bound: {name}", getattr(args, name), 1, integer=True, error=IntegrationError)
    steps = args.gradient_accumulation_steps * args.weight_sync_steps
    return args.max_staleness - (-PLANNER_FETCHES[planner_of(args)] // steps)  # S + ⌈c / (G·W)⌉ in integers


def kept_versions(args) -> int:
    """Copies kept per dtype: one per version a trained token may have (staleness 0 .. staleness_bound)."""
    return staleness_bound(args) + 1


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class VersionCopies:
    """Copies of the policy in one dtype keyed by the weight version TRL sent the server (`kept_versions` of them, the
    oldest recycled), and a copy of the current weights when they have moved since the last sync. `score` turns a
    copy and a packed row's forward arguments into the row's log-probs [1, N] (trl_async.forward)."""

    def __init__(self, trainer, dtype: str, matmul: str, score):
        from trl.trainer.utils import add_fused_lm_head

        self.trainer, self.dtype, self.matmul, self.score = trainer, dtype, matmul, score
        self.kind = check_supported(sharded_root(trainer.model))
        self.keep = kept_versions(trainer.args)
        self.versions: dict[int, nn.Module] = {}
        self.version_step: dict[int, int] = {}
        self.current: nn.Module | None = None
        self.current_step = -1
        self._add_head = lambda m: add_fused_lm_head(m, temperature=trainer.temperature)
        self.build_seconds = 0.0
        self.missing_named: set[int] = set()

    def _new(self) -> nn.Module:
        t0 = time.perf_counter()
        copy = build_shadow(sharded_root(self.trainer.model), self.dtype, self.trainer.accelerator.device,
                            self.matmul)
        self._add_head(copy)
        self.build_seconds += time.perf_counter() - t0  # once per kept copy, then recycled
        return copy.eval()

    def snapshot(self, version: int) -> None:
        """The weights just sent as `version` (every rank, in step: a sharded model's gather is a collective)."""
        reuse = self.versions.pop(min(self.versions)) if len(self.versions) >= self.keep else self._new()
        self._fill(reuse)
        self.versions[version] = reuse
        self.version_step[version] = self.trainer.state.global_step

    @torch.no_grad()
    def _fill(self, copy: nn.Module) -> None:
        """The trainer's full weights copied into `copy`, each tensor rounded to nearest into its dtype by copy_ (as
        vLLM's load does), every parameter known and filled, in place: no buffer allocated past the copy's own.
        weights.sync_shadow also counts the changed values: a second pass over every weight (18.2 of the 43.6 s
        that 5 syncs took in a 4-step cProfile run on the bundled model, 2-core EPYC under load) no figure reads."""
        params = dict(copy.named_parameters())
        filled = set()
        for name, value in full_weights(sharded_root(self.trainer.model), self.kind):
            p = params.get(name)
            if p is None:
                raise IntegrationError(f"the shadow has no parameter {name!r} (a module the engine's model lacks): "
                                       "the async monitor supports models whose trained parameters are the base "
                                       "model's")
            p.copy_(value)
            filled.add(name)
        if len(filled) != len(params):
            missing = sorted(set(params) - filled)
            raise IntegrationError(f"the trainer's model has no parameter for {missing[0]!r} of the shadow "
                                   f"({len(missing)} missing): its weights cannot be mirrored")

    def now(self, latest: int) -> nn.Module:
        """The current weights in this dtype: version `latest`'s copy if no optimizer step came since its sync."""
        step = self.trainer.state.global_step
        if latest in self.versions and self.version_step[latest] == step:
            return self.versions[latest]
        if self.current is None:
            self.current = self._new()
        if self.current_step != step:
            self._fill(self.current)
            self.current_step = step
        return self.current

    def score_tokens(self, kwargs: dict, token_index: torch.Tensor, versions: torch.Tensor, latest: int,
                     need_now: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """(now_row [1, N], now [M], old [M]): the row scored at the current weights, each token's log-prob at the
        current weights and at its sample's version (NaN where that version has no copy: named once, in a
        warning). One forward per version present, none twice; without `need_now` (the trainer ratio, whose
        current side is the loss's own forward) the current weights are not scored: now_row and now are None."""
        current = self.now(latest) if need_now else None
        now_row = self.score(current, kwargs) if need_now else None  # [1, N]
        now = now_row.flatten()[token_index] if need_now else None  # [M]
        old = torch.full(token_index.shape, math.nan, device=token_index.device)  # [M]
        for v in versions.unique().tolist():
            at = versions == v
            copy = self.versions.get(v)
            if copy is None:
                self._name_missing(v, int(at.sum()), latest)
                continue
            full = now_row if copy is current else self.score(copy, kwargs)
            old[at] = full.flatten()[token_index][at]
        return now_row, now, old

    def _name_missing(self, version: int, tokens: int, latest: int) -> None:
        name_missing_once(self.missing_named, version,
                          f"phantomclip: {tokens} trained tokens of weight version {version} (trained at {latest}) "
                          f"have no {self.dtype} copy (kept: {sorted(self.versions)}): they are left out of "
                          "precision/* and counted in precision/no_shadow_total, and the fix clips them against the "
                          "server's log-probs; attach before training starts to keep every version")


class TrainerVersions:
    """The weights of every version a trained token may have, as the live model holds them: for each kept version,
    a copy of each trainable parameter's local tensor (FSDP2's shard on this rank, the whole tensor without
    sharding), recycled oldest first. `score` swaps a version's tensors into the live model in place, runs the
    trainer's own forward (trl_async.forward.score_as_trl: same module, code, precision and kernels as the loss),
    and swaps the current ones back: the old side of ratio "trust-region". Frozen parameters (a LoRA model's base)
    never move, so are not copied: a LoRA model keeps copies of its adapters only.

    Memory per rank: `keep` x (trainable parameters on this rank) x their dtype's size, plus (FSDP2) one stash of the
    current shards while a version is swapped in (`bytes_per_rank`); unsharded, the parameters are pointed at a
    version's tensors and back, with no stash. `keep` is every version a trained token may
    have (kept_versions, exact) unless told fewer: the cheaper form that still keeps a trust region, on the move
    since the oldest kept version for older tokens, the move before it joining β in the capped weight.
    Layouts: one process, DDP and FSDP2 (the only
    sharding TRL 1.16's async trainer supports, async_grpo_trainer.py `__init__`); FSDP1 and ZeRO-3 refused in one
    line."""

    def __init__(self, trainer, keep: int | None = None):
        self.trainer = trainer
        exact = kept_versions(trainer.args)
        if keep is not None and not (isinstance(keep, int) and 1 <= keep <= exact):
            raise IntegrationError(f"kept_versions must be an integer from 1 to {exact} (staleness bound "
                                   f"{exact - 1} + 1: every version a trained token may have), got {keep!r}")
        self.keep = exact if keep is None else keep
        """versions kept: `exact` keeps every version a token may have; fewer keep the newest `keep` only, and a
        token of an older version is clipped against the oldest kept one (`substitute`)."""
        root = sharded_root(trainer.model)
        kind = check_supported(root)
        self.sharded = kind == "fsdp2"
        """FSDP2: a version's shards are copied into the live shards and back (FSDP2 gathers from its own storage);
        else each parameter's tensor is pointed at the version's and back (no copy, no stash)."""
        if kind not in ("none", "fsdp2"):
            raise IntegrationError(f"ratio 'trust-region' swaps kept weights into the live model, which it does for "
                                   f"one process, DDP and FSDP2, not {kind}: use FSDP2 (TRL's async trainer's layout) "
                                   "or ratio='decoupled'")
        seen, self.params = set(), []
        for p in root.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        self.versions: dict[int, list[torch.Tensor]] = {}
        self.version_step: dict[int, int] = {}
        self._stash: list[torch.Tensor] | None = None
        self.missing_named: set[int] = set()

    @staticmethod
    def _local(p: nn.Parameter) -> torch.Tensor:
        return p.to_local() if hasattr(p, "to_local") else p.data  # FSDP2: this rank's shard (a DTensor's local)

    def bytes_per_rank(self) -> int:
        """Bytes the kept versions (and, sharded, the stash) take on this rank."""
        one = sum(self._local(p).numel() * self._local(p).element_size() for p in self.params)
        return (self.keep + (1 if self.sharded else 0)) * one

    @torch.no_grad()
    def snapshot(self, version: int) -> None:
        """The weights just sent as `version` (local to each rank: no collective)."""
        reuse = self.versions.pop(min(self.versions)) if len(self.versions) >= self.keep else None
        if reuse is None:
            reuse = [self._local(p).detach().clone() for p in self.params]
        else:
            for kept, p in zip(reuse, self.params, strict=True):
                kept.copy_(self._local(p))
        self.versions[version] = reuse
        self.version_step[version] = self.trainer.state.global_step

    def substitute(self, version: int) -> int | None:
        """The oldest kept version newer than `version` (one without its own copy), or None."""
        newer = [v for v in self.versions if v > version]
        return min(newer) if newer else None

    def is_current(self, version: int) -> bool:
        """`version` is the newest kept and no optimizer step came since it was sent: its weights are the live ones
        (an older version was followed by a sync, which TRL makes after a step)."""
        return version == max(self.versions, default=None) and self.version_step[version] == \
            self.trainer.state.global_step

    @torch.no_grad()
    def score(self, model: nn.Module, kwargs: dict, version: int, score) -> torch.Tensor:
        """[1, N] score(model, kwargs) with version `version`'s weights in the live model, then the current ones
        back, bit for bit. Collective under FSDP2 (the forward gathers): every rank calls it for the same versions
        in the same order. Autocast's cache of cast weights (kept for the whole of an enclosing autocast region,
        whatever the grad mode: torch's `cached_cast`) is cleared before and after, so neither side reuses the
        other's casts."""
        kept = self.versions[version]
        if not self.sharded:
            saved = [p.data for p in self.params]
            try:
                for k, p in zip(kept, self.params, strict=True):
                    p.data = k
                torch.clear_autocast_cache()
                return score(model, kwargs)
            finally:
                for s, p in zip(saved, self.params, strict=True):
                    p.data = s
                torch.clear_autocast_cache()
        if self._stash is None:
            self._stash = [self._local(p).detach().clone() for p in self.params]
        else:
            for s, p in zip(self._stash, self.params, strict=True):
                s.copy_(self._local(p))
        try:
            for k, p in zip(kept, self.params, strict=True):
                self._local(p).copy_(k)
            _reshard(model)  # an FSDP2 module left unsharded (the root after a forward) holds the current weights
            torch.clear_autocast_cache()
            return score(model, kwargs)
        finally:
            for s, p in zip(self._stash, self.params, strict=True):
                self._local(p).copy_(s)
            _reshard(model)  # ... or, after this forward, the version's: the loss's forward gathers afresh
            torch.clear_autocast_cache()

    def _name_missing(self, version: int, tokens: int, latest: int) -> None:
        name_missing_once(self.missing_named, version,
                          f"phantomclip: {tokens} trained tokens of weight version {version} (trained at {latest}) "
                          f"have no kept weights (kept: {sorted(self.versions)}): the fix clips them against the "
                          "server's log-probs with weight 1, counted in offpolicy/no_copy_total; attach before "
                          "training starts to keep every version")


def name_missing_once(named: set[int], version: int, message: str) -> None:
    """Warn once per version whose trained tokens have no kept weights (`named`: the versions already said)."""
    if version not in named:
        named.add(version)
        warnings.warn(message, stacklevel=3)


def _reshard(model: nn.Module) -> None:
    """Free every FSDP2 module's gathered parameters, so the next forward all-gathers from the (swapped) shards
    (torch.distributed.fsdp.FSDPModule.reshard); nothing to do without FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def current_version(trainer) -> int:
    """TRL's model_version, which only the main process bumps, the same on every rank (a broadcast)."""
    version = torch.tensor([trainer.model_version if trainer.accelerator.is_main_process else 0])
    if _world() > 1:
        version = version.to(trainer.accelerator.device)
        dist.broadcast(version, src=0)
    return int(version.item())


class VersionReader:
    """The rollout queue as TRL's reader sees it; notes each sample's version on the way (main process), keyed by
    the sample's `input_ids` array, which TRL's reader passes on as is into the planner's rows (the dict it yields
    holds the same object). Per sample, not per group: a worker that tags each sample with the version its request
    was served at is honoured as such (TRL 1.16's own tags a whole group with the version at its first request:
    docs/trl.md, "Versions per request")."""

    def __init__(self, inner, versions: dict):
        self._inner, self._versions = inner, versions

    def get(self, *args, **kwargs):
        sample = self._inner.get(*args, **kwargs)
        self._versions[id(sample.input_ids)] = (sample.input_ids, int(sample.model_version))
        return sample

    def __getattr__(self, name):
        return getattr(self._inner, name)


class VersionedCollate:
    """TRL's collator, plus `pc_sample_version` [rows, samples]: the version of each sample of each row, in the
    order `TreeRow.pack` numbers them (`segment_id`), −1 padded. Entries of samples TRL dropped as stale (noted on
    the way, never collated) are forgotten once older than any sample still in the pipeline can be."""

    def __init__(self, inner, versions: dict, horizon: int):
        self._inner, self._versions, self._horizon = inner, versions, horizon

    def __call__(self, examples):
        (rows,) = examples
        batch = self._inner(examples)
        versions = [[self._pop(s) for s in row.samples] for row in rows]
        width = max(len(v) for v in versions)
        batch[VERSION_KEY] = torch.tensor([v + [-1] * (width - len(v)) for v in versions], dtype=torch.long)
        newest = max(max(v) for v in versions)
        for key in [k for k, (_, v) in self._versions.items() if v < newest - self._horizon]:
            del self._versions[key]
        return batch

    def _pop(self, sample: dict) -> int:
        entry = self._versions.pop(id(sample["input_ids"]), None)
        if entry is None:  # the reader notes every sample it hands TRL: only a reader bypassed or replaced gets here
            raise IntegrationError(f"a sample of group {sample.get('group_id')!r} reached TRL's collator without "
                                   "passing the integration's queue reader: something replaced trainer.rollout_queue "
                                   "after the monitor attached")
        return entry[1]
