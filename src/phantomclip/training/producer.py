"""The rollout side of asynchronous GRPO: a producer thread that samples batches with weights `staleness` steps
old, and the weight snapshots it samples with.

Determinism: batch k is sampled with weight version max(0, k − staleness), published by the trainer after step
version − 1, with a sampling seed fixed by (seed, k); so what a batch holds never depends on thread timing.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..base.devices import clock
from ..engines.local import Engine, LocalEngine, Rollout, SamplingParams, sync_weights
from ..precision.recipes import Recipe, apply_recipe
from ..precision.scoring import score_packed
from ..routing import routes as routing
from ..routing import train as routing_train
from ..routing.routes import Routes

PROMPT_STREAM = 1_000_003
"""prompt draw of step k under seed s: random.Random(s · PROMPT_STREAM + k). A prime larger than any step count,
so two (seed, step) pairs of runs under 10^6 steps never share a draw."""

SAMPLE_STREAM = 7919
"""sampling seed of step k under seed s: s · SAMPLE_STREAM + k (the 1000th prime; streams of seeds s and s + 1
would meet only after 7919 steps, far beyond any run here)."""


def drawn_prompts(seed: int, step: int, per_step: int, pool_size: int) -> list[int]:
    """The pool indices batch `step` samples from (PROMPT_STREAM): fixed by the seed before the run starts, so the
    trainer tokenizes only the prompts its steps will draw, and the producer draws exactly those."""
    rng = random.Random(seed * PROMPT_STREAM + step)
    return [rng.randrange(pool_size) for _ in range(per_step)]


@dataclass
class Batch:
    """One rollout batch as the producer hands it over."""

    step: int
    prompts: list[str]
    rollout: Rollout
    packed: dict[str, torch.Tensor]
    """`rollout.pack(pad)`: prompts and completions in one padded batch, built once, in the producer thread."""
    weights_version: int
    """the engine sampled with θ_{weights_version}."""
    logp_old: torch.Tensor | None
    """[B, L] trainer log-probs at θ_{weights_version} (recompute-old only)."""
    generate_s: float
    logp_shadow_old: torch.Tensor | None = None
    """[B, L] the rollout's own weights θ_old, engine recipe, prefill path: the θ_old side of α and β_kernel (None at
    staleness 0, where θ_old is the current weights and the trainer's shadow serves)."""
    shadow_old_s: float = 0.0
    """seconds spent on logp_shadow_old (part of generate_s): the cost of the three-way split."""
    sync_s: float = 0.0
    """seconds the engine's weight sync took before sampling (part of generate_s; 0 when it held the version)."""
    routes: Routes | None = None
    """MoE models, local engine: the experts the engine chose as it sampled, on the packed batch's grid."""


