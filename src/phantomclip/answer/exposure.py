"""Where β meets the user's loss, in figures read from a diagnose result alone: the exposure (the trainer setup of
answer/setups.py at the user's correction and caps), what β touches under it, and the sign test that says whether
another measured setting touches detectably less of the same tokens.

Every decision of the answer (the status, each change and its order) uses one rule per exposure, `touched`:
  in the clip, or in neither   a token is touched when β puts it outside PPO's trust region [1 − ε_low, 1 + ε_high]:
                               in the clip it loses its gradient whenever its advantage has the matching sign; in
                               neither it is used at full weight although it is off-policy by more than PPO trusts
                               an update to be
  in a weight, token modes     exp(β) > C (the weight truncated to C, or the token masked); IcePop: exp(β) outside
                               its band (masked)
  in a weight, sequence modes  every token of a sequence with exp(Σβ) > C (its weight truncated to C, or masked)
The sign test compares units: tokens under a token rule, sequences under a sequence rule (a sequence's tokens are
touched together: counting them apart would count one decision many times).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..maths.metrics import mean_or_nan, trust_region_split
from .setups import (
    IN_WEIGHT,
    OFF,
    SEQUENCE_CORRECTIONS,
    TRUNCATING,
    UNNAMED,
    Setup,
    get_setup,
    resolve_mode,
)


def user_recipe(result: dict) -> str:
    """The user's trainer recipe: the first of --trainer (the config's, when one was read)."""
    return next(iter(result["recipes"]))


def outside(rec: dict) -> float:
    """A recipe's share of tokens outside the trust region at α = 0 (NaN for a JSON null)."""
    v = rec.get("outside_trust_region")
    return math.nan if v is None else float(v)


def pct(share: float) -> str:
    """A share as the answer prints it: '1.51%'."""
    return f"{100 * share:.2f}%"


def region_text(result: dict) -> str:
    """PPO's trust region of the run in numbers, '[0.8, 1.28]': the one way the answer and the verdict write it."""
    tr = result["trust_region"]
    return f"[{1 - tr['epsilon_low']:.4g}, {1 + tr['epsilon_high']:.4g}]"


@dataclass(frozen=True)
class Exposure:
    """Where β meets the user's loss: the setup, IN_CLIP / IN_WEIGHT / IN_NEITHER, and the correction with its caps."""

    setup: Setup
    where: str
    mode: str
    """the correction the setup runs (loss.CORRECTIONS; 'none': off)."""
    cap: float
    """C of that correction (--token-cap for token modes, --seq-mask-cap for sequence modes)."""
    band: tuple[float, float]
    """IcePop's band (--icepop-low, --icepop-high)."""

    @property
    def unit(self) -> str:
        """What one decision of the rule touches: 'sequence' under a sequence correction, else 'token'."""
        return "sequence" if self.where == IN_WEIGHT and self.mode in SEQUENCE_CORRECTIONS else "token"

    @property
    def verb(self) -> str:
        """What the correction does to what it touches: 'truncates' or 'drops'."""
        return "truncates" if self.mode in TRUNCATING else "drops"

    def setting(self) -> str:
        """The correction as the answer names it: 'sequence_mask C = 3', 'icepop [0.5, 2]'."""
        if self.mode == "icepop":
            return f"icepop [{self.band[0]:g}, {self.band[1]:g}]"
        return f"{self.mode} C = {self.cap:g}"


def exposure(result: dict) -> Exposure:
    """The result's exposure, from its config (diagnose.config's setup, is_mode and caps). A result written before the
    setup was recorded, or naming one this version lacks, is judged as an unnamed setup: β in the clip."""
    c = result.get("config") or {}
    try:
        setup = get_setup(str(c.get("setup") or ""))
        mode = resolve_mode(setup, str(c.get("is_mode") or ""))
    except ValueError:
        setup, mode = UNNAMED, OFF
    cap = c.get("seq_mask_cap" if mode in SEQUENCE_CORRECTIONS else "token_cap") or 3.0
    return Exposure(setup=setup, where=setup.where(mode), mode=mode, cap=float(cap),
                    band=(float(c.get("icepop_low") or 0.5), float(c.get("icepop_high") or 2.0)))


# ----------------------------------------------------------------------------------- per token, per unit


