import copy
import os

import pytest
import torch

from conftest import offline
from phantomclip.models.load import ModelError, atomic_save_dir, load_model, tiny_tokenizer


def test_tiny_random_is_seeded_and_sized():
    a, b, c = load_model("tiny-random:1"), load_model("tiny-random:1"), load_model("tiny-random:2")
    wa, wb, wc = (m.model.model.layers[0].mlp.up_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert a.model.config.num_hidden_layers == 2 and a.model.config.hidden_size == 64
    assert all(p.dtype == torch.float32 for p in a.model.parameters())
    # init std is the third field: std 0.3 by default, 0.05 when asked
    assert 0.25 < wa.std().item() < 0.35
    assert 0.04 < load_model("tiny-random:1:0.05").model.model.layers[0].mlp.up_proj.weight.std().item() < 0.06


def test_tiny_moe_is_a_seeded_qwen3_moe_with_its_router_scale():
    from phantomclip.models.load import TINY_MOE_ROUTER_STD

    a, b, c = load_model("tiny-moe:1"), load_model("tiny-moe:1"), load_model("tiny-moe:2")
    ga, gb, gc = (m.model.model.layers[0].mlp.gate.weight for m in (a, b, c))  # [8 experts, 64]
    assert torch.equal(ga, gb) and not torch.equal(ga, gc)
    cfg = a.model.config
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok, cfg.num_hidden_layers) == ("qwen3_moe", 8, 2, 2)
    # the routers at their own scale (512 draws: the sample std is within 0.2 ± 15% with room to spare), the rest at
    # the init std (default 0.3, here 0.05)
    assert abs(ga.std().item() / TINY_MOE_ROUTER_STD - 1) < 0.15
    experts = load_model("tiny-moe:1:0.05").model.model.layers[0].mlp.experts.gate_up_proj  # [8, 128, 64]
    assert 0.045 < experts.std().item() < 0.055
    assert len(a.tokenizer) == 259 and a.path is None
    with pytest.raises(ModelError, match="tiny-moe\\[:SEED"):
        load_model("tiny-moe:0:2")


def test_bad_specs_and_paths(tmp_path):
    with pytest.raises(ModelError, match="tiny-random\\[:SEED"):
        load_model("tiny-random:abc")
    with pytest.raises(ModelError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ModelError, match="no config.json"):
        load_model(str(tmp_path))


def test_unknown_hub_idoffline(monkeypatch):
    offline(monkeypatch)
    with pytest.raises(ModelError, match="cannot load model 'phantomclip-test/no-such-model'"):
        load_model("phantomclip-test/no-such-model")


def test_local_dir_roundtrip_and_vocab_mismatch(tmp_path, tiny):
    good = tmp_path / "good"
    tiny.model.save_pretrained(good)
    tiny.tokenizer.save_pretrained(good)
    loaded = load_model(str(good))
    assert torch.equal(loaded.model.lm_head.weight, tiny.model.lm_head.weight)
    bad = tmp_path / "bad"
    tiny.model.save_pretrained(bad)
    tok = tiny_tokenizer()
    tok.add_tokens([f"<extra_{i}>" for i in range(100)])  # 359 tokens for a 320-row embedding
    tok.save_pretrained(bad)
    with pytest.raises(ModelError, match="359 tokens but the model embeds only 320"):
        load_model(str(bad))


def test_atomic_save_dir_leaves_nothing_on_interruption(tmp_path):
    target = tmp_path / "cache" / "model"

    def write_then_die(tmp):
        (tmp / "config.json").write_text("{}")
        raise KeyboardInterrupt  # killed half-way through the write

    with pytest.raises(KeyboardInterrupt):
        atomic_save_dir(target, write_then_die)
    assert not target.exists() and os.listdir(target.parent) == []
    atomic_save_dir(target, lambda tmp: (tmp / "config.json").write_text('{"ok": 1}'))
    assert (target / "config.json").read_text() == '{"ok": 1}'
    assert os.listdir(target.parent) == ["model"]


def _fake_gguf(monkeypatch, tmp_path, tiny):
    """Stand in for the GGUF path and transformers' GGUF reader with the tiny model (fast)."""
    import transformers

    import phantomclip.models.load as models

    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF")
    monkeypatch.setattr(models, "bundled_gguf_path", lambda: fake)
    real_model, real_tok = transformers.AutoModelForCausalLM.from_pretrained, transformers.AutoTokenizer.from_pretrained

    def model_loader(path, *a, gguf_file=None, **k):
        return copy.deepcopy(tiny.model) if gguf_file else real_model(path, *a, **k)

    def tok_loader(path, *a, gguf_file=None, **k):
        return tiny.tokenizer if gguf_file else real_tok(path, *a, **k)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model_loader)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tok_loader)


def test_interrupted_first_load_leaves_no_cache(tmp_path, monkeypatch, tiny):
    from transformers import PreTrainedTokenizerBase

    cache = tmp_path / "cache"
    monkeypatch.setenv("PHANTOMCLIP_CACHE", str(cache))
    _fake_gguf(monkeypatch, tmp_path, tiny)
    real_save = PreTrainedTokenizerBase.save_pretrained

    def interrupted(self, *a, **k):  # the model weights are already written when this fires
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_model("smollm2-135m", progress=lambda *a: None)
    assert os.listdir(cache) == []  # no half-written cache, no temp dir
    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", real_save)
    first = load_model("smollm2-135m", progress=lambda *a: None)
    assert os.listdir(cache) == ["smollm2-135m-dense-v1"]
    again = load_model("smollm2-135m", progress=lambda *a: None)
    for (name, p), q in zip(first.model.named_parameters(), again.model.parameters()):
        assert torch.equal(p, q), name


def test_unwritable_cache_is_a_clear_error(tmp_path, monkeypatch, tiny):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("PHANTOMCLIP_CACHE", str(blocker / "cache"))
    _fake_gguf(monkeypatch, tmp_path, tiny)
    with pytest.raises(ModelError, match="set PHANTOMCLIP_CACHE to a writable directory"):
        load_model("smollm2-135m", progress=lambda *a: None)


def test_real_bundled_model(tmp_path, monkeypatch):
    """The one test that reads the real SmolLM2-135M GGUF (about 30 s): shape, tying, cache round trip."""
    monkeypatch.setenv("PHANTOMCLIP_CACHE", str(tmp_path))
    first = load_model("smollm2-135m", progress=lambda *a: None)
    cfg = first.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, cfg.model_type) == (30, 576, 49152, "llama")
    assert first.model.lm_head.weight is first.model.model.embed_tokens.weight  # tied
    again = load_model("smollm2-135m", progress=lambda *a: None)  # from the dense cache
    for (name, p), q in zip(first.model.named_parameters(), again.model.parameters()):
        assert torch.equal(p, q), name
    assert again.tokenizer("Hello world").input_ids == first.tokenizer("Hello world").input_ids
