"""Per-token log-probabilities and entropies of given token ids, under a precision recipe.

Convention: logp[b, t] = log p(input_ids[b, t] | input_ids[b, :t]), so position 0 is never scored.
The logits come out of the model in the recipe's compute dtype (bf16 logits for a bf16 trainer, as in
TRL and vLLM) and are upcast to fp32 before the log-softmax. Instead of the naive
`model(ids).logits.float().log_softmax(-1).gather(...)`, which holds [B, T, V] fp32 logits and a second
[B, T, V] for the log-softmax (B*T*V*4 bytes each: 400 MB for 8 x 256 tokens and vocab 49,152), we run the
decoder body once, keep only the hidden states at the scored positions, and apply the head in chunks of
`chunk_size` rows: peak memory is a few chunk_size x V fp32 temporaries (log-softmax, its exp for the
entropy), and unscored positions (prompts, padding) never reach the 49,152-wide head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .recipes import Recipe, apply_recipe, decoder_body, forward_context, lm_head


@dataclass
class Scores:
    """Per-token results, aligned with input_ids; zero where not scored."""

    logp: torch.Tensor  # [B, T] fp32
    entropy: torch.Tensor  # [B, T] fp32
    mask: torch.Tensor  # [B, T] bool: positions that were scored
    log_kept: torch.Tensor | None = None  # [B, T] fp32 log S, the mass top-p/top-k/min-p keep (when asked)
    logit_stats: torch.Tensor | None = None  # [B, T, 3] fp32 std, max and target margin of the logits (when asked)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, so left padding does not shift RoPE: [B, T] long."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def cache_kwarg(module: nn.Module) -> str:
    """Name of the KV-cache argument of a Hugging Face forward: `cache` in transformers 5.x, `past_key_values`
    before."""
    import inspect

    return "past_key_values" if "past_key_values" in inspect.signature(module.forward).parameters else "cache"


def _final_logits(model: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """What some CausalLM forwards do to the head's output (the engine runs the full forward, so must we)."""
    cfg = model.config
    if getattr(cfg, "logit_scale", None) not in (None, 1.0):  # Cohere
        logits = logits * cfg.logit_scale
    if getattr(cfg, "logits_scaling", None) not in (None, 1.0):  # Granite
        logits = logits / cfg.logits_scaling
    cap = getattr(cfg, "final_logit_softcapping", None)  # Gemma 2 / 3
    return logits if not cap else torch.tanh(logits / cap) * cap


LOGIT_STATS = ("logit_std", "logit_max", "logit_margin")
"""The columns of `Scores.logit_stats`, per scored position: the standard deviation of the logits over the
vocabulary (population), their maximum, and the target's margin z_target - max_{v != target} z_v (negative when
another token is more likely). What sets the size of a rounding error in the log-probs: a relative error of eps
in the logits moves log p by about eps * |z| (docs/metrics.md)."""


def logit_statistics(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[N, 3] fp32: `LOGIT_STATS` of finite logits [N, V] (any dtype, upcast) for targets [N]."""
    z = logits.float()  # [N, V]
    top2 = z.topk(2, dim=-1).values  # [N, 2]
    target = z.gather(-1, targets[:, None]).squeeze(-1)  # [N]
    # the best other token: the runner-up where the target is the top logit (a tie gives margin 0), else the top
    best_other = torch.where(target == top2[:, 0], top2[:, 1], top2[:, 0])  # [N]
    return torch.stack([z.std(dim=-1, correction=0), top2[:, 0], target - best_other], dim=-1)


def logprobs_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 log p(target) [N] and entropy [N] (None if not asked) from finite [N, V] logits of any dtype."""
    z = logits.float()  # [N, V]
    if not with_entropy:  # no [N, V] output at all: logsumexp reduces, gather picks
        return z.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1), None
    logp_all = torch.log_softmax(z, dim=-1)  # [N, V]
    # H = -sum p log p, as a row-wise dot product (no third [N, V] temporary)
    entropy = -torch.linalg.vecdot(logp_all.exp(), logp_all)  # [N]
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), entropy


