"""The seed article's claims, as data the page can set its own measurements beside: Hugging Face, "Defeating the
trainer-generator precision mismatch in TRL" (April 2026; Qwen3-0.6B, reward = −completion length, an fp32 trainer
against a bf16 vLLM engine; /work/shared/DESIGN.md section 1 summarises it). Only what the article states is here;
every figure of this page's own is computed from the files when the page is built."""

from __future__ import annotations

SEED = ("Hugging Face, \u201cDefeating the trainer-generator precision mismatch in TRL\u201d (April 2026; Qwen3-0.6B, "
        "an fp32 trainer against a bf16 vLLM engine)")
"""the seed article as the page cites it."""
SEED_PHANTOM_SHARE = 0.18
"""'about 18% of tokens phantom-clipped early in training': a share of all tokens, the base rate the summary's
share of clipped tokens is set beside."""
