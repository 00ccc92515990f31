"""Command line: `phantomclip diagnose | train | experiment | trace | engines | report`. Bad input exits with status 2
and one line, never a traceback."""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from ..base.console import (
    TERMINATED_EXIT,
    Terminated,
    exit_at_once_on_interrupt,
    say_error,
    stdout_console,
    terminate_as_interrupt,
)
from .flags import (
    EXIT_USAGE,
    OneLineParser,
    add_config_args,
    config_from_args,
    names_never_fail_the_streams,
    say,
    typed_flags,
)
from .sources import apply_run_config, apply_trainer_config

JSON_PATHS = (" (an earlier phantomclip output is replaced whole, through a temp file; a file phantomclip did not "
              "write is refused; a symlink's target is replaced, the link kept; a device or FIFO such as /dev/stdout "
              "is written into; a directory is refused)")
"""what --json does with what is already at PATH (files.output_target)."""


def _diagnose_parser(sub) -> None:
    from ..diagnose.config import KNOB_FIELDS as DIAGNOSE_KNOBS
    from ..diagnose.config import DiagnoseConfig
    from ..diagnose.gates import DRIFT_GATE

    p = sub.add_parser(
        "diagnose",
        help="measure the trainer/engine precision gap before training",
        description="Sample completions with an engine, re-score them under each trainer recipe, and report β = "
        "logp − logp_engine: its bias, its tails, and the share of tokens it pushes outside PPO's trust region.",
    )
    # --engine, --logprobs-mode, --matmul: DiagnoseConfig.validate refuses others; --drift has its own flag below
    add_config_args(p, DiagnoseConfig, skip=("drift", "unmapped", "recorded_notes", "typed_flags", "checkpoint_lag",
                                             "rollouts_part"),
                    knobs=DIAGNOSE_KNOBS)
    p.set_defaults(max_tokens=None, n=None)  # None: a config file may fill it (cli.sources); --rollouts: all
    p.add_argument("--drift", type=_whole_number, default=None, metavar="K",
                   help="push the same (unchanged) weights into the engine K times (K >= 1) and re-read the same "
                   "sampled tokens after each push; a gap that moves is an engine defect and fails the gate "
                   f"'{DRIFT_GATE}' (exit 1) unless you give your own --fail-if on a drift.* key. Off by default; "
                   "its cost is printed")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write every figure and the per-token arrays to PATH" + JSON_PATHS)
    configs = p.add_mutually_exclusive_group()
    configs.add_argument("--from-trl-config", default=None, metavar="YAML",
                         help="take the model, trainer recipe, engine dtype, sampling settings, ε, the correction cap "
                         "and the completion length from a TRL GRPOConfig YAML; a flag you type wins over the "
                         "config's value")
    configs.add_argument("--from-verl-config", default=None, metavar="YAML",
                         help="the same from a verl PPO/GRPO trainer YAML (the model, actor and rollout dtypes, "
                         "rollout sampling, clip ratios, algorithm.rollout_correction, data.max_response_length); a "
                         "flag you type wins over the config's value")
    configs.add_argument("--from-verl-log", default=None, metavar="LOG",
                         help="measure nothing: print the phantomclip/* and rollout_corr/* figures a verl run logged "
                         "(its stdout or its file log) per step and over the run, judged on its last steps; alone")
    p.add_argument("--fail-if", action="append", default=None, metavar="EXPR",
                   help="CI gate, repeatable: exit 1 if KEY OP NUMBER holds (OP: > >= < <=), KEY a dotted path into "
                   "the JSON result, tried as given and then under 'recipes.', e.g. 'fp32.outside_trust_region>0.01' "
                   "or 'fp32.frameworks.verl.training/rollout_probs_diff_mean>0.01'; a NaN figure fails no gate. "
                   "Exit 2 for a malformed EXPR (before any work) or a KEY the result lacks")


