"""Section 11 sets the page's data beside the seed article's claims, each tested on the data shown and said either
way: β's sign (a t interval on mean β), β against the advantage (Pearson's r with Fisher's interval), the phantom-clip
share, and the stall and its fixes. The demo first (hand-checked numbers), then altered data that flips each."""

import copy
import html
import math

import pytest

from phantomclip.maths.metrics import t_interval
from phantomclip.report import collect, demo_sources, render
from phantomclip.report.seed_article import beta_advantage, beta_bias, phantom_share, stall_and_fixes


@pytest.fixture(scope="module")
def demo():
    return collect(demo_sources())


def _baseline_runs(data):
    return [r for r in data.runs + data.fp8_runs if r.get("tokens") and (r.get("arm") or r["config"].get(
        "intervention")) == "none"]


def test_beta_bias_is_tested_and_said_either_way(demo):
    """The demo: section 4's 508 tokens hold no detectable bias (+0.0010 [−0.0039, +0.0060]); the FP8 experiment's
    bf16 baseline's 1152 logged tokens a negative one (−0.0066 [−0.0109, −0.0022]). Shifting every β of the
    diagnose file by −0.05 makes the histogram's tokens negative too."""
    text = beta_bias(demo)
    assert ("over the 508 tokens of section 4's histogram (fp32 trainer, before training), mean β = +0.0010 nats "
            "[-0.0039, +0.0060], no detectable bias") in text
    assert "over the 1152 logged training tokens of fp8 none/seed-0, mean β = -0.0066 nats [-0.0109, -0.0022], " \
           "negative, as the seed reports" in text
    shifted = copy.deepcopy(demo)
    arr = next(iter(shifted.diagnose[-1]["tokens"]["per_recipe"].values()))
    arr["beta"] = [None if b is None else b - 0.05 for b in arr["beta"]]
    assert "before training), mean β = -0.0490 nats" in beta_bias(shifted)
    assert "before training), mean β = -0.0490 nats [-0.0539, -0.0440], negative, as the seed reports" in \
        beta_bias(shifted)


def test_beta_advantage_correlation_with_its_interval(demo):
    """Pearson's r over the baseline runs' logged tokens of non-zero advantage, recomputed here by numpy's
    corrcoef (a second implementation), with Fisher's interval atanh(r) ± 1.96/√(n − 3); the demo's holds zero.
    Setting β = advantage/10 + a small alternation makes the link detectable."""
    import numpy as np

    pairs = [(b, a) for r in _baseline_runs(demo) for t in r["tokens"] for b, a in zip(t["beta"], t["advantage"])
             if b is not None and a]
    r = float(np.corrcoef([p[0] for p in pairs], [p[1] for p in pairs])[0, 1])
    half = 1.959964 / math.sqrt(len(pairs) - 3)
    low, high = math.tanh(math.atanh(r) - half), math.tanh(math.atanh(r) + half)
    assert len(pairs) == 808 and low < 0 < high
    text = beta_advantage(demo)
    assert (f"Over the 808 logged tokens of the baseline's 2 runs with a non-zero advantage, Pearson's r between β "
            f"and the advantage is {r:+.3f}, 95% interval [{low:+.3f}, {high:+.3f}]") in text
    assert text.endswith("no detectable link, where the seed found one.")
    linked = copy.deepcopy(demo)
    for run in _baseline_runs(linked):
        for t in run["tokens"]:
            t["beta"] = [a / 10 + 1e-3 * (-1) ** i for i, a in enumerate(t["advantage"])]
    assert beta_advantage(linked).endswith("a detectable link, as the seed reports.")


def test_stall_and_fixes_follow_the_sanity_experiment(demo):
    """The demo's baseline learns (its length falls by seed, the interval below zero) and no seed converges; of
    precision matching only match-bf16 ends detectably shorter and none converges; only force-r1 and no-clip
    converge in every seed: said as disagreeing with the seed's 'matching fixes it'. A baseline whose length does
    not move reads as a stall."""
    ends = []
    for r in demo.runs:
        if r.get("arm") == "none" or r["config"].get("intervention") == "none":
            rows = [m for m in r["metrics"] if m.get("completion/length_mean") is not None]
            ends.append(rows[-1]["completion/length_mean"] - rows[0]["completion/length_mean"])
    moved = t_interval(ends)
    text = stall_and_fixes(demo)
    assert f"(by seed {moved['mean']:+.1f} [{moved['low']:+.1f}, {moved['high']:+.1f}]): it learns, it does not " \
           "stall; 0 of 3 seeds converged" in text and moved["high"] < 0
    assert ("match-bf16 (ended shorter than the baseline, 0 of 3 seeds converged), fp16 (no detectable "
            "difference") in text
    assert text.endswith("Every seed converged only under force-r1 and no-clip; no precision-matching arm converged, "
                         "where the seed reports that matching fixes the run.")
    assert "far fewer" in phantom_share(demo) and "1.64% of all tokens [1.00%, 2.29%] over 3 seeds" in \
        phantom_share(demo)

    flat = copy.deepcopy(demo)  # each baseline seed alternates around its first length: last - first is -1, +1, -1
    for j, r in enumerate(r for r in flat.runs if r.get("arm") == "none" or r["config"].get("intervention") == "none"):
        first = r["metrics"][0]["completion/length_mean"]
        for i, m in enumerate(r["metrics"]):
            m["completion/length_mean"] = first + 0.5 * (-1) ** (i + j * (len(r["metrics"]) - 1))
    assert "no detectable fall: a stall, as the seed's" in stall_and_fixes(flat)


def test_section_11_is_on_the_demo_page_and_empty_without_data(demo):
    page = html.unescape(render(demo))
    section = page.split("11. Beside the seed article")[1].split("12. Appendix")[0]
    assert "β's sign." in section and "β and the advantage." in section and "The stall." in section
    from phantomclip.report.sources import ReportData

    empty = ReportData()
    assert beta_bias(empty) == beta_advantage(empty) == phantom_share(empty) == stall_and_fixes(empty) == ""
