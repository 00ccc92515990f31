"""Every framework's figures on a hand-worked batch, the published bounds, and the --fail-if gate.

Tolerance: inputs are float64 and each figure is a handful of float64 operations (an exp, a few sums) on values
exact to one ulp, so the module and the hand-worked expressions below agree to about 1e-15 relative; 1e-12 leaves
room for another summation order and for libm's exp differing in the last bit, and still catches any wrong formula.
"""

import math

import pytest
import torch

from phantomclip.base.errors import ConfigError, PhantomclipError
from phantomclip.diagnose.gates import Gate, GateError, failed_gates, lookup, parse_gate
from phantomclip.maths.frameworks import FRAMEWORKS, THRESHOLDS, judged_figures

REL = 1e-12


def approx(x: float) -> object:
    return pytest.approx(x, rel=REL, abs=1e-15)


# The batch: 2 sequences x 3 tokens, the last token of sequence 0 masked out (its gap of 7.9 must not leak in).
#   logp        = [[-1.0, -0.5, -2.0], [-0.2, -3.0, -0.7]]
#   logp_engine = [[-1.1, -0.3, -9.9], [-0.2, -2.5, -0.4]]
#   ℓ = logp − logp_engine = [[0.1, -0.2, (masked)], [0.0, -0.5, -0.3]]
#   5 tokens: ℓ = 0.1, -0.2, 0.0, -0.5, -0.3;  |ℓ| = 0.1, 0.2, 0.0, 0.5, 0.3 (sum 1.1);  Σℓ = -0.9
#   sequences: S_0 = 0.1 − 0.2 = -0.1 (n_0 = 2), S_1 = 0 − 0.5 − 0.3 = -0.8 (n_1 = 3)
LOGP = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -3.0, -0.7]], dtype=torch.float64)
LOGP_ENGINE = torch.tensor([[-1.1, -0.3, -9.9], [-0.2, -2.5, -0.4]], dtype=torch.float64)
MASK = torch.tensor([[True, True, False], [True, True, True]])

# exp values, written out (math.exp, float64):
E_P1 = 1.1051709180756477  # exp(0.1)
E_M1 = 0.9048374180359595  # exp(-0.1)
E_P2 = 1.2214027581601699  # exp(0.2)
E_M2 = 0.8187307530779818  # exp(-0.2)
E_P3 = 1.3498588075760032  # exp(0.3)
E_M3 = 0.7408182206817179  # exp(-0.3)
E_M4 = 0.6703200460356393  # exp(-0.4)
E_P5 = 1.6487212707001282  # exp(0.5)
E_M5 = 0.6065306597126334  # exp(-0.5)
E_M6 = 0.5488116360940264  # exp(-0.6)
E_M7 = 0.4965853037914095  # exp(-0.7)
E_M8 = 0.44932896411722156  # exp(-0.8)
E_M10 = 0.36787944117144233  # exp(-1.0)
E_M11 = 0.33287108369807955  # exp(-1.1)
E_M16 = 0.20189651799465538  # exp(-1.6)
E_M25 = 0.0820849986238988  # exp(-2.5)
E_M30 = 0.049787068367863944  # exp(-3.0)
E_P12 = 3.3201169227365472  # exp(1.2)

# k3 = e^ℓ − 1 − ℓ per token:
K_P1 = E_P1 - 1.1  # ℓ = 0.1:  0.0051709180756477
K_M2 = E_M2 - 0.8  # ℓ = -0.2: 0.0187307530779818
K_M5 = E_M5 - 0.5  # ℓ = -0.5: 0.1065306597126334
K_M3 = E_M3 - 0.7  # ℓ = -0.3: 0.0408182206817179
K3 = [K_P1, K_M2, 0.0, K_M5, K_M3]  # ℓ = 0 gives 0; mean 0.1712505515479808 / 5 = 0.0342501103095962


def std(xs: list[float]) -> float:
    """Unbiased std, by hand."""
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def figures(name: str, logp=LOGP, logp_engine=LOGP_ENGINE, mask=MASK) -> dict[str, float]:
    return FRAMEWORKS[name](logp, logp_engine, mask)


