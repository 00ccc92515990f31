"""How much two FP8 rule choices change the numbers, on the bundled model's weights (fp32, as dequantised):

1. the block rule: vLLM 0.32's per_block_cast_to_fp8 (scale = amax / 448, q = x * (1 / scale), fp8.quant_blocks)
   against the older x * (448 / amax): the share of E4M3 values that differ, over every full 128 x 128 block of every
   Linear the FP8 engine quantises (the bundled model's widths, 576, are not multiples of 128: fp8-block refuses the
   model, and only its full blocks are read here);
2. Marlin's weight scale (W8A16) in bf16 against the fp32 amax / 448: the relative change of each per-tensor scale
   (merged q/k/v and gate/up share one, as vLLM's merged layers do).

    python bench/checks/fp8_rules.py  # about a minute on a busy 2-core CPU, once the bundled model's dense cache exists

Prints one line per figure; docs/results.md "The article's reader pass, routing's touched share and the FP8 rules"
records them with the machine, the date and the commit.
"""

import torch

from phantomclip.models.load import load_model
from phantomclip.precision import fp8, fp8_layers
from phantomclip.precision.recipes import lm_head


def main() -> None:
    model = load_model("smollm2-135m").model.float()
    linears = fp8_layers.quantised_linears(model, {id(lm_head(model))})
    differ = total = 0
    for m in linears.values():
        w = m.weight.detach().float()
        n, k = (w.shape[0] // fp8.BLOCK) * fp8.BLOCK, (w.shape[1] // fp8.BLOCK) * fp8.BLOCK
        if not n or not k:
            continue
        v = w[:n, :k].reshape(n // fp8.BLOCK, fp8.BLOCK, k // fp8.BLOCK, fp8.BLOCK)
        amax = v.abs().amax(dim=(1, 3), keepdim=True).clamp_min(fp8.BLOCK_AMAX_FLOOR)
        new, _ = fp8.quant_blocks(w[:n, :k])
        old = fp8.to_e4m3(v * (fp8.E4M3_MAX / amax)).reshape(n, k)
        differ += int((new.view(torch.uint8) != old.view(torch.uint8)).sum())
        total += n * k
    print(f"block rule: {differ} of {total} E4M3 values differ ({100 * differ / total:.4f}%) between x * (1 / scale) "
          f"and x * (448 / amax), over the full 128 x 128 blocks of {len(linears)} Linears")
    changes = []
    for parent in {name.rpartition(".")[0] for name in linears}:
        members = {leaf: m for name, m in linears.items() if name.rpartition(".")[0] == parent
                   for leaf in [name.rpartition(".")[2]]}
        merged = [f for f in fp8_layers.FUSED if all(leaf in members for leaf in f)]  # one scale for a merged layer
        alone = [(leaf,) for leaf in members if not any(leaf in f for f in merged)]
        for group in merged + alone:
            amax = torch.stack([fp8.amax_of(members[leaf].weight.detach()) for leaf in group]).amax()
            s32 = amax / fp8.E4M3_MAX
            changes.append(abs(s32.bfloat16().float().item() / s32.item() - 1))
    changes.sort()
    print(f"Marlin's bf16 weight scale: relative change of the {len(changes)} per-tensor scales against fp32, median "
          f"{changes[len(changes) // 2]:.2e}, max {changes[-1]:.2e} (bf16 keeps 8 significant bits: a "
          f"rounding moves a value by at most 2^-8 = {2.0 ** -8:.2e} of itself)")


if __name__ == "__main__":
    main()
