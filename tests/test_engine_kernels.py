"""The engine's kernel choices against the paths they replace: the fused q/k/v and gate/up products of the static
decoder (decode.FusedLinears) must give what the separate packed Linears gave, token for token and log-prob for
log-prob, so that the goldens (tests/test_golden*.py) and every recorded figure stay as they were.

Why equality and not a tolerance: each output of a fused product is the same dot product over the same K inputs as
the part's own product; oneDNN's blocking along N does not reorder that sum, and `fuses_bit_identically` probes it
per shape on the running CPU before a fusion is used. The tolerance an eps-derived bound would allow (a reordered
sum: 2 eps sqrt(K) |x||w| per output) is therefore zero here, and anything above zero is a bug (a forgotten cast,
a bias read from the wrong part, a stale layout after a sync)."""

import pytest
import torch

from phantomclip.engines import decode
from phantomclip.engines.local import LocalEngine, SamplingParams
from test_decode import tiny_family

pytestmark = pytest.mark.skipif(not decode.can_pack(torch.float32),
                                reason="oneDNN's packed linear needs an x86 CPU with mkldnn")


def unfused(monkeypatch) -> None:
    """The decoder as before fusion: every Linear called on its own (the reference path)."""
    monkeypatch.setattr(decode.FusedLinears, "of", classmethod(lambda cls, owner, names: None))
    monkeypatch.setattr(decode, "fused_mlp", lambda mlp: None)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_product_equals_its_parts_and_follows_a_sync(dtype, bias):
    if not decode.can_pack(dtype):
        pytest.skip(f"no packed {dtype} kernel on this CPU")
    g = torch.Generator().manual_seed(0)
    owner = torch.nn.Module()
    for name, n in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32)):
        lin = torch.nn.Linear(48, n, bias=bias).to(dtype)
        with torch.no_grad():
            for p in lin.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        setattr(owner, name, lin)
    names = ("q_proj", "k_proj", "v_proj")
    assert decode.pack_linears(owner) == 3
    fused = decode.FusedLinears.of(owner, names)
    assert fused is not None and decode.FusedLinears.of(owner, names) is fused  # kept on the owner across calls
    for step in range(2):
        for rows in (1, 16, 200):
            x = torch.randn(rows, 48, generator=g).to(dtype)
            with torch.no_grad():
                got = fused(x)
                want = [getattr(owner, n)(x) for n in names]  # each part's own packed product
            for a, b in zip(got, want):
                assert a.dtype == b.dtype == dtype and torch.equal(a, b), (step, rows)
        with torch.no_grad():  # a weight sync writes in place: the fused layout must follow (and the bias, live)
            for n in names:
                for p in getattr(owner, n).parameters():
                    p.mul_(1.5)


def test_a_fusion_that_rounds_otherwise_is_not_used(monkeypatch):
    """Where the probe finds the fused product rounding otherwise than the parts, the parts run as before."""
    owner = torch.nn.Module()
    owner.gate_proj, owner.up_proj = torch.nn.Linear(40, 24), torch.nn.Linear(40, 24)
    decode.pack_linears(owner)
    monkeypatch.setattr(decode, "_FUSED_IDENTICAL", {((24, 24), 40, True, torch.float32): False})
    assert decode.FusedLinears.of(owner, ("gate_proj", "up_proj")) is None
    monkeypatch.setattr(decode, "_FUSED_IDENTICAL", {})
    assert decode.FusedLinears.of(owner, ("gate_proj", "up_proj")) is not None  # probed here: identical
    owner.up_proj.register_forward_hook(lambda *a: None)  # a hook the fused call would skip: not fused
    assert decode.FusedLinears.of(owner, ("gate_proj", "up_proj")) is None


@pytest.mark.parametrize("model_type", decode.FAMILIES)
@pytest.mark.parametrize("dtype,matmul", [(torch.float32, "auto"), (torch.bfloat16, "auto"),
                                          (torch.bfloat16, "emulated")])
def test_engine_on_fused_products_samples_what_the_unfused_engine_sampled(monkeypatch, model_type, dtype, matmul):
    """Per token: the same sampled tokens and bit-identical log-probs (raw and processed, with top-p so that both
    are exercised) from the engine with fused products as from the engine calling each Linear alone, per family
    (qwen2 carries q/k/v biases, qwen3 per-head norms on the split q and k) and kernel."""
    master = tiny_family(model_type)
    prompts = [[5, 17, 99, 3, 250, 41], [7, 8], [300, 2, 64, 64]]
    params = SamplingParams(max_tokens=12, seed=4, top_p=0.95)
    engine = LocalEngine(master, dtype, matmul=matmul)
    dec = decode.StaticDecoder(engine.model, 1, 2)
    assert all(f is not None for f in dec.qkv + dec.gate_up), "the tiny families' products fuse on this CPU"
    fused = engine.generate(prompts, params)
    with monkeypatch.context() as m:
        unfused(m)
        reference = LocalEngine(master, dtype, matmul=matmul).generate(prompts, params)
    assert fused.completion_ids == reference.completion_ids
    for a, b in ((fused.logp_engine, reference.logp_engine),
                 (fused.logp_engine_processed, reference.logp_engine_processed)):
        for row_a, row_b in zip(a, b):
            diffs = [abs(x - y) for x, y in zip(row_a, row_b)]
            assert max(diffs) == 0.0, f"{model_type} {dtype} {matmul}: max |Δ logp| {max(diffs):.3e}, expected 0"
