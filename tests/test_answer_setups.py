"""The answer for each trainer setup a framework runs (setups.SETUPS: TRL GRPOTrainer with each of its IS modes and
with its correction off, TRL AsyncGRPOTrainer, verl decoupled and bypass), on one real diagnose run of a tiny model:
the status and the first change checked against a second computation written here, from the run's per-token β and
plain Python (no phantomclip function), with the rules the docs state:
  β in the clip (async, bypass)       a token is touched when β is outside [log(1 − ε_low), log(1 + ε_high)]
  β in an IS weight (TRL, verl)        token modes: β > log C; sequence modes: every token of a sequence with Σβ > log C
  β in no ratio (correction off)       as the clip: the tokens outside are trained on uncorrected
  status                              touched share ≤ 0.1% ok, ≥ 10% will stall, else at risk
  a change                            one-sided sign test on units (tokens, or sequences under a sequence mode) touched
                                      with the user's recipe only against with the alternative only, p < 0.05 / the
                                      number of alternatives tested; the first change touches the fewest tokens
The run's ε and caps are chosen from a first run so that each rule touches a few tokens: each case has something to
judge (random weights: the mechanism, not a real model's size)."""

import math

import pytest

from phantomclip.answer.decide import answer
from phantomclip.answer.verdict_text import one_line, verdict
from phantomclip.diagnose.job import DiagnoseConfig, run_diagnose

TINY = dict(model="tiny-random:0", n=16, max_tokens=16, seed=0, batch_invariance=False, framework=["trl"])


def _beta(result: dict, name: str) -> list[float]:
    return result["tokens"]["per_recipe"][name]["beta"]


def _between(values: list[float], k: int) -> float:
    """A threshold with exactly k of `values` above it: the midpoint of the k-th and (k+1)-th largest (per-token β is
    rounded to 1e-6 in the JSON; a midpoint keeps the threshold off every value)."""
    top = sorted(values, reverse=True)
    return (top[k - 1] + top[k]) / 2


@pytest.fixture(scope="module")
def run() -> dict:
    """One diagnose of tiny-random:0 (fp32 the user's recipe, fp16 beside it, bf16 the local engine's stand-in) with ε
    and caps set so that 6 tokens are outside the trust region, 6 tokens above the token cap and 2 sequences above
    the sequence cap (read from a first run on the same seed: the same samples)."""
    first = run_diagnose(DiagnoseConfig(trainer=["fp32"], **TINY))
    beta, seq = _beta(first, "fp32"), first["tokens"]["sequence"]
    sums = [sum(b for b, s in zip(beta, seq) if s == row) for row in sorted(set(seq))]
    epsilon = math.expm1(_between(beta, 6))
    cfg = DiagnoseConfig(trainer=["fp32", "fp16", "bf16"], epsilon=min(epsilon, 0.9), epsilon_high=epsilon,
                         token_cap=math.exp(_between(beta, 6)), seq_mask_cap=math.exp(_between(sums, 2)), **TINY)
    result = run_diagnose(cfg)
    assert _beta(result, "fp32") == beta  # the same samples, the same β
    return result


def _as(run: dict, setup: str, mode: str = "", answer_in: str = "trl") -> dict:
    r = {**run, "config": {**run["config"], "setup": setup, "is_mode": mode, "answer_in": answer_in}}
    return r


# ------------------------------------------------------------------------------ the second computation


def _touched(result: dict, beta: list, where: str, mode: str = "") -> list[bool]:
    """Per token, touched under the rule of `where` ('clip', 'none', 'weight' with `mode`)."""
    c, seq = result["config"], result["tokens"]["sequence"]
    if where != "weight":
        return [b < math.log(1 - c["epsilon"]) or b > math.log(1 + c["epsilon_high"]) for b in beta]
    if mode.startswith("token"):
        return [b > math.log(c["token_cap"]) for b in beta]
    sums = {}
    for b, s in zip(beta, seq):
        sums[s] = sums.get(s, 0.0) + b
    return [sums[s] > math.log(c["seq_mask_cap"]) for s in seq]


def _units(result: dict, flags: list[bool], mode: str) -> list[bool]:
    if not mode.startswith("sequence"):
        return flags
    by = {}
    for f, s in zip(flags, result["tokens"]["sequence"]):
        by[s] = by.get(s, False) or f
    return [by[s] for s in sorted(by)]


def _p(worse: int, better: int) -> float:
    n = worse + better
    return sum(math.comb(n, k) for k in range(worse, n + 1)) / 2**n if n else 1.0


def _status(share: float) -> str:
    return "ok" if share <= 0.001 else "will stall" if share >= 0.10 else "at risk"


def _up3(x: float) -> float:
    """x rounded up to 3 significant digits (the printed setting still does what its line says)."""
    scale = 10 ** (2 - math.floor(math.log10(abs(x))))
    return math.ceil(x * scale) / scale


def _wider(r: dict, where: str, mode: str) -> dict | None:
    """The knob the answer may widen, by the rule: the knob advice's keep setting (the run's `knobs`, whose maths
    tests/test_knobs.py checks) rounded up, never below the user's, at most twice it; the config as it would be."""
    c, knobs = r["config"], r["knobs"]
    if where == "clip":
        keep = knobs["clip"]["keep"]
        low, high = max(c["epsilon"], _up3(keep["epsilon_low"])), max(c["epsilon_high"], _up3(keep["epsilon_high"]))
        if (low, high) == (c["epsilon"], c["epsilon_high"]) or low > 2 * c["epsilon"] or low >= 1 or \
                high > 2 * c["epsilon_high"]:
            return None
        return {**c, "epsilon": low, "epsilon_high": high}
    if where == "weight":
        field = "token_cap" if mode.startswith("token") else "seq_mask_cap"
        need = knobs[mode if mode in knobs else "sequence_mask"]["keep"]["cap"]
        if need <= c[field] or _up3(need) > 2 * c[field]:
            return None
        return {**c, field: max(c[field], _up3(need))}
    return None