def test_trl_hand_worked():
    f = figures("trl")
    # |ℓ|: mean 1.1 / 5 = 0.22, max 0.5
    assert f["sampling/sampling_logp_difference/mean"] == approx(0.22)
    assert f["sampling/sampling_logp_difference/max"] == approx(0.5)
    # sequence_mask: ρ = exp(S) = exp(-0.1) = 0.90484, exp(-0.8) = 0.44933, both <= 3: nothing masked
    assert f["sampling/importance_sampling_ratio/min"] == approx(E_M8)
    assert f["sampling/importance_sampling_ratio/mean"] == approx((E_M1 + E_M8) / 2)  # 0.6770831910765905
    assert f["sampling/importance_sampling_ratio/max"] == approx(E_M1)
    assert f["sampling/importance_sampling_ratio_raw/min"] == approx(E_M8)
    assert f["sampling/importance_sampling_ratio_raw/mean"] == approx((E_M1 + E_M8) / 2)
    assert f["sampling/importance_sampling_ratio_raw/max"] == approx(E_M1)


def test_trl_sequence_mask_at_the_cap():
    # S_0 = -0.3 + 1.5 = 1.2 -> ρ = 3.32012 > 3: masked to 0; S_1 = -0.5 + 0.4 = -0.1 -> ρ = 0.90484 stays.
    logp = torch.tensor([[-0.3, -1.0], [-0.5, -0.5]], dtype=torch.float64)
    logp_engine = torch.tensor([[-1.5, -1.0], [-0.4, -0.5]], dtype=torch.float64)
    f = figures("trl", logp, logp_engine, torch.ones(2, 2, dtype=torch.bool))
    assert f["sampling/importance_sampling_ratio/min"] == 0.0
    assert f["sampling/importance_sampling_ratio/mean"] == approx(E_M1 / 2)  # (0 + 0.90484) / 2
    assert f["sampling/importance_sampling_ratio/max"] == approx(E_M1)
    assert f["sampling/importance_sampling_ratio_raw/min"] == approx(E_M1)
    assert f["sampling/importance_sampling_ratio_raw/mean"] == approx((E_P12 + E_M1) / 2)  # 2.1124771703862534
    assert f["sampling/importance_sampling_ratio_raw/max"] == approx(E_P12)


def test_verl_training_hand_worked():
    f = figures("verl")
    # probability space, per token: p = exp(logp), q = exp(logp_engine)
    p = [E_M10, E_M5, E_M2, E_M30, E_M7]  # 0.36788, 0.60653, 0.81873, 0.04979, 0.49659
    q = [E_M11, E_M3, E_M2, E_M25, E_M4]  # 0.33287, 0.74082, 0.81873, 0.08208, 0.67032
    # |p − q| = 0.0350084, 0.1342876, 0, 0.0322979, 0.1737347
    d = [E_M10 - E_M11, E_M3 - E_M5, 0.0, E_M25 - E_M30, E_M4 - E_M7]
    assert f["training/rollout_probs_diff_mean"] == approx(sum(d) / 5)  # 0.0750657181885424
    assert f["training/rollout_probs_diff_max"] == approx(E_M4 - E_M7)  # 0.1737347422442298
    assert f["training/rollout_probs_diff_std"] == approx(std(d))  # 0.0746849
    # Pearson of p and q: Σ(p−p̄)(q−q̄) / √(Σ(p−p̄)² Σ(q−q̄)²)
    pm, qm = sum(p) / 5, sum(q) / 5
    cov = sum((a - pm) * (b - qm) for a, b in zip(p, q))
    r = cov / math.sqrt(sum((a - pm) ** 2 for a in p) * sum((b - qm) ** 2 for b in q))
    assert f["training/rollout_actor_probs_pearson_corr"] == approx(r)  # 0.9587347
    assert 0.95 < r < 0.96


def test_verl_rollout_corr_hand_worked():
    f = figures("verl")
    # kl = mean(logp_engine − logp) = mean(−ℓ) = 0.9 / 5
    assert f["rollout_corr/kl"] == approx(0.18)
    assert f["rollout_corr/k3_kl"] == approx(sum(K3) / 5)
    # per sequence: mean logp_engine − mean logp = −G: G_0 = -0.1/2 = -0.05, G_1 = -0.8/3; mean |.| = 0.158333
    assert f["rollout_corr/log_ppl_abs_diff"] == approx((0.05 + 0.8 / 3) / 2)
    # E[ρ²] − 1 over tokens: ρ² = e^{2ℓ} = e^0.2, e^-0.4, 1, e^-1.0, e^-0.6 (no clamp: |ℓ| < 20)
    assert f["rollout_corr/chi2_token"] == approx((E_P2 + E_M4 + 1 + E_M10 + E_M6) / 5 - 1)  # -0.2383172
    # E[(Π ρ)²] − 1 over sequences: e^{2S} = e^-0.2, e^-1.6
    assert f["rollout_corr/chi2_seq"] == approx((E_M2 + E_M16) / 2 - 1)  # -0.4896863
    # ESS, sequence level, threshold 2: w_0 = e^-0.1 = 0.90484 (inside [0.5, 2]), w_1 = e^-0.8 = 0.44933 -> 0.5.
    # Token-weighted (n = 2, 3; N = 5): m = (2·0.90484 + 3·0.5)/5 = 0.661935; ESS = m²·5 / (2·0.90484² + 3·0.25)
    m = (2 * E_M1 + 3 * 0.5) / 5
    assert f["rollout_corr/rollout_is_eff_sample_size"] == approx(m * m * 5 / (2 * E_M1**2 + 3 * 0.25))  # 0.917623