def truncate_logprobs(logp_all: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """Log-probs [N, V] renormalised over the tokens that min-p, top-k and top-p keep (-inf elsewhere).

    Applied in vLLM's order (v1 sampler: min-p as a logits processor, then top-k, then top-p on the
    renormalised top-k distribution); the top token is always kept. Returns `logp_all` itself when nothing
    is truncated. The kept mass is S = Σ_kept p, and logp_kept = logp_all − log S on kept tokens.
    """
    logp_kept = logp_all
    if min_p > 0:
        floor = logp_all.max(-1, keepdim=True).values + math.log(min_p)  # [N, 1]: p >= min_p * p_max
        logp_kept = logp_kept.masked_fill(logp_kept < floor, float("-inf"))
    if 0 < top_k < logp_all.shape[-1]:
        kth = torch.topk(logp_kept, top_k, dim=-1).values[:, -1:]  # [N, 1]
        logp_kept = logp_kept.masked_fill(logp_kept < kth, float("-inf"))
    if logp_kept is not logp_all:  # renormalise (only needed before top-p, which reads probabilities)
        logp_kept = torch.log_softmax(logp_kept, dim=-1)
    if top_p < 1:
        sorted_lp, order = torch.sort(logp_kept, dim=-1, descending=True)  # [N, V]
        mass_before = torch.cumsum(sorted_lp.exp(), dim=-1) - sorted_lp.exp()  # [N, V]
        # back to vocabulary order; the top token has no mass before it, so it is always kept
        keep = torch.zeros_like(logp_kept, dtype=torch.bool).scatter(-1, order, mass_before < top_p)  # [N, V]
        logp_kept = torch.log_softmax(logp_kept.masked_fill(~keep, float("-inf")), dim=-1)
    return logp_kept


def log_kept_mass(logp_all: torch.Tensor, logp_kept: torch.Tensor) -> torch.Tensor:
    """log S [N]: the log of the probability mass (under logp_all [N, V]) of the tokens logp_kept keeps."""
    return torch.logsumexp(logp_all.masked_fill(torch.isneginf(logp_kept), float("-inf")), dim=-1)


def nucleus_log_mass(logp_all: torch.Tensor, kept_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log S [N]: the mass under logp_all [N, V] of a recorded nucleus, kept_ids [N, K] (−1: padding), with the
    target [N] always counted once. slime's trainer renormalises over the engine's recorded nucleus this way: a
    keep-mask from rollout_top_p_token_ids, the sampled token kept even where it is missing from it
    (slime/utils/ppo_utils.py `_VocabParallelLogProbEntropy.forward` @624b824, `log_prob_logits[rows, target] =
    vocab_parallel_logits[rows, target]`)."""
    ids = torch.where(kept_ids >= 0, kept_ids.long(), targets[:, None])  # [N, K]: padding points at the target
    keep = torch.zeros_like(logp_all, dtype=torch.bool).scatter(-1, ids, True)  # [N, V]
    keep.scatter_(-1, targets[:, None], True)
    return torch.logsumexp(logp_all.masked_fill(~keep, float("-inf")), dim=-1)


def score(
    model: nn.Module,
    recipe: Recipe,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    score_mask: torch.Tensor | None = None,
    chunk_size: int = 128,
    temperature: float = 1.0,
    entropy: bool = True,
    grad: bool = False,
    truncation: tuple[int, float, float] | None = None,
    logit_stats: bool = False,
    nucleus: torch.Tensor | None = None,
) -> Scores:
    """Log-probs and entropies of input_ids[b, t] at positions where score_mask is True.

    input_ids, attention_mask, score_mask: [B, T]; score_mask defaults to every real token after a row's first.
    `model` must already be laid out for `recipe` (see recipes.apply_recipe). With `grad=True` the log-probs
    carry the graph back to the model's parameters (the trainer's forward); otherwise nothing is recorded.
    `truncation` = (top_k, top_p, min_p) also returns log S, the log of the probability mass that truncated
    sampling would keep at each scored position under this model (`Scores.log_kept`). `logit_stats` also returns
    `LOGIT_STATS` of the logits at each scored position (`Scores.logit_stats`, after temperature). `nucleus`
    [B, T, K] (−1 padded): the engine's recorded nucleus of each token, whose mass is log S in place of
    `truncation`'s (`nucleus_log_mass`).
    """
    with torch.set_grad_enabled(grad):
        return _score(model, recipe, input_ids, attention_mask, score_mask, chunk_size=chunk_size,
                      temperature=temperature, entropy=entropy, truncation=truncation, logit_stats=logit_stats,
                      nucleus=nucleus)


def _score(
    model: nn.Module,
    recipe: Recipe,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    score_mask: torch.Tensor | None,
    *,
    chunk_size: int,
    temperature: float,
    entropy: bool,
    truncation: tuple[int, float, float] | None,
    logit_stats: bool,
    nucleus: torch.Tensor | None = None,
) -> Scores:
    B, T = input_ids.shape
    # A token can be scored only if the position before it is a real token (not padding, not column -1).
    has_context = torch.zeros_like(attention_mask, dtype=torch.bool)
    has_context[:, 1:] = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    score_mask = has_context if score_mask is None else score_mask.bool() & has_context
    body, head = decoder_body(model), lm_head(model)
    device = input_ids.device
    with forward_context(recipe, device):
        hidden = body(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        ).last_hidden_state  # [B, T, H]
        # The hidden state at t-1 predicts token t.
        pred_mask = torch.zeros_like(score_mask)
        pred_mask[:, :-1] = score_mask[:, 1:]
        h = hidden[pred_mask]  # [N, H]
        targets = input_ids[score_mask]  # [N]
        out = _head_logprobs(model, head, h, targets, chunk_size=chunk_size, temperature=temperature,
                             entropy=entropy, truncation=truncation, logit_stats=logit_stats,
                             nucleus=None if nucleus is None else nucleus[score_mask])  # [N, K]

    def scatter(values: torch.Tensor | None) -> torch.Tensor:  # [N] -> [B, T], zeros where not scored (or not asked)
        blank = torch.zeros(B, T, dtype=torch.float32, device=device)
        return blank if values is None else blank.masked_scatter(score_mask, values)

    entropy_bt = scatter(None if out.entropy is None else out.entropy.detach())  # [B, T]
    stats = None if out.stats is None else torch.stack([scatter(c) for c in out.stats.unbind(-1)], -1)  # [B, T, 3]
    return Scores(logp=scatter(out.logp), entropy=entropy_bt, mask=score_mask,
                  log_kept=scatter(out.log_kept) if out.log_kept is not None else None, logit_stats=stats)


@dataclass
class HeadScores:
    """`_head_logprobs`' figures per scored position [N]; a field not asked for is None."""

    logp: torch.Tensor
    """[N] fp32 log p(target) at the temperature."""
    entropy: torch.Tensor | None
    """[N] entropy of the next-token distribution."""
    log_kept: torch.Tensor | None
    """[N] log S: the probability mass the sampler's truncation keeps."""
    stats: torch.Tensor | None
    """[N, 3] `logit_statistics`."""


def _head_logprobs(
    model: nn.Module,
    head: nn.Module,
    h: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int,
    temperature: float,
    entropy: bool,
    truncation: tuple[int, float, float] | None = None,
    logit_stats: bool = False,
    nucleus: torch.Tensor | None = None,
) -> HeadScores:
    """The head on hidden states h [N, H] in chunks of `chunk_size` rows: log p(target), and what is asked of
    entropy, log S under `truncation` = (top_k, top_p, min_p) or over the recorded `nucleus` [N, K], and
    `logit_statistics`."""
    logps, ents, kepts, stats = [], [], [], []
    for s in range(0, targets.shape[0], chunk_size):
        logits = _final_logits(model, head(h[s : s + chunk_size]))  # [c, V], compute dtype
        if temperature != 1.0:
            logits = logits.float() / temperature
        with torch.autocast(h.device.type, enabled=False):  # the loss maths in fp32 (autocast would run vecdot in bf16)
            lp, e = logprobs_from_logits(logits, targets[s : s + chunk_size], entropy)  # [c], [c] or None
            if nucleus is not None:
                logp_all = torch.log_softmax(logits.float(), dim=-1)  # [c, V]
                kepts.append(nucleus_log_mass(logp_all, nucleus[s : s + chunk_size], targets[s : s + chunk_size]))
            elif truncation:
                logp_all = torch.log_softmax(logits.float(), dim=-1)  # [c, V]
                kepts.append(log_kept_mass(logp_all, truncate_logprobs(logp_all, *truncation)))
            if logit_stats:
                stats.append(logit_statistics(logits.detach(), targets[s : s + chunk_size]))
        logps.append(lp)
        if e is not None:
            ents.append(e)
    empty = torch.zeros(0, device=h.device)

    def joined(parts: list[torch.Tensor], asked: bool, blank: torch.Tensor) -> torch.Tensor | None:
        return (torch.cat(parts) if parts else blank) if asked else None

    return HeadScores(logp=joined(logps, True, empty), entropy=joined(ents, entropy, empty),
                      log_kept=joined(kepts, bool(truncation) or nucleus is not None, empty),
                      stats=joined(stats, logit_stats, torch.zeros(0, 3, device=h.device)))


def score_completions(
    model: nn.Module,
    recipe: Recipe,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    prompt_width: int,
    group_size: int = 1,
    chunk_size: int = 128,
    grad: bool = False,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probs [B, L] of the completion tokens of a packed batch (`Rollout.pack`: prompts in columns :P,
    completions in P:), running each group's prompt once.

    GRPO samples `group_size` completions per prompt, in consecutive rows. The prompt is run once per group and
    its KV cache repeated over the group's rows (with its gradient, when `grad`), then the completions run
    against it: the prompt's share of the compute falls by a factor of group_size (the bundled model's chat
    prompts are about half of each row). Same maths as `score` on the whole rows; the matmul shapes differ, so
    values differ by rounding (about 1e-6 in fp32; one rounding step now and then in bf16).
    """
    from transformers import DynamicCache

    B, P = input_ids.shape[0], prompt_width
    if B % group_size:
        raise ValueError(f"{B} rows do not split into groups of {group_size}")
    prompt_ids, prompt_mask = input_ids[::group_size, :P], attention_mask[::group_size, :P]  # [G, P]
    comp_ids, comp_mask = input_ids[:, P:], completion_mask[:, P:].bool()  # [B, L]
    body, head = decoder_body(model), lm_head(model)
    with torch.set_grad_enabled(grad), forward_context(recipe, input_ids.device):
        cache, kw = DynamicCache(), cache_kwarg(body)
        prompt_out = body(
            input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids_from_mask(prompt_mask),
            use_cache=True, **{kw: cache},
        ).last_hidden_state  # [G, P, H]
        cache.batch_repeat_interleave(group_size)  # [B, heads, P, d] per layer
        comp_hidden = body(
            input_ids=comp_ids, attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask)[:, P:],  # [B, L]: after the prompt's real tokens
            use_cache=True, **{kw: cache},
        ).last_hidden_state  # [B, L, H]
        # Completion token t is predicted by the hidden state before it: the prompt's last for t = 0.
        pred = torch.cat([prompt_out[:, -1:].repeat_interleave(group_size, 0), comp_hidden[:, :-1]], 1)  # [B, L, H]
        logp = _head_logprobs(model, head, pred[comp_mask], comp_ids[comp_mask], chunk_size=chunk_size,
                              temperature=temperature, entropy=False).logp  # [N]
    return torch.zeros(comp_ids.shape, dtype=torch.float32, device=input_ids.device).masked_scatter(comp_mask, logp)


@torch.no_grad()
def naive_logprobs(
    model: nn.Module, recipe: Recipe, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Reference path: full logits, fp32 log-softmax over the whole [B, T, V] tensor: [B, T] (position 0 = 0)."""
    with forward_context(recipe, input_ids.device):
        logits = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        ).logits  # [B, T, V]
    logp = logits.float().log_softmax(-1)[:, :-1].gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
    return torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1) * attention_mask


