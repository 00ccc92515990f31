"""Real vLLM FP8 against phantomclip's emulation, on the bundled model: for each FP8 recipe, does this vLLM build run
it, refuse it, or ignore it, and where it runs, is its β_quant the emulation's?

Run in the vLLM environment (scripts/install_vllm_cpu.sh):

    .venv-vllm/bin/python bench/checks/vllm_fp8_check.py [--out F]

For each recipe of fp8_vllm.VLLM_ARGS (and vLLM's plain quantization='fp8', which this build maps to the same online
per-tensor path as 'fp8_per_tensor'), vLLM is started on the bundled model in bf16 with the recipe's engine arguments,
in a child process each (a failed start leaves vLLM's state half-built). A start that raises is 'refused' (the
exception's first line and the innermost vLLM frame are kept); one that starts is checked for being in effect
(quantised Linears hold float8_e4m3fn weights; the KV cache's attention says is_fp8_kv_cache) and scores the same
sequences as a bf16 vLLM by prefill (prompt_logprobs): identical log-probs would mean 'ignored'.

The sequences: the first 16 bundled prompts, each followed by 32 tokens the local bf16 engine samples (seed 0).
β_quant is compared on their completion tokens only:
  vLLM:      logp(vLLM bf16) − logp(vLLM FP8 recipe), both by prefill;
  emulation: logp(bf16 scorer) − logp(bf16 + recipe scorer) (diagnose's β_quant: the two local shadows).
Also, for fp8-w8a8-channel, vLLM's E4M3 weights and scales of every quantised Linear are compared with
fp8.quantise_weight's of the same bf16 weights, bit for bit.

Feeds docs/diagnose.md "FP8 engines: `--engine-quant`" (what vllm-cpu does with each recipe), docs/results.md "FP8
engines: the tiny model's experiment, the cost, what was not run" and the CPU rules of precision/fp8_vllm.py;
tests/test_fp8_vllm_real.py is its shorter, tested form.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

CASES = {
    "bf16": {},
    "bf16+fp8-kv": {"kv_cache_dtype": "fp8"},
    "bf16+fp8-kv (fp8_e4m3)": {"kv_cache_dtype": "fp8_e4m3"},
    "bf16+fp8-w8a8-channel": {"quantization": "fp8_per_channel"},
    "bf16+fp8-w8a8": {"quantization": "fp8_per_tensor"},
    "bf16+fp8-w8a8 (quantization='fp8')": {"quantization": "fp8"},
    "bf16+fp8-block": {"quantization": "fp8_per_block"},
}
N_SEQ, TOKENS = 16, 32


def sequences():
    """(token ids [N_SEQ lists], prompt lengths): bundled prompts + 32 tokens of the local bf16 engine."""
    from phantomclip.engines.local import LocalEngine, SamplingParams
    from phantomclip.models.load import load_model
    from phantomclip.models.prompts import bundled_prompts, encode_prompts
    from phantomclip.precision.recipes import get_recipe

    lm = load_model("smollm2-135m")
    prompts = encode_prompts(lm.tokenizer, bundled_prompts()[:N_SEQ])
    ro = LocalEngine(lm.model, recipe=get_recipe("bf16")).generate(prompts, SamplingParams(max_tokens=TOKENS, seed=0))
    return [p + c for p, c in zip(ro.prompt_ids, ro.completion_ids)], [len(p) for p in ro.prompt_ids]


def child(name: str, args: dict, seqs: list[list[int]], out: str) -> None:
    """Start vLLM with `args`, record what happened and the prefill log-probs of `seqs`; writes JSON to `out`."""
    from phantomclip.engines.vllm import set_env_defaults

    set_env_defaults()
    import torch
    import vllm

    from phantomclip.models.load import load_model

    lm = load_model("smollm2-135m")
    res: dict = {"case": name, "args": args, "vllm": vllm.__version__}
    t0 = time.perf_counter()
    try:
        llm = vllm.LLM(model=str(lm.path), dtype="bfloat16", enforce_eager=True, seed=0, max_model_len=1024, **args)
    except Exception as e:  # noqa: BLE001  what vLLM says is the finding
        frames = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                  for f in traceback.extract_tb(e.__traceback__) if "site-packages/vllm/" in f.filename]
        lines = str(e).strip().splitlines()
        res.update(outcome="refused", error=f"{type(e).__name__}: {' '.join(lines)[:600]}", raised_at=frames[-2:])
        json.dump(res, open(out, "w"))
        return
    res["startup_s"] = time.perf_counter() - t0

    def inspect(worker):
        info = {"fp8_linears": 0, "linears": 0, "fp8_kv_layers": 0, "weights": {}}
        for n, mod in worker.model_runner.get_model().named_modules():
            w = getattr(mod, "weight", None)
            if hasattr(mod, "quant_method") and w is not None and n.rpartition(".")[2].endswith("proj"):
                info["linears"] += 1
                if w.dtype == torch.float8_e4m3fn:
                    info["fp8_linears"] += 1
                    info["kernel"] = type(getattr(mod.quant_method, "fp8_linear", None)).__name__
                    info["weights"][n] = (w.detach().clone(), mod.weight_scale.detach().clone())
            if getattr(getattr(mod, "impl", None), "is_fp8_kv_cache", False):
                info["fp8_kv_layers"] += 1
        return info

    info = llm.collective_rpc(inspect)[0]
    weights = info.pop("weights")
    res.update(info)
    if weights:
        res["weights_match"] = _weights_match(lm.model, weights)
    params = vllm.SamplingParams(prompt_logprobs=0, max_tokens=1, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
    res["logp"] = [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], s[1:])] for o, s in zip(outs, seqs)]
    res["outcome"] = "ran"
    json.dump(res, open(out, "w"))


def _weights_match(model, weights) -> dict:
    """vLLM's E4M3 weight and per-channel scale of each quantised Linear against fp8.quantise_weight of the same bf16
    weights (q/k/v and gate/up concatenated along the output rows, as vLLM merges them)."""
    import torch

    from phantomclip.precision.fp8_layers import LINEAR_QUANTS, quantise_weight

    spec = LINEAR_QUANTS["fp8-w8a8-channel"]
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    mods = dict(model.named_modules())
    same_q = same_s = 0
    for name, (wq, ws) in weights.items():
        parent, _, leaf = name.rpartition(".")
        w = torch.cat([mods[f"{parent}.{p}"].weight for p in parts.get(leaf, (leaf,))]).to(torch.bfloat16)
        q, s = quantise_weight(w, spec)  # [N, K], [1, N]
        vq = wq.T  # vLLM keeps every E4M3 weight as [K, N] (torch._scaled_mm's layout), square ones too
        same_q += bool(torch.equal(vq.view(torch.uint8), q.view(torch.uint8)))
        same_s += bool(torch.equal(ws.reshape(-1), s.reshape(-1)))
    return {"layers": len(weights), "weights_equal": same_q, "scales_equal": same_s}


def emulated(seqs, prompt_lens, recipe_names):
    """Completion-token log-probs of each local recipe's scorer (fp64 lists, one per sequence)."""
    import torch

    from phantomclip.models.load import load_model
    from phantomclip.precision.recipes import apply_recipe, get_recipe
    from phantomclip.precision.scoring import score

    lm = load_model("smollm2-135m")
    out = {}
    for name in recipe_names:
        recipe = get_recipe(name)
        model = apply_recipe(lm.model, recipe)
        rows = []
        for s, p in zip(seqs, prompt_lens):
            x = torch.tensor([s])
            logp = score(model, recipe, x, torch.ones_like(x), entropy=False).logp[0].double()  # [T]
            rows.append(logp[p:].tolist())
        out[name] = rows
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--cases", default=",".join(CASES))
    a = ap.parse_args()
    seqs, plens = sequences()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "seqs.json")
        json.dump(seqs, open(src, "w"))
        for i, name in enumerate(n for n in CASES if n in a.cases.split(",")):
            out = os.path.join(tmp, f"{i}.json")
            code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import vllm_fp8_check as c; "
                    f"c.child({name!r}, {CASES[name]!r}, json.load(open({src!r})), {out!r})")
            subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            runs[name] = json.load(open(out))
    import statistics

    base = [lp[p - 1:] for lp, p in zip(runs["bf16"]["logp"], plens)]  # completion tokens (prefill drops token 0)
    ran = [n for n, r in runs.items() if r["outcome"] == "ran" and n != "bf16"]
    emu = emulated(seqs, plens, ["bf16", *dict.fromkeys(n.split(" ")[0] for n in ran)])
    summary = {}
    for name, r in runs.items():
        row = {k: r.get(k) for k in ("outcome", "error", "raised_at", "kernel", "fp8_linears", "linears",
                                     "fp8_kv_layers", "weights_match")}
        if r["outcome"] == "ran" and name != "bf16":
            fp8 = [lp[p - 1:] for lp, p in zip(r["logp"], plens)]
            bq_v = [b - f for bs, fs in zip(base, fp8) for b, f in zip(bs, fs)]
            key = name.split(" ")[0]
            bq_e = [b - f for bs, fs in zip(emu["bf16"], emu[key]) for b, f in zip(bs, fs)]
            row.update(tokens=len(bq_v), identical_to_bf16=all(x == 0 for x in bq_v),
                       vllm_beta_quant_abs_mean=statistics.fmean(abs(x) for x in bq_v),
                       emulated_beta_quant_abs_mean=statistics.fmean(abs(x) for x in bq_e),
                       vllm_minus_emulated_abs_mean=statistics.fmean(abs(x - y) for x, y in zip(bq_v, bq_e)),
                       correlation=statistics.correlation(bq_v, bq_e))
        summary[name] = row
    kernel = [b - e for bs, es in zip(base, emu["bf16"]) for b, e in zip(bs, es)]
    summary["bf16"]["vllm_minus_scorer_abs_mean"] = statistics.fmean(abs(x) for x in kernel)
    text = json.dumps({"vllm": runs["bf16"]["vllm"], "cases": summary}, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