class RolloutProducer:
    """Runs `make_batch(k, version, weights)` for k = first..last−1 in a background thread, at most
    max(1, staleness) batches ahead. Batch k waits for weights version max(0, k − staleness), which the trainer
    publishes after step version − 1: so the content of every batch is fixed by (seed, k), not by timing."""

    def __init__(self, make_batch: Callable[[int, int, dict], Batch], first: int, last: int, staleness: int):
        self.make_batch, self.first, self.last, self.staleness = make_batch, first, last, staleness
        self._weights: dict[int, dict[str, torch.Tensor]] = {}
        self._cond = threading.Condition()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, staleness))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)

    def start(self) -> RolloutProducer:
        self._thread.start()
        return self

    def publish(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        with self._cond:
            self._weights[version] = weights
            self._cond.notify_all()

    def get(self) -> Batch:
        while True:
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("the rollout producer stopped without a batch") from None
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        while self._thread.is_alive():
            try:
                self._queue.get_nowait()  # unblock a put
            except queue.Empty:
                pass
            self._thread.join(timeout=0.1)

    def _run(self) -> None:
        try:
            for k in range(self.first, self.last):
                version = max(0, k - self.staleness)
                with self._cond:
                    while version not in self._weights and not self._stop.is_set():
                        self._cond.wait(timeout=0.5)
                    if self._stop.is_set():
                        return
                    weights = self._weights[version]
                    for v in [v for v in self._weights if v < version]:
                        del self._weights[v]
                self._put(self.make_batch(k, version, weights))
        except BaseException as e:  # handed to the trainer, which re-raises it in the main thread
            self._put(e)

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                continue


def snapshot(model: nn.Module, reuse: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A detached copy of every floating-point weight (tied ones under each name), for the engine to load later.

    `reuse`: an older snapshot nobody reads any more; its buffers are overwritten instead of allocating 4 bytes
    per parameter again (fresh allocations page-fault: 0.8 s against 0.1 s for the bundled model here).
    """
    with torch.no_grad():
        if reuse is not None:
            for k, v in model.state_dict().items():
                if k in reuse:
                    reuse[k].copy_(v)
            return reuse
        return {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}


@dataclass(frozen=True)
class Sampling:
    """What the producer needs of the run's config (trainer.TrainConfig's fields of the same names)."""

    seed: int
    prompts_per_step: int
    group_size: int
    max_tokens: int
    temperature: float
    staleness: int
    matmul: str
    replay_routes: bool = False
    """--intervention r3: the θ_old forwards (logp_old, logp_shadow_old) choose the engine's experts."""


class RolloutMaker:
    """The producer thread's work for batch k: sync the engine to θ_version if it holds other weights, sample,
    and score the rollout where the trainer needs its θ_old side (all no-grad, off the trainer's thread):
    - logp_shadow_old: θ_old scored the way the shadow is (prefill, engine recipe, our kernels; the local engine's
      own model, or a copy synced beside vLLM), the θ_old side of α and of β_kernel; skipped at staleness 0, where
      θ_old = θ_t and the trainer's shadow serves;
    - logp_old: the trainer's recipe at θ_old (`old_recipe`: recompute-old only)."""

    def __init__(self, *, engine: Engine, master: nn.Module, pool: list[str], pool_ids: Mapping[int, list[int]],
                 stops: tuple[int, ...], sampling: Sampling, shadow_recipe: Recipe, old_recipe: Recipe | None):
        self.engine, self.pool, self.pool_ids, self.stops, self.sampling = engine, pool, pool_ids, stops, sampling
        self.shadow_recipe, self.old_recipe = shadow_recipe, old_recipe
        self.device = next(master.parameters()).device  # where the trainer scores the batch
        self.engine_version = -1
        # The shadow at θ_old: the local engine's own copy of θ_old is that model (same recipe, same kernels); vLLM's
        # weights live in another process, so the shadow at θ_old is a copy of its own, synced with the engine.
        stale = sampling.staleness > 0
        self.own_shadow_old = stale and not isinstance(engine, LocalEngine)
        self.shadow_old = (apply_recipe(master, shadow_recipe, matmul=sampling.matmul) if self.own_shadow_old
                           else engine.model if stale else None)
        self.old_policy = (apply_recipe(master, old_recipe, matmul=sampling.matmul) if old_recipe is not None
                           else None)
        self.capture = routing_train.capture_plan(engine, master, sampling.replay_routes)

    def __call__(self, k: int, version: int, weights: dict) -> Batch:
        s, t0 = self.sampling, time.perf_counter()
        sync_s = 0.0
        if self.engine_version != version:
            self.engine.load_weights(weights, count_changes=False)  # the trainer counts them on its shadow
            sync_s = clock(self.device) - t0  # the local engine's copies are device work
            if self.own_shadow_old:
                sync_weights(self.shadow_old, weights, count_changes=False)
            self.engine_version = version
        chosen = drawn_prompts(s.seed, k, s.prompts_per_step, len(self.pool))
        prompt_ids = [self.pool_ids[i] for i in chosen for _ in range(s.group_size)]
        params = SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature,
                                seed=s.seed * SAMPLE_STREAM + k, stop_token_ids=self.stops)
        rollout, routes = (routing.generate_with_routes(self.engine, prompt_ids, params) if self.capture
                           else (self.engine.generate(prompt_ids, params), None))
        packed = rollout.pack(self.stops[0] if self.stops else 0, device=self.device)
        P = rollout.prompt_width
        logp_old = logp_shadow_old = None
        replay = routing_train.replaying([self.old_policy, self.shadow_old], routes, P, s.group_size,
                                         s.replay_routes)
        with replay:
            if self.old_policy is not None:
                sync_weights(self.old_policy, weights, count_changes=False)
                logp_old = score_packed(self.old_policy, self.old_recipe, packed, P, s.group_size, s.temperature)
            t_split = time.perf_counter()
            if self.shadow_old is not None:
                logp_shadow_old = score_packed(self.shadow_old, self.shadow_recipe, packed, P, s.group_size,
                                               s.temperature)
        t_end = clock(self.device)
        return Batch(step=k, prompts=[self.pool[i] for i in chosen for _ in range(s.group_size)], rollout=rollout,
                     packed=packed, weights_version=version, logp_old=logp_old, generate_s=t_end - t0,
                     logp_shadow_old=logp_shadow_old, shadow_old_s=t_end - t_split, sync_s=sync_s, routes=routes)


def start_producer(make_batch: Callable[[int, int, dict], Batch], start: int, steps: int, staleness: int,
                   snapshots: dict[int, dict]) -> RolloutProducer:
    """A running producer for batches start..steps−1, handed every weight version already snapshotted."""
    producer = RolloutProducer(make_batch, start, steps, staleness)
    for version in sorted(snapshots):
        producer.publish(version, snapshots[version])
    return producer.start()


def publish_weights(producer: RolloutProducer, snapshots: dict[int, dict], master: nn.Module, version: int,
                    staleness: int) -> None:
    """Snapshot θ_version for the producer. Versions below version − staleness are done with: the batches that
    used them are consumed, later ones use newer weights; so the oldest one's buffers take the new snapshot."""
    stale = [v for v in snapshots if v < version - staleness]
    free = snapshots.pop(stale[0]) if stale else None
    for v in stale[1:]:
        del snapshots[v]
    snapshots[version] = snapshot(master, reuse=free)
    producer.publish(version, snapshots[version])
