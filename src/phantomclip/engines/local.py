"""Inference engines: anything that samples completions and reports the log-prob of each sampled token.

`Engine` is the interface (a vLLM backend implements it elsewhere). `LocalEngine` is the in-process one:
a batched sampler over a Hugging Face causal LM with a KV cache, whose log-probs come from its own decode
path in its own dtype, exactly as an inference engine's do. Sampling is a pure function,
`sample_next_token`, seeded through an explicit torch.Generator.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from ..base.devices import on_cpu
from ..base.numerics import dtype_name
from ..precision.recipes import Recipe, apply_recipe, engine_recipe, kernel_name
from ..precision.scoring import cache_kwarg, position_ids_from_mask, truncate_logprobs
from . import decode


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; the defaults are the plain sampling RL uses (temperature 1, full vocabulary)."""

    max_tokens: int = 64
    """stop a sequence after this many sampled tokens."""
    temperature: float = 1.0
    """logits are divided by this before softmax (> 0)."""
    top_p: float = 1.0
    """keep the smallest set of tokens whose probability reaches top_p (1 = off)."""
    top_k: int = 0
    """keep the k most probable tokens (0 = off)."""
    min_p: float = 0.0
    """keep the tokens whose probability is at least min_p times the top token's (0 = off)."""
    seed: int = 0
    """seed of the sampling generator: the same seed, prompts and weights give the same tokens."""
    stop_token_ids: tuple[int, ...] = ()
    """a sequence ends after sampling one of these (the stop token is kept and scored)."""

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")

    @property
    def truncated(self) -> bool:
        return self.top_p < 1 or self.top_k > 0 or self.min_p > 0


@dataclass
class Rollout:
    """What an engine returns: per sequence, the prompt, the sampled tokens and their log-probs."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logp_engine: list[list[float]]
    """log-prob of each sampled token over the full vocabulary, after temperature (vLLM 'raw' when T = 1)."""
    logp_engine_processed: list[list[float]]
    """log-prob renormalised over the tokens top-p / top-k kept (vLLM 'processed'); equal to logp_engine without
    truncation."""
    finished: list[bool] = field(default_factory=list)
    """True where the sequence ended on a stop token, False where it hit max_tokens."""

    @property
    def prompt_width(self) -> int:
        """P: `pack` puts the left-padded prompts in columns :P and the completions in P:."""
        return max(len(p) for p in self.prompt_ids)

    def pack(self, pad_id: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Prompt + completion in one padded batch: prompts left-padded, completions right-padded.

        Returns input_ids, attention_mask, completion_mask [B, T] and logp_engine(_processed) [B, T], whose
        value at t is the engine's log-prob of input_ids[:, t] (0 outside completions), on `device` (built from the
        host's token lists on the CPU, then copied once).
        """
        prompt_ids, prompt_attn = left_pad(self.prompt_ids, pad_id)  # [B, P]
        B, P = prompt_ids.shape  # P == self.prompt_width
        L = max(max((len(c) for c in self.completion_ids), default=0), 1)
        ids = torch.cat([prompt_ids, torch.full((B, L), pad_id, dtype=torch.long)], dim=1)  # [B, P + L]
        attn = torch.cat([prompt_attn, torch.zeros(B, L, dtype=torch.long)], dim=1)
        comp = torch.zeros(B, P + L, dtype=torch.bool)
        lp = torch.zeros(B, P + L)
        lpp = torch.zeros(B, P + L)
        for b, c in enumerate(self.completion_ids):
            if c:
                ids[b, P : P + len(c)] = torch.tensor(c)
                attn[b, P : P + len(c)] = 1
                comp[b, P : P + len(c)] = True
                lp[b, P : P + len(c)] = torch.tensor(self.logp_engine[b])
                lpp[b, P : P + len(c)] = torch.tensor(self.logp_engine_processed[b])
        packed = {"input_ids": ids, "attention_mask": attn, "completion_mask": comp, "logp_engine": lp,
                  "logp_engine_processed": lpp}
        return {k: v.to(device) for k, v in packed.items()}


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids [B, W], attention_mask [B, W]) right-aligned, W = the longest list."""
    W = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), W), pad_id, dtype=torch.long)
    attn = torch.zeros(len(seqs), W, dtype=torch.long)
    for b, seq in enumerate(seqs):
        if seq:
            ids[b, W - len(seq) :] = torch.tensor(seq)
            attn[b, W - len(seq) :] = 1
    return ids, attn


class Engine(Protocol):
    """Samples completions for token-id prompts and reports each sampled token's log-prob."""

    dtype: torch.dtype

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Rollout: ...

    def describe(self) -> dict:
        """What the engine is, for reports: at least 'kind' and 'dtype'."""
        ...

    def close(self) -> None:
        """Free what the engine holds beyond Python objects (processes, caches, temporary files)."""
        ...