def test_verl_is_weight_clamped_above_and_safety_bound():
    # S_0 = 1.2 -> e^1.2 = 3.32 clamps to 2; S_1 = -0.1 -> 0.90484; n = 2, 2.
    logp = torch.tensor([[-0.3, -1.0], [-0.5, -0.5]], dtype=torch.float64)
    logp_engine = torch.tensor([[-1.5, -1.0], [-0.4, -0.5]], dtype=torch.float64)
    f = figures("verl", logp, logp_engine, torch.ones(2, 2, dtype=torch.bool))
    m = (2 * 2.0 + 2 * E_M1) / 4  # 1.452419
    assert f["rollout_corr/rollout_is_eff_sample_size"] == approx(m * m * 4 / (2 * 4.0 + 2 * E_M1**2))
    # one token with ℓ = 30: verl clamps log ρ to 20 before exp, so χ² = e^40 − 1 at both levels
    one = figures("verl", torch.tensor([[0.0]], dtype=torch.float64), torch.tensor([[-30.0]], dtype=torch.float64),
                  torch.ones(1, 1, dtype=torch.bool))
    assert one["rollout_corr/chi2_token"] == approx(math.exp(40) - 1)
    assert one["rollout_corr/chi2_seq"] == approx(math.exp(40) - 1)
    # one token: no std, no correlation
    assert math.isnan(one["training/rollout_probs_diff_std"])
    assert math.isnan(one["training/rollout_actor_probs_pearson_corr"])


def test_nemo_rl_hand_worked():
    f = figures("nemo-rl")
    # mean exp|ℓ| = (e^0.1 + e^0.2 + 1 + e^0.5 + e^0.3) / 5 = 6.3251537545119490 / 5
    assert f["token_mult_prob_error"] == approx((E_P1 + E_P2 + 1 + E_P5 + E_P3) / 5)  # 1.265030750902
    # k3 with log r = logp − logp_engine, token mean
    assert f["gen_kl_error"] == approx(sum(K3) / 5)  # 0.0342501103095962


def test_slime_hand_worked():
    # per-sample mean: seq 0 (0.1 + 0.2)/2 = 0.15, seq 1 (0 + 0.5 + 0.3)/3 = 0.26667; mean of the two = 0.208333
    # (the token mean would be 0.22: the short sequence weighs more here)
    assert figures("slime")["train_rollout_logprob_abs_diff"] == approx((0.15 + 0.8 / 3) / 2)


def test_skyrl_hand_worked():
    f = figures("skyrl")
    # |ℓ| = 0.1, 0.2, 0, 0.5, 0.3: mean 0.22; deviations -0.12, -0.02, -0.22, 0.28, 0.08;
    # squares 0.0144 + 0.0004 + 0.0484 + 0.0784 + 0.0064 = 0.148; unbiased variance 0.148 / 4 = 0.037
    assert f["policy/rollout_train_logprobs_abs_diff_mean"] == approx(0.22)
    assert f["policy/rollout_train_logprobs_abs_diff_std"] == approx(math.sqrt(0.037))  # 0.1923538
    assert f["policy/rollout_train_logprobs_abs_diff_max"] == approx(0.5)
    assert f["policy/rollout_train_logprobs_abs_diff_min"] == 0.0


def test_prime_rl_hand_worked():
    f = figures("prime-rl")
    # k3 sorted: 0, 0.0051709, 0.0187308, 0.0408182, 0.1065307 -> median (5 values) = 0.0187308 = k3(-0.2)
    assert f["mismatch_kl/all/mean"] == approx(sum(K3) / 5)
    assert f["mismatch_kl/all/median"] == approx(K_M2)
    assert f["mismatch_kl/all/std"] == approx(std(K3))  # 0.0433795
    assert f["mismatch_kl/all/min"] == 0.0
    assert f["mismatch_kl/all/max"] == approx(K_M5)
    # 4 tokens (the last of sequence 1 masked out too): k3 sorted 0, 0.0051709, 0.0187308, 0.1065307;
    # torch.median takes the lower middle value, 0.0051709 = k3(0.1), not the interpolated 0.0119508
    four = figures("prime-rl", mask=torch.tensor([[True, True, False], [True, True, False]]))
    assert four["mismatch_kl/all/median"] == approx(K_P1)


