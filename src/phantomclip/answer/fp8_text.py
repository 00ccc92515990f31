"""diagnose's lines for an FP8 engine (the result's 'fp8' key, diagnose.fp8_figures): the FP8 engine beside the plain
engine on the same samples, β_quant, and what the quantisers cost in trust region. Words only: every figure is read
from the result, none is computed here."""

from __future__ import annotations


def _pct(v: float | None) -> str:
    return "n/a" if v is None or v != v else f"{100 * v:.1f}%"


def _num(v: float | None) -> str:
    return "n/a" if v is None or v != v else f"{v:.4f}"


def fp8_lines(result: dict) -> list[str]:
    """Plain-text lines for the 'fp8' key of a diagnose result (empty without one)."""
    f = result.get("fp8")
    if not f:
        return []
    fp8, plain = f["engine_recipe"], f["plain_recipe"]
    q, e, tr = f["beta_quant"], f["engines"], f["trust_region"]
    quant_line = (f"  β_quant = {plain} shadow − {fp8} shadow (the quantisers alone, same weights and kernels): mean "
                  f"{_num(q['beta_mean'])}, mean |·| {_num(q['beta_abs_mean'])}, p99 |·| {_num(q['beta_abs_p99'])}, "
                  f"outside {_pct(q['outside_trust_region'])}")
    if e is None:  # an engine that cannot read given tokens (vLLM): the shadows' split only
        return [f"FP8 engine {fp8} on {q['tokens']} tokens (every figure: JSON fp8; the {plain} engine's own reading "
                "of these samples is not measured with this engine: --engine local measures it):", quant_line,
                _pushed_line(tr)]
    lines = [
        f"FP8 engine {fp8} beside the {plain} engine on the same {q['tokens']} tokens (every figure: JSON fp8):",
        f"  the engines' own gap, {plain} − {fp8} engine: mean {_num(e['beta_mean'])}, mean |·| "
        f"{_num(e['beta_abs_mean'])}, p99 |·| {_num(e['beta_abs_p99'])}, outside the trust region "
        f"{_pct(e['outside_trust_region'])}",
        quant_line,
        f"  {'trainer':<14}{'mean |β| vs FP8':>17}{'vs ' + plain:>12}{'outside vs FP8':>16}{'vs ' + plain:>12}",
    ]
    for name, vs_plain in f["recipes_plain_engine"].items():
        vs_fp8 = result["recipes"].get(name, {})
        lines.append(f"  {name:<14}{_num(vs_fp8.get('beta_abs_mean')):>17}{_num(vs_plain['beta_abs_mean']):>12}"
                     f"{_pct(vs_fp8.get('outside_trust_region')):>16}{_pct(vs_plain['outside_trust_region']):>12}")
    return [*lines, _pushed_line(tr), ORDER_LINE]


ORDER_LINE = ("  the local FP8 engine is emulated (vLLM's quantisers bit for bit, the E4M3 products summed in fp32 in "
              "one order; a GPU kernel sums in another): single tokens' β_quant move with the order, so read the "
              "means and the shares outside, not one token's β (trace --recipe ... --against its plain recipe "
              "measures the spread over orders)")
"""said under an emulated FP8 engine's figures (the local engine's; vLLM's own FP8 kernels are not emulated)."""


def _pushed_line(tr: dict) -> str:
    return (f"  the quantisers push {_pct(tr['pushed_out'])} of the {tr['recipe']} trainer's tokens outside the "
            f"trust region ({_pct(tr['outside'])} outside with β_quant, {_pct(tr['outside_without_quant'])} "
            f"without it; {_pct(tr['pulled_in'])} pulled in)")


QUANT_CELLS = {"quant |β|": ("split", "quant", "beta_abs_mean"),
               "quant out": ("split", "quant", "outside_trust_region")}
"""diagnose's split table's further columns for an FP8 engine (split.quant: β_quant, the quantisers alone)."""


def split_title(result: dict) -> str:
    """The split table's title: an FP8 engine's three parts (β_precision against the plain shadow), else two."""
    fp8 = result.get("fp8")
    if fp8:
        return (f"β = β_precision (vs the plain {fp8['plain_recipe']} shadow) + β_quant (plain vs FP8 shadow) + "
                f"β_kernel (the {fp8['engine_recipe']} shadow vs the engine)")
    return f"β = β_precision (vs the {result['shadow']['recipe']} shadow) + β_kernel (shadow vs engine)"


def fp8_split_head(result: dict, name: str, now: float, split: dict, what: str) -> tuple[str, float]:
    """The FP8 engine's three-part split for recipe `name`, in words, and what matching the kernels alone would
    leave: β_precision + β_quant (the recipe against the FP8 shadow, fp8.recipes_fp8_shadow), not β_precision alone."""
    fp8, eng = result["fp8"], result["engine"]
    prec, quant = split["precision"]["beta_abs_mean"], split["quant"]["beta_abs_mean"]
    kern = split["kernel"]["beta_abs_mean"]
    left = (fp8.get("recipes_fp8_shadow") or {}).get(name, {}).get("beta_abs_mean")
    left = prec + quant if left is None else left  # an older file: the parts' sizes bound what is left
    head = (f"β = β_precision + β_quant + β_kernel: for {name} (mean |β| {now:.4f}), β_precision ({name} against the "
            f"plain {fp8['plain_recipe']} shadow) has mean |·| {prec:.4f}, β_quant (that shadow against the "
            f"{fp8['engine_recipe']} shadow: the quantisers alone, emulated) {quant:.4f} and β_kernel (the "
            f"{fp8['engine_recipe']} shadow against the {eng['dtype']} FP8 engine: {what}) {kern:.4f}; β_precision + "
            f"β_quant, what matching the kernels would leave, has mean |·| {left:.4f}.")
    return head, left
