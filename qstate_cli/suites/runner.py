"""Run a suite: every point through its kind's hook, results written as each one finishes.

One results document per run (`OUT/<run name>.json`, kind = the run's kind; a name qstate
picks, so always a regular file in OUT, never written through a link there: atomic.py): the
documents returned by the hooks are merged (records concatenated, and each extra list
such as `series` concatenated). Each record gets `point`, the key of the point that
made it. The file is rewritten atomically after every point (results.ResultWriter), and
`meta.suite` lists the points, which are done and which failed (the hook raised, or a row
it returned says `status: failed`, e.g. out of memory), so Ctrl-C keeps what was measured and
`--resume` runs only the points not done (failed points are retried). A run without
--resume replaces an earlier run's files in the folder, saying how many finished points
that drops; a resume is refused on another device or build, and records its session
(`meta.suite.resumes`, and each point's `session`).
The engine's `meta` of each point is kept whole in `meta.suite.points[key]["meta"]`; the
document's own `meta` holds each field that every done point's meta has with one value,
and `cpu_share` (kernels) the lowest of the points' (`_run_meta`; docs/results.md).
`run_suite` hands back each run's document (`SuiteRun.doc`), so nothing re-reads them.

Every point's options are checked (kinds.check_point) before any file is created; a hook
that raises QstateError still stops the run (the suite asked for something the engine
does not know); any other exception marks that point failed and the suite goes on.
Progress goes to a `Progress` (progress.py): begin(total points), start(label, done)
before each point, log(line) for a failed point; the CLI draws it. Inside a point the
engine's own progress is the suite's too (`_PointProgress`): its phases as
start("run: point: phase (step/steps)", points done), its log lines as log(line), so a
diagnose point that replays for minutes is not silent in a CI log.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..atomic import remove_stale_temporaries
from ..errors import QstateError
from ..kinds import KINDS
from ..progress import QUIET, Progress
from ..results import ResultWriter, environment, json_default, load as load_results
from .expand import Point
from .kinds import check_point, hook_for
from .load import LoadedSuite


@dataclass
class SuiteRun:
    """One run of a suite: its results file and the document in it."""

    name: str
    kind: str
    path: Path
    doc: dict

    @property
    def state(self) -> dict:
        """meta.suite: points, done, failed."""
        return self.doc["meta"]["suite"]


def _failed_row(point: Point, exc: BaseException) -> dict:
    """The row of a point that crashed: its parameters as scalar fields, like a measured row's
    (a list parameter of one value is that value, of several their text, of none left out;
    kernels and memory: `name` is the configuration or baseline the point ran)."""
    row = {}
    for key, value in point.params.items():
        if isinstance(value, (list, tuple)):
            if not value:
                continue
            value = value[0] if len(value) == 1 else ", ".join(map(str, value))
        if not isinstance(value, (dict, list, tuple)):
            row[key] = value
    if "name" not in row and KINDS[point.kind].baseline_param == "baseline":
        row["name"] = row.get("config", row.get("baseline"))
    return {**row, "status": "failed", "reason": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}


SAME_BUILD = ("device", "device_name", "torch", "triton", "python", "qstate")  # env fields a resume must share
SESSION = ("git_sha", "created", "argv")  # what meta.suite.resumes records of each resuming session


def _run_env(run: dict) -> dict:
    device = run["defaults"].get("device")
    return environment(None if device in (None, "auto") else device)


def _check_same_build(path: Path, old_env: dict, env: dict) -> None:
    """A resume adds rows to a file measured by another session: refused when that session's
    device or build differs (its rows and the new ones would not be one measurement)."""
    for key in SAME_BUILD:
        if key in old_env and old_env.get(key) != env.get(key):
            raise QstateError(f"{path}: its rows were measured with {key} {old_env.get(key)!r}, this session has "
                              f"{env.get(key)!r}; a resume must run on the same device and build: run without "
                              "--resume to measure afresh, or use another --out")


def _open_writer(path: Path, run: dict, suite: LoadedSuite, points: list[Point], resume: bool):
    """A writer for one run's file: fresh, or (resume) the file so far minus failed points."""
    meta_points = {p.key: {"label": p.label, "params": p.params} for p in points}
    suite_meta = {"name": suite.name, "file": suite.file, "run": run["name"], "description": suite.description,
                  "run_description": run["description"], "sets": suite.sets, "points": meta_points, "done": [],
                  "failed": []}
    env = _run_env(run)
    if resume and path.is_symlink():  # qstate writes a regular file there (atomic.py): a link was put there since
        raise QstateError(f"{path}: a symbolic link where this run's results file should be; --resume reads only "
                          "the file qstate wrote: remove the link, or run without --resume")
    if resume and path.exists():
        doc = load_results(path)
        old = (doc.get("meta") or {}).get("suite") or {}
        if doc.get("kind") != run["kind"] or old.get("run") != run["name"]:
            raise QstateError(f"{path}: not the results of run {run['name']!r} ({run['kind']}); "
                              "use another --out or run without --resume")
        _check_same_build(path, doc["env"], env)
        strangers = sorted(set(old.get("done") or []) - set(meta_points))  # finished ones only
        if strangers:
            raise QstateError(f"{path}: {len(strangers)} finished points are not in this suite (was it edited or "
                              "run with other --set values?); use another --out or run without --resume")
        done = [k for k in old.get("done", []) if k in meta_points]
        keep = set(done)
        for key in done:  # a finished point keeps the engine meta and the session it was measured with
            old_point = (old.get("points") or {}).get(key) or {}
            for field in ("meta", "session"):
                if field in old_point:
                    meta_points[key][field] = old_point[field]
        resumes = [r for r in old.get("resumes") or [] if isinstance(r, dict)]
        resumes.append({k: env.get(k) for k in SESSION})
        writer = ResultWriter(path, run["kind"], env=doc["env"],
                              records=[r for r in doc["records"] if r.get("point") in keep], picked_in=path.parent)
        for key, value in doc.items():
            if key not in ("schema_version", "kind", "env", "meta", "records") and isinstance(value, list):
                writer.doc[key] = [r for r in value if not isinstance(r, dict) or r.get("point") in keep]
        resumed = old.get("resumed") if isinstance(old.get("resumed"), int) else 0
        writer.doc["meta"] = {**doc.get("meta", {}), "suite": {**suite_meta, "done": done, "resumed": resumed + 1,
                                                               "resumes": resumes}}
        _run_meta(writer)
        return writer, keep
    return ResultWriter(path, run["kind"], meta={"suite": suite_meta}, env=env, picked_in=path.parent), set()