def test_openrlhf_hand_worked():
    # mean(logp_engine − logp) = 0.9 / 5
    assert figures("openrlhf")["vllm_kl"] == approx(0.18)


def test_nonfinite_tokens_are_left_out():
    # the masked-out token becomes a scored one with a NaN engine log-prob, and a fourth all-NaN padded position:
    # every figure is that of the batch above
    logp = torch.cat([LOGP, torch.full((2, 1), -1.0, dtype=torch.float64)], 1)
    logp_engine = torch.cat([LOGP_ENGINE, torch.full((2, 1), float("-inf"), dtype=torch.float64)], 1)
    logp_engine[0, 2] = float("nan")
    mask = torch.tensor([[True, True, True, True], [True, True, True, False]])
    for name in FRAMEWORKS:
        got, want = figures(name, logp, logp_engine, mask), figures(name)
        assert got == pytest.approx(want, rel=REL), name


def test_empty_mask_is_nan_everywhere():
    empty = torch.zeros(2, 3, dtype=torch.bool)
    for name in FRAMEWORKS:
        f = figures(name, mask=empty)
        assert f and all(math.isnan(v) for v in f.values()), (name, f)


def test_every_figure_is_a_float_and_fp32_inputs_work():
    for name in FRAMEWORKS:
        f = figures(name, LOGP.float(), LOGP_ENGINE.float(), MASK)
        assert all(isinstance(v, float) for v in f.values()), name
        # fp32 inputs: the same figures to fp32 rounding of the inputs
        assert f == pytest.approx(figures(name), rel=1e-5, abs=1e-6), name


def test_thresholds_name_real_figures():
    for (name, figure), (op, bound, source) in THRESHOLDS.items():
        assert figure in figures(name), (name, figure)
        assert op in (">", ">=", "<", "<=") and math.isfinite(bound) and source


def test_table_verdicts():
    rows = judged_figures(LOGP, LOGP_ENGINE, MASK, ["verl", "nemo-rl", "slime", "openrlhf"])
    by = {(r["framework"], r["figure"]): r for r in rows}
    assert len(rows) == 10 + 2 + 1 + 1
    assert set(rows[0]) == {"framework", "figure", "value", "threshold", "verdict"}
    # 0.0751 > 0.01, 1.265 > 1.05, 0.0343 > 1e-3, 0.2083 > 0.1: all over
    assert by["verl", "training/rollout_probs_diff_mean"]["threshold"] == "<= 0.01"
    assert by["verl", "training/rollout_probs_diff_mean"]["verdict"] == "over"
    assert by["nemo-rl", "token_mult_prob_error"]["verdict"] == "over"
    assert by["nemo-rl", "gen_kl_error"]["threshold"] == "<= 0.001"
    assert by["nemo-rl", "gen_kl_error"]["verdict"] == "over"
    assert by["slime", "train_rollout_logprob_abs_diff"]["verdict"] == "over"
    # no published bound: no threshold, no verdict
    assert by["openrlhf", "vllm_kl"]["threshold"] is None and by["openrlhf", "vllm_kl"]["verdict"] == "-"
    assert by["openrlhf", "vllm_kl"]["value"] == approx(0.18)

    # |ℓ| = 0.001 everywhere: |Δp| <= 0.001, exp(0.001) = 1.001, k3 ≈ 5e-7, 0.001: all ok
    small = judged_figures(LOGP, LOGP - 0.001, MASK, ["verl", "nemo-rl", "slime"])
    assert [r["verdict"] for r in small if r["threshold"]] == ["ok"] * 4
    # at the bound exactly: ℓ = 0 − (−0.1) = 0.1 exactly, slime's bound is value <= 0.1
    at = judged_figures(torch.zeros(1, 1, dtype=torch.float64), torch.full((1, 1), -0.1, dtype=torch.float64),
                         torch.ones(1, 1, dtype=torch.bool), ["slime"])
    assert at[0]["value"] == 0.1 and at[0]["verdict"] == "ok"
    # nothing scored: NaN, nothing to judge
    empty = judged_figures(LOGP, LOGP_ENGINE, torch.zeros(2, 3, dtype=torch.bool), ["verl"])
    assert empty[0]["threshold"] == "<= 0.01" and empty[0]["verdict"] == "-"