def _run_diagnose(args) -> int:
    from ..diagnose.gates import DRIFT_GATE, check_gate_roots, check_gates, parse_gate
    from ..diagnose.job import DiagnoseConfig
    from ..diagnose.postmortem import run_rollouts
    from ..diagnose.recorded import RECORDED_FLAGS
    from ..diagnose.text import render_diagnose, with_verdict

    if args.from_verl_log:
        return _print_verl_log(args)
    gates = [parse_gate(expr) for expr in args.fail_if or []]  # a malformed gate is refused before any work
    if args.drift and not any(g.key.split(".")[0] == "drift" for g in gates):
        gates.append(parse_gate(DRIFT_GATE))
    apply_trainer_config(args)
    args.typed_flags = sorted(set(getattr(args, "typed", ())) & set(RECORDED_FLAGS))
    return _run_config_job(DiagnoseConfig, args, lambda cfg, err: with_verdict(run_rollouts(cfg, console=err)),
                           render_diagnose, check=lambda result: check_gates(gates, result),
                           precheck=lambda cfg: check_gate_roots(gates, cfg),
                           outputs=lambda cfg: {"--save-rollouts": cfg.save_rollouts})


def _print_verl_log(args) -> int:
    """diagnose --from-verl-log: a run's own log read back; nothing is sampled, so any other flag typed is refused."""
    from ..base.errors import ConfigError
    from ..diagnose.verl_log import verl_log_lines

    other = sorted(set(getattr(args, "typed", ())) - {"from_verl_log"})
    if other:
        raise ConfigError(f"--{other[0].replace('_', '-')} with --from-verl-log: reading a run's log measures "
                          "nothing, so the flag would be ignored; drop it")
    for line in verl_log_lines(args.from_verl_log):
        say(line)
    return 0


def _train_parser(sub) -> None:
    import dataclasses

    from ..training.config import KNOB_FIELDS as TRAIN_KNOBS
    from ..training.config import RESUME_MAY_CHANGE, TrainConfig

    resume_flags = [f.name for f in dataclasses.fields(TrainConfig) if f.name in RESUME_MAY_CHANGE]
    p = sub.add_parser(
        "train", help="asynchronous GRPO that logs α (policy change) and β (precision gap) separately",
        description="Train with GRPO: an engine samples with weights --staleness steps old, the trainer takes one "
        "clipped-surrogate step per batch, and every step logs log r = α + β and the phantom-clip rate.",
    )
    add_config_args(p, TrainConfig, knobs=TRAIN_KNOBS)
    p.add_argument("--out", default=None, help="run directory (default: runs/<task>-<intervention>-<time>)")
    p.add_argument("--resume", nargs="?", const=True, default=False, metavar="DIR",
                   help="continue the run in DIR (or --out) from its last checkpoint, with the settings in its "
                   "config.json: flags need not be typed again; one typed with another value than the run's is "
                   f"refused, except {', '.join('--' + k.replace('_', '-') for k in resume_flags)}")
    p.add_argument("--list-interventions", action="store_true", help="list the interventions and exit")


def whole_run_line(s: dict) -> str:
    """The end-of-run line: the whole run's clip accounting (metrics.run_phantom_summary); '-' where a figure has
    nothing to count (no clipped token, no advantage)."""
    pct = lambda x, d=2: "-" if x != x else f"{100 * x:.{d}f}%"  # noqa: E731 (x != x: NaN)
    growth = s["beta_growth"]  # NaN when no step had any β (an fp32 engine, a temperature of 1e-30): no ratio
    times = "x -" if growth != growth else f"x{growth:.2f}"
    return (f"whole run: phantom-clip rate {pct(s['phantom_rate'])} (last 5 steps {pct(s['phantom_rate_last'])}), "
            f"{pct(s['phantom_share_of_clipped'], 0)} of clipped tokens phantom, {pct(s['phantom_adv_share'])} of Σ|A| "
            f"lost to phantom clips; mean |β| {s['beta_abs_mean_start']:.4f} (first 5 steps) -> "
            f"{s['beta_abs_mean_end']:.4f} (last 5), {times}; β alone outside the trust region at the "
            f"end: {pct(s['beta_outside_end'])}")


