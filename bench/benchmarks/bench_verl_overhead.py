"""phantomclip's cost inside verl 0.9.1's own actor step on the CPU: the target is <= 2% of verl's policy-loss step.

Runs in the verl venv (docs/verl.md, "Tests"), one process, gloo, verl's TrainingWorker with its FSDP2 engine on a
tiny random Llama (tests/verl_actor_step_worker.py builds it; tests/verl_cpu.py is the CPU platform verl 0.9.1
lacks). The batch is larger than the test's: --batch sequences of --response tokens, 2 micro-batches per mini-batch.

    .venv-verl/bin/python bench/benchmarks/bench_verl_overhead.py [--repeats 21] [--batch 8] [--response 64]
                                                                  [--threads 1]

Timed, alternating the two paths in one process (A B, B A, A B, ...) so that both share the machine's noise and
neither always runs second:
- the actor update (`train_mini_batch`: forward, ppo_loss, backward, optimizer step over every micro-batch) with
  loss_mode vanilla against phantomclip_vanilla (the same worker, the loss swapped with `set_loss_fn`); besides the
  two medians, the median of the pairs' ratios (each pair back to back, so a slow minute slows both);
- the loss alone: verl's worker-side `ppo_loss` on one micro-batch's padded tensors, forward and backward, with each
  loss_mode (what a loss call costs without the model: the harshest denominator);
- the figures alone: `worker_figures` on one micro-batch's tensors (what the registered loss adds per call), times
  the calls per update;
- the driver: `compute_rollout_correction_and_add_to_batch` wrapped against verl's own (`__wrapped__`), token TIS;
- bypass mode's optional recompute (PHANTOMCLIP_VERL_BYPASS_RECOMPUTE_EVERY): verl's `infer_batch` on the batch,
  the forward decoupled mode runs at every step, against the update.
Wall and CPU seconds (time.process_time: every thread of this process) are medians over --repeats; the load average
is printed beside them. One torch thread by default: on 2 shared cores, two OpenMP threads that spin while another
process holds a core made the same update take 30x longer from one minute to the next. Feeds bench/RESULTS.md §10
and docs/results.md "phantomclip inside verl: its cost" (docs/verl.md "Cost" points there).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2] / "tests"
sys.path.insert(0, str(TESTS))

import verl_actor_step_worker as step  # noqa: E402  (sets verl's CPU platform before verl is imported)


def cpu_kind() -> tuple[str, str]:
    """('amx' | 'avx512bf16' | 'avx2', model name) from /proc/cpuinfo's first flags and model lines."""
    flags, model = set(), "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags" and not flags:
            flags = set(value.split())
        if key.strip() == "model name" and model == "?":
            model = value.strip()
    return ("amx" if "amx_bf16" in flags else "avx512bf16" if "avx512_bf16" in flags else "avx2"), model


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def make_batch(batch: int, response: int):
    """`batch` sequences of 8 prompt tokens and `response` response tokens (the last quarter of every other
    response masked), advantages of both signs."""
    import torch
    from verl import DataProto

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 256, (batch, 8), generator=g)
    responses = torch.randint(3, 256, (batch, response), generator=g)
    response_mask = torch.ones(batch, response, dtype=torch.long)
    response_mask[::2, response * 3 // 4:] = 0
    attention = torch.cat([torch.ones(batch, 8, dtype=torch.long), response_mask], 1)
    adv = torch.randn(batch, 1, generator=g).expand(batch, response).contiguous()
    return DataProto.from_dict(tensors={
        "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention,
        "position_ids": (attention.cumsum(1) - 1).clamp(min=0), "prompts": prompts, "responses": responses,
        "response_mask": response_mask.float(), "advantages": adv})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--response", type=int, default=64)
    args = parser.parse_args()
    if args.repeats < 2 or args.batch < 4 or args.batch % 2 or args.response < 4:
        parser.error("--repeats >= 2, --batch an even number >= 4, --response >= 4")

    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=0, world_size=1)
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo import rollout_corr_helper
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    from phantomclip.integrations.verl import worker_figures

    kind, model = cpu_kind()
    print(f"CPU: {kind} ({model}), {os.cpu_count()} cores, torch threads {torch.get_num_threads()}")
    root = Path(tempfile.mkdtemp(prefix="bench-verl-"))
    worker = step.build_worker(step.tiny_model_dir(root), "vanilla")
    half = args.batch // 2
    configs = {mode: FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=args.batch,
                                     ppo_micro_batch_size_per_gpu=half, rollout_n=1, clip_ratio_high=0.28,
                                     policy_loss={"loss_mode": mode}) for mode in ("vanilla", "phantomclip_vanilla")}
    worker.engine_config.micro_batch_size_per_gpu = half  # train_batch reads it (engine_workers.py)
    batch = make_batch(args.batch, args.response)
    old = step.recompute(worker, batch)  # [B, R]
    beta = 0.1 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))
    batch.batch["old_log_probs"], batch.batch["rollout_log_probs"] = old, old - beta
    corr = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)
    hooked = rollout_corr_helper.compute_rollout_correction_and_add_to_batch
    batch, _ = hooked(batch, corr)

    def update(mode: str):
        worker.set_loss_fn(partial(ppo_loss, config=configs[mode]))
        td = left_right_2_no_padding(batch.to_tensordict())
        tu.assign_non_tensor(td, calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
                             global_batch_size=args.batch, mini_batch_size=args.batch, epochs=1, seed=1,
                             dataloader_kwargs={"shuffle": False}, compute_loss=True, temperature=1.0)
        return worker.train_mini_batch(td)

    t = batch.batch
    micro = {k: t[k][:half] for k in ("old_log_probs", "advantages", "response_mask")}
    new = micro["old_log_probs"] + 0.05 * torch.randn(micro["old_log_probs"].shape)

    def figures():
        return worker_figures("vanilla", micro["old_log_probs"], new, micro["advantages"],
                              micro["response_mask"].bool(), configs["phantomclip_vanilla"])

    from tensordict import TensorDict
    from verl.utils.tensordict_utils import assign_non_tensor
    from verl.workers.utils import losses

    padded = losses.no_padding_2_padding
    micro_td = TensorDict({"response_mask": micro["response_mask"], "old_log_probs": micro["old_log_probs"],
                           "advantages": micro["advantages"]}, batch_size=[half])
    assign_non_tensor(micro_td, dp_size=1, batch_num_tokens=None, global_batch_size=None)

    def loss_alone(mode: str):
        losses.no_padding_2_padding = lambda x, data: x  # the micro-batch's log-probs are padded already
        try:
            lp = new.clone().requires_grad_(True)
            loss, _ = losses.ppo_loss(configs[mode], {"log_probs": lp}, micro_td.clone())
            loss.backward()
        finally:
            losses.no_padding_2_padding = padded

    def fresh():
        return type(batch).from_dict(tensors={k: t[k].clone() for k in ("old_log_probs", "rollout_log_probs")} |
                                     {"response_mask": t["response_mask"].clone()})

    rows: dict[str, list[tuple[float, float]]] = {}
    for mode in ("vanilla", "phantomclip_vanilla"):  # warm-up, not timed
        update(mode), loss_alone(mode)
    for i in range(args.repeats):
        order = ("vanilla", "phantomclip_vanilla")
        for mode in order if i % 2 == 0 else order[::-1]:  # A B, B A, A B, ...: neither always runs second
            rows.setdefault(f"update {mode}", []).append(timed(lambda: update(mode))[1:])
        for mode in ("vanilla", "phantomclip_vanilla"):
            rows.setdefault(f"loss alone {mode}", []).append(
                min((timed(lambda: loss_alone(mode))[1:] for _ in range(20)), key=lambda x: x[0]))
        rows.setdefault("figures, one micro-batch", []).append(
            min((timed(figures)[1:] for _ in range(20)), key=lambda x: x[0]))
        rows.setdefault("driver: verl's correction", []).append(timed(lambda: hooked.__wrapped__(fresh(), corr))[1:])
        rows.setdefault("driver: wrapped", []).append(timed(lambda: hooked(fresh(), corr))[1:])
        rows.setdefault("bypass recompute (infer_batch)", []).append(timed(lambda: step.recompute(worker, batch))[1:])
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in rows.items()}
    print(f"load average {os.getloadavg()[0]:.2f}; batch {args.batch} x {args.response} response tokens, "
          f"2 micro-batches of {half}; medians of {args.repeats}")
    print(f"{'path':36} {'wall ms':>10} {'cpu ms':>10}")
    for k, (w, c) in med.items():
        print(f"{k:36} {1e3 * w:10.2f} {1e3 * c:10.2f}")
    base = med["update vanilla"]
    per_update = tuple(2 * x for x in med["figures, one micro-batch"])  # two micro-batches per update
    print(f"figures per update / update: wall {100 * per_update[0] / base[0]:.3f}%, "
          f"cpu {100 * per_update[1] / base[1]:.3f}% (target <= 2%)")
    print(f"update with phantomclip_vanilla / vanilla: wall {med['update phantomclip_vanilla'][0] / base[0]:.4f}, "
          f"cpu {med['update phantomclip_vanilla'][1] / base[1]:.4f} (medians; includes the noise of the two)")
    pairs = [tuple(o / v for o, v in zip(ours, theirs))
             for ours, theirs in zip(rows["update phantomclip_vanilla"], rows["update vanilla"])]
    print(f"  median of the pairs' ratios: wall {statistics.median(p[0] for p in pairs):.4f}, "
          f"cpu {statistics.median(p[1] for p in pairs):.4f}")
    alone = med["loss alone vanilla"]
    print(f"loss alone, phantomclip_vanilla / vanilla: wall {med['loss alone phantomclip_vanilla'][0] / alone[0]:.3f}, "
          f"cpu {med['loss alone phantomclip_vanilla'][1] / alone[1]:.3f}")
    extra = tuple(a - b for a, b in zip(med["driver: wrapped"], med["driver: verl's correction"]))
    print(f"driver figures: +{1e3 * extra[0]:.2f} ms wall, +{1e3 * extra[1]:.2f} ms cpu per step")
    print(f"bypass recompute / update: wall {med['bypass recompute (infer_batch)'][0] / base[0]:.3f}, "
          f"cpu {med['bypass recompute (infer_batch)'][1] / base[1]:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