def test_table_unknown_framework():
    with pytest.raises(ConfigError, match="unknown; choose from trl, verl"):
        judged_figures(LOGP, LOGP_ENGINE, MASK, ["trl", "deepspeed-chat"])


@pytest.mark.parametrize("expr, gate", [
    ("fp32.outside_trust_region>0.01", Gate("fp32.outside_trust_region", ">", 0.01)),
    (" recipes.bf16.kl_k3 >= 1e-3 ", Gate("recipes.bf16.kl_k3", ">=", 0.001)),
    ("mismatch/beta_abs_mean<2", Gate("mismatch/beta_abs_mean", "<", 2.0)),
    ("beta_mean<=-0.05", Gate("beta_mean", "<=", -0.05)),
])
def test_parse_gate(expr, gate):
    assert parse_gate(expr) == gate


@pytest.mark.parametrize("expr, says", [
    ("", "expected KEY OP NUMBER"),
    ("fp32.outside_trust_region", "expected KEY OP NUMBER"),
    ("x=0.1", "expected KEY OP NUMBER"),
    ("x==0.1", "expected KEY OP NUMBER"),
    ("x!=0.1", "expected KEY OP NUMBER"),
    ("x>", "expected KEY OP NUMBER"),
    (">0.1", "expected KEY OP NUMBER"),
    ("x>0.1>0.2", "expected KEY OP NUMBER"),
    ("x>0.1\ny<2", "expected KEY OP NUMBER"),
    ("x>abc", "the bound 'abc' is not a number"),
    ("x>nan", "must be a finite number"),
    ("x<inf", "must be a finite number"),
    ("fp32..tokens>1", "empty part"),
    (".tokens>1", "empty part"),
])
def test_parse_gate_rejects(expr, says):
    with pytest.raises(GateError, match=says) as err:
        parse_gate(expr)
    assert isinstance(err.value, PhantomclipError)
    assert "\n" not in str(err.value) and str(err.value).startswith("--fail-if")


SUMMARY = {
    "fp32": {"outside_trust_region": 0.026, "tokens": 512, "lowp_highp_ratio": None},
    "bf16": {"outside_trust_region": 0.004},
    "arms": {"eps=0.2": {"phantom_rate": 0.18}},
    "runs": [{"phantom_rate": 0.1}, {"phantom_rate": 0.3}],
    "engine": {"kind": "local"},
}


def test_lookup():
    assert lookup(SUMMARY, "fp32.outside_trust_region") == 0.026
    assert lookup(SUMMARY, "fp32.tokens") == 512.0
    assert math.isnan(lookup(SUMMARY, "fp32.lowp_highp_ratio"))  # JSON null
    assert lookup(SUMMARY, "arms.eps=0.2.phantom_rate") == 0.18  # a key holding a dot
    assert lookup(SUMMARY, "runs.1.phantom_rate") == 0.3  # a list, by index
    with pytest.raises(GateError, match=r"no figure 'fp16\.outside_trust_region'.*fp32, bf16, arms, runs, engine"):
        lookup(SUMMARY, "fp16.outside_trust_region")
    with pytest.raises(GateError, match="no figure 'runs.2.phantom_rate'"):
        lookup(SUMMARY, "runs.2.phantom_rate")
    with pytest.raises(GateError, match="'fp32' is a group, not a number"):
        lookup(SUMMARY, "fp32")
    with pytest.raises(GateError, match="'engine.kind' is a str, not a number"):
        lookup(SUMMARY, "engine.kind")


def test_failed_gates():
    gates = [parse_gate(g) for g in (
        "fp32.outside_trust_region>0.01",  # 0.026 > 0.01: fails
        "bf16.outside_trust_region>0.01",  # 0.004: passes
        "fp32.tokens<100",  # 512: passes
        "fp32.lowp_highp_ratio>1",  # NaN satisfies no comparison: passes
        "fp32.outside_trust_region>=0.026",  # equal: >= holds, fails
        "runs.1.phantom_rate>0.2",  # 0.3: fails
    )]
    assert failed_gates(SUMMARY, gates) == [
        "fp32.outside_trust_region = 0.026, bound: > 0.01",
        "fp32.outside_trust_region = 0.026, bound: >= 0.026",
        "runs.1.phantom_rate = 0.3, bound: > 0.2",
    ]
    assert failed_gates(SUMMARY, []) == []
    with pytest.raises(GateError, match="no figure 'fp32.kl_k3'"):
        failed_gates(SUMMARY, [parse_gate("fp32.kl_k3>0.1")])
