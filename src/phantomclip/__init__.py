"""phantomclip: find, explain and fix the trainer/engine precision mismatch in RL fine-tuning."""

__version__ = "0.1.0"
SCHEMA_VERSION = 1
"""version of the JSON files this package writes (trace, run config, experiment summary; diagnose has its own)."""
DIAGNOSE_SCHEMA = 2
"""version of the diagnose JSON alone. 2: `drift`, `config.drift` and `config.knob_length` added, and the first
number under which `knobs`, `recipes.*.frameworks` and `recipes.*.split.batch` are written (schema-1 files may
lack them); readers take 1 and 2 and treat each of these keys as optional. Its own number, not SCHEMA_VERSION's:
only the diagnose file changed, and bumping the shared number would stamp every run directory, trace and
experiment written from now on as newer, so an older phantomclip would refuse files whose content did not change
(runs.read_json_object)."""


MOVED: dict[str, str] = {
    "errors": "base.errors",
    "files": "base.files",
    "owned": "base.owned",
    "locks": "base.locks",
    "console": "base.console",
    "devices": "base.devices",
    "numerics": "base.numerics",
    "recipes": "precision.recipes",
    "scoring": "precision.scoring",
    "fp8": "precision.fp8",
    "fp8_vllm": "precision.fp8_vllm",
    "loss": "maths.loss",
    "metrics": "maths.metrics",
    "frameworks": "maths.frameworks",
    "models": "models.load",
    "prompts": "models.prompts",
    "engine": "engines.local",
    "decode": "engines.decode",
    "compare": "engines.compare",
    "routing": "routing.routes",
    "routing_depth": "routing.depth",
    "routing_train": "routing.train",
    "routing_text": "routing.text",
    "rollouts": "rollouts.record",
    "rollout_readers": "rollouts.readers",
    "rollout_batches": "rollouts.batches",
    "runs": "runs.rundir",
    "run_checks": "runs.checks",
    "trainer": "training.trainer",
    "train_config": "training.config",
    "interventions": "training.interventions",
    "tasks": "training.tasks",
    "producer": "training.producer",
    "experiments": "training.experiments",
    "trace": "trace.job",
    "depth": "trace.depth",
    "growth": "trace.growth",
    "answer": "answer.decide",
    "answer_changes": "answer.changes",
    "exposure": "answer.exposure",
    "setups": "answer.setups",
    "verdict_text": "answer.verdict_text",
    "fp8_text": "answer.fp8_text",
    "diagnose": "diagnose.job",
    "diagnose_config": "diagnose.config",
    "diagnose_fp8": "diagnose.fp8",
    "diagnose_records": "diagnose.records",
    "diagnose_text": "diagnose.text",
    "knobs": "diagnose.knobs",
    "recorded": "diagnose.recorded",
    "postmortem": "diagnose.postmortem",
    "postmortem_text": "diagnose.postmortem_text",
    "cli": "cli.main",
    "config_flags": "cli.flags",
    "config_sources": "cli.sources",
    "job_text": "trace.text, engines.compare_text, training.experiment_text",
    "integrations.trl_async": "integrations.trl_async.monitor",
    "integrations.trl_async_checks": "integrations.trl_async.checks",
    "integrations.trl_async_cpu": "integrations.trl_async.cpu",
    "integrations.trl_async_forward": "integrations.trl_async.forward",
    "integrations.trl_async_ratio": "integrations.trl_async.ratio",
    "integrations.trl_async_stats": "integrations.trl_async.stats",
    "integrations.trl_async_versions": "integrations.trl_async.versions",
    "integrations.config_files": "integrations.configs.load",
    "integrations.trl_config": "integrations.configs.trl",
    "integrations.verl": "integrations.configs.verl",
}
"""Modules of phantomclip 0.1's flat layout -> where they live since the packages by concept (docs/architecture.md).
An import of an old path fails with one line naming the new one instead of a bare ModuleNotFoundError."""


class _MovedFinder:
    """Consulted after every real finder (appended to sys.meta_path), so it sees only names that exist nowhere."""

    @staticmethod
    def find_spec(fullname: str, path=None, target=None):
        new = MOVED.get(fullname.removeprefix("phantomclip.")) if fullname.startswith("phantomclip.") else None
        if new:
            raise ModuleNotFoundError(f"{fullname} moved to phantomclip.{new}: import from there "
                                      "(docs/architecture.md maps every module)", name=fullname)
        return None


def moved_names(package: str):
    """A package's __getattr__ where the package took the name of an old module (phantomclip.models was models.py):
    `from phantomclip.models import load_model` fails with one line naming the module that defines it now. Names the
    package does not define and no module of it defines stay a plain AttributeError (hasattr and submodule imports
    rely on it)."""

    def __getattr__(name: str):
        import ast
        from pathlib import Path

        here = Path(__file__).parent.joinpath(*package.split(".")[1:])
        if not name.startswith("__") and not here.joinpath(f"{name}.py").is_file() and not here.joinpath(name).is_dir():
            for path in sorted(here.glob("*.py")):
                tree = ast.parse(path.read_text(encoding="utf-8"))
                defined = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                           if isinstance(t, ast.Name)} | {n.name for n in tree.body
                                                          if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
                if name in defined:
                    raise ImportError(f"{package}.{name} moved to {package}.{path.stem}.{name}: import it "
                                      f"from {package}.{path.stem} (docs/architecture.md)", name=package)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


import sys as _sys  # noqa: E402 (after the names the finder reads)

if not any(f is _MovedFinder for f in _sys.meta_path):
    _sys.meta_path.append(_MovedFinder)
