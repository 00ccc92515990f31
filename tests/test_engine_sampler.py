"""`engine.sample_next_token` against the sampler as first written, bit for bit.

The sampler's CDF now lives in one reused fp64 buffer (cast, exp and cumsum in place), temperature 1 skips its
division, and the "last token with mass" pass runs only when u reaches the total; none of that may move a sampled
token or a log-prob. `reference_sample_next_token` is the first version (engine.py at cbddab7, now engines/local.py),
kept here verbatim in its arithmetic, and every case compares tokens and both log-probs with torch.equal (NaN-aware
where a row is NaN).
"""

import pytest
import torch

from phantomclip.engines.local import LocalEngine, SamplingParams, _Sampler, sample_next_token
from phantomclip.precision.scoring import truncate_logprobs


def reference_sample_next_token(logits, generator, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The sampler of cbddab7: out-of-place fp64 probabilities and CDF, the last-with-mass clamp on every row."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # [B, V]
    logp_kept = truncate_logprobs(logp_all, top_k, top_p, min_p)  # [B, V]
    probs = logp_kept.double().exp()  # [B, V]
    cdf = torch.cumsum(probs, dim=-1)  # [B, V]
    u = torch.rand(cdf.shape[0], 1, generator=generator, dtype=torch.float64, device=cdf.device) * cdf[:, -1:]
    token = torch.searchsorted(cdf, u, right=True).squeeze(-1)  # [B]
    last_nonzero = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)  # [B]
    token = torch.minimum(token, last_nonzero)
    return token, logp_all.gather(-1, token[:, None]).squeeze(-1), logp_kept.gather(-1, token[:, None]).squeeze(-1)


SETTINGS = [
    {},  # what RL runs: temperature 1, the full vocabulary
    {"temperature": 0.7},
    {"temperature": 1.3, "top_p": 0.9},
    {"top_k": 50},
    {"min_p": 0.05, "top_k": 5, "top_p": 0.5},
]


def assert_same(ref, new, what):
    for name, a, b in zip(("token", "logp", "logp_processed"), ref, new):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, name)
        same = torch.equal(a, b) or (torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(
            a[~torch.isnan(a)], b[~torch.isnan(b)]))
        assert same, f"{what}: {name} differs at {(a != b).nonzero().flatten()[:5].tolist()}"


def random_logits(seed: int) -> torch.Tensor:
    """A [B, V] case: odd and even widths (exp's vector lanes and scalar tail fall differently), peaked and flat
    distributions, bf16/fp16/fp32 logits, some with -inf entries (zero-mass tokens inside the CDF)."""
    g = torch.Generator().manual_seed(seed)
    B, V = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(2, 1500, (1,), generator=g))
    scale = (0.5, 3.0, 10.0, 40.0)[seed % 4]
    logits = (torch.randn(B, V, generator=g) * scale).to((torch.float32, torch.bfloat16, torch.float16)[seed % 3])
    if seed % 5 == 0:
        logits[:, ::3] = float("-inf")
    return logits


@pytest.mark.parametrize("threads", [1, 2])
def test_sampler_equals_the_first_version_bit_for_bit(threads):
    # 40 shapes x 5 settings, at 1 and 2 threads (a contiguous exp splits over threads: the lanes move with it)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for seed in range(40):
            logits = random_logits(seed)
            workspace = torch.empty(logits.shape, dtype=torch.float64)
            for kw in SETTINGS:
                ref = reference_sample_next_token(logits, torch.Generator().manual_seed(seed), **kw)
                for ws in (None, workspace):  # without a buffer, and with one reused (stale contents) across settings
                    new = sample_next_token(logits, torch.Generator().manual_seed(seed), workspace=ws, **kw)
                    assert_same(ref, new, f"seed {seed} {tuple(logits.shape)} {logits.dtype} {kw} threads {threads}")
    finally:
        torch.set_num_threads(before)


def test_sampler_equals_the_first_version_at_the_bundled_models_width():
    # 64 x 49,152 bf16 logits (the bundled model's vocabulary, the bench's 64 rows), plain and nucleus, 3 steps on one
    # generator as a decode loop draws them (the workspace reused between steps)
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 49152, generator=g) * 4).bfloat16()
    workspace = torch.empty(64, 49152, dtype=torch.float64)
    for kw in ({}, {"top_p": 0.95}):
        g_ref, g_new = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
        for step in range(3):
            ref = reference_sample_next_token(logits, g_ref, **kw)
            assert_same(ref, sample_next_token(logits, g_new, workspace=workspace, **kw), f"{kw} step {step}")


def test_u_at_the_total_and_nan_rows_take_the_last_token_with_mass(monkeypatch):
    # u = r * total with r rounding to 1 gives u == total: searchsorted(right=True) returns V, outside the
    # vocabulary; both versions then take the last token with mass (here index 5: the -inf tail has none).
    # torch.rand is replaced by ones for that one draw (rand itself never returns 1; its rounding with the
    # multiplication can). A NaN row has a NaN total and goes the same way.
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5, -1.0, 0.3] + [float("-inf")] * 4,
                           [0.0, 1.0, 2.0, 0.5, -1.0, 0.3, 0.1, 0.2, 0.4, -0.2],
                           [float("nan")] * 10])  # [3, 10]
    monkeypatch.setattr(torch, "rand", lambda *a, generator=None, dtype=None, device=None: torch.ones(
        *a, dtype=dtype, device=device))
    ref = reference_sample_next_token(logits, torch.Generator())
    new = sample_next_token(logits, torch.Generator())
    assert_same(ref, new, "u == total")
    assert new[0].tolist()[:2] == [5, 9]  # the last token with mass per row (hand-read from the logits above)


def test_decode_loop_reuses_one_workspace_and_samples_as_before(tiny, tiny_prompts):
    # The engine's own sampler object: one fp64 buffer per generate, and the tokens of a whole generate equal to
    # what the reference sampler gives on the same logits, step after step.
    engine = LocalEngine(tiny.model, torch.float32)
    params = SamplingParams(max_tokens=6, seed=5, temperature=0.9)
    sampler = _Sampler(params, engine.device)
    g_ref = torch.Generator().manual_seed(params.seed)
    logits = torch.randn(len(tiny_prompts), tiny.model.config.vocab_size, generator=torch.Generator().manual_seed(0))
    buffers = set()
    for step in range(3):
        new = sampler.pick(step, logits)
        buffers.add(sampler.workspace.data_ptr())
        assert_same(reference_sample_next_token(logits, g_ref, temperature=0.9), new, f"step {step}")
    assert len(buffers) == 1
    ro = engine.generate(tiny_prompts, params)
    assert ro.completion_ids == engine.generate(tiny_prompts, params).completion_ids
