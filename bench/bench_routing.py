"""Routing on the tiny MoE (models.load_tiny_moe, routing.py).

--scales: how the router's weight scale shapes routing (models.TINY_MOE_ROUTER_STD was chosen from this): per
router std, the top-k margin (k-th minus (k+1)-th logit), the mixing weight of the first expert, the expert load's
entropy (share of log E) and the share of tokens whose top-k set differs between an fp32 and a bf16 forward.

--overhead: what route capture and replay add to `diagnose` on the tiny MoE: the same diagnose run with the routing
figures on and off (routing off = the dense path: no hooks, no replayed forward), alternating, median wall time.

Run: python bench/bench_routing.py --scales; python bench/bench_routing.py --overhead [--rounds 5]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch


def scales(stds: list[float], seed: int = 0) -> None:
    from phantomclip import models, routing
    from phantomclip.recipes import apply_recipe, get_recipe
    from phantomclip.scoring import score

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
        flip = routing.flips(a, b)  # [layers, 8, 64]
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
    from phantomclip.diagnose import run_diagnose
    from phantomclip.diagnose_config import DiagnoseConfig

    def once(routes: bool) -> float:
        cfg = DiagnoseConfig(model="tiny-moe:0", n=16, max_tokens=32, batch_size=8, routing=routes)
        t0 = time.perf_counter()
        run_diagnose(cfg)
        return time.perf_counter() - t0

    from phantomclip import diagnose

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", action="store_true")
    ap.add_argument("--overhead", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.scales:
        scales([0.01, 0.03, 0.1, 0.2, 0.3, 1.0])
    if args.overhead:
        overhead(args.rounds)


if __name__ == "__main__":
    main()
