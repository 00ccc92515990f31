import os

import pytest
import torch

from phantomclip.models import ModelError, atomic_save_dir, load_model, tiny_tokenizer


def test_tiny_random_is_seeded_and_sized():
    a, b, c = load_model("tiny-random:1"), load_model("tiny-random:1"), load_model("tiny-random:2")
    wa, wb, wc = (m.model.model.layers[0].mlp.up_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert a.model.config.num_hidden_layers == 2 and a.model.config.hidden_size == 64
    assert all(p.dtype == torch.float32 for p in a.model.parameters())
    # init std is the third field: std 0.3 by default, 0.05 when asked
    assert 0.25 < wa.std().item() < 0.35
    assert 0.04 < load_model("tiny-random:1:0.05").model.model.layers[0].mlp.up_proj.weight.std().item() < 0.06


def test_bad_specs_and_paths(tmp_path):
    with pytest.raises(ModelError, match="tiny-random\\[:SEED"):
        load_model("tiny-random:abc")
    with pytest.raises(ModelError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ModelError, match="no config.json"):
        load_model(str(tmp_path))


def test_unknown_hub_id_offline(monkeypatch):
    _offline(monkeypatch)
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


def test_bundled_model_first_load_is_atomic_and_cached(tmp_path, monkeypatch):
    """The real SmolLM2-135M GGUF: an interrupted first load leaves no cache; the next one builds it."""
    from transformers import PreTrainedTokenizerBase

    monkeypatch.setenv("PHANTOMCLIP_CACHE", str(tmp_path))
    real_save = PreTrainedTokenizerBase.save_pretrained

    def interrupted(self, *a, **k):  # the model weights are already written when this fires
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_model("smollm2-135m", progress=lambda *a: None)
    assert os.listdir(tmp_path) == []  # no half-written cache, no temp dir
    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", real_save)
    first = load_model("smollm2-135m", progress=lambda *a: None)
    cfg = first.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, cfg.model_type) == (30, 576, 49152, "llama")
    assert first.model.lm_head.weight is first.model.model.embed_tokens.weight  # tied
    assert os.listdir(tmp_path) == ["smollm2-135m-dense-v1"]
    again = load_model("smollm2-135m", progress=lambda *a: None)  # from the dense cache
    for (name, p), q in zip(first.model.named_parameters(), again.model.parameters()):
        assert torch.equal(p, q), name
    assert again.tokenizer("Hello world").input_ids == first.tokenizer("Hello world").input_ids


def _offline(monkeypatch):
    """Offline mode as a user without network sets it (HF_HUB_OFFLINE is read once, at import)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
