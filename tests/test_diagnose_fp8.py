"""diagnose --engine-quant: the FP8 engine beside the plain engine on the same samples, β = β_precision + β_quant +
β_kernel exactly per token, and the refusals (one line, exit 2, before sampling)."""

import math

import torch

from conftest import bad_cli
from phantomclip.diagnose.config import DiagnoseConfig
from phantomclip.diagnose.job import figures, measure, result_dict
from phantomclip.engines.local import LocalEngine
from phantomclip.precision.recipes import get_recipe

CFG = dict(model="tiny-random:0:0.3", n=6, max_tokens=6, batch_size=3, trainer=["fp32", "bf16"], framework=["trl"],
           batch_invariance=False)


def test_fp8_engine_split_adds_up_exactly_per_token():
    cfg = DiagnoseConfig(**CFG, engine_quant="fp8-w8a8,fp8-kv")
    prep, sampled, scored, ref = measure(cfg)
    assert ref.shadow == "bf16+fp8-w8a8+fp8-kv" and ref.logp_plain_shadow is not None
    assert torch.equal(ref.logp_plain_shadow, scored["bf16"].logp)  # the plain shadow is the bf16 recipe's scores
    m = sampled.mask
    lp, plain, sh, eng = (t.double()[m] for t in (scored["fp32"].logp, ref.logp_plain_shadow, ref.logp_shadow,
                                                   ref.logp_engine))
    precision, quant, kernel = lp - plain, plain - sh, sh - eng
    # each part is a difference of two fp32 values (exact in float64) and the sum telescopes in this order
    assert torch.equal(kernel + quant + precision, lp - eng)
    assert quant.abs().mean() > 0  # the quantisers moved the log-probs

    res = result_dict(cfg, prep, sampled, ref, figures(cfg, scored, ref, m))
    fp8 = res["fp8"]
    assert fp8["beta_quant"]["beta_abs_mean"] == quant.abs().mean().item()
    assert res["recipes"]["fp32"]["split"]["quant"]["beta_mean"] == quant.mean().item()
    assert res["recipes"]["fp32"]["split"]["precision"]["beta_mean"] == precision.mean().item()
    # the per-token lists (6 decimals each) add up to β within their rounding: 3 parts, 5e-7 each
    tok, per = res["tokens"], res["tokens"]["per_recipe"]["fp32"]
    for b, p, q, k in zip(per["beta"], per["beta_precision"], tok["beta_quant"], tok["beta_kernel"]):
        assert abs(b - (p + q + k)) <= 2e-6
    # the plain engine read the same tokens: its log-probs are the bf16 engine's own decode of them
    plain_engine = LocalEngine(prep.lm.model, recipe=get_recipe("bf16"))
    first = sampled.packed[0]
    assert torch.equal(ref.logp_engine_plain[:3][m[:3]], _reread(plain_engine, first, cfg, prep)[m[:3]])
    tr = fp8["trust_region"]
    assert math.isclose(tr["outside"] - tr["outside_without_quant"], tr["pushed_out"] - tr["pulled_in"])
    assert set(fp8["recipes_plain_engine"]) == {"fp32", "bf16"} and "token_truncate" in str(fp8["knobs_plain_engine"])


def _reread(engine, packed, cfg, prep):
    """The first batch's completions teacher-forced through `engine`, as [3, T] engine log-probs."""
    from phantomclip.engines.local import Rollout
    from phantomclip.models.load import stop_token_ids

    P = packed["attention_mask"].shape[1] - packed["completion_mask"].sum(-1).max().item()
    prompts = [ids[a.bool()][: int(a[:P].sum())].tolist() for ids, a in zip(packed["input_ids"],
                                                                             packed["attention_mask"])]
    comps = [ids[c.bool()].tolist() for ids, c in zip(packed["input_ids"], packed["completion_mask"])]
    out = engine.rescore(Rollout(prompts, comps, [[0.0] * len(c) for c in comps], [[0.0] * len(c) for c in comps]),
                         cfg.sampling(0, stop_token_ids(prep.lm)))
    return out.pack(prep.lm.tokenizer.pad_token_id)["logp_engine"]


def test_no_fp8_key_without_quantisers():
    cfg = DiagnoseConfig(**{**CFG, "n": 3})
    prep, sampled, scored, ref = measure(cfg)
    res = result_dict(cfg, prep, sampled, ref, figures(cfg, scored, ref, sampled.mask))
    assert "fp8" not in res and "quant" not in res["recipes"]["fp32"]["split"] and "beta_quant" not in res["tokens"]


def test_fp8_refusals_are_one_line(capsys):
    line = bad_cli(["diagnose", "--model", "tiny-random", "--n", "2", "--engine-quant", "fp8-block"], capsys,
                   after_progress=True)
    assert "bf16+fp8-block" in line and "model.layers.0.self_attn.q_proj" in line and "128" in line
    line = bad_cli(["diagnose", "--model", "tiny-random", "--engine-quant", "fp8-w8a8,fp8-nope"], capsys)
    assert "--engine-quant" in line and "fp8-nope" in line
    line = bad_cli(["train", "--model", "tiny-random", "--engine-quant", "fp8-block", "--steps", "1"], capsys,
                   after_progress=True)
    assert "bf16+fp8-block" in line and "q_proj" in line
    # an MoE model: its experts are 3-D tensors the emulation does not quantise (vLLM does): refused, not run with
    # bf16 experts
    line = bad_cli(["diagnose", "--model", "tiny-moe", "--n", "2", "--max-tokens", "4", "--engine-quant", "fp8-w8a8"],
                   capsys, after_progress=True)
    assert "recipe bf16+fp8-w8a8: model.layers.0.mlp.experts.gate_up_proj holds an MoE layer's experts" in line
