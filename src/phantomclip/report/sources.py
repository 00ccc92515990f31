"""What `phantomclip report` reads: every diagnose JSON, trace JSON, `trace --run` JSON, experiment summary and run
directory under the paths it is given, classified by the keys at their top level.

An `experiment fp8` summary has the shape of every experiment's summary and is told apart by its "experiment" key:
it is its own kind (`fp8`), drawn in its own section against its own baseline (the bf16 engine), not in the
interventions table, whose arms change the trainer's side against a bf16 engine. A run directory inside an
experiment's output (OUT/<arm>/seed-N, beside OUT/experiment.json) belongs to that experiment: the runs of an FP8
experiment go to `fp8_runs`, so the closed loop's figures (section 5) never mix an FP8 arm into their "none" or "tis".

The rule for files that cannot be used: one named on the command line is an error naming it (one line, exit 2);
one found by searching a directory is skipped, and a single warning names the skipped files. A file that is one of
ours but damaged (a key missing, a key of the wrong type, a newer schema) is an error wherever it was found: the page
would otherwise silently lack what the user expects to see.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .. import DIAGNOSE_SCHEMA, SCHEMA_VERSION
from ..base.errors import PhantomclipError, PhantomclipWarning
from ..base.files import InputError, json_reason, read_input
from ..base.locks import writer_of
from ..runs import framework_log
from ..runs.checks import check_metrics_rows, check_run_ids
from ..runs.framework_log import FrameworkLogError, looks_like_verl_log
from ..runs.read import read_jsonl, run_id


class ReportError(PhantomclipError):
    """Unreadable sources or an output path that cannot be written."""


@dataclass
class ReportData:
    """Everything the page can draw, gathered from files; each item keeps the path it came from (`_path`)."""

    diagnose: list[dict] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)
    sanity: list[dict] = field(default_factory=list)
    traces: list[dict] = field(default_factory=list)
    growths: list[dict] = field(default_factory=list)
    """`trace --run` results: β along a training run, per snapshot."""
    fp8: list[dict] = field(default_factory=list)
    """`experiment fp8` summaries: the FP8 engine's arms against the bf16 engine."""
    fp8_runs: list[dict] = field(default_factory=list)
    """the runs of an FP8 experiment (or of an FP8 engine), each with its "arm" ('fp8,tis'): kept out of `runs`."""
    moe: list[dict] = field(default_factory=list)
    """`moe-r3` experiment summaries (bench/experiments/exp_moe_r3.py): routing replay on an MoE model against its
    baseline."""
    moe_runs: list[dict] = field(default_factory=list)
    """the runs of a `moe-r3` experiment: another model's runs, kept out of `runs`."""
    verl_logs: list[dict] = field(default_factory=list)
    """verl runs' file-tracker logs (runs/framework_log.py `read_verl_log`): what the run logged, drawn in "Your
    framework"."""

    def files(self) -> list[Path]:
        """Every file the page draws from, in the order found: the JSON files, then each run's config, metrics and
        (where the run logged them) tokens."""
        out = [Path(d["_path"]) for d in self.diagnose + self.sanity + self.fp8 + self.moe + self.traces + self.growths
               + self.verl_logs]
        for r in self.runs + self.fp8_runs + self.moe_runs:
            out += [Path(r["_path"]) / "config.json", Path(r["_path"]) / "metrics.jsonl"]
            out += [Path(r["_path"]) / "tokens.jsonl"] if r.get("tokens") else []
        return out

    def empty(self) -> bool:
        return not (self.diagnose or self.runs or self.sanity or self.traces or self.growths or self.fp8
                    or self.fp8_runs or self.moe or self.moe_runs or self.verl_logs)


DOC_SHAPES = {"diagnose": {"recipes": dict, "tokens": dict}, "sanity": {"runs": list, "arms": list},
              "traces": {"sites": list, "first_order": dict}, "growths": {"snapshots": list, "prob_edges": list},
              "fp8": {"runs": list, "arms": list}, "moe": {"runs": list, "arms": list}}