STALE = ("report.html", "report.md")  # made from the run files: stale once those change


def _replace_earlier(out_dir: Path, suite: LoadedSuite, resume: bool, progress: Progress) -> None:
    """Before the first point: the folder must describe one run of this suite. Without
    --resume, an earlier run's files (every run's, and those of runs the suite no longer
    has) are replaced, and how many finished points that drops is said; with or without it,
    the report made from the earlier files is removed (the CLI writes it again at the end)."""
    names = {run["name"] for run in suite.runs}
    finished, ours, gone = 0, False, []
    for path in sorted(out_dir.glob("*.json")) if out_dir.is_dir() else []:
        try:
            state = ((json.loads(path.read_text()).get("meta") or {}).get("suite") or {})
            done = len(state.get("done") or []) if isinstance(state.get("done"), list) else 0
        except (OSError, ValueError, RecursionError, AttributeError):
            state, done = {}, 0
        if path.stem in names:
            ours = True
            finished += 0 if resume else done
        elif isinstance(state, dict) and state.get("name") == suite.name and state.get("run") == path.stem:
            ours = True  # a run this suite no longer has: its rows are not this suite's
            if not resume:
                finished += done
                gone.append(path)
    if finished:
        progress.log(f"{out_dir}: {finished} finished points of an earlier run are replaced "
                     "(use --resume to keep them)")
    for path in gone + ([out_dir / name for name in STALE] if ours else []):
        path.unlink(missing_ok=True)
    left = remove_stale_temporaries(out_dir, [f"{name}.json" for name in names] + list(STALE)) if ours else []
    if left:
        progress.log(f"{out_dir}: removed {len(left)} temporary file(s) an interrupted write left "
                     f"({', '.join(p.name for p in left[:3])}{', ...' if len(left) > 3 else ''})")


