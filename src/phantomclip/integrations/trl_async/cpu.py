"""TRL's AsyncGRPOTrainer on a CPU, without a vLLM server: the stand-ins at the three boundaries it crosses.

TRL 1.16's async trainer (trl/experimental/async_grpo/) needs a GPU three times over: its packed forward attends with
FlashAttention-3 from the Hub (`packing.tree_attention` -> `_flash_attn()`), its rollout worker asks a vLLM server
for completions and their log-probs over HTTP (`async_rollout_worker.AsyncRolloutWorker`), and its weight sync
streams the policy to that server over NCCL (`weight_transfer.WeightTransferClient`). The trainer accepts injected
workers and weight transfers (`rollout_worker=`, `weight_transfer=`: its `RolloutWorkerProtocol` and
`WeightTransferProtocol`), so everything else of TRL runs unchanged here: its queue, staleness filter, planner,
tree packing, collator, `compute_loss`, metrics and version counter.

- `use_cpu_stand_ins()`: TRL's own `tree_attention` (its K/V gather along each segment's root-to-segment path)
  with the kernel call replaced by a per-segment scaled-dot-product attention, causal from the bottom right as
  FlashAttention's varlen kernel is when a segment's queries are the last of its keys; and no CUDA query
  for the peak FLOPs of the device.
- `LocalRolloutWorker`: the worker's output interface (`RolloutSample`s on `rollout_buffer`) filled by phantomclip's
  in-process bf16 `LocalEngine`: completions, their sampled-token log-probs (the engine's, as vLLM's would be), the
  version the engine's weights came from, group-normalised advantages as TRL's `_score_group` computes them.
- `LocalWeightTransfer`: `send_weights` casts TRL's streamed (name, fp32 tensor) pairs into that engine, as vLLM's
  load rounds them to its dtype.
- `DiskWeightTransfer`: for a real vLLM(-cpu) server with TRL's real rollout worker: the NCCL stream replaced by a
  safetensors file the server reloads in place (vLLM's `/collective_rpc` -> `reload_weights(weights_path=...)`).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from ...engines.local import LocalEngine, SamplingParams
from ...models.prompts import encode_prompts


class _VarlenAttention:
    """`flash_attn_varlen_func` on any device, one segment at a time (what TRL's `tree_attention` calls)."""

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                               causal=True, window_size=(-1, -1), softcap=None, **kwargs):
        if not causal or tuple(window_size) != (-1, -1) or softcap:
            raise NotImplementedError("the CPU tree attention covers causal attention without window or softcap")
        out = torch.empty_like(q)  # [total_q, H, D]
        groups = q.shape[1] // k.shape[1]  # grouped-query attention: each K/V head serves `groups` query heads
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for s in range(len(cq) - 1):
            qs = q[cq[s]:cq[s + 1]].transpose(0, 1)  # [H, Lq, D]
            ks = k[ck[s]:ck[s + 1]].transpose(0, 1).repeat_interleave(groups, 0)  # [H, Lk, D]
            vs = v[ck[s]:ck[s + 1]].transpose(0, 1).repeat_interleave(groups, 0)  # [H, Lk, D]
            lq, lk = qs.shape[1], ks.shape[1]
            # bottom-right causal: the segment's queries are the last lq of its path's lk keys (flash-attn >= 2.1)
            allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)  # [Lq, Lk]
            out[cq[s]:cq[s + 1]] = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=allowed, scale=softmax_scale).transpose(0, 1)
        return out


def use_cpu_stand_ins() -> None:
    """Let TRL's async trainer run without CUDA (process-wide, idempotent): its tree attention goes through
    `_VarlenAttention` instead of FlashAttention-3 (`packing._flash_attn` replaced), and its peak-FLOPs lookup, which
    asks CUDA for the device's name even on a CPU (trl/trainer/utils.py `get_peak_flops_per_device`), answers None
    off CUDA: TRL then leaves out its MFU figures, as it does for any device it does not know."""
    from trl.experimental.async_grpo import async_grpo_trainer, packing
    from trl.trainer.utils import get_peak_flops_per_device

    packing._flash_attn = lambda: _VarlenAttention
    async_grpo_trainer.get_peak_flops_per_device = (
        lambda accelerator, dtype: get_peak_flops_per_device(accelerator, dtype)
        if accelerator.device.type == "cuda" else None)


class _OnDemandQueue:
    """The rollout buffer: `get` fills it with `groups_per_fill` new groups when it is empty, sampled at the
    engine's current weights. Samples left in it when the weights move are what makes staleness."""

    def __init__(self, fill: Callable[[], list]):
        self._fill, self._items = fill, []

    def get(self, timeout: float | None = None):
        if not self._items:
            self._items = self._fill()
        return self._items.pop(0)

    def get_nowait(self):
        return self.get()

    def put_nowait(self, item) -> None:
        self._items.append(item)

    def qsize(self) -> int:
        return len(self._items)