"""what each kind of JSON file holds at its top level (the keys that tell the kinds apart, with their types)."""
MARKS = {"diagnose": ("trust_region", "knobs"), "sanity": ("verdict", "baseline"), "traces": ("hook_overhead",),
         "growths": ("reference_step",)}
"""keys only that kind writes besides its shape's: a file with one of them but not all its shape's keys is that kind,
damaged (an experiment's own experiment.json has "arms" too, and is not a damaged summary)."""
KIND_WORDS = {"diagnose": "a diagnose JSON", "sanity": "an experiment summary", "traces": "a trace JSON",
              "growths": "a trace --run JSON", "fp8": "an experiment fp8 summary", "moe": "a moe-r3 summary"}
OWN_KIND = {"fp8": "fp8", "moe-r3": "moe"}
"""an experiment summary's "experiment" -> the kind it is filed as; every other experiment (sanity, epsilon) is a
'sanity' summary, drawn in the interventions table."""


class Unusable(Exception):
    """A file that is not phantomclip data (unreadable, not JSON, not an object, of no known kind): the reason."""


def read_json(path: Path) -> dict:
    """The JSON object in `path`, or Unusable saying why not. Python's own limits (an integer of more than 4300
    digits, nesting deeper than the recursion limit) are reasons like any other, not tracebacks."""
    try:
        data = json.loads(read_input(path))
    except InputError as e:  # a FIFO, a device, too large, unreadable, not UTF-8
        raise Unusable(e.reason) from None
    except RecursionError:
        raise Unusable("is not valid JSON for phantomclip (nested too deep to read)") from None
    except ValueError as e:  # json.JSONDecodeError, and int() refusing a number of thousands of digits
        raise Unusable(f"is not valid JSON ({json_reason(e)})") from None
    if not isinstance(data, dict):
        raise Unusable(f"holds a JSON {type(data).__name__}, not the object phantomclip writes")
    return data


def kind_of(path: Path, doc: dict) -> str | None:
    """'diagnose', 'sanity', 'fp8', 'traces' or 'growths' by the keys `doc` has; None when it is none of them. A file
    with a kind's mark but not all of its keys is damaged: ReportError naming the first key missing."""
    full = [k for k, shape in DOC_SHAPES.items() if all(key in doc for key in shape)]
    if full:
        return OWN_KIND.get(doc.get("experiment"), "sanity") if full[0] == "sanity" else full[0]
    partial = next((k for k, marks in MARKS.items() if any(key in doc for key in marks)), None)
    if partial is None:
        return None
    missing = [key for key in DOC_SHAPES[partial] if key not in doc]
    raise ReportError(f"{path}: looks like {KIND_WORDS[partial]} but has no \"{missing[0]}\": the file was cut, "
                      "edited or is not one phantomclip wrote")


def _check_schema(path: Path, doc: dict, kind: str | None) -> None:
    newest = DIAGNOSE_SCHEMA if kind == "diagnose" else SCHEMA_VERSION  # diagnose's file has its own number
    schema = doc.get("schema", SCHEMA_VERSION)
    if not isinstance(schema, int) or isinstance(schema, bool):
        raise ReportError(f"{path}: \"schema\" is {str(schema)[:40]!r}, not a whole number: the file was edited or is "
                          "not one phantomclip wrote")
    if schema > newest:
        raise ReportError(f"{path}: written with data schema {schema}, newer than this phantomclip reads "
                          f"({newest}): upgrade phantomclip")


def _check_shape(path: Path, doc: dict, shape: dict[str, type]) -> None:
    for key, kind in shape.items():
        if not isinstance(doc[key], kind):
            raise ReportError(f"{path}: \"{key}\" holds a {type(doc[key]).__name__}, not a {kind.__name__}: the file "
                              "was edited or is not one phantomclip wrote")


Manifests = dict[Path, dict | Unusable]
"""experiment.json files read during one collect: resolved path -> its JSON object, or why it cannot be used. Made
by collect for one build and passed down, so a plan shared by many run directories (21 for the demo's FP8
experiment) is read once, and a later build in the same process reads the files afresh."""