def score_packed(model: nn.Module, recipe: Recipe, packed: dict[str, torch.Tensor], prompt_width: int,
                 group_size: int, temperature: float) -> torch.Tensor:
    """[B, L] no-grad log-probs of the completion tokens of a packed batch (`Rollout.pack`: columns prompt_width..),
    at the sampling temperature."""
    return score_completions(model, recipe, packed["input_ids"], packed["attention_mask"], packed["completion_mask"],
                             prompt_width=prompt_width, group_size=group_size, temperature=temperature)


class TrainerForward:
    """The trainer's differentiable forward: fp32 master weights cast into the recipe's layout on every call.

    The optimizer owns the fp32 master (as in mixed-precision training); the cast is part of the graph, so
    gradients reach the master in fp32 whatever the recipe computes in.
    """

    def __init__(self, master: nn.Module, recipe: Recipe, matmul: str):
        self.master, self.recipe = master, recipe
        plain_fp32 = recipe.weight_dtype == torch.float32 and not recipe.autocast_dtype and not recipe.fp32_modules
        self.layout = master if plain_fp32 else apply_recipe(master, recipe, matmul=matmul)
        by_name = master.state_dict(keep_vars=True)  # tied weights appear under both names
        self.sources = {name: by_name[name] for name, _ in self.layout.named_parameters()}
        self.dtypes = {name: p.dtype for name, p in self.layout.named_parameters()}

    def logprobs(self, packed: dict[str, torch.Tensor], prompt_width: int, group_size: int, grad: bool = True,
                 temperature: float = 1.0) -> torch.Tensor:
        """[B, L] log-probs of the packed batch's completion tokens (0 at padding), at `temperature`."""
        from torch.func import functional_call

        scorer = _Scorer(self.layout, self.recipe, prompt_width, group_size, grad, temperature)
        args = (packed["input_ids"], packed["attention_mask"], packed["completion_mask"])
        if self.layout is self.master:
            return scorer(*args)
        with torch.set_grad_enabled(grad):
            params = {f"model.{name}": src.to(self.dtypes[name]) for name, src in self.sources.items()}
        return functional_call(scorer, params, args)


class _Scorer(nn.Module):
    """`score_completions` as a module, so torch.func.functional_call can run it with substituted parameters."""

    def __init__(self, model: nn.Module, recipe: Recipe, prompt_width: int, group_size: int, grad: bool,
                 temperature: float):
        super().__init__()
        self.model, self.recipe, self.prompt_width, self.group_size, self.grad = (model, recipe, prompt_width,
                                                                                  group_size, grad)
        self.temperature = temperature

    def forward(self, input_ids, attention_mask, completion_mask):
        return score_completions(self.model, self.recipe, input_ids, attention_mask, completion_mask,
                                 prompt_width=self.prompt_width, group_size=self.group_size, grad=self.grad,
                                 temperature=self.temperature)