def _in_point_order(writer: ResultWriter, order: dict[str, int]) -> None:
    """Rows in the order of their points, so a resumed file equals an uninterrupted one."""
    for key, rows in writer.doc.items():
        if key not in ("env", "meta") and isinstance(rows, list):
            rows.sort(key=lambda r: order.get(r.get("point"), len(order)) if isinstance(r, dict) else len(order))


RUN_MINIMUM = ("cpu_share",)  # meta fields whose run value is the lowest of its points' (kernels: compare)


def _same(a, b) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _run_meta(writer: ResultWriter, new_key: str | None = None) -> None:
    """The document's meta from its done points' engine meta (meta.suite.points[key]["meta"]):
    each field all of them have with one value, and RUN_MINIMUM fields at their lowest; beside
    `suite`, which stays as it is. With `new_key` (the point just done) only that point is
    folded into the fields kept so far (a suite of 10,000 points does not compare every point
    again after each); without it, all of them, as a resumed file's start."""
    state = writer.doc["meta"]["suite"]
    metas = [state["points"][k]["meta"] for k in state["done"] + state["failed"]  # failed: rows it did measure
             if isinstance(state["points"].get(k, {}).get("meta"), dict)]
    new = state["points"].get(new_key, {}).get("meta") if new_key is not None else None
    if isinstance(new, dict) and len(metas) > 1:
        run = {k: v for k, v in writer.doc["meta"].items() if k != "suite"}
        for key in list(run):
            if key not in new:
                del run[key]
            elif key in RUN_MINIMUM:
                if isinstance(new[key], (int, float)) and not isinstance(new[key], bool):
                    run[key] = new[key] if run[key] is None else min(run[key], new[key])
            elif not _same(new[key], run[key]):
                del run[key]
        writer.doc["meta"] = {**run, "suite": state}
        return
    if new_key is not None and not isinstance(new, dict):
        return  # a point without engine meta changes nothing
    run = {}
    if metas:
        for key in metas[0]:
            if key == "suite" or not all(key in m for m in metas):
                continue
            values = [m[key] for m in metas]
            if key in RUN_MINIMUM:
                numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
                run[key] = min(numbers) if numbers else None
            elif all(_same(v, values[0]) for v in values[1:]):
                run[key] = values[0]
    writer.doc["meta"] = {**run, "suite": state}


def _merge(writer: ResultWriter, point: Point, out: dict, hook_name: str) -> str | None:
    """Add a point's rows (and engine meta); the reason of its first failed row, if any."""
    if not isinstance(out, dict) or not isinstance(out.get("records"), list):
        raise QstateError(f"the {point.kind} hook ({hook_name}) returned no 'records' list for {point.label}")
    meta = out.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise QstateError(f"the {point.kind} hook ({hook_name}) returned a 'meta' that is not a mapping")
    lists = {key: rows for key, rows in out.items() if key not in ("meta", "env")}
    for key, rows in lists.items():
        if not isinstance(rows, list):
            raise QstateError(f"the {point.kind} hook ({hook_name}) returned {key!r} that is not a list of rows")
    for key, rows in lists.items():
        writer.doc.setdefault(key, []).extend({**row, "point": point.key} if isinstance(row, dict) else row
                                              for row in rows)
    if meta is not None:  # JSON's copy: what the file will hold, and no engine object kept alive
        writer.doc["meta"]["suite"]["points"][point.key]["meta"] = json.loads(
            json.dumps(meta, default=json_default, allow_nan=True))
    return next(((str(row.get("reason") or "").strip().splitlines() or ["failed"])[0][:300]
                 for rows in lists.values() for row in rows
                 if isinstance(row, dict) and row.get("status") == "failed"), None)