def read_manifest(path: Path, manifests: Manifests) -> dict:
    """The experiment.json at `path`, read once per collect (`manifests`); Unusable as read_json says."""
    key = path.resolve()
    if key not in manifests:
        try:
            manifests[key] = read_json(key)
        except Unusable as why:
            manifests[key] = why
    found = manifests[key]
    if isinstance(found, Unusable):
        raise Unusable(*found.args)
    return found


def _add(data: ReportData, f: Path, doc: dict, manifests: Manifests) -> bool:
    """File `doc` (read from `f`) into `data`; False when it is of no kind the page draws. `manifests`: the
    experiment.json files this collect has read (read_manifest)."""
    if f.name == "config.json" and (f.parent / "metrics.jsonl").exists():
        _check_schema(f, doc, None)
        name = f"{f.parent.parent.name}/{f.parent.name}" if f.parent.name.startswith("seed-") else f.parent.name
        experiment, arm = experiment_arm(f.parent, doc, manifests)
        metrics = check_metrics_rows(f.parent / "metrics.jsonl", read_jsonl(f.parent / "metrics.jsonl"))
        check_run_ids(f.parent / "metrics.jsonl", metrics, run_id(doc))  # rows copied from another run
        writer = writer_of(f.parent)  # the run's lock: one being written is drawn as far as it has come, and said
        if writer is not None:
            warnings.warn(f"{f.parent} is being written (phantomclip process {writer}): the page draws the "
                          f"{len(metrics)} steps it has logged so far", PhantomclipWarning, stacklevel=2)
        run = {"_path": str(f.parent), "name": name, "config": doc, "arm": arm, "experiment": experiment,
               "group": arm if experiment or doc.get("engine_quant") else seed_group(name)[0],
               "metrics": metrics, "tokens": read_jsonl(f.parent / "tokens.jsonl")}
        {"fp8": data.fp8_runs, "moe-r3": data.moe_runs}.get(experiment or "", data.runs).append(run)
        return True
    if f.name == "experiment.json" and {"experiment", "arms", "seeds"} <= set(doc):
        return True  # an experiment's plan: its summary.json beside it holds what the page draws
    kind = kind_of(f, doc)
    if kind is None:
        return False
    _check_schema(f, doc, kind)
    _check_shape(f, doc, DOC_SHAPES[kind])
    doc["_path"] = str(f)
    getattr(data, kind).append(doc)
    return True


def seed_group(name: str) -> tuple[str, int | None]:
    """('none', 0) for a run named 'none/seed-0' or 'none-seed0' (one seed of a group); (name, None) otherwise.

    A run's "group" is the name every figure gives it: an experiment's arm ('force-r1'), an FP8 engine's ('fp8,tis'),
    else the name its reader gave the run directory, seeds of OUT/x/seed-k together as x. The intervention is not a
    name for a reader's own run: one run drawn as 'none' in the training figures and as 'run1' in the trace growth
    figures read as two runs."""
    m = re.fullmatch(r"(.+?)[-/]seed-?(\d+)", name)
    return (m.group(1), int(m.group(2))) if m else (name, None)


def experiment_arm(run: Path, config: dict, manifests: Manifests) -> tuple[str | None, str]:
    """(the experiment the run directory belongs to, its arm's name there). An experiment writes its runs to
    OUT/<arm>/seed-N (experiments.run_dir: ',' as '+', '=' as '-') beside OUT/experiment.json, whose "arms" name them;
    a run outside one is 'fp8' when its engine quantised (config "engine_quant", the FP8 arms' only difference from
    the bf16 engine's: their intervention alone would call the FP8 engine 'none'), else nobody's, its arm the
    intervention. `manifests`: the experiment.json files already read in this collect (read_manifest)."""
    from ..training.experiments import run_dir

    intervention = str(config.get("intervention", run.name))
    quant = config.get("engine_quant") or ""
    fallback = (("fp8" if quant else None),
                (quant if intervention == "none" else f"{quant},{intervention}") if quant else intervention)
    if not run.name.startswith("seed-"):
        return fallback
    try:
        manifest = read_manifest(run.parent.parent / "experiment.json", manifests)
    except Unusable:
        return fallback
    arms, experiment = manifest.get("arms"), manifest.get("experiment")
    if not isinstance(arms, list) or not isinstance(experiment, str):
        return fallback
    here = run.parent.parent
    arm = next((a for a in arms if isinstance(a, str) and run_dir(here, a, 0).parent == run.parent), None)
    return (experiment, arm) if arm is not None else fallback


