"""Routing on the tiny MoE (models.load_tiny_moe, routing/routes.py).

--scales: how the router's weight scale shapes routing (models.TINY_MOE_ROUTER_STD was chosen from this): per
router std, the top-k margin (k-th minus (k+1)-th logit), the mixing weight of the first expert, the expert load's
entropy (share of log E) and the share of tokens whose top-k set differs between an fp32 and a bf16 forward.

--overhead: what route capture and replay add to `diagnose` on the tiny MoE: the same diagnose run with the routing
figures on and off (routing off = the dense path: no hooks, no replayed forward), alternating, median wall time.

--parts: where a train step's route work goes, on one packed batch of the results/moe-r3 runs' shape (tiny-moe:0,
1 prompt x 8 completions, 16 tokens, fp32 trainer, bf16 engine): a no-grad forward alone, with the capture hooks,
with the replay hooks, and the gathering of the captured routes into the step's figures; medians of interleaved
repeats.

--train: `train --intervention r3` on the same shape, three ways in rotating order: the route figures as now (one
forward beside the loss's), as first built (two forwards beside it), and none (replay in the loss only, no figures);
per run the median over its steps (the first left out: warm-up) of the trainer's side of a step (time/step_s less
time/wait_s), then per round the differences, median over rounds.

Run: python bench/benchmarks/bench_routing.py --scales; python bench/benchmarks/bench_routing.py --overhead
[--rounds 5]; nice -n 15 python bench/benchmarks/bench_routing.py --parts --train [--rounds 5] [--steps 8]

Feeds bench/RESULTS.md "2026-12-03: routing capture and replay on the tiny MoE" (--overhead, --scales) and "2026-12-03:
the route work of a train step on the tiny MoE, profiled and halved" (--parts, --train), and docs/results.md "Expert
routing on the tiny MoE: what replay removes".
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch


def scales(stds: list[float], seed: int = 0) -> None:
    from phantomclip.models import load as models
    from phantomclip.precision.recipes import apply_recipe, get_recipe
    from phantomclip.precision.scoring import score
    from phantomclip.routing import routes as routing
    from phantomclip.routing.figures import flips
    ids = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(1))  # [8, 64] random bytes
    att = torch.ones_like(ids)
    print("router_std layer margin_p10 margin_p50 top1_weight_p50 top1_weight_p90 load_entropy fp32_bf16_flip")
    for std in stds:
        old = models.TINY_MOE_ROUTER_STD
        models.TINY_MOE_ROUTER_STD = std
        try:
            lm = models.load_tiny_moe(f"tiny-moe:{seed}")
        finally:
            models.TINY_MOE_ROUTER_STD = old
        bf16 = apply_recipe(lm.model, get_recipe("bf16"), matmul="auto")
        with routing.capture(lm.model) as rec32:
            score(lm.model, get_recipe("fp32"), ids, att)
        with routing.capture(bf16) as rec16:
            score(bf16, get_recipe("bf16"), ids, att)
        a, b = (r.routes(routing.full_layout(64), 8, 64) for r in (rec32, rec16))
        flip = flips(a, b)  # [layers, 8, 64]
        for layer in range(a.layers):
            m = a.margin[layer].flatten().double()
            w = a.weights[layer, ..., 0].flatten().double()  # the first expert's normalised weight
            load = torch.bincount(a.ids[layer].flatten().long(), minlength=8).double()
            p = load / load.sum()
            entropy = -(p * p.clamp_min(1e-300).log()).sum().item() / math.log(8)
            print(f"{std:<10} {layer:<5} {m.quantile(0.1).item():<10.3g} {m.median().item():<10.3g} "
                  f"{w.median().item():<15.3f} {w.quantile(0.9).item():<15.3f} {entropy:<12.3f} "
                  f"{flip[layer].double().mean().item():.4f}")


def overhead(rounds: int) -> None:
    from phantomclip.diagnose.config import DiagnoseConfig
    from phantomclip.diagnose.job import run_diagnose

    def once(routes: bool) -> float:
        cfg = DiagnoseConfig(model="tiny-moe:0", n=16, max_tokens=32, batch_size=8, routing=routes)
        t0 = time.perf_counter()
        run_diagnose(cfg)
        return time.perf_counter() - t0

    from phantomclip.diagnose import job as diagnose

    phase = []  # wall time of the replayed forward and the route table, inside the runs with routing on
    real_phase = diagnose.route_phase

    def timed_phase(*a, **k):
        t0 = time.perf_counter()
        out = real_phase(*a, **k)
        phase.append(time.perf_counter() - t0)
        return out

    diagnose.route_phase = timed_phase
    once(True)  # warm-up: imports, first oneDNN kernels
    on, off = [], []
    for r in range(rounds):  # ABBA: neither side always runs second
        for routes in ((True, False) if r % 2 == 0 else (False, True)):
            (on if routes else off).append(once(routes))
    ratio = statistics.median(a / b for a, b in zip(on, off))
    share = statistics.median(p / t for p, t in zip(phase[1:], on))  # phase[0] is the warm-up's
    print(f"diagnose tiny-moe:0 n=16 max_tokens=32: routing on median {statistics.median(on):.3f} s, off "
          f"{statistics.median(off):.3f} s, median paired ratio {ratio:.3f} over {rounds} pairs; the route phase "
          f"(replayed forward + table) median {statistics.median(phase[1:]):.3f} s, {100 * share:.1f}% of a run")


R3_RUN = dict(model="tiny-moe:0", max_tokens=16, lr=3e-3, intervention="r3")
"""the results/moe-r3 runs' settings (bench/experiments/exp_moe_r3.py), r3 arm."""


