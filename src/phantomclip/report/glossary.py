"""The page's glossary box: every unit, symbol and name the figures and tables use without defining them
("nats", "neglen", "dapo", "mean |·|" among them). The task names and their definitions come from
tasks.TASKS, so a new task is defined here the day it exists. docs/metrics.md, section Glossary, holds the same
terms for the documentation."""

from __future__ import annotations

import re

from .escape import html_text

TERMS: dict[str, str] = {
    "nats": "the unit of a natural-log difference: β = 0.18 nats is a probability ratio of e^0.18 ≈ 1.2.",
    "mean |·|": "the mean of the absolute values (mean |β|: the average size of β whatever its sign).",
    "α": "the policy's real change in the ratio: the same forward at the current and at the rollout's weights.",
    "β": "the trainer's log-probability of a token minus the engine's, at the same weights, minus α; β_precision and "
         "β_kernel are its two exact parts (section 3).",
    "ε, trust region": "PPO's clip range: the ratio r = e^(α+β) is clipped to [1 − ε, 1 + ε].",
    "phantom-clipped": "a token whose gradient the clip zeroed although α alone would not have been clipped.",
    "ulp": "unit in the last place: the spacing between a number and its neighbour in a format (section 1).",
    "fp32, fp16, bf16": "32-bit float; 16-bit float with 11 significant bits; bfloat16, 16 bits with fp32's exponent "
                        "range and 8 significant bits.",
    "recipe": "how a forward runs from the fp32 master weights: fp32, bf16, fp16, bf16-autocast, fp32-head.",
    "FP8, E4M3": "8-bit float with 4 exponent and 3 mantissa bits (largest 448); an FP8 engine (fp8-w8a8, vLLM's "
                 "quantization='fp8') stores each Linear's weight in it with one scale per tensor and each token's "
                 "activations with one scale per token (section 8).",
    "emulated FP8": "the FP8 engine of this page: phantomclip's local engine with vLLM's quantisers bit for bit on a "
                    "CPU, the E4M3 products summed in fp32 in one order (a GPU's kernel sums in another, which moves "
                    "single tokens' β_quant; section 8).",
    "β_quant": "an FP8 engine's own part of β: its recipe without the quantisers against the same recipe with them "
               "(β = β_precision + β_quant + β_kernel, section 8).",
    "MoE, router, flip": "mixture of experts: each token runs k of E experts per layer, picked by a router; a flip is "
                         "an expert choice of the trainer that differs from the engine's (section 9).",
    "β_route, β_rest": "β split on an MoE model: the trainer's own routes against the engine's replayed, and "
                       "everything else; they add up to β token by token (section 9).",
    "r3": "rollout routing replay (R3): the trainer's forwards use the experts the engine chose, removing β_route "
          "(section 9).",
    "tis, mis, icepop": "corrections that reweigh or mask tokens by the ratio π/μ of trainer to engine: truncated "
                        "(TIS), masked per sequence (MIS), masked outside [0.5, 2] (IcePop).",
    "arm": "one intervention of an experiment (none: the baseline), run under each seed.",
    "seed": "one run's random seed; an arm's seeds differ only in it.",
    "pp": "percentage points: the difference of two percentages.",
    "grpo, dapo, dr_grpo": "how the loss averages over tokens (the run's loss_type): per sequence then over sequences "
                           "(GRPO); over every token of the batch (DAPO, Yu et al. 2025); a sum over a fixed length "
                           "(Dr. GRPO, Liu et al. 2025).",
}
"""term -> its definition, as the page shows it."""


def terms() -> dict[str, str]:
    """TERMS and every task name (task: its description from tasks.TASKS)."""
    from ..training.tasks import TASKS

    return {**TERMS, **{f"{name} (task)": t.doc for name, t in TASKS.items()}}


def term_id(term: str) -> str:
    """The id of a term's <dt>: 'glossary-' and its ASCII letters, digits and dashes ('mean |·|' -> 'glossary-mean',
    'neglen (task)' -> 'glossary-neglen-task'); a term of none of them ('α') by its code point ('glossary-u3b1')."""
    slug = "-".join(re.findall(r"[a-z0-9_]+", term.lower())) or "u" + "-".join(f"{ord(c):x}" for c in term.strip())
    return f"glossary-{slug}"


def html_glossary() -> str:
    """A folded box of the terms, after the summary; each is a <dt> with an id (term_id), so a page can link to it,
    and a link to the box or a term opens the box (layout.js openLinked)."""
    items = "".join(f'<dt id="{term_id(term)}">{html_text(term)}</dt><dd>{html_text(text)}</dd>'
                    for term, text in terms().items())
    return ('<details class="glossary" id="glossary"><summary>Glossary: the units, symbols and names on this page '
            '(docs/metrics.md, section Glossary, has the full list)</summary>'
            f"<dl>{items}</dl></details>")