def fp8_arm_order(run: dict) -> int:
    """The place of the run's arm in `experiment fp8`'s order (the bf16 engine, the FP8 engine, then each correction
    as experiments.fp8_arms builds them; an arm it does not build last): legends and tables read alike."""
    from ..training.config import TrainConfig
    from ..training.experiments import fp8_arms

    order = list(fp8_arms(TrainConfig()))
    return order.index(run["arm"]) if run["arm"] in order else len(order)


def _warn_skipped(src: Path, skipped: list[str]) -> None:
    shown = "; ".join(skipped[:3]) + (f"; and {len(skipped) - 3} more" if len(skipped) > 3 else "")
    warnings.warn(f"--from {src}: skipped {len(skipped)} file{'s' if len(skipped) > 1 else ''} that phantomclip "
                  f"cannot use: {shown}", PhantomclipWarning, stacklevel=3)


def collect(sources: list[str | Path], skip: Path | None = None) -> ReportData:
    """Classify every JSON file and run directory under `sources` (files or directories); files found under `skip`
    (the report's own --out, when it lies inside a --from directory) are not data: they are the last page's copies."""
    skip = Path(skip).resolve() if skip is not None else None
    data = ReportData()
    seen: set[Path] = set()
    manifests: Manifests = {}
    for src in map(Path, sources):
        if not src.exists():
            raise ReportError(f"--from {src}: no such file or directory")
        named = not src.is_dir()  # a file, or a FIFO or device named by the user: read_input says which
        skipped: list[str] = []
        for found in [src] if named else sorted([*src.rglob("*.json"), *src.rglob("*.jsonl")]):
            f = found.resolve()
            if f in seen or (skip is not None and not named and skip in f.parents):
                continue
            seen.add(f)
            if f.suffix == ".jsonl":  # verl's file log; a run's own metrics/tokens .jsonl are read with its directory
                if looks_like_verl_log(f):
                    data.verl_logs.append(_read_verl_log(f))
                elif named:
                    raise ReportError(f"--from {src}: a .jsonl that is not verl's file log ({{\"step\", \"data\"}} per "
                                      "line); give a run directory for a run's metrics.jsonl")
                continue
            try:
                doc = read_manifest(f, manifests) if f.name == "experiment.json" else read_json(f)
                if not _add(data, f, doc, manifests):
                    raise Unusable("is none of diagnose, trace, trace --run or experiment JSON, nor a run's "
                                   "config.json beside its metrics.jsonl")
            except Unusable as why:
                if named:
                    raise ReportError(f"--from {src}: {why}") from None
                skipped.append(f"{found.relative_to(src)} {why}")
        if skipped:
            _warn_skipped(src, skipped)
    data.fp8_runs.sort(key=fp8_arm_order)  # stable: the seeds of an arm stay in the order found
    # a diagnose of an MoE model (a route table) first: the sections that read the last diagnose file read a dense
    # model's where there is one, and the MoE section reads the last with a route table (stable otherwise)
    data.diagnose.sort(key=lambda d: "routing" not in d)
    if data.empty():
        raise ReportError(f"--from {' '.join(map(str, sources))}: found no diagnose JSON, trace JSON, run directory, "
                          "experiment directory or verl log; give the files that diagnose --json, trace --json, train "
                          "--out or experiment --out wrote, or verl's file-logger .jsonl")
    return data


def _read_verl_log(path: Path) -> dict:
    """A verl log read back (runs/framework_log.py `read_verl_log`: {"_path", "format", "steps"}); a damaged one is a
    ReportError naming the file and line."""
    try:
        return framework_log.read_verl_log(path)
    except FrameworkLogError as e:
        raise ReportError(str(e)) from None


def demo_sources() -> list[Path]:
    """The bundled demo data (a diagnose JSON, a trace JSON and sanity-experiment runs on the bundled model)."""
    return [Path(str(resources.files(__package__).joinpath("demo")))]
