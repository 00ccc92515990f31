"""TRL's packed forward of one rank's row, replayed on a copy of the policy (integrations.trl_async): the forward
arguments TRL's `compute_loss` builds from a collated batch, and the log-probs a copy gives the row's labels, either
through TRL's own fused forward (the trainer's code path, bit for bit) or through TRL's log-prob head on the
labelled positions only (what TRL's head does on a Triton device; cheaper on a CPU)."""

from __future__ import annotations

import torch
from torch import nn

from ...base.errors import IntegrationError

BATCH_KEYS = ("attention_mask", "token_index", "input_ids", "position_ids", "shift_labels", "tree_kv_index",
              "tree_cu_seqlens_q", "tree_cu_seqlens_k", "tree_max_seqlens", "old_log_probs", "advantages",
              "segment_id", "global_n_tokens")
"""every key of TRL's collated micro-batch the hooks read (trl 1.16 async_grpo_trainer.py `DataCollatorForRollout`
and `compute_loss`); checked at attach on a probe batch (trl_async.checks.check_pipeline)."""


def packed_forward(inputs: dict) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(forward kwargs, token_index [M], selected [1, M_pad]) of one rank's packed row, as TRL's compute_loss builds
    them (async_grpo_trainer.py lines 1498-1510: inter-rank padding stripped, tree attention's index tensors)."""
    mask_bool = inputs["attention_mask"].bool()
    selected = inputs["token_index"] >= 0
    kwargs = {key: inputs[key][mask_bool].unsqueeze(0) for key in ("input_ids", "position_ids", "shift_labels")}
    for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k"):
        kwargs[key] = inputs[key][inputs[key] >= 0]
    kwargs["tree_max_seqlen_q"], kwargs["tree_max_seqlen_k"] = inputs["tree_max_seqlens"][0].tolist()
    return kwargs, inputs["token_index"][selected], selected


HEAD_ROWS_CPU = 64
"""labelled positions per call of TRL's log-prob head in a shadow forward on a CPU. Each call turns a [rows, 32768]
bf16 logit tile into fp32 temporaries of rows x 128 KiB; at 64 rows they stay under glibc's largest mmap threshold
(32 MiB) and are reused, at 256 rows every one is a fresh mapping faulted in page by page. The bundled model's head
over 256 rows in a fresh process, one thread's CPU time, 2-core EPYC (avx512_bf16) under load: 233 ms in one call
(49k page faults), 169 at 128 rows, 148 at 64 (none), 168 at 48, 179 at 32 (more calls re-read the 56 MB head); in
the bench's process after 3 training steps a row's head took 145 ms over all 270 positions (8.6k faults), 123 ms
over its 219 labelled ones (none), beside a 546 ms body (bench/RESULTS.md §9). The log-probs are bit for bit the
same at every size (each row's logits and log-softmax are its own: tests/test_trl_async.py)."""

HEAD_CLOSURE = ("backbone_attr", "temperature", "final_logit_softcapping", "logit_scale")
"""what `score_labelled` reads off the fused head TRL's add_fused_lm_head installs (trl 1.16 trainer/utils.py
`_fused_forward`'s closure): the same backbone, temperature, softcap and logit scale as its own head call."""


def fused_head(model: nn.Module) -> dict:
    """The arguments TRL's fused head on `model` passes its chunked log-prob function, from its closure."""
    fn = getattr(model.forward, "__func__", None)
    cells = dict(zip(getattr(getattr(fn, "__code__", None), "co_freevars", ()), getattr(fn, "__closure__", None) or ()))
    missing = [name for name in HEAD_CLOSURE if name not in cells]
    if missing:
        raise IntegrationError(f"the shadow's fused head has no {missing[0]!r}: this TRL's add_fused_lm_head differs "
                               "from trl 1.16's, which phantomclip.integrations.trl_async reads")
    return {name: cells[name].cell_contents for name in HEAD_CLOSURE}


@torch.inference_mode()
def score_labelled(model: nn.Module, kwargs: dict) -> torch.Tensor:
    """[1, N] log-probs of the row's labels from `model`'s fused head (0 where a position has no label), scoring only
    the labelled positions: what TRL's own head does on a Triton device (trainer/utils.py `_fused_forward`, `compact`:
    hidden_states[mask]); on a CPU TRL's head scores all N positions, prompt and completion ends included (21% of a
    bf16 shadow forward of the bundled model in the bench's process, HEAD_ROWS_CPU). The body runs on the whole row
    as in TRL's forward; its labelled rows then go through TRL's own chunked log-prob function with TRL's arguments
    (`fused_head`), in blocks of HEAD_ROWS_CPU rows on a CPU. The same log-probs bit for bit as TRL's fused forward
    of the row (tests/test_trl_async.py: the tiny model, and the bundled model's widths with its 49152-token head in
    two vocabulary chunks): a row's bf16 logits do not depend on the other rows of its product (oneDNN's brgemm, its
    AVX2 fallback and ATen's gemm measured so at 1-301 rows), and the fold into a log-softmax is per row. Under
    inference_mode, not no_grad: the same kernels, without autograd's version counters and view tracking; the result
    is only ever read."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    head = fused_head(model)
    body = {key: value for key, value in kwargs.items() if key != "shift_labels"}
    hidden = getattr(model, head["backbone_attr"])(**body, use_cache=False).last_hidden_state  # [1, N, H]
    labels = kwargs["shift_labels"]  # [1, N]
    rows = (labels[0] != -100).nonzero().squeeze(1)  # [L] the labelled positions, in order
    out = torch.zeros(labels.shape, dtype=torch.float32, device=hidden.device)  # [1, N]
    lm_head = model.get_output_embeddings()
    picked = hidden[0, rows]  # [L, H]
    step = HEAD_ROWS_CPU if picked.device.type == "cpu" else max(rows.numel(), 1)
    for i in range(0, rows.numel(), step):
        logp = ChunkedLogProbFunction.apply(
            picked[i:i + step], lm_head.weight, lm_head.bias, labels[0, rows[i:i + step]], head["temperature"],
            _CHUNKED_LOGPROB_CHUNK_SIZE, head["final_logit_softcapping"], head["logit_scale"], ("log_probs",))[0]
        out[0, rows[i:i + step]] = logp.float()  # [≤ step]
    return out


@torch.no_grad()
def score_as_trl(model: nn.Module, kwargs: dict) -> torch.Tensor:
    """[1, N] log-probs of the row's labels from `model` through TRL's own fused forward, the call compute_loss makes
    (`model(..., fused_lm_head=True).log_probs`): on the trainer's weights, in the trainer's precision, the very
    values the loss's own forward gives (same code, same kernels; the autocast context of the loss, if any, is the
    caller's). For the live model, as is (π_prox) or with a kept version's weights swapped in (the old side of the
    fix's `ratio="trust-region"`: trl_async.versions.TrainerVersions)."""
    return model(**kwargs, fused_lm_head=True).log_probs.float()  # [1, N]