def as_rows(result: dict, values: list) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-token array of the result (one value per sampled token, in `tokens`' order) as [B, T] float64 with its
    mask [B, T]: rows from tokens.sequence, columns from tokens.position; a null (NaN written out) is not a token."""
    tok = result["tokens"]
    seq = torch.tensor(tok["sequence"], dtype=torch.long)  # [N]
    pos = torch.tensor(tok["position"], dtype=torch.long)  # [N]
    x = torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float64)  # [N]
    shape = (int(seq.max()) + 1, int(pos.max()) + 1) if seq.numel() else (0, 0)
    rows, mask = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.bool)  # [B, T] each
    rows[seq, pos] = torch.nan_to_num(x)
    mask[seq, pos] = torch.isfinite(x)
    return rows, mask


def touched(beta: torch.Tensor, mask: torch.Tensor, exp: Exposure, trust_region: dict) -> torch.Tensor:
    """[B, T] bool: the tokens of β [B, T] (mask [B, T]) whose gradient β touches under `exp` (module docstring)."""
    if exp.where != IN_WEIGHT:
        below, above = trust_region_split(beta, trust_region["epsilon_low"], trust_region["epsilon_high"])
        return (below | above) & mask
    if exp.mode == "icepop":
        return ((beta < math.log(exp.band[0])) | (beta > math.log(exp.band[1]))) & mask
    if exp.unit == "token":
        return (beta > math.log(exp.cap)) & mask
    dropped = torch.where(mask, beta, torch.zeros_like(beta)).sum(-1) > math.log(exp.cap)  # [B] exp(Σβ) > C
    return dropped[:, None] & mask


def units(hit: torch.Tensor, mask: torch.Tensor, exp: Exposure) -> torch.Tensor:
    """[U] bool: `touched`'s tokens [B, T] as the units the sign test counts (tokens, or sequences with a token)."""
    if exp.unit == "token":
        return hit[mask]
    return hit.any(-1)[mask.any(-1)]


def token_share(hit: torch.Tensor, mask: torch.Tensor) -> float:
    """The share of the tokens touched."""
    return mean_or_nan(hit[mask].double())


def sign_test(worse: int, better: int) -> float:
    """One-sided exact sign test: P(X >= worse) for X ~ Binomial(worse + better, 1/2); 1 with no discordant unit."""
    n = worse + better
    return sum(math.comb(n, k) for k in range(worse, n + 1)) / 2**n if n else 1.0


def gain(result: dict, mine: list, other: list) -> dict:
    """Does β `other` touch detectably less than β `mine` (per-token arrays of the same tokens) under the result's
    exposure? Per unit, `worse`: touched under `mine` only, `better`: under `other` only. Under no difference each
    discordant unit is either with probability 1/2 (the sign test, McNemar's exact form), so p = P(X >= worse | X ~
    Binomial(worse + better, 1/2)). With each side's share of tokens touched (`mine`, `other`) and the `unit`."""
    exp = exposure(result)
    a_beta, mask_a = as_rows(result, mine)
    b_beta, mask_b = as_rows(result, other)
    mask = mask_a & mask_b  # [B, T] tokens both arrays have
    a = touched(a_beta, mask, exp, result["trust_region"])
    b = touched(b_beta, mask, exp, result["trust_region"])
    ua, ub = units(a, mask, exp), units(b, mask, exp)
    worse, better = int((ua & ~ub).sum()), int((ub & ~ua).sum())
    return {"worse": worse, "better": better, "p": sign_test(worse, better), "unit": exp.unit,
            "mine": token_share(a, mask), "other": token_share(b, mask)}


def per_recipe(result: dict, name: str, key: str = "beta") -> list | None:
    """A recipe's per-token array `key` (None for a result written without per-token arrays)."""
    return ((result.get("tokens") or {}).get("per_recipe") or {}).get(name, {}).get(key)


def recipe_gain(result: dict, mine: str, other: str) -> dict | None:
    """`gain` of recipe `other` over recipe `mine` on the same tokens; None without per-token arrays."""
    a, b = per_recipe(result, mine), per_recipe(result, other)
    return None if a is None or b is None else gain(result, a, b)


def without_fp8(result: dict) -> tuple[list, str] | None:
    """The user's β had the engine sampled without its FP8 quantisers, per token, and what stands for that engine: the
    plain engine's reading of the same tokens (`logp_engine_plain`: the local engine teacher-forced through its decode
    path), else β − β_quant (the FP8 shadow's quantisers taken out; no engine read the tokens without them). None
    without an FP8 engine or per-token arrays."""
    tok = result.get("tokens") or {}
    beta = per_recipe(result, next(iter(result["recipes"])))
    if beta is None or "beta_quant" not in tok:
        return None
    if tok.get("logp_engine_plain") is not None:
        rows = zip(beta, tok["logp_engine"], tok["logp_engine_plain"])
        return [None if None in r else r[0] + r[1] - r[2] for r in rows], "the plain engine on the same tokens"
    rows = zip(beta, tok["beta_quant"])
    return [None if None in r else r[0] - r[1] for r in rows], "β − β_quant (no plain engine read the tokens)"