def _check_traces(plans) -> None:
    """Every trace file a point replays is loaded once (a corrupt or hostile one refused,
    QstateError) before any file of the folder is replaced: found at its own point, after the
    other runs were measured again, it left that run's earlier results gone. Names (`demo`,
    `corpus:NAME`) are made on first use and checked there."""
    from ..trace import load_trace
    from .checks import is_name

    seen: set[str] = set()
    for _, points in plans:
        for point in points:
            trace = point.params.get("trace")
            if isinstance(trace, str) and trace not in seen and not is_name(trace):
                seen.add(trace)
                load_trace(trace)


class _PointProgress(Progress):
    """An engine's progress inside the suite's current point, as the suite's: a phase
    start(label, n) is start("<point>: <label> (n/total)", points done), n and total the
    engine's own units (diagnose: replayed steps; bench: rows), a log line the suite's log
    line; its rows and results stay the runner's business."""

    def __init__(self, suite: Progress):
        super().__init__(on_begin=self._begin, on_start=self._start, on_log=suite.log)
        self.suite, self.point, self.done, self.steps = suite, "", 0, None

    def enter(self, point: str, done: int) -> None:
        self.point, self.done, self.steps = point, done, None

    def _begin(self, total: int, result) -> None:
        self.steps = total

    def _start(self, label: str, step: int) -> None:
        count = f" ({step}/{self.steps})" if self.steps else ""
        self.suite.start(f"{self.point}: {label}{count}", self.done)


def run_suite(suite: LoadedSuite, out_dir, resume: bool = False, progress: Progress | None = None) -> list[SuiteRun]:
    """Run every point of every run; returns each run's file and document."""
    out_dir = Path(out_dir)
    progress = progress or QUIET
    plans = suite.points()
    inner = _PointProgress(progress)
    hooks = {run["kind"]: hook_for(run["kind"], inner) for run, _ in plans}  # fail before measuring anything
    for run, points in plans:  # every point's options checked before any file is created
        for point in points:
            try:
                check_point(run["kind"], json.loads(json.dumps(point.params)))
            except QstateError as exc:
                raise QstateError(f"{suite.file}: run {run['name']!r}, point {point.label}: {exc}") from None
    writers = []
    for run, points in plans:
        path = out_dir / f"{run['name']}.json"
        writers.append((path, *_open_writer(path, run, suite, points, resume)))
    _check_traces(plans)
    _replace_earlier(out_dir, suite, resume, progress)
    for _, writer, _ in writers:  # every run's file now describes this session (no earlier run's rows)
        writer.flush()
    total = sum(len(points) for _, points in plans)
    done_so_far = sum(len(done) for _, _, done in writers)
    progress.begin(total, None)
    for (run, points), (path, writer, done) in zip(plans, writers):
        hook = hooks[run["kind"]]
        hook_name = getattr(hook, "__qualname__", repr(hook))
        order = {p.key: i for i, p in enumerate(points)}
        state = writer.doc["meta"]["suite"]
        session = len(state.get("resumes") or [])  # 0: the env block's session; n: resumes[n - 1]
        for point in points:
            if point.key in done:
                continue
            progress.start(f"{run['name']}: {point.label}", done_so_far)
            inner.enter(f"{run['name']}: {point.label}", done_so_far)
            state["points"][point.key]["session"] = session
            try:
                failed = _merge(writer, point, hook(json.loads(json.dumps(point.params))), hook_name)
            except QstateError as exc:
                raise QstateError(f"{suite.file}: run {run['name']!r}, point {point.label}: {exc}") from None
            except Exception as exc:  # noqa: BLE001 - a point that crashes is recorded, the suite goes on
                writer.records.append({**_failed_row(point, exc), "point": point.key})
                state["failed"].append(point.key)
                progress.log(f"failed {run['name']}: {point.label}: {exc}")
            else:
                if failed is None:
                    state["done"].append(point.key)
                else:  # a row the engine marked failed (out of memory): the point is failed, --resume retries it
                    state["failed"].append(point.key)
                    progress.log(f"failed {run['name']}: {point.label}: {failed}")
                _run_meta(writer, point.key)
            _in_point_order(writer, order)
            writer.flush()
            done_so_far += 1
    progress.start("done", done_so_far)
    return [SuiteRun(run["name"], run["kind"], path, writer.doc) for (run, _), (path, writer, _) in zip(plans, writers)]