def _run_train(args) -> int:
    import time

    from rich.console import Console

    from ..maths.metrics import run_phantom_summary
    from ..training.trainer import INTERVENTIONS, TrainConfig, TrainConfigError, train

    if args.list_interventions:
        for name, iv in INTERVENTIONS.items():
            print(f"{name:14s} {iv.doc}")
        return 0
    if isinstance(args.resume, str):
        if args.out and args.out != args.resume:
            raise TrainConfigError(f"--resume {args.resume} and --out {args.out} name two runs: give one of them")
        args.out, args.resume = args.resume, True
    if args.resume and not args.out:
        raise TrainConfigError("--resume needs the run directory to continue: --resume DIR")
    if args.resume:
        apply_run_config(args, TrainConfig)
    cfg = config_from_args(TrainConfig, args)
    cfg.validate()
    out = args.out or f"runs/{cfg.task}-{cfg.intervention.replace(',', '+')}-{time.strftime('%Y%m%d-%H%M%S')}"
    err = Console(stderr=True)
    result = train(cfg, out=out, resume=args.resume, console=err)
    last = result.metrics[-1] if result.metrics else {}
    state = "stopped (checkpoint written; --resume continues)" if result.interrupted else "done"
    err.print(f"{state}: {len(result.metrics)}/{cfg.steps} steps in {out}; "
              f"last reward {last.get('reward/mean', float('nan')):.2f}, "
              f"mean length {last.get('completion/length_mean', float('nan')):.1f}")
    if result.metrics:
        err.print(whole_run_line(run_phantom_summary(result.metrics)))
    return 130 if result.interrupted else 0


def _experiment_parser(sub) -> None:
    from ..training.config import KNOB_FIELDS as TRAIN_KNOBS
    from ..training.config import TrainConfig
    from ..training.experiments import DEFAULT_SEEDS, SANITY_DEFAULTS
    p = sub.add_parser("experiment", help="named experiment matrices over several seeds, read with 95%% intervals")
    esub = p.add_subparsers(dest="experiment", required=True)
    helps = {
        "sanity": ("baseline and every intervention on reward = −length, same seeds and budget",
                   "Runs the baseline (trainer/engine precision as given) and each intervention under --seeds seeds, "
                   "then prints per arm the mean and 95% t interval over seeds, the paired difference to the baseline "
                   "and a verdict (also summary.md / summary.json in --out)."),
        "epsilon": ("the ε sweep (0.05, 0.1, 0.2, 0.3) of the baseline and match-bf16",
                    "Runs the baseline and match-bf16 at each ε under --seeds seeds; read like sanity."),
        "fp8": ("the bf16 engine against an FP8 engine (fp8-w8a8), alone and with TIS, MIS, IcePop, shadow ratio, "
                "force r=1",
                "Runs the baseline (the bf16 engine), the FP8 engine and the FP8 engine with each correction under "
                "--seeds seeds; read like sanity."),
    }
    for name, (help_text, description) in helps.items():
        s = esub.add_parser(name, help=help_text, description=description)
        add_config_args(s, TrainConfig, skip=("intervention",), defaults=SANITY_DEFAULTS, knobs=TRAIN_KNOBS)
        s.add_argument("--seeds", type=_whole_number, default=DEFAULT_SEEDS,
                       help=f"seeds per arm: --seed, --seed + 1, ... (default {DEFAULT_SEEDS})")
        s.add_argument("--out", default=f"runs/{name}",
                       help=f"experiment directory (default: runs/{name}); rerun to continue")
        s.add_argument("--only", default=None, help="comma-separated arm names to run (default: all)")
        s.add_argument("--keep-checkpoints", action="store_true", help="keep finished runs' checkpoint.pt (default: "
                       "deleted once a run is finished; only needed to extend a run)")