def _load() -> str:
    import os

    return "load average " + ", ".join(f"{x:.1f}" for x in os.getloadavg())


def parts(rounds: int) -> None:
    from phantomclip.engines.local import LocalEngine, SamplingParams
    from phantomclip.models.load import load_model
    from phantomclip.models.prompts import bundled_prompts, encode_prompts
    from phantomclip.precision.recipes import get_recipe
    from phantomclip.precision.scoring import TrainerForward
    from phantomclip.routing import routes as routing
    from phantomclip.routing import train as routing_train

    lm = load_model("tiny-moe:0")
    prompts = encode_prompts(lm.tokenizer, bundled_prompts()[:1]) * 8  # train's defaults: 1 prompt, group 8
    rollout, routes = routing.generate_with_routes(LocalEngine(lm.model, torch.bfloat16), prompts,
                                                   SamplingParams(max_tokens=16, seed=0))
    packed, P = rollout.pack(lm.tokenizer.pad_token_id), rollout.prompt_width
    policy = TrainerForward(lm.model, get_recipe("fp32"), "auto")
    rec_holder = {}

    def plain():
        policy.logprobs(packed, P, 8, grad=False)

    def captured():
        with routing.capture(policy.layout) as rec:
            policy.logprobs(packed, P, 8, grad=False)
        rec_holder["rec"] = rec

    def replayed():
        with routing_train.replaying([policy.layout], routes, P, 8, True):
            policy.logprobs(packed, P, 8, grad=False)

    def gathered():
        own = policy.logprobs(packed, P, 8, grad=False)  # (not timed apart: the figures need some log-probs)
        t0 = time.perf_counter()
        routing_train.route_row(own, rec_holder["rec"], own, packed, routes, P=P, group=8, eps=(0.2, 0.2))
        return time.perf_counter() - t0

    ways = {"forward": plain, "with capture": captured, "with replay": replayed}
    times = {k: [] for k in ways}
    gather = []
    captured()
    for r in range(rounds * 4):
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            t0 = time.perf_counter()
            ways[name]()
            times[name].append(time.perf_counter() - t0)
        gather.append(gathered())
    base = statistics.median(times["forward"])
    for name, ts in times.items():
        print(f"{name}: median {1e3 * statistics.median(ts):.2f} ms ({statistics.median(ts) / base:.3f}x a forward)")
    print(f"gathering the routes into the step figures (routing_train.route_row): median "
          f"{1e3 * statistics.median(gather):.2f} ms; {_load()}")