def _expected(r: dict, setup: str, mode: str, where: str) -> tuple[list, list]:
    """(every alternative tested as (kind, share touched, p), the kinds offered, fewest tokens touched first)."""
    mine_beta = _beta(r, "fp32")
    mine = _touched(r, mine_beta, where, mode)
    # bf16: the local engine's stand-in, never offered; nor is with_shadow_ratio for TRL GRPOTrainer (its IS weight
    # on β_kernel alone): β_kernel against the local engine is the stand-in's own prefill-against-decode gap
    alternatives = {"recipe": (r, _beta(r, "fp16"), mode, mode)}
    if where == "weight":  # the truncating mode of the other unit at the user's cap, counted on sequences
        cap = r["config"]["seq_mask_cap" if mode.startswith("sequence") else "token_cap"]
        other = "token_truncate" if mode.startswith("sequence") else "sequence_truncate"
        alternatives["mode"] = ({**r, "config": {**r["config"], "token_cap": cap, "seq_mask_cap": cap}}, mine_beta,
                                other, "sequence")
    wider = _wider(r, where, mode)
    if wider is not None:
        alternatives["widen"] = ({**r, "config": wider}, mine_beta, mode, mode)
    tested = []
    for kind, (cfg, beta, their_mode, unit) in alternatives.items():
        theirs = _touched(cfg, beta, where, their_mode)
        a, b = _units(r, mine, unit), _units(r, theirs, unit)
        worse = sum(x and not y for x, y in zip(a, b))
        better = sum(y and not x for x, y in zip(a, b))
        tested.append((kind, sum(theirs) / len(theirs), _p(worse, better)))
    offered = sorted((t for t in tested if t[2] < 0.05 / len(tested)), key=lambda t: t[1])
    return tested, [t[0] for t in offered]


KINDS = {"recipe": lambda c: c["fields"] is not None and any("dtype" in k for k in c["fields"]),
         "mode": lambda c: "vllm_importance_sampling_mode" in c["setting"] or "rollout_is=" in c["setting"],
         "widen": lambda c: " at this " in c["effect"]}
"""how each kind of change is told apart in the answer's JSON."""


CASES = [  # setup, is_mode, where β meets the loss
    ("trl-grpo", "token_truncate", "weight"), ("trl-grpo", "token_mask", "weight"),
    ("trl-grpo", "sequence_truncate", "weight"), ("trl-grpo", "sequence_mask", "weight"),
    ("trl-grpo", "none", "none"), ("trl-async", "", "clip"),
    ("verl-decoupled", "token_truncate", "weight"), ("verl-bypass", "", "clip"),
]


@pytest.mark.parametrize("setup, mode, where", CASES)
def test_status_and_first_change_per_setup(run, setup, mode, where):
    framework = "verl" if setup.startswith("verl") else "trl"
    r = _as(run, setup, mode, framework)
    mine = _touched(r, _beta(r, "fp32"), where, mode)
    share = sum(mine) / len(mine)
    ans = answer(r)
    assert ans["contract"]["setup"] == setup and ans["contract"]["beta_in"] == where
    assert ans["status"] == _status(share) and ans["reasons"][0].startswith(f"{100 * share:.2f}% of tokens"), \
        (share, ans["reasons"][0])
    if ans["status"] == "ok":
        assert ans["changes"] == []
        return
    tested, offered = _expected(r, setup, mode, where)
    measured = [c for c in ans["changes"] if c["share"] is not None]
    assert [next(k for k, told in KINDS.items() if told(c)) for c in measured] == offered, (tested, ans["changes"])
    for c, kind in zip(measured, offered):
        assert c["share"] == pytest.approx(next(t[1] for t in tested if t[0] == kind), abs=1e-12)
    shadow = {"trl-async": "with_async_shadow_ratio(AsyncGRPOTrainer)"}.get(setup)  # verl has no hook
    assert [c["setting"] for c in ans["changes"] if c["share"] is None] == ([shadow] if shadow else [])
    if where != "clip":  # β is not in the clip: no ε, and no shadow ratio for the clip
        assert not any("epsilon" in c["setting"] or "clip_ratio" in c["setting"] for c in ans["changes"])
    if where == "none":
        assert "  turn its correction on: vllm_importance_sampling_correction: true" in ans["reasons"]


@pytest.mark.parametrize("setup, mode, where", CASES)
def test_the_verdict_states_the_answers_status_and_changes(run, setup, mode, where):
    """One verdict: the paragraph under the answer names the same status and the same changes in the same order,
    from one computation (the answer's block); under OK it offers none."""
    r = _as(run, setup, mode, "verl" if setup.startswith("verl") else "trl")
    ans, said = answer(r), verdict(r)
    head = f"As the answer above says ({ans['status'].upper()})"
    assert said.count("As the answer above says") == 1 and head in said
    sentence = said[said.index(head):]
    if not ans["changes"]:
        assert sentence.startswith(head + ": ") and "change," not in sentence
        return
    listed = sentence[len(head + ", change, fewest tokens touched first: "):]
    positions = [listed.index(f"{one_line(c)} ({c['effect']})") for c in ans["changes"]]
    assert positions == sorted(positions) and positions[0] == 0
