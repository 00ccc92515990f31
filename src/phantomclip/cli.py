"""Command line: `phantomclip diagnose ...`. Bad input exits with status 2 and one line, never a traceback."""

from __future__ import annotations

import argparse
import sys

from .recipes import RECIPES

EXIT_USAGE = 2


def _diagnose_parser(sub) -> None:
    from .diagnose import DiagnoseConfig

    d = DiagnoseConfig()
    p = sub.add_parser(
        "diagnose",
        help="measure the trainer/engine precision gap before training",
        description="Sample completions with an engine, re-score them under each trainer recipe, and report β = "
        "logp − logp_engine: its bias, its tails, and the share of tokens it pushes outside PPO's trust region.",
    )
    p.add_argument("--model", default=d.model, help="bundled 'smollm2-135m' (default), 'tiny-random[:seed[:init_std]]', a model directory or a hub id")
    p.add_argument("--trainer", default=",".join(d.trainer), help=f"comma-separated trainer recipes (default: all): {', '.join(f'{k} = {v.doc}' for k, v in RECIPES.items())}")
    p.add_argument("--engine-dtype", default=d.engine_dtype, help="dtype of the engine: bf16 (default), fp16 or fp32")
    p.add_argument("--epsilon", type=float, default=d.epsilon, help="PPO clip ε_low (default 0.2)")
    p.add_argument("--epsilon-high", type=float, default=None, help="PPO clip ε_high (default: --epsilon)")
    p.add_argument("--n", type=int, default=d.n, help=f"completions to sample (default {d.n})")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help=f"max completion tokens (default {d.max_tokens})")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help=f"sequences per engine/scoring batch (default {d.batch_size})")
    p.add_argument("--seq-mask-cap", type=float, default=d.seq_mask_cap, help="cap C of TRL's sequence_mask for seq_mask_drop_share (default 3.0)")
    p.add_argument("--prompts", default=None, help="prompts file: one per line, or JSONL with a 'prompt' field (default: 64 bundled prompts)")
    p.add_argument("--matmul", default=d.matmul, choices=["auto", "native", "emulated"], help="low-precision matmul kernels (see README)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every figure and the per-token arrays to PATH")


def _run_diagnose(args) -> int:
    from rich.console import Console

    from .diagnose import DiagnoseConfig, check_output_path, render, run_diagnose, write_json

    cfg = DiagnoseConfig(
        model=args.model, trainer=args.trainer, engine_dtype=args.engine_dtype, epsilon=args.epsilon,
        epsilon_high=args.epsilon_high, n=args.n, max_tokens=args.max_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, seed=args.seed, batch_size=args.batch_size, prompts=args.prompts,
        matmul=args.matmul, seq_mask_cap=args.seq_mask_cap,
    )
    cfg.validate()  # fail on bad flags before loading anything
    if args.json:
        check_output_path(args.json)
    out = Console()
    result = run_diagnose(cfg, console=Console(stderr=True))
    render(result, out)
    if args.json:
        write_json(result, args.json)
        out.print(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="phantomclip", description="Find, explain and fix the trainer/engine precision mismatch in RL fine-tuning.")
    sub = parser.add_subparsers(dest="command", required=True)
    _diagnose_parser(sub)
    args = parser.parse_args(argv)
    # Expected failures (bad paths, names, values) are ValueErrors with a message written for the user.
    from .diagnose import ConfigError
    from .models import ModelError
    from .prompts import PromptError
    from .recipes import RecipeError

    try:
        return {"diagnose": _run_diagnose}[args.command](args)
    except (ConfigError, ModelError, PromptError, RecipeError) as e:
        print(f"phantomclip {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"phantomclip {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