class LocalRolloutWorker:
    """TRL's `RolloutWorkerProtocol` with phantomclip's `LocalEngine` as the generator (no process, no server).

    Each fill samples `groups_per_fill` prompts x `num_generations` completions at the engine's weights and tags
    them with the version those weights are (`update_model_version`, called by TRL after each sync). With
    `groups_per_fill` = 2 x the groups one optimizer step consumes, the staleness at the loss runs 0, 1, 1, 2, 1, 2,
    ... deterministically (accelerate's dispatcher fetches the next micro-batch, and so triggers the next fill,
    before the step's sync).
    """

    def __init__(self, engine: LocalEngine, tokenizer, prompts: list[str], reward: Callable, num_generations: int,
                 max_tokens: int, temperature: float = 1.0, groups_per_fill: int = 1, seed: int = 0):
        self.engine, self.tokenizer, self.prompts, self.reward = engine, tokenizer, prompts, reward
        self.num_generations, self.groups_per_fill, self.seed = num_generations, groups_per_fill, seed
        self.stop_ids = tuple(sorted({tokenizer.eos_token_id}))
        self.params = dict(max_tokens=max_tokens, temperature=temperature, stop_token_ids=self.stop_ids)
        self.prompt_ids = encode_prompts(tokenizer, prompts)  # the chat template where there is one, as TRL's worker
        self.model_version = 0
        self.next_group = 0
        self.rollout_buffer = _OnDemandQueue(self._fill)
        self.metrics_queue: queue.Queue = queue.Queue()

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def check_health(self, stale_after_s: float) -> None: ...

    def update_model_version(self, model_version: int) -> None:
        self.model_version = model_version

    def _fill(self) -> list:
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        samples = []
        for _ in range(self.groups_per_fill):
            group = self.next_group
            self.next_group += 1
            text = self.prompts[group % len(self.prompts)]
            prompt_ids = self.prompt_ids[group % len(self.prompts)]
            params = SamplingParams(**self.params, seed=self.seed * 1_000_003 + group)
            out = self.engine.generate([prompt_ids] * self.num_generations, params)
            completions = [self.tokenizer.decode(c) for c in out.completion_ids]
            rewards = np.asarray(self.reward([text] * len(completions), completions, out.completion_ids), dtype=float)
            advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-8)  # TRL's _score_group: population std
            now = time.time()
            for ids, logps, adv, r in zip(out.completion_ids, out.logp_engine, advantages, rewards, strict=True):
                samples.append(RolloutSample(
                    prompt=text, completion=self.tokenizer.decode(ids),
                    input_ids=np.asarray(prompt_ids + ids, dtype=np.int64),
                    completion_mask=np.asarray([0] * len(prompt_ids) + [1] * len(ids), dtype=np.int64),
                    old_log_probs=np.asarray([0.0] * len(prompt_ids) + list(logps), dtype=np.float32),
                    advantage=float(adv), model_version=self.model_version, group_id=group,
                    metrics={"reward": float(r), "reward_std": float(rewards.std())}, enqueued_at=now))
        return samples


class LocalWeightTransfer:
    """TRL's `WeightTransferProtocol` into a `LocalEngine`: each streamed tensor cast to the engine's dtype. With
    `count_changes` (default) each sync also counts the share of the engine's values that changed (a second pass
    over every weight, for examples/trl_async_grpo.py's printout: work a real server's receive does not do, so the
    cost bench turns it off)."""

    def __init__(self, engine: LocalEngine, count_changes: bool = True):
        self.engine, self.count_changes = engine, count_changes
        self.changed_share: list[float] = []

    def init_weight_transfer(self) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def destroy(self) -> None: ...

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.changed_share.append(self.engine.load_weights(dict(iterator), count_changes=self.count_changes))


class DiskWeightTransfer:
    """TRL's `WeightTransferProtocol` into a running vLLM server without NCCL (a CPU server cannot join an NCCL
    group): `send_weights` writes TRL's streamed (name, tensor) pairs, under the checkpoint names TRL's NCCL path
    sends, to `directory`/model.safetensors (atomically: temp then rename), then asks the server to reload them in
    place through its dev endpoint `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path":
    directory}}` (vllm 0.32 `v1/worker/gpu_worker.py` `reload_weights` -> `model_loader/reload/inplace.py`: the
    checkpoint-format load, each tensor rounded to the server's dtype as the NCCL receive does). `pause`/`resume`
    are TRL's own (`/pause?mode=keep`, `/resume`). The server needs VLLM_SERVER_DEV_MODE=1, as TRL's does."""

    def __init__(self, server_url: str, directory: str, timeout: float = 600.0):
        self.server_url, self.directory, self.timeout = server_url.rstrip("/"), directory, timeout
        self.seconds: list[float] = []

    def _post(self, path: str, **kwargs) -> None:
        import requests

        response = requests.post(f"{self.server_url}{path}", timeout=self.timeout, **kwargs)
        if response.status_code != 200:
            raise RuntimeError(f"vLLM server {self.server_url}{path}: {response.status_code} {response.text[:200]} "
                               "(start it with VLLM_SERVER_DEV_MODE=1)")

    def init_weight_transfer(self) -> None:
        from trl.experimental.async_grpo.vllm_client import VLLMClient

        VLLMClient(self.server_url, self.timeout).wait_for_server_ready()

    def pause(self) -> None:
        self._post("/pause", params={"mode": "keep"})

    def resume(self) -> None:
        self._post("/resume")

    def destroy(self) -> None: ...

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        import os
        from pathlib import Path

        from safetensors.torch import save_file

        from ...base.files import atomic_write

        t0 = time.perf_counter()
        # each tensor its own contiguous copy: safetensors refuses tensors sharing storage (tied weights, views)
        tensors = {name: value.detach().to("cpu").contiguous().clone() for name, value in iterator}
        os.makedirs(self.directory, exist_ok=True)
        atomic_write(Path(self.directory) / "model.safetensors", lambda tmp: save_file(tensors, tmp))
        self._post("/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": self.directory}})
        self.seconds.append(time.perf_counter() - t0)