def check_prompts(prompts: list[list[int]]) -> None:
    """Every engine's precondition: at least one prompt, none of them empty."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")


def next_token_logprobs(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_all, logp_kept) [B, V]: fp32 log-softmax of logits [B, V] at `temperature`, and the same renormalised
    over the tokens truncation keeps (-inf elsewhere). The one computation sampling and re-scoring share."""
    x = logits.float()  # [B, V]: a fresh copy unless the logits are fp32 already (then the caller's tensor)
    if temperature != 1.0:  # x / 1 == x exactly, so temperature 1 skips the pass; in place on our own copy only
        x = x / temperature if logits.dtype == torch.float32 else x.div_(temperature)
    logp_all = torch.log_softmax(x, dim=-1)  # [B, V]
    return logp_all, truncate_logprobs(logp_all, top_k, top_p, min_p)


def sample_next_token(
    logits: torch.Tensor, generator: torch.Generator, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
    min_p: float = 0.0, workspace: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` [B, V] (any dtype; upcast to fp32).

    Returns (token [B] long, logp [B] over the full vocabulary at this temperature,
    logp_processed [B] renormalised over the kept set: logp - log S where S is the kept probability mass).
    `workspace`: an fp64 tensor of the logits' shape and device to build the CDF in (its contents are overwritten and
    do not matter); a decode loop passes the same one every step, so that the [B, V] fp64 buffer is not allocated
    and page-faulted in anew each time (at 64 x 49,152 that was half of the sampler's CPU time). Without one, a
    fresh buffer is used. The tokens and log-probs do not depend on it (tested bit for bit against the first version).
    """
    logp_all, logp_kept = next_token_logprobs(logits, temperature, top_k, top_p, min_p)  # [B, V] each
    # Inverse-CDF sampling with one uniform per row. (torch.multinomial draws an exponential per vocabulary
    # entry: ~20 ms per step for 16 x 49,152 on a CPU core, a third of a decode step.) The CDF is built in fp64
    # so that tail tokens of 1e-9 probability keep their own step instead of vanishing in fp32 rounding.
    # One fp64 buffer, three in-place passes (cast, exp, cumsum): the same kernels on the same contiguous [B, V]
    # layout as out-of-place ones, hence the same bits (exp's vectorised and scalar-tail lanes fall on the same
    # elements; a buffer of another shape, e.g. only some columns, could round some of them otherwise).
    cdf = _fp64_buffer(logp_kept, workspace).copy_(logp_kept).exp_()  # [B, V]: probabilities
    cdf = torch.cumsum(cdf, dim=-1, out=cdf)  # [B, V]: running sums, in place (each read before it is written)
    total = cdf[:, -1:]  # [B, 1]
    u = torch.rand(cdf.shape[0], 1, generator=generator, dtype=torch.float64, device=cdf.device) * total
    token = torch.searchsorted(cdf, u, right=True).squeeze(-1)  # [B]
    # searchsorted returns the first i with cdf[i] > u. When u < total that i has mass: cdf[i] > u >= cdf[i - 1]
    # (or i = 0 and cdf[0] > u >= 0), and fl(a + p) > a only when p > 0. Only u rounding up to the total (r close to
    # 1) or a non-finite row leaves no such i (token = V): then the last token with mass is taken, as the first
    # version did for every row (`_last_with_mass`); that rare case alone pays for the extra pass.
    if bool((token == cdf.shape[-1]).any()) or not bool(torch.isfinite(total).all()):
        token = torch.minimum(token, _last_with_mass(logp_kept))
    return token, logp_all.gather(-1, token[:, None]).squeeze(-1), logp_kept.gather(-1, token[:, None]).squeeze(-1)


def _fp64_buffer(like: torch.Tensor, workspace: torch.Tensor | None) -> torch.Tensor:
    """`workspace` when it is a contiguous fp64 tensor of `like`'s shape and device, else a new one."""
    ok = (workspace is not None and workspace.dtype == torch.float64 and workspace.shape == like.shape
          and workspace.device == like.device and workspace.is_contiguous())
    return workspace if ok else torch.empty(like.shape, dtype=torch.float64, device=like.device)


def _last_with_mass(logp_kept: torch.Tensor) -> torch.Tensor:
    """[B]: per row the last index whose fp64 probability exp(logp) is > 0 (V - 1 for a row with none), computed
    on the whole [B, V] tensor exactly as the first version of the sampler did for every row."""
    probs = logp_kept.double().exp()  # [B, V]
    return probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)  # [B]


class LocalEngine:
    """In-process batched sampler with a KV cache, running a Hugging Face causal LM in one dtype."""

    def __init__(
        self, master: nn.Module, dtype: torch.dtype = torch.bfloat16, matmul: str = "auto",
        recipe: Recipe | None = None, static_decode: bool | None = None, packed: bool | None = None,
    ):
        """`recipe` (default: plain `dtype`) lets the engine keep some modules in fp32, e.g. 'fp32-head'.
        `static_decode`: run `decode.StaticDecoder` (None: wherever `decode.supports` the model and recipe; False: the
        model's own forward with a DynamicCache, for any architecture). `packed`: run the Linears on weights laid out
        once for oneDNN (`decode.pack_linears`; None: wherever `decode.can_pack` their dtype; False: `F.linear`)."""
        self.recipe = recipe or engine_recipe(dtype)
        self.dtype = self.recipe.weight_dtype
        self.matmul = matmul
        self.model = apply_recipe(master, self.recipe, matmul=matmul)
        self.device = next(self.model.parameters()).device
        self._cache_kw = cache_kwarg(self.model)
        # the static decoder and packed weights are CPU machinery (oneDNN); elsewhere the model's own forward runs
        supported = decode.supports(self.model, self.recipe) and on_cpu(self.device)
        if static_decode and not supported:
            raise ValueError(f"the static decode path does not support {self.model.config.model_type!r} under this "
                             f"recipe (see decode.supports); leave static_decode unset")
        self.static_decode = supported if static_decode is None else static_decode
        no_autocast = self.recipe.autocast_dtype is None  # engine recipes have none: the packed op ignores autocast
        if packed is False:  # FP8 Linears lay their E4M3 images out themselves (fp8_layers.use_fp8): not in this engine
            for m in self.model.modules():
                if hasattr(m, "_pc_fp8_pack"):
                    m._pc_fp8_pack = False
        self.packed = packed is not False and no_autocast and decode.pack_linears(self.model) > 0
        if packed and not self.packed:
            raise ValueError("no Linear of this engine can run on packed weights here (see decode.can_pack); leave "
                             "packed unset")

    def load_weights(self, weights: nn.Module | Mapping[str, torch.Tensor], count_changes: bool = True) -> float:
        """Weight sync: cast fp32 master weights (a model or a state dict) into this engine's layout, in place.

        Returns the share of parameter values that changed in the engine's precision: an update smaller than
        half a bf16 spacing is invisible to a bf16 engine (boundary crossings, numerics.steps_to_cross).
        """
        return sync_weights(self.model, weights, count_changes)

    def describe(self) -> dict:
        kernel = kernel_name(self.matmul, self.recipe.compute_dtype, self.device)
        return {"kind": "local", "dtype": dtype_name(self.dtype), "matmul": kernel, "startup_seconds": 0.0,
                "decode": "static" if self.static_decode else "hf", "packed_weights": self.packed}

    def close(self) -> None:
        """Nothing to free: the engine is its model copy, released with the object."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Rollout:
        return self._decode(prompts, params, _Sampler(params, self.device))

    def rescore(self, rollout: Rollout, params: SamplingParams) -> Rollout:
        """The same prompts and completions, teacher-forced through the engine's own decode path (KV cache, one token
        a step, this batch's layout) with its current weights: the engine's log-probs of given tokens, as it would
        have reported them had it sampled them. With the weights that sampled `rollout` (and the same batch), the
        log-probs equal the rollout's bit for bit (tested)."""
        return self._decode(rollout.prompt_ids, params, _Forced(rollout.completion_ids, params, self.device))

    def _stepper(self, batch: int, max_len: int):
        """The forward the decode loop calls: (ids [B, T], positions [B, T], attention_mask [B, >= seen + T]) ->
        logits of the last position [B, V]. Our static-cache forward for the Llama/Qwen families, else the model's
        own with a DynamicCache."""
        if self.static_decode:
            return decode.StaticDecoder(self.model, batch, max_len)
        from transformers import DynamicCache

        cache, kw = DynamicCache(), self._cache_kw

        def hf_step(ids: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            out = self.model(input_ids=ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                             logits_to_keep=1, **{kw: cache})
            return out.logits[:, -1]  # [B, V]

        return hf_step

    @torch.no_grad()
    def _decode(self, prompts: list[list[int]], params: SamplingParams, chooser: _Sampler | _Forced) -> Rollout:
        """The decode loop: each next token from `chooser` (sampled, or given), with its log-prob from the same
        logits; a row ends when the chooser says so and gets padding after."""
        check_prompts(prompts)
        pad = pad_id(params)
        ids, prompt_attn = (t.to(self.device) for t in left_pad(prompts, pad))  # [B, P]
        B, P = ids.shape
        steps = chooser.steps
        attn = torch.cat([prompt_attn, torch.zeros(B, steps, dtype=torch.long, device=self.device)], dim=1)
        step_fn = self._stepper(B, P + steps)
        pos = position_ids_from_mask(attn[:, :P])  # [B, P]
        logits = step_fn(ids, pos, attn[:, :P])  # [B, V]
        next_pos = pos[:, -1:] + 1  # [B, 1]
        done = chooser.done_at_start(B)  # [B]
        tokens, logps, logps_proc = [], [], []
        for step in range(steps):
            tok, lp, lpp = chooser.pick(step, logits)  # [B] each
            tok = torch.where(done, torch.full_like(tok, pad), tok)
            tokens.append(tok), logps.append(lp), logps_proc.append(lpp)
            attn[:, P + step] = (~done).long()  # a row that stopped earlier gets no more tokens
            done = done | chooser.ends(step, tok)
            if bool(done.all()) or step == steps - 1:
                break
            logits = step_fn(tok[:, None], next_pos, attn[:, : P + step + 1])
            next_pos = next_pos + 1
        tok_t = torch.stack(tokens, 1)  # [B, L]
        lp_t, lpp_t = torch.stack(logps, 1), torch.stack(logps_proc, 1)  # [B, L]
        lengths = attn[:, P:].sum(-1).tolist()
        return Rollout(
            prompt_ids=[list(p) for p in prompts],
            completion_ids=[tok_t[b, : lengths[b]].tolist() for b in range(B)],
            logp_engine=[lp_t[b, : lengths[b]].tolist() for b in range(B)],
            logp_engine_processed=[lpp_t[b, : lengths[b]].tolist() for b in range(B)],
            finished=chooser.finished(done),
        )


def pad_id(params: SamplingParams) -> int:
    """The token a finished row is padded with: the first stop token (0 without one)."""
    return params.stop_token_ids[0] if params.stop_token_ids else 0


class _Sampler:
    """The decode loop's tokens drawn by `sample_next_token` (seeded once per call); a row ends at a stop token."""

    def __init__(self, params: SamplingParams, device: torch.device):
        self.params, self.steps, self.device = params, params.max_tokens, device
        self.gen = torch.Generator(device=device).manual_seed(params.seed)  # a stream per device: CUDA draws differ
        self.stop = torch.tensor(params.stop_token_ids or [-1], device=device)
        self.workspace: torch.Tensor | None = None  # sample_next_token's fp64 CDF buffer

    def done_at_start(self, batch: int) -> torch.Tensor:
        return torch.zeros(batch, dtype=torch.bool, device=self.device)

    def pick(self, step: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p = self.params
        self.workspace = _fp64_buffer(logits, self.workspace)  # [B, V] fp64, reused every step
        return sample_next_token(logits, self.gen, p.temperature, p.top_k, p.top_p, p.min_p, workspace=self.workspace)

    def ends(self, step: int, tok: torch.Tensor) -> torch.Tensor:
        return torch.isin(tok, self.stop)

    def finished(self, done: torch.Tensor) -> list[bool]:
        return done.tolist()


class _Forced:
    """The decode loop's tokens taken from given completions (teacher forcing, `LocalEngine.rescore`), scored from
    the same logits as sampling would have; a row ends after its last given token."""

    def __init__(self, completions: list[list[int]], params: SamplingParams, device: torch.device):
        self.params, self.completions = params, completions
        self.steps = max(max((len(c) for c in completions), default=0), 1)
        given = torch.full((len(completions), self.steps), pad_id(params), dtype=torch.long)  # [B, steps], host
        for b, c in enumerate(completions):
            given[b, : len(c)] = torch.tensor(c, dtype=torch.long)
        self.given = given.to(device)
        self.lengths = torch.tensor([len(c) for c in completions], device=device)  # [B]

    def done_at_start(self, batch: int) -> torch.Tensor:
        return self.lengths == 0

    def pick(self, step: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p, tok = self.params, self.given[:, step]  # [B]
        logp_all, logp_kept = next_token_logprobs(logits, p.temperature, p.top_k, p.top_p, p.min_p)
        return tok, logp_all.gather(-1, tok[:, None]).squeeze(-1), logp_kept.gather(-1, tok[:, None]).squeeze(-1)

    def ends(self, step: int, tok: torch.Tensor) -> torch.Tensor:
        return self.lengths <= step + 1

    def finished(self, done: torch.Tensor) -> list[bool]:
        return [bool(c) and c[-1] in self.params.stop_token_ids for c in self.completions]


@torch.no_grad()
def sync_weights(
    model: nn.Module, weights: nn.Module | Mapping[str, torch.Tensor], count_changes: bool = True
) -> float:
    """Copy `weights` into `model`'s parameters of the same name, each cast to that parameter's dtype.

    Names missing from `weights` are left alone (tied weights appear once). Returns the share of the copied
    values that changed (NaN when `count_changes` is off, which saves a comparison pass).
    """
    source = weights.state_dict() if isinstance(weights, nn.Module) else weights
    changed, total = 0, 0
    for name, p in model.named_parameters():
        if name in source:
            if count_changes:
                new = source[name].to(p.dtype)
                changed += (p != new).sum().item()
                p.copy_(new)
            else:
                p.copy_(source[name])
            total += p.numel()
    return changed / max(total, 1) if count_changes else float("nan")
