"""Where a job's settings come from besides the flags typed: a trainer's config file (`diagnose --from-trl-config` /
`--from-verl-config`) and a run's own config.json (`train --resume DIR`). A typed flag always wins over a config file;
on a resume it must agree with the run."""

from __future__ import annotations

from .flags import config_from_args


def apply_trainer_config(args) -> None:
    """Fill the diagnose flags from --from-trl-config or --from-verl-config (integrations.trl / integrations.verl),
    printing what was taken and the notes on stderr. A flag the user typed wins over the config (main's
    args.typed); the config's completion length fills both --max-tokens and --knob-length, so `--max-tokens 48`
    samples short while the knob advice is still judged (extrapolated) at the config's length. A value the config
    gives that diagnose refuses is one line naming the config, before anything is printed."""
    from ..base.errors import ConfigError
    from ..diagnose.job import DiagnoseConfig

    settings, notes, source = {}, [], args.from_trl_config or args.from_verl_config
    if args.from_trl_config:
        from ..integrations.configs.trl import diagnose_settings_from_trl

        settings, notes = diagnose_settings_from_trl(source)
    elif args.from_verl_config:
        from ..integrations.configs.verl import diagnose_settings_from_verl

        settings, notes = diagnose_settings_from_verl(source)
    if "max_tokens" in settings:
        settings["knob_length"] = settings["max_tokens"]
    typed = getattr(args, "typed", set())
    kept = sorted(k for k in settings if k in typed)
    if "trainer" in typed:
        notes = _without_trainer_reading(settings, notes)
    settings = {k: v for k, v in settings.items() if k not in typed}
    for key, value in settings.items():
        setattr(args, key, value)
    args.max_tokens = DiagnoseConfig.max_tokens if args.max_tokens is None else args.max_tokens
    if args.n is None:  # --rollouts reads every record unless --n caps them; sampling draws the default 64
        args.n = 0 if getattr(args, "rollouts", "") else DiagnoseConfig.n
    if not source:
        return
    cfg = config_from_args(DiagnoseConfig, args)
    try:
        cfg.validate()
    except ConfigError as e:
        if str(e).split(" ", 1)[0].removeprefix("--").replace("-", "_") in settings:
            flag = "--from-trl-config" if args.from_trl_config else "--from-verl-config"
            raise ConfigError(f"{e} (the value {flag} {source} gives; a flag you type wins over it)") from None
        raise
    from rich.console import Console

    err = Console(stderr=True)
    err.print(f"from the {'TRL' if args.from_trl_config else 'verl'} config: "
              + ", ".join(f"{k}={v if len(str(v)) <= 80 else str(v)[:77] + '...'}" for k, v in settings.items()),
              markup=False)
    if "max_tokens" in settings:  # a real config's length multiplies the run: say so before any work
        from ..diagnose.job import scored_recipes

        k = len(scored_recipes(cfg))
        shorter = (f"; --max-tokens {DiagnoseConfig.max_tokens} samples shorter, and the knob advice is still judged "
                   f"at {args.max_tokens} tokens" if args.max_tokens > DiagnoseConfig.max_tokens else "")
        err.print(f"this run samples {args.n} completions of up to {args.max_tokens} tokens (the config's length) and "
                  f"scores them under {k} recipes{shorter}", markup=False)
    if kept:
        err.print("kept the flags you gave over the config's values: "
                  + ", ".join("--" + k.replace("_", "-") for k in kept), markup=False)
    for note in notes:
        err.print(f"note: {note}", markup=False)


def _without_trainer_reading(settings: dict, notes: list[str]) -> list[str]:
    """--trainer typed: the recipe measured is the one typed, so the config's reading of the trainer is neither
    measured nor told (its note dropped, its `unmapped` values too); an unmapped engine setting stays unjudged."""
    from ..integrations.configs.load import TRAINER_NOTE, without_trainer_keys

    settings["unmapped"] = without_trainer_keys(settings.get("unmapped", ""))
    if not settings["unmapped"]:
        del settings["unmapped"]
    return [n for n in notes if not n.startswith(TRAINER_NOTE)]


def apply_run_config(args, config_cls) -> None:
    """`train --resume DIR`: every flag not typed takes the run's own value from DIR/config.json; a typed flag whose
    value differs from the run's is refused naming the key (a resumed run continues the same numbers), except those
    a resume may change (training.config.RESUME_MAY_CHANGE: the budget and what is logged)."""
    import dataclasses
    from pathlib import Path

    from ..runs.read import read_run_config
    from ..training.config import ADDED_SINCE_SCHEMA_1, RESUME_MAY_CHANGE, TrainConfigError

    path = Path(args.out) / "config.json"
    if not (path.exists() or path.is_symlink()):  # a FIFO or device there is read_input's to refuse
        raise TrainConfigError(f"--resume {args.out}: no config.json there, so no run to continue: drop --resume to "
                               "start one")
    saved = {**ADDED_SINCE_SCHEMA_1, **read_run_config(Path(args.out))}  # a model's folder is refused
    typed = getattr(args, "typed", set())
    names = [f.name for f in dataclasses.fields(config_cls) if f.name in saved]
    for name in names:
        if name not in typed:
            setattr(args, name, saved[name])
    given = config_from_args(config_cls, args)  # the typed values as the config reads them (lists split, ...)
    for name in names:
        if name in typed and name not in RESUME_MAY_CHANGE and getattr(given, name) != saved[name]:
            flag = "--" + name.replace("_", "-")
            raise TrainConfigError(f"{flag} {getattr(given, name)!r}: the run in {args.out} has {saved[name]!r} "
                                   f"(config.json); drop {flag} to continue it, or start a new run with another --out")