def train_cost(rounds: int, steps: int) -> None:
    from dataclasses import replace

    from phantomclip.routing import train as routing_train
    from phantomclip.training import trainer
    from phantomclip.training.config import TrainConfig

    real = trainer.routed_step

    def two_forwards(step_fn, batch, ctx):
        cfg, P = ctx.cfg, batch.rollout.prompt_width
        t0 = time.perf_counter()
        figures = routing_train.step_route_figures(ctx.policy, batch.packed, batch.routes, P, cfg.group_size,
                                                   cfg.temperature, (ctx.plan.eps_low, ctx.plan.eps_high))
        figures["time/route_s"] = time.perf_counter() - t0
        with routing_train.replaying([ctx.policy.layout, ctx.shadow, ctx.plain_shadow], batch.routes, P,
                                     cfg.group_size, True):
            out = step_fn(batch, ctx)
        out.row.update(figures)
        return out

    def no_figures(step_fn, batch, ctx):
        with routing_train.replaying([ctx.policy.layout, ctx.shadow, ctx.plain_shadow], batch.routes,
                                     batch.rollout.prompt_width, ctx.cfg.group_size, True):
            return step_fn(batch, ctx)

    ways = {"one extra forward (now)": real, "two extra forwards (before)": two_forwards, "no figures": no_figures}
    cfg = TrainConfig(**R3_RUN, steps=steps)
    trainer.train(replace(cfg, steps=2))  # warm-up
    per = {k: [] for k in ways}
    route = {k: [] for k in list(ways)[:2]}  # median time/route_s per run
    for r in range(rounds):
        order = list(ways)[r % 3:] + list(ways)[: r % 3]
        for name in order:
            trainer.routed_step = ways[name]
            rows = trainer.train(cfg).metrics[1:]
            per[name].append(statistics.median(x["time/step_s"] - x["time/wait_s"] for x in rows))
            if name in route:
                route[name].append(statistics.median(x["time/route_s"] for x in rows))
        trainer.routed_step = real
        print(f"round {r}: " + ", ".join(f"{k} {1e3 * per[k][-1]:.1f} ms" for k in ways) + "; route work "
              + ", ".join(f"{k} {1e3 * route[k][-1]:.1f} ms" for k in route) + f"; {_load()}")
    for name, xs in route.items():
        share = statistics.median(a / b for a, b in zip(xs, per[name]))
        print(f"{name}: time/route_s median {1e3 * statistics.median(xs):.1f} ms, {100 * share:.1f}% of the trainer "
              "side of its step (median over runs)")
    print("time/route_s now vs before: median paired ratio "
          f"{statistics.median(a / b for a, b in zip(*route.values())):.3f}")
    now, before, off = (per[k] for k in ways)
    for name, xs in (("one extra forward (now)", now), ("two extra forwards (before)", before)):
        cost = statistics.median((a - b) / b for a, b in zip(xs, off))
        print(f"{name}: trainer side of a step median {1e3 * statistics.median(xs):.1f} ms, {100 * cost:.1f}% over "
              "no figures (median of paired ratios)")
    print(f"no figures: median {1e3 * statistics.median(off):.1f} ms; now vs before: median paired ratio "
          f"{statistics.median(a / b for a, b in zip(now, before)):.3f} over {rounds} rounds")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", action="store_true")
    ap.add_argument("--overhead", action="store_true")
    ap.add_argument("--parts", action="store_true")
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.scales:
        scales([0.01, 0.03, 0.1, 0.2, 0.3, 1.0])
    if args.overhead:
        overhead(args.rounds)
    if args.parts:
        parts(args.rounds)
    if args.train:
        train_cost(args.rounds, args.steps)


if __name__ == "__main__":
    main()