def _whole_number(text: str) -> int:
    """argparse type for a count >= 1 (argparse names the flag in its one-line error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {value}")
    return value


def _run_experiment(args) -> int:
    from rich.console import Console

    from ..training.experiment_text import render_experiment
    from ..training.experiments import EXPERIMENTS, build_matrix, run_experiment
    from ..training.trainer import TrainConfig

    cfg = config_from_args(TrainConfig, args)
    cfg.validate()
    known = list(EXPERIMENTS[args.experiment](cfg))
    only = _split_run_names(args.only, known) if args.only is not None else None
    matrix = build_matrix(args.experiment, cfg, args.seeds, only=only)
    summary = run_experiment(matrix, args.out, console=Console(stderr=True), keep_checkpoints=args.keep_checkpoints)
    render_experiment(summary, stdout_console())
    say(f"wrote {args.out}/summary.md and summary.json")
    return 0


def _split_run_names(text: str, known: list[str]) -> list[str]:
    """'none,shadow-ratio,fp8,tis' -> ['none', 'shadow-ratio', 'fp8,tis'] where 'fp8,tis' is a run of `known` (run
    names hold commas): at each place the longest run of parts that names a known arm is taken, else one part (an
    unknown name is refused by build_matrix). An empty list is refused: an empty shell variable must not turn into
    "every arm"."""
    from ..base.errors import ConfigError

    parts = [p.strip() for p in text.split(",") if p.strip()]  # ',,' or an empty --only names nothing
    names: list[str] = []
    i = 0
    while i < len(parts):
        width = next((w for w in range(len(parts) - i, 1, -1) if ",".join(parts[i:i + w]) in known), 1)
        names.append(",".join(parts[i:i + width]))
        i += width
    if not names:
        raise ConfigError("--only is empty: name the arms to run, or drop --only to run them all")
    return names


def _trace_parser(sub) -> None:
    from ..trace.job import TraceConfig

    p = sub.add_parser("trace", help="where β is born: error along depth, first-order link, weights vs compute, "
                       "what-if recipes",
                       description="Run a recipe and a reference on the same tokens with forward hooks and report "
                       "where their outputs diverge, how logit errors become log-prob errors, and which modules kept "
                       "in fp32 remove most of β.")
    add_config_args(p, TraceConfig)
    p.add_argument("--json", default=None, metavar="PATH", help="also write every figure to PATH" + JSON_PATHS)


def _run_config_job(cls, args, run, render, check=None, precheck=None, outputs=None) -> int:
    """A config-driven command: flags -> validated config (failing before any work, --json path included, and
    precheck(cfg) when given), run(cfg, stderr console) -> result, render(result, stdout console), then the result
    written to --json; the exit status is check(result)'s when given (diagnose's --fail-if gates), else 0.
    `outputs(cfg)`: the job's other output files by flag (diagnose's --save-rollouts), checked with --json before any
    work (writable, no two of them the same file, no file phantomclip did not write) and each said once written,
    with a word where it replaced an earlier output."""
    from rich.console import Console

    from ..base.files import check_distinct_outputs, check_output_path, check_replaceable, write_json

    cfg = config_from_args(cls, args)
    cfg.validate()
    if precheck:
        precheck(cfg)
    named = {flag: path for flag, path in {"--json": args.json, **(outputs(cfg) if outputs else {})}.items() if path}
    for flag, path in named.items():
        check_output_path(path, flag)
    check_distinct_outputs(named)
    replaced = {flag for flag, path in named.items() if check_replaceable(path, flag)}
    result = run(cfg, Console(stderr=True))
    render(result, stdout_console())
    if args.json:
        write_json(result, args.json)
    for flag, path in named.items():
        say(f"wrote {path}" + (" (it replaced the file that was there)" if flag in replaced else ""))
    return check(result) if check else 0


TRACE_RUN_READS = {"run", "matmul", "device", "json"}
"""the flags trace --run uses; any other one typed beside --run is refused (the run's config.json says them)."""


def _run_trace(args) -> int:
    from ..base.devices import resolve_device
    from ..base.errors import ConfigError
    from ..trace import growth
    from ..trace.job import TraceConfig, run_trace
    from ..trace.text import render_growth, render_trace

    ignored = sorted(getattr(args, "typed", set()) - TRACE_RUN_READS) if args.run else []
    if ignored:  # the run's config.json says the model and its settings: a typed one would be silently dropped
        flag = "--" + ignored[0].replace("_", "-")
        raise ConfigError(f"{flag} with --run: trace --run takes the model and its settings from the run's "
                          f"config.json, so {flag} would be ignored; drop it")

    def run(cfg, err):
        if cfg.run:
            return growth.run_growth(cfg.run, cfg.matmul, resolve_device(cfg.device), console=err)
        return run_trace(cfg, console=err)

    return _run_config_job(TraceConfig, args, run,
                           lambda result, out: (render_growth if "snapshots" in result else render_trace)(result, out))


def _engines_parser(sub) -> None:
    from ..engines.compare import CompareConfig

    p = sub.add_parser("engines", help="what the real engine costs: start-up and tokens/s of the in-process engine "
                       "and vLLM",
                       description="Sample the same prompts with the same seeds in each dtype with each engine, and "
                       "report start-up and median sampling throughput (vLLM must be installed for --engines vllm: see "
                       "docs/vllm.md).")
    add_config_args(p, CompareConfig)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows to PATH" + JSON_PATHS)


def _run_engines(args) -> int:
    from ..engines.compare import CompareConfig, run_compare
    from ..engines.compare_text import render_engines

    return _run_config_job(CompareConfig, args, run_compare, render_engines)


def _report_parser(sub) -> None:
    p = sub.add_parser("report", help="an interactive, offline HTML article built from your measurements",
                       description="Build report/index.html from diagnose JSON files, trace JSON files, run "
                       "directories and experiment directories (searched recursively); without --from, from the "
                       "bundled demo data. With --serve, also serve it on http://127.0.0.1:PORT.")
    p.add_argument("--from", dest="sources", nargs="+", default=None, metavar="PATH",
                   help="files or directories to read (default: the bundled demo data)")
    p.add_argument("--out", default=None,
                   help="output directory (default: report/; a temporary directory with --serve)")
    p.add_argument("--serve", action="store_true", help="serve the page on 127.0.0.1 until Ctrl-C")
    p.add_argument("--port", type=_port, default=8000, help="port for --serve (default 8000; 0 picks a free one)")


def _port(text: str) -> int:
    """argparse type of --port: a whole number in 0..65535 (0: the system picks a free one)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port: give 0..65535 (0 picks a free one)")
    return port


def _run_report(args) -> int:
    import shutil
    import tempfile

    from ..report import build, demo_sources

    if not args.sources:  # as with --serve: the demo, said once, so nobody mistakes it for their own data
        print("no --from: drawing the bundled demo data (give --from PATH... for your own measurements)",
              file=sys.stderr)
    sources = args.sources or demo_sources()
    ours = tempfile.mkdtemp(prefix="phantomclip-report-") if args.serve and not args.out else None
    try:
        page = build(sources, args.out or ours or "report")
        say(f"wrote {page}")
        if args.serve:
            _serve(page, args.port)
    finally:
        if ours is not None:  # the temporary directory --serve made: gone with the server (Ctrl-C included)
            shutil.rmtree(ours, ignore_errors=True)
    return 0


def _serve(page, port: int) -> None:
    """Serve `page`'s directory on 127.0.0.1:`port` until Ctrl-C."""
    import functools
    import http.server

    from ..report import ReportError

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(page.parent))
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    except OSError as e:
        raise ReportError(f"--port {port}: cannot serve there ({e.strerror or e}); pick another port, or 0 "
                          "for a free one") from None
    with server:
        print(f"serving on http://127.0.0.1:{server.server_address[1]}/ (Ctrl-C to stop)", flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt as e:  # Ctrl-C stops the server as asked; SIGTERM ends the run as everywhere
            if isinstance(e, Terminated):
                raise


def _show_as_line(prog: str, category: type[Warning], default):
    """A warnings.showwarning that prints warnings of `category` as one line on stderr (Python's default adds the
    source line that raised it) and hands others to `default`."""

    def show(message, cat, filename, lineno, file=None, line=None):
        if issubclass(cat, category):
            say(f"{prog}: warning: {message}", sys.stderr)
        else:
            default(message, cat, filename, lineno, file, line)

    return show


def main(argv: list[str] | None = None) -> int:
    names_never_fail_the_streams()
    with exit_at_once_on_interrupt("phantomclip"):  # the parsers import torch: a Ctrl-C there exits 130, no traceback
        parser = OneLineParser(prog="phantomclip", description="Find, explain and fix the trainer/engine precision "
                               "mismatch in RL fine-tuning.")
        parser.add_argument("--version", action="version", version=f"phantomclip {__version__}")
        sub = parser.add_subparsers(dest="command", required=True)
        for add_parser in (_diagnose_parser, _train_parser, _experiment_parser, _trace_parser, _engines_parser,
                           _report_parser):
            add_parser(sub)
        try:
            args, extra = parser.parse_known_args(argv)
        except SystemExit as e:  # --version, --help (printed into stdout's buffer) and usage errors exit here
            code = _flushed("phantomclip", e.code)
            if code != e.code:
                return code
            raise
        except OSError as e:  # an unbuffered stdout (PYTHONUNBUFFERED) fails in the write itself
            return _stdout_lost("phantomclip", e)
    with terminate_as_interrupt():  # SIGTERM from here on: the run's own KeyboardInterrupt path, one line, 143
        return _run_command(parser, sub, args, extra, argv)


def _flushed(prog: str, code: int | str | None) -> int | str | None:
    """`code`, once what was printed on stdout is written; EXIT_USAGE and one line on stderr where it cannot be (a
    full disk, /dev/full, a closed pipe). Python's own flush at exit comes after main has returned and, on the way
    out of argparse's --version and --help, loses the output with exit 0 (measured with Python 3.11)."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError) as e:
        return _stdout_lost(prog, e)
    return code


def _stdout_lost(prog: str, e: Exception) -> int:
    """The one line of output that could not be written, EXIT_USAGE (as a command's own lost stdout)."""
    return say_error(f"{prog}: error: cannot write stdout ({getattr(e, 'strerror', None) or e}): free some space or "
                     "redirect stdout elsewhere", EXIT_USAGE)


def _run_command(parser, sub, args, extra: list[str], argv: list[str] | None) -> int:
    """The command `args` names, run to its exit status: bad input one line and EXIT_USAGE, Ctrl-C 130, SIGTERM
    TERMINATED_EXIT."""
    if extra:  # reported by the command's own parser, so the hint names its --help
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    # Expected failures (bad paths, names, values) are PhantomclipErrors with a message written for the user.
    from ..base.errors import PhantomclipError, PhantomclipWarning

    commands = {"diagnose": _run_diagnose, "train": _run_train, "experiment": _run_experiment, "trace": _run_trace,
                "engines": _run_engines,
                "report": _run_report}
    import warnings

    args.typed = typed_flags(sub.choices[args.command], sys.argv[1:] if argv is None else argv)
    try:
        with warnings.catch_warnings():  # the one-line form lasts for this command only
            warnings.showwarning = _show_as_line(f"phantomclip {args.command}", PhantomclipWarning,
                                                 warnings.showwarning)
            code = commands[args.command](args)
        sys.stdout.flush()  # a full or closed stdout fails here, in one line, not in Python's exit
        return code
    except PhantomclipError as e:
        return say_error(f"phantomclip {args.command}: error: {e}", EXIT_USAGE)
    except Terminated:
        return say_error(f"phantomclip {args.command}: terminated", TERMINATED_EXIT)
    except KeyboardInterrupt:
        return say_error(f"phantomclip {args.command}: interrupted", 130)
    except OSError as e:  # the environment, not the code: stdout on a full disk, a path the checks did not meet
        where = "stdout" if e.filename is None else e.filename
        return say_error(f"phantomclip {args.command}: error: cannot write or read {where} ({e.strerror or e}): "
                         "free some space or choose another place (redirect stdout elsewhere)", EXIT_USAGE)


if __name__ == "__main__":
    sys.exit(main())
