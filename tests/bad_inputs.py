"""The bad-input catalogue: every class of bad or hostile input a user can hand qstate,
each one a real command line, with the one line it must get (exit code 2).

`tests/test_bad_input.py` runs every case through `typer.testing.CliRunner` and a
sample of them as real subprocesses, and asserts: exit code 2, exactly one line on
stderr, no traceback, the expected message, and no side effect (the folder the case
works in holds exactly the files it held before, byte for byte: no partial output, no
temporary file, nothing overwritten or lost).

`python tests/bad_inputs.py > docs/errors.md` runs every case as a real subprocess and
writes the table of docs/errors.md from what each one printed.

A case builds its hostile files in an empty folder (`make(dir) -> argv`); it must not
need the network, a GPU or more than a few seconds of CPU when qstate behaves.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "tests" / "data" / "results"


@dataclass(frozen=True)
class Case:
    id: str
    group: str  # the class of bad input (a heading of docs/errors.md)
    what: str  # what is tried, in words
    make: Callable[[Path], list[str]]  # builds its files in the folder; returns the argv after `qstate`
    message: str  # a regular expression the one line must match
    env: dict = field(default_factory=dict)


def unwritable_dir(tmp: Path) -> Path:
    """A folder no file can be created in: a read-only folder, or /sys where we run as root
    (root ignores permission bits; /sys refuses new files to everyone)."""
    if os.geteuid() == 0:
        return Path("/sys")
    ro = tmp / "read-only"
    ro.mkdir(exist_ok=True)
    ro.chmod(0o555)
    return ro


def copy_result(tmp: Path, name: str, edit: Callable[[dict], None] | None = None, src: Path | None = None) -> str:
    doc = json.loads((src or RESULTS / "memory.json").read_text())
    if edit is not None:
        edit(doc)
    path = tmp / name
    path.write_text(json.dumps(doc))
    return str(path)


def write(tmp: Path, name: str, text: str) -> str:
    path = tmp / name
    path.write_text(text)
    return str(path)


def small_trace(hparams: dict | None = None, optimizer: str = "adamw"):
    """A 2-tensor, 4-step trace made in memory (no training)."""
    from qstate_cli.trace.schema import Trace, TraceTensor

    gen = torch.Generator().manual_seed(0)
    tensors = [TraceTensor(f"w{i}", i, (3000,), torch.tensor([0, 1]), torch.randn(4, 3000, generator=gen))
               for i in range(2)]
    hp = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0} if hparams is None else hparams
    return Trace(optimizer, hp, 0, 1, 4, "fp32", tensors, {"source": "tests/bad_inputs.py"})


def raw_trace(tmp: Path, name: str, edit: Callable[[dict], None]) -> str:
    """A trace file written with torch.save past qstate's checks (what a stranger can send)."""
    obj = small_trace().to_dict()
    edit(obj)
    path = tmp / name
    torch.save(obj, path)
    return str(path)


# -- the catalogue ---------------------------------------------------------------------------

CASES: list[Case] = []


def case(group: str, what: str, message: str, env: dict | None = None):
    def register(make):
        CASES.append(Case(make.__name__.replace("_", "-"), group, what, make, message, env or {}))
        return make
    return register


OUT = "Output paths (checked before any work)"


@case(OUT, "`diagnose --theory --json` naming a folder", r"--json .*: is a folder; name a file")
def json_is_a_folder(tmp):
    (tmp / "out").mkdir()
    return ["diagnose", "--theory", "--json", str(tmp / "out")]


@case(OUT, "`diagnose --json` in a folder that cannot be written", r"--json .*: cannot write in .*")
def json_unwritable(tmp):
    return ["diagnose", "--theory", "--json", str(unwritable_dir(tmp) / "x.json")]


@case(OUT, "`bench memory --csv` under an existing file", r"--csv .*: .*afile is a file, not a folder")
def csv_under_a_file(tmp):
    write(tmp, "afile", "keep me")
    return ["bench", "memory", "--numel", "1000", "-c", "fp32", "--baseline", "none", "--csv",
            str(tmp / "afile" / "x.csv")]


@case(OUT, "`bench kernels --json` in a folder that cannot be written", r"--json .*: cannot write in .*")
def bench_json_unwritable(tmp):
    return ["bench", "kernels", "--numel", "1024", "-c", "fp32", "--baseline", "none",
            "--json", str(unwritable_dir(tmp) / "k.json")]


@case(OUT, "`report --out` under an existing file", r"--html .*: .*afile is a file, not a folder")
def report_out_under_a_file(tmp):
    write(tmp, "afile", "keep me")
    return ["report", copy_result(tmp, "memory.json"), "--out", str(tmp / "afile" / "sub")]


@case(OUT, "`report --markdown` in a folder that cannot be written", r"--markdown .*: cannot write in .*")
def report_markdown_unwritable(tmp):
    return ["report", copy_result(tmp, "memory.json"), "--markdown", str(unwritable_dir(tmp) / "r.md")]


@case(OUT, "`compare --results` naming a folder", r"--results .*: is a folder; name a file")
def compare_results_is_a_folder(tmp):
    (tmp / "out").mkdir()
    m = copy_result(tmp, "memory.json")
    return ["compare", m, m, "--results", str(tmp / "out")]


@case(OUT, "`compare` with $GITHUB_STEP_SUMMARY in a folder that cannot be written",
      r"GITHUB_STEP_SUMMARY .*: cannot write in .*", env={"GITHUB_STEP_SUMMARY": "/sys/qstate-summary.md"})
def step_summary_unwritable(tmp):
    m = copy_result(tmp, "memory.json")
    return ["compare", m, m]


@case(OUT, "`run --out` under an existing file", r"--out .*: .*afile is a file, not a folder")
def run_out_under_a_file(tmp):
    write(tmp, "afile", "keep me")
    suite = write(tmp, "s.yaml", "kind: memory\ndefaults: {numel: [1000], config: [fp32]}\n")
    return ["run", suite, "--out", str(tmp / "afile" / "o")]


@case(OUT, "`trace demo -o` in a folder that cannot be written", r"--output .*: cannot write in .*")
def demo_output_unwritable(tmp):
    return ["trace", "demo", "-o", str(unwritable_dir(tmp) / "t.pt"), "--steps", "1"]


@case(OUT, "`diagnose demo` with $QSTATE_CACHE naming a file (trained 44 s, then 'cannot write (File exists)'; "
      "a relative $QSTATE_CACHE is read from the working folder)",
      r"error: cache /.*/afile: is a file, not a folder; the demo trace is recorded there before use: set "
      r"QSTATE_CACHE", env={"QSTATE_CACHE": "afile"})
def demo_cache_is_a_file(tmp):
    write(tmp, "afile", "keep me")
    return ["diagnose", "demo", "-c", "bf16"]


@case(OUT, "`trace info demo` with a cache folder that cannot be written (trained 38 s, then failed to write it)",
      r"error: cache /proc/qstate-cache: cannot write in /proc .*; the demo trace is recorded there before use",
      env={"QSTATE_CACHE": "/proc/qstate-cache"})
def demo_cache_unwritable(tmp):
    return ["trace", "info", "demo"]


@case(OUT, "`trace corpus --record` with a cache folder that cannot be written",
      r"error: cache /proc/qstate-cache: cannot write in /proc .*; corpus trace synthetic-heavy is recorded there",
      env={"QSTATE_CACHE": "/proc/qstate-cache"})
def corpus_cache_unwritable(tmp):
    return ["trace", "corpus", "--record", "synthetic-heavy"]


@case(OUT, "`report --markdown` with `--out` (--out was ignored: only the Markdown was written)",
      r"error: --out .*rr: not used with --markdown \(--out is the folder of both reports when neither --html nor "
      r"--markdown is given\)")
def report_out_with_markdown(tmp):
    return ["report", copy_result(tmp, "memory.json"), "--markdown", str(tmp / "sub" / "r.md"), "--out",
            str(tmp / "rr")]


def _trace_file(tmp: Path, name: str = "keep.pt") -> str:
    from qstate_cli.trace import save_trace

    return str(save_trace(small_trace(), tmp / name))


def _checkpoint(tmp: Path, name: str) -> str:
    p = torch.nn.Parameter(torch.ones(8))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones(8)
    opt.step()
    torch.save(opt.state_dict(), tmp / name)
    return str(tmp / name)


_DIAGNOSE = ["-c", "sr-4bit", "--steps-limit", "1", "--skip-reset-check"]


@case(OUT, "`diagnose DIR/keep.pt --json ./keep.pt` (the trace, spelled otherwise)",
      r"--json keep.pt: is also an input \(TRACE\); name another file")
def diagnose_json_is_the_trace(tmp):
    return ["diagnose", _trace_file(tmp), *_DIAGNOSE, "--json", "./keep.pt"]


@case(OUT, "`diagnose TRACE --json` naming a symlink to the trace",
      r"--json .*link.pt: is also an input \(TRACE\); name another file")
def diagnose_json_is_a_link_to_the_trace(tmp):
    (tmp / "link.pt").symlink_to(_trace_file(tmp))
    return ["diagnose", str(tmp / "keep.pt"), *_DIAGNOSE, "--json", str(tmp / "link.pt")]


@case(OUT, "`diagnose --json` and `--html` naming one file",
      r"--html .*same.out: --json writes it too; name another file")
def diagnose_two_outputs_one_file(tmp):
    return ["diagnose", _trace_file(tmp), *_DIAGNOSE, "--json", str(tmp / "same.out"), "--html", str(tmp / "same.out")]


@case(OUT, "`diagnose SHARDS/ --json SHARDS/rank0.pt` (a file of the input folder; it was replaced by JSON)",
      r"--json .*rank0.pt: is a file of the input folder TRACE; name a file outside it, or a new one")
def diagnose_json_in_the_trace_folder(tmp):
    (tmp / "shards").mkdir()
    (tmp / "shards" / "rank0.pt").write_bytes(b"a shard")
    return ["diagnose", str(tmp / "shards"), *_DIAGNOSE, "--json", str(tmp / "shards" / "rank0.pt")]


@case(OUT, "`doctor DCP/ --json DCP/.metadata` (a file of the checkpoint folder; it was replaced by JSON)",
      r"--json .*\.metadata: is a file of the input folder CHECKPOINT; name a file outside it, or a new one")
def doctor_json_in_the_checkpoint_folder(tmp):
    (tmp / "dcp").mkdir()
    (tmp / "dcp" / ".metadata").write_bytes(b"metadata")
    return ["doctor", str(tmp / "dcp"), "--json", str(tmp / "dcp" / ".metadata")]


@case(OUT, "`run DIR/m.json --out DIR` whose run `m` would write over the suite file",
      r"--out .*m.json: is also an input \(SUITE\); name another file")
def run_writes_over_its_suite(tmp):
    (tmp / "s").mkdir()
    suite = write(tmp / "s", "m.json", '{"runs": [{"name": "m", "kind": "memory", "defaults": {"numel": [1000], '
                                       '"config": ["fp32"], "device": "cpu"}}]}')
    return ["run", suite, "--out", str(tmp / "s"), "--no-report"]


@case(OUT, "`bench memory --csv -` (wrote a file named '-')", r"--csv -: this output is a file, not stdout; name a file")
def csv_dash(tmp):
    return ["bench", "memory", "-n", "1000", "-c", "fp32", "--csv", "-"]


@case(OUT, "`report --html` naming the results file", r"--html .*memory.json: is also an input \(RESULTS\)")
def report_html_is_the_input(tmp):
    return ["report", copy_result(tmp, "memory.json"), "--html", str(tmp / "memory.json")]


@case(OUT, "`report FOLDER --markdown` naming a results file in the folder",
      r"--markdown .*b.json: is also an input \(RESULTS\)")
def report_markdown_is_in_the_input_folder(tmp):
    (tmp / "res").mkdir()
    copy_result(tmp / "res", "a.json"), copy_result(tmp / "res", "b.json")
    return ["report", str(tmp / "res"), "--markdown", str(tmp / "res" / "b.json")]


@case(OUT, "`report --plots --markdown /dev/null` (made a folder /dev/null-plots/)",
      r"--plots saves the PNGs beside the Markdown report: .*/dev/null is a device or a pipe")
def report_plots_beside_a_device(tmp):
    return ["report", copy_result(tmp, "memory.json"), "--markdown", "/dev/null", "--plots"]


@case(OUT, "`report --plots --html` only (the plots were dropped silently)",
      r"--plots saves the PNGs beside the Markdown report: give --markdown a file in a folder$")
def report_plots_without_markdown(tmp):
    return ["report", copy_result(tmp, "memory.json"), "--html", str(tmp / "r.html"), "--plots"]


@case(OUT, "`compare --results` naming NEW", r"--results .*b.json: is also an input \(NEW\); name another file")
def compare_results_is_new(tmp):
    return ["compare", copy_result(tmp, "a.json"), copy_result(tmp, "b.json"), "--results", str(tmp / "b.json")]


@case(OUT, "`compare` with $GITHUB_STEP_SUMMARY naming BASELINE", r"GITHUB_STEP_SUMMARY a.json: is also an input "
      r"\(BASELINE\)", env={"GITHUB_STEP_SUMMARY": "a.json"})
def step_summary_is_the_baseline(tmp):
    return ["compare", copy_result(tmp, "a.json"), copy_result(tmp, "b.json")]


@case(OUT, "`doctor --csv` naming the checkpoint", r"--csv .*ckpt.pt: is also an input \(CHECKPOINT\)")
def doctor_csv_is_the_checkpoint(tmp):
    return ["doctor", _checkpoint(tmp, "ckpt.pt"), "--csv", str(tmp / "ckpt.pt")]


@case(OUT, "`doctor --json` naming the --against checkpoint", r"--json .*old.pt: is also an input \(--against\)")
def doctor_json_is_the_against(tmp):
    return ["doctor", _checkpoint(tmp, "ckpt.pt"), "--against", _checkpoint(tmp, "old.pt"), "--json",
            str(tmp / "old.pt")]


YAML = "Suites: YAML that would hang or exhaust memory (limits: qstate_cli/suites/bounded_yaml.py)"


def alias_bomb(levels: int = 10, fan: int = 10) -> str:
    """520 bytes that expand to fan**levels values when aliases are followed."""
    lines = ["kind: memory", "defaults:", "  a0: &a0 [" + ",".join(["x"] * fan) + "]"]
    lines += [f"  a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * fan) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@case(YAML, "an alias bomb (10 levels of 10 aliases, 520 bytes) to `suite validate`",
      r"bomb.yaml:\d+: invalid YAML: more than 100,000 values once aliases are expanded")
def yaml_alias_bomb_validate(tmp):
    return ["suite", "validate", write(tmp, "bomb.yaml", alias_bomb())]


@case(YAML, "the same alias bomb to `run`", r"bomb.yaml:\d+: invalid YAML: more than 100,000 values")
def yaml_alias_bomb_run(tmp):
    return ["run", write(tmp, "bomb.yaml", alias_bomb()), "--out", str(tmp / "out")]


@case(YAML, "a recursive alias `a: &a [*a]`", r"self.yaml:3: invalid YAML: a recursive alias")
def yaml_recursive_alias(tmp):
    return ["suite", "validate", write(tmp, "self.yaml", "kind: memory\ndefaults:\n  a: &a [*a]\n")]


@case(YAML, "a recursive alias in a `--set` value", r"--set 'numel=&a \[\*a\]': the value is not valid YAML: "
      r"a recursive alias")
def set_recursive_alias(tmp):
    return ["run", write(tmp, "s.yaml", "kind: memory\n"), "--set", "numel=&a [*a]", "--out", str(tmp / "out")]


@case(YAML, "101 aliases of one value", r"many.yaml:\d+: invalid YAML: more than 100 aliases")
def yaml_too_many_aliases(tmp):
    body = "kind: memory\ndefaults:\n  x: &x 1\n  l: [" + ",".join(["*x"] * 101) + "]\n"
    return ["suite", "validate", write(tmp, "many.yaml", body)]


@case(YAML, "lists nested 10,000 deep", r"deep.yaml(:\d+)?: invalid YAML: nested deeper than 64 levels")
def yaml_too_deep(tmp):
    return ["suite", "validate", write(tmp, "deep.yaml", "kind: memory\nx: " + "[" * 10000 + "]" * 10000 + "\n")]


@case(YAML, "a 2 MiB suite", r"big.yaml: invalid YAML: larger than 1 MiB")
def yaml_too_big(tmp):
    return ["suite", "validate", write(tmp, "big.yaml", "kind: memory\n" + "# padding\n" * 220_000)]


@case(YAML, "three range axes of 10,000 values (10^12 points)", r"cp.yaml:\d+: axes: run 'kernels' has "
      r"1,000,000,000,000 points .* the limit is 10,000")
def yaml_cross_product(tmp):
    axis = "{start: 1, stop: 10000, step: 1}"
    return ["run", write(tmp, "cp.yaml", f"kind: kernels\naxes:\n  numel: {axis}\n  seed: {axis}\n"
                                        f"  warmup_ms: {axis}\n"), "--out", str(tmp / "out")]


@case(YAML, "a `--set` value that is not YAML", r"--set 'numel=\[1, 2': the value is not valid YAML: expected ',' "
      r"or '\]'.* at column 6$")
def set_value_not_yaml(tmp):
    return ["run", write(tmp, "s.yaml", "kind: memory\n"), "--set", "numel=[1, 2", "--out", str(tmp / "out")]


TRACE = "Traces: hostile, corrupt or impossible (limits: qstate_cli/trace/io.py)"


class _Pwn:
    """Unpickling this runs `touch PWNED` (what weights_only=True must never do)."""

    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


@case(TRACE, "a torch.save file whose pickle would run a shell command", r"refused: the file holds Python objects")
def trace_runs_code(tmp):
    path = tmp / "evil.pt"
    torch.save({"format": "qstate-trace", "x": _Pwn(str(tmp / "PWNED"))}, path)
    return ["trace", "info", str(path)]


@case(TRACE, "a raw pickle (not a zip archive)", r"not a qstate trace \(a raw pickle, refused because loading one can run code")
def trace_raw_pickle(tmp):
    import pickle

    path = tmp / "evil.pt"
    path.write_bytes(pickle.dumps(_Pwn(str(tmp / "PWNED"))))
    return ["diagnose", str(path)]


@case(TRACE, "a zip bomb: a trace whose data.pkl is deflated 64 MiB of zeros (160 KB on disk)",
      r"refused: inflates to [\d,]+ bytes from [\d,]+ on disk \(more than 4x; a zip bomb\?\)")
def trace_zip_bomb(tmp):
    buf = io.BytesIO()
    torch.save(small_trace().to_dict(), buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    path = tmp / "bomb.pt"
    with zipfile.ZipFile(path, "w") as out:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("data.pkl"):
                packed = zipfile.ZipInfo(info.filename)
                packed.compress_type = zipfile.ZIP_DEFLATED
                with out.open(packed, "w") as fh:
                    fh.write(data)
                    for _ in range(64):
                        fh.write(bytes(1 << 20))
            else:
                out.writestr(info, data)
    return ["trace", "info", str(path)]


def _flip_tensor_bytes(raw: bytes) -> bytes:
    """Flip 4 bytes in the middle of the archive's largest tensor record (the grads)."""
    archive = zipfile.ZipFile(io.BytesIO(raw))
    rec = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    local = raw[rec.header_offset:rec.header_offset + 30]
    start = rec.header_offset + 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")
    at = start + rec.file_size // 2
    out = bytearray(raw)
    out[at:at + 4] = bytes(b ^ 0xFF for b in out[at:at + 4])
    return bytes(out)


@case(TRACE, "a trace with 4 flipped bytes in its gradient data", r"the data does not match its sha256: the file is "
      r"corrupt")
def trace_flipped_bytes(tmp):
    from qstate_cli.trace import save_trace

    path = save_trace(small_trace(), tmp / "t.pt")
    path.write_bytes(_flip_tensor_bytes(path.read_bytes()))
    return ["diagnose", str(path), "-c", "bf16"]


@case(TRACE, "a truncated trace (the first half of the file)", r"corrupt or truncated trace")
def trace_truncated(tmp):
    from qstate_cli.trace import save_trace

    path = save_trace(small_trace(), tmp / "t.pt")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return ["trace", "info", str(path)]


def _hparams_case(betas):
    def make(tmp):
        return ["diagnose", raw_trace(tmp, "t.pt", lambda d: d["optimizer"]["hparams"].update(betas=betas)), "-c",
                "bf16"]
    return make


for _betas, _name, _msg in (([0.9, 1.0], "beta2 = 1", r"betas \[0.9, 1.0\]: each beta must be in \[0, 1\)"),
                            ("x", "betas 'x'", r"betas 'x': give two numbers"),
                            ([0.9], "betas [0.9]", r"betas \[0.9\]: give two numbers"),
                            ([-1, 2], "betas [-1, 2]", r"betas \[-1, 2\]: each beta must be in \[0, 1\)")):
    _make = _hparams_case(_betas)
    _make.__name__ = "trace_hparams_" + _name.replace(" ", "").replace("'", "").replace("=", "_").replace(
        "[", "").replace("]", "").replace(",", "_").replace("-", "m").replace(".", "")
    case(TRACE, f"a trace with {_name}", r"t.pt: optimizer adamw: hparams " + _msg)(_make)


@case(TRACE, "a trace with a learning rate of 10**400, an int past any float (an OverflowError traceback)",
      r"hparams lr 1000+\.\.\.: must be a finite number")
def trace_hparams_huge_int_lr(tmp):
    return ["trace", "info", raw_trace(tmp, "t.pt", lambda d: d["optimizer"]["hparams"].update(lr=10 ** 400))]


@case(TRACE, "a trace with a NaN learning rate (to `trace info`)", r"hparams lr nan: must be a finite number")
def trace_hparams_nan_lr(tmp):
    return ["trace", "info", raw_trace(tmp, "t.pt", lambda d: d["optimizer"]["hparams"].update(lr=float("nan")))]


def _edit_tensor(**fields):
    def edit(d):
        d["tensors"][0].update(fields)
    return edit


@case(TRACE, "absent rows past the trace's steps (rows the replay would skip that do not exist)",
      r"t.pt: tensor 0 \('w0'\): 'absent' must be ascending, distinct rows below n_steps")
def trace_absent_out_of_range(tmp):
    def edit(d):
        d["schema_version"] = 2
        d["tensors"][0]["absent"] = torch.tensor([0, d["n_steps"]])
        del d["tensors"][0]["sha256"]
    return ["diagnose", raw_trace(tmp, "t.pt", edit)]


@case(TRACE, "absent rows as floats", r"t.pt: tensor 0 \('w0'\): 'absent' must be a 1-D int64 tensor of rows")
def trace_absent_floats(tmp):
    def edit(d):
        d["schema_version"] = 2
        d["tensors"][0]["absent"] = torch.tensor([0.0, 1.0])
        del d["tensors"][0]["sha256"]
    return ["trace", "info", raw_trace(tmp, "t.pt", edit)]


@case(TRACE, "sparse gradients, no sha256 (a NotImplementedError traceback in `trace info`)",
      r"t.pt: tensor 0 \('w0'\): 'grads' is a sparse_coo tensor; a trace holds dense tensors")
def trace_sparse_grads(tmp):
    def edit(d):
        t = d["tensors"][0]
        t["grads"] = t["grads"].to_sparse()
        del t["sha256"]
    return ["trace", "info", raw_trace(tmp, "t.pt", edit)]


@case(TRACE, "sparse gradients with a sha256 (a traceback hashing them)", r"'grads' is a sparse_coo tensor")
def trace_sparse_grads_sha(tmp):
    return ["trace", "info", raw_trace(tmp, "t.pt", lambda d: d["tensors"][0].update(
        grads=d["tensors"][0]["grads"].to_sparse()))]


@case(TRACE, "meta-device gradients (a shape without data: a traceback in `diagnose`)",
      r"'grads' is a meta tensor \(a shape without data\); a trace holds dense tensors")
def trace_meta_grads(tmp):
    return ["diagnose", raw_trace(tmp, "t.pt", _edit_tensor(grads=torch.empty(4, 3000, device="meta"))), "-c",
            "bred-4bit"]


@case(TRACE, "meta-device block indices (to `trace info`)", r"'blocks' is a meta tensor")
def trace_meta_blocks(tmp):
    return ["trace", "info", raw_trace(tmp, "t.pt", _edit_tensor(blocks=torch.tensor([0, 1], device="meta")))]


@case(TRACE, "gradients of 2^30 steps x 3000 elements over 4 bytes (an expanded tensor: 12 TB when read)",
      r"'grads' is a view of 3,221,225,472,000 elements over 4 bytes of storage")
def trace_expanded_grads(tmp):
    def edit(d):
        d["n_steps"] = 2**30
        d["tensors"] = d["tensors"][:1]
        d["tensors"][0].update(grads=torch.zeros(1).expand(2**30, 3000))
    return ["trace", "info", raw_trace(tmp, "t.pt", edit)]


@case(TRACE, "step_start 2^70 (a 97-line numba TypingError in `diagnose`)",
      r"step_start 1180591620717411303424 with n_steps 4 ends past step 2\^63-1; steps are int64")
def trace_huge_step(tmp):
    return ["diagnose", raw_trace(tmp, "t.pt", lambda d: d.update(step_start=2**70)), "-c", "bred-4bit",
            "--skip-reset-check"]


@case(TRACE, "a tensor of shape [2^62, 2^62] (an OverflowError in `diagnose`)",
      r"tensor 0 \('w0'\): shape \[4611686018427387904, 4611686018427387904\]: past 2\^48 elements")
def trace_huge_shape(tmp):
    return ["diagnose", raw_trace(tmp, "t.pt", _edit_tensor(shape=[2**62, 2**62])), "-c", "bred-4bit"]


DOCTOR = "Checkpoints: hostile, corrupt or impossible (limits: qstate_cli/doctor/dcpmeta.py)"


def _dcp(tmp: Path, edit: Callable) -> str:
    """A torch.distributed.checkpoint folder of one AdamW state (dcp.save in this one
    process), its .metadata then edited as a stranger could: `edit(metadata)`."""
    import pickle
    import warnings

    import torch.distributed.checkpoint as dcp

    p = torch.nn.Parameter(torch.ones(64, 32))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones_like(p)
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"optimizer": opt.state_dict()}, checkpoint_id=str(tmp / "ck"))
    path = tmp / "ck" / ".metadata"
    md = pickle.loads(path.read_bytes())
    edit(md)
    path.write_bytes(pickle.dumps(md))
    return str(tmp / "ck")


def _exp_avg(md):
    return md.state_dict_metadata["optimizer.state.0.exp_avg"]


@case(DOCTOR, "a DCP planner_data path with list index 10^9 (ran for minutes; 10^8 took 1.85 GB)",
      r"ck/.metadata: the planner_data path of '.*' holds list index 1000000000, but the checkpoint stores \d+ "
      r"item\(s\)")
def dcp_planner_list_index(tmp):
    return ["doctor", _dcp(tmp, lambda md: md.planner_data.update(
        {k: ("optimizer", "state", 10**9, "x") for k in md.state_dict_metadata}))]


def _declare_8gib(md):
    entry = _exp_avg(md)
    entry.size = torch.Size([2**28, 8])
    entry.chunks[0].sizes = torch.Size([2**28, 8])


@case(DOCTOR, "a 30 KB DCP folder declaring an 8 GiB tensor (allocated and filled before the refusal)",
      r"ck: its metadata declares tensors of 8.00 GiB, but its data files hold [\d,]+ bytes: a truncated or forged")
def dcp_declares_more_than_stored(tmp):
    return ["doctor", _dcp(tmp, _declare_8gib)]


@case(DOCTOR, "DCP metadata whose state_dict_metadata is a list (an AttributeError)",
      r"not DCP metadata \(state_dict_metadata is list and storage_data dict; both are dicts\)")
def dcp_metadata_list(tmp):
    return ["doctor", _dcp(tmp, lambda md: setattr(md, "state_dict_metadata", []))]


@case(DOCTOR, "DCP metadata whose storage_data is a list (an AttributeError)", r"storage_data list; both are dicts")
def dcp_storage_list(tmp):
    return ["doctor", _dcp(tmp, lambda md: setattr(md, "storage_data", []))]


@case(DOCTOR, "a DCP tensor of size (-5, 4) (a RuntimeError)",
      r"'optimizer.state.0.exp_avg' declares size \(-5, 4\): each dimension must be a whole number >= 0")
def dcp_negative_size(tmp):
    return ["doctor", _dcp(tmp, lambda md: setattr(_exp_avg(md), "size", torch.Size([-5, 4])))]


@case(DOCTOR, "a DCP tensor whose dtype is the text 'float32' (a TypeError)",
      r"'optimizer.state.0.exp_avg' declares dtype 'float32', not a torch dtype")
def dcp_text_dtype(tmp):
    return ["doctor", _dcp(tmp, lambda md: setattr(_exp_avg(md).properties, "dtype", "float32"))]


@case(DOCTOR, "DCP planner_data paths that are empty (an IndexError)",
      r"the planner_data path of '.*' is \(\), not a non-empty tuple of names and list indices")
def dcp_planner_empty_path(tmp):
    return ["doctor", _dcp(tmp, lambda md: md.planner_data.update({k: () for k in md.state_dict_metadata}))]


@case(DOCTOR, "a DCP tensor declared int64 whose stored chunk is float32 (cast silently)",
      r"a chunk of 'optimizer.state.0.exp_avg' is torch.float32, but its metadata declares torch.int64")
def dcp_chunk_dtype_differs(tmp):
    return ["doctor", _dcp(tmp, lambda md: setattr(_exp_avg(md).properties, "dtype", torch.int64))]


@case(DOCTOR, "`doctor --max-gib 1e-9` (said '0.0 GiB is over the limit of 0.0 GiB')",
      r"ckpt.pt: [\d,]+ bytes is over the limit of 1 byte \(--max-gib\)")
def doctor_max_gib_tiny(tmp):
    return ["doctor", _checkpoint(tmp, "ckpt.pt"), "--max-gib", "1e-9"]


GATE = "The compare gate fails closed (qstate_cli/compare/evidence.py)"


def _kernels(tmp: Path, name: str, edit=None) -> str:
    return copy_result(tmp, name, edit, src=RESULTS / "kernels.json")


@case(GATE, "NEW with zero records", r"NEW .*new.json: no kernels rows, but the baseline has 27 \(it holds no rows at "
      r"all\); an empty or mismatched result cannot pass the gate")
def gate_new_empty(tmp):
    return ["compare", _kernels(tmp, "base.json"), _kernels(tmp, "new.json", lambda d: d.update(records=[]))]


@case(GATE, "NEW of another kind (memory against a kernels baseline)", r"NEW .*: no kernels rows, but the baseline has "
      r"27 \(it holds memory rows\)")
def gate_new_other_kind(tmp):
    return ["compare", _kernels(tmp, "base.json"), copy_result(tmp, "new.json")]


@case(GATE, "an empty baseline", r"baseline .*base.json: no kernels rows to compare NEW's 27 against")
def gate_baseline_empty(tmp):
    return ["compare", _kernels(tmp, "base.json", lambda d: d.update(records=[])), _kernels(tmp, "new.json")]


def _double_time(doc):
    for row in doc["records"]:
        if row.get("time_ms"):
            row["time_ms"] *= 2


@case(GATE, "NEW's time_ms doubled, its samples_ms left alone", r"NEW .*new.json: row 0 \(nearest-4bit\): time_ms "
      r"[\d.]+ is not the median of its samples_ms \([\d.]+\); the file was edited or corrupted")
def gate_time_not_median(tmp):
    return ["compare", _kernels(tmp, "base.json"), _kernels(tmp, "new.json", _double_time)]


@case(GATE, "a NaN in a baseline's samples_ms", r"baseline .*: row 0 \(nearest-4bit\): samples_ms must be a list of "
      r"positive finite numbers")
def gate_nan_sample(tmp):
    return ["compare", _kernels(tmp, "base.json", lambda d: d["records"][0]["samples_ms"].append(float("nan"))),
            _kernels(tmp, "new.json")]


@case(GATE, "a baseline folder with no results files", r"base: no results files \(\*.json\) in this folder")
def gate_empty_folder(tmp):
    (tmp / "base").mkdir()
    return ["compare", str(tmp / "base"), _kernels(tmp, "new.json")]


def _twice_records(tmp, name):
    """A kernels result with a second "records" key (json.loads keeps the last; a reviewer reads the first)."""
    path = Path(_kernels(tmp, name))
    text = path.read_text()
    path.write_text(text.replace('"records": [', '"records": [], "records": [', 1))
    return str(path)


@case(GATE, "a key twice in one object (was: the last one kept)", r"base.json: not a results file: key 'records' "
      r"appears twice in one object")
def gate_duplicate_key(tmp):
    return ["compare", _twice_records(tmp, "base.json"), _kernels(tmp, "new.json")]


@case(GATE, "a `role: copy` in a memory baseline (was: the row left out of the gate)",
      r"base.json: records\[0\] \(fp32\): role 'copy' on a memory row: only kernels results have copy rows")
def gate_copy_role_outside_kernels(tmp):
    return ["compare", copy_result(tmp, "base.json", lambda d: d["records"][0].update(role="copy")),
            copy_result(tmp, "new.json")]


@case(GATE, "`--threshold inf` (every timing regression passed)", r"--threshold inf: use a finite ratio above 1")
def gate_threshold_inf(tmp):
    return ["compare", _kernels(tmp, "base.json"), _kernels(tmp, "new.json"), "--threshold", "inf"]


RES = "Malformed result files (to report, compare and run --resume)"


def _result_cases():
    edits = [
        ("string schema_version", lambda d: d.update(schema_version="1"), r"schema_version '1': must be a whole number"),
        ("a record that is not a mapping", lambda d: d["records"].append(3), r"records\[\d+\] is '3', not a row"),
        ("no env block", lambda d: d.pop("env"), r"no 'env' block"),
        ("meta.suite.done not a list", lambda d: d["meta"].update(suite={"done": 5}), r"meta.suite.done must be a list "
         r"of point keys"),
        ("kind missing", lambda d: d.pop("kind"), r"'kind' None: must be a name"),
        ("records not a list", lambda d: d.update(records={"a": 1}), r"'records' must be a list of rows"),
        ("a record whose name is a list (was a type error)", lambda d: d["records"][0].update(name=["a"]),
         r"records\[0\]: name \['a'\] is not text"),
        ("a record's numel \"big\" (was a type error sorting sizes)", lambda d: d["records"][0].update(numel="big"),
         r"records\[0\] \(fp32\): numel 'big' is not a number"),
        ("a metric that is text (was read as a missing value)",
         lambda d: d["records"][0].update(bytes_per_param="8"), r"records\[0\] \(fp32\): bytes_per_param '8' is "
         r"not a number"),
        ("a row table (series) that is text (was an attribute error)", lambda d: d.update(series="oops"),
         r"'series' must be a list of rows"),
    ]
    for what, edit, message in edits:
        slug = re.sub(r"[^a-z]+", "_", what).strip("_")
        for command in ("report", "compare"):
            def make(tmp, edit=edit, command=command):
                bad = copy_result(tmp, "bad.json", edit)
                if command == "report":
                    return ["report", bad, "--out", str(tmp / "reports")]
                return ["compare", copy_result(tmp, "good.json"), bad]
            make.__name__ = f"results_{slug}_{command}"
            case(RES, f"{what}, to `{command}`", r"bad.json: " + message)(make)


_result_cases()


@case(RES, "a schema_version of 5001 digits, to `compare` (was a ValueError, exit 1: read as a regression)",
      r"huge.json: not a results file \(a number with more digits than JSON readers take\)")
def results_huge_integer_compare(tmp):
    return ["compare", copy_result(tmp, "good.json"), write(tmp, "huge.json", '{"schema_version": ' + "9" * 5001
                                                            + ', "records": []}')]


@case(RES, "100000 nested `[`, to `compare` (was a RecursionError, exit 1: read as a regression)",
      r"deep.json: not a results file \(JSON nested too deep to read\)")
def results_deep_nesting_compare(tmp):
    return ["compare", write(tmp, "deep.json", "[" * 100000), copy_result(tmp, "good.json")]


@case(RES, "100000 nested `[`, to `report`", r"deep.json: not a results file \(JSON nested too deep to read\)")
def results_deep_nesting_report(tmp):
    return ["report", write(tmp, "deep.json", "[" * 100000), "--out", str(tmp / "reports")]


@case(RES, "`run --resume` over a results file whose meta.suite.done is not a list",
      r"memory.json: meta.suite.done must be a list of point keys")
def resume_bad_suite_meta(tmp):
    suite = write(tmp, "s.yaml", "kind: memory\ndefaults: {numel: [1000], config: [fp32]}\n")
    (tmp / "out").mkdir()
    copy_result(tmp / "out", "memory.json", lambda d: d["meta"].update(suite={"run": "memory", "done": 5}))
    return ["run", suite, "--out", str(tmp / "out"), "--resume"]


FLAGS = "Flags: sizes and values out of range (checked before any work)"


@case(FLAGS, "`--numel 9^99999999` (a power too large to compute)", r"numel '9\^99999999': more than 2\^48 elements")
def numel_huge_power(tmp):
    return ["bench", "memory", "--numel", "9^99999999", "-c", "fp32"]


@case(FLAGS, "`--numel 2^-3`", r"numel '2\^-3': give a whole number of elements")
def numel_negative_power(tmp):
    return ["bench", "kernels", "--numel", "2^-3", "-c", "fp32"]


@case(FLAGS, "`--copy-numel 0` (was silently the default)", r"--copy-numel 0: must be >= 1")
def copy_numel_zero(tmp):
    return ["bench", "kernels", "--copy-numel", "0", "--numel", "1024", "-c", "fp32", "--baseline", "none"]


@case(FLAGS, "`--baseline torchao4` (a misspelt peer)",
      r"unknown baseline 'torchao4' for adamw: choose from [a-z0-9, -]+, all, none; did you mean torchao-adamw4bit")
def baseline_misspelt(tmp):
    return ["bench", "kernels", "--numel", "1024", "-c", "fp32", "--baseline", "torchao4"]


@case(FLAGS, "`--warmup-ms -1`", r"--warmup-ms -1: must be a finite number >= 0")
def warmup_negative(tmp):
    return ["bench", "kernels", "--warmup-ms", "-1", "--numel", "1024", "-c", "fp32", "--baseline", "none"]


@case(FLAGS, "`--rep-ms 0`", r"--rep-ms 0: must be a finite number > 0")
def rep_ms_zero(tmp):
    return ["bench", "kernels", "--rep-ms", "0", "--numel", "1024", "-c", "fp32", "--baseline", "none"]


@case(FLAGS, "`bench train --threads abc` (a ValueError traceback, exit 1)",
      r"--threads 'abc': give a whole number \(0: torch's default\)")
def train_threads_not_a_number(tmp):
    return ["bench", "train", "-c", "bred-4bit", "--steps", "2", "--threads", "abc"]


@case(FLAGS, "`bench train --warmup-frac nan` (every row failed, exit 0)", r"--warmup-frac nan: must be from 0 to 1")
def train_warmup_nan(tmp):
    return ["bench", "train", "-c", "bred-4bit", "--steps", "2", "--warmup-frac", "nan"]


@case(FLAGS, "`bench train --diverge-factor nan` (divergence detection silently off)",
      r"--diverge-factor nan: must be a finite number above 1")
def train_diverge_nan(tmp):
    return ["bench", "train", "-c", "bred-4bit", "--steps", "2", "--diverge-factor", "nan"]


@case(FLAGS, "`bench train -c 'bred-4bit@lr=inf'` (ran and diverged)",
      r"in run 'bred-4bit@lr=inf': lr must be a positive finite number")
def train_run_lr_inf(tmp):
    return ["bench", "train", "-c", "bred-4bit@lr=inf", "--steps", "2"]


@case(FLAGS, "`diagnose` with an unknown configuration (no progress line before the error)",
      r"unknown configuration 'nosuch-4bit'")
def diagnose_unknown_config(tmp):
    return ["diagnose", _trace_file(tmp, "t.pt"), "-c", "nosuch-4bit"]


@case(FLAGS, "`diagnose --reset sometimes`", r"reset")
def diagnose_bad_reset(tmp):
    return ["diagnose", _trace_file(tmp, "t.pt"), "-c", "bf16", "--reset", "sometimes"]


@case(FLAGS, "`diagnose --backend fused` (not a codec backend)", r"--backend fused: choose auto or reference")
def diagnose_bad_backend(tmp):
    return ["diagnose", _trace_file(tmp, "t.pt"), "-c", "bf16", "--backend", "fused"]


@case(FLAGS, "`-c m=int4` (v was silently stored on m's signed grid)", r"the v state needs a spec too")
def config_m_without_v(tmp):
    return ["diagnose", _trace_file(tmp, "t.pt"), "-c", "m=int4"]


@case(FLAGS, "`bench train --seeds 1000000000` (built a list of 10^9 seeds: 24 GB)",
      r"error: --seeds 1000000000: at most 1,000 \(one training run per seed and configuration\)")
def train_seeds_huge(tmp):
    return ["bench", "train", "-c", "bred-4bit", "--steps", "2", "--seeds", "1000000000"]


@case(FLAGS, "`bench train --steps 1000000000`", r"error: --steps 1000000000: at most 10,000,000")
def train_steps_huge(tmp):
    return ["bench", "train", "-c", "bred-4bit", "--steps", "1000000000"]


@case(FLAGS, "`bench train --seeds 0` (the message named no flag: 'seeds must be at least 1')",
      r"error: --seeds 0: must be at least 1$")
def train_seeds_zero(tmp):
    return ["bench", "train", "-c", "bred-4bit", "--steps", "2", "--seeds", "0"]


@case(FLAGS, "`bench kernels --rounds 1000000000`", r"error: --rounds 1000000000: at most 1,000")
def kernels_rounds_huge(tmp):
    return ["bench", "kernels", "--numel", "1024", "-c", "fp32", "--baseline", "none", "--rounds", "1000000000"]


@case(FLAGS, "`compare --ab --rounds 1000000000`", r"error: --rounds 1000000000: at most 1,000")
def ab_rounds_huge(tmp):
    return ["compare", "--ab", "nearest-4bit", "sr-4bit", "--rounds", "1000000000"]


@case(FLAGS, "`bench headline --reps 1000000000`", r"error: --reps 1000000000: at most 10,000")
def headline_reps_huge(tmp):
    return ["bench", "headline", "--reps", "1000000000"]


@case(FLAGS, "`trace demo --steps 1000000000` (said 'over max_mib=2048', a setting with no option)",
      r"error: --steps 1000000000: the trace would be [\d,]+ MiB, over the 2,048 MiB cap on a trace; use at most "
      r"[\d,]+ steps$")
def demo_steps_huge(tmp):
    return ["trace", "demo", "-o", str(tmp / "t.pt"), "--steps", "1000000000"]


@case(FLAGS, "`trace demo --grad-dtype fp8` (the message named no flag: 'grad_dtype')",
      r"error: --grad-dtype 'fp8': choose from fp32, bf16")
def demo_grad_dtype(tmp):
    return ["trace", "demo", "-o", str(tmp / "t.pt"), "--grad-dtype", "fp8"]


@case(FLAGS, "`diagnose` with no TRACE (the message spoke of suite points)",
      r"error: diagnose needs a TRACE \(a trace file, `demo` or `corpus:NAME`\), or --theory")
def diagnose_no_trace(tmp):
    return ["diagnose"]


HUGE = "99999999999999999999999"  # past 2^64


@case(FLAGS, "`bench memory --seed` past 2^63-1 (torch.manual_seed overflowed)",
      r"--seed 9+: must be a whole number from 0 to 2\^63-1")
def seed_huge_memory(tmp):
    return ["bench", "memory", "--device", "cpu", "-c", "fp32", "--baseline", "none", "-m", "small-lm", "--seed", HUGE]


@case(FLAGS, "`bench kernels --seed -1`", r"--seed -1: must be a whole number from 0 to 2\^63-1")
def seed_negative_kernels(tmp):
    return ["bench", "kernels", "--numel", "1024", "-c", "fp32", "--baseline", "none", "--seed", "-1"]


@case(FLAGS, "`trace demo --seed` past 2^63-1", r"--seed 9+: must be a whole number from 0 to 2\^63-1")
def seed_huge_demo(tmp):
    return ["trace", "demo", "-o", str(tmp / "x.pt"), "--steps", "2", "--seed", HUGE]


@case(FLAGS, "`-m '5*99999999999999999999'` (a repeat count too large to build)",
      r"shapes '5\*9+': more than 100,000 tensors")
def shapes_huge_repeat(tmp):
    return ["bench", "memory", "--device", "cpu", "-c", "fp32", "--baseline", "none", "-m", "5*99999999999999999999"]


@case(FLAGS, "`audit -m 99999999x99999999` (was an OOM row in bench memory)",
      r"shapes '99999999x99999999': more than 2\^48 elements")
def shapes_huge_numel(tmp):
    return ["audit", "-m", "99999999x99999999"]


@case(FLAGS, "`bench memory -m ',,'` (was silently small-lm)", r"--model ',,': names nothing")
def model_list_empty(tmp):
    return ["bench", "memory", "--device", "cpu", "-c", "fp32", "--baseline", "none", "-m", ",,"]


@case(FLAGS, "`audit -w 1000000000`", r"--world-size 1000000000: use 1 to 65,536 ranks")
def audit_world_huge(tmp):
    return ["audit", "-m", "tiny-lm", "-w", "1000000000"]


@case(FLAGS, "`audit -w 65536` without --rank (every rank's rows)", r"3,801,088 rows; the limit is 250,000: show "
      r"one rank with --rank")
def audit_rows_huge(tmp):
    return ["audit", "-m", "tiny-lm", "-w", "65536"]


@case(FLAGS, "`doctor --max-gib nan`", r"--max-gib nan: must be a finite number > 0")
def doctor_max_gib_nan(tmp):
    return ["doctor", write(tmp, "ok.pt", "x"), "--max-gib", "nan"]


@case(FLAGS, "`doctor --max-gib inf`", r"--max-gib inf: must be a finite number > 0")
def doctor_max_gib_inf(tmp):
    return ["doctor", write(tmp, "ok.pt", "x"), "--max-gib", "inf"]


@case(FLAGS, "`-c m=...,v=...,v=int8` (the last v silently won)", r"configuration 'm=int4:nearest:b128,"
      r"v=lin4nz:nearest:b128,v=int8': v is given twice")
def config_state_twice(tmp):
    return ["bench", "memory", "--device", "cpu", "--baseline", "none", "-m", "tiny-lm", "-c",
            "m=int4:nearest:b128,v=lin4nz:nearest:b128,v=int8"]


def _diagnose_flag(flag: str, value: str):
    def make(tmp):
        return ["diagnose", _trace_file(tmp, "t.pt"), "-c", "sr-4bit", flag, value]
    make.__name__ = "diagnose_" + flag.strip("-").replace("-", "_") + "_" + value.replace("-", "minus")
    return make


for _flag, _value, _msg in (("--steps-limit", "-3", r"--steps-limit -3: must be >= 1"),
                            ("--reset", "-5", r"unknown reset policy '-5'"),
                            ("--device", "tpu", r"unknown device 'tpu'")):
    case(FLAGS, f"`diagnose {_flag} {_value}` (checked before the trace is loaded: no empty line first)",
         _msg)(_diagnose_flag(_flag, _value))


SUITE = "Suites that `run` would refuse: `suite validate` refuses them too"


@case(SUITE, "an unknown configuration name in an axis", r"uc.yaml:3: axes.config\[1\]: unknown "
      r"configuration 'nosuch-4bit'; did you mean")
def suite_unknown_config(tmp):
    return ["suite", "validate", write(tmp, "uc.yaml", "kind: memory\naxes:\n  config: [fp32, nosuch-4bit]\n")]


@case(SUITE, "a trace file that does not exist (relative: read from the suite's folder)",
      r"mt.yaml:2: defaults.trace: .*/nosuch.pt: no such file \(a relative path is read from the suite's folder\)")
def suite_missing_trace(tmp):
    return ["suite", "validate", write(tmp, "mt.yaml", "kind: diagnose\ndefaults: {trace: nosuch.pt}\n")]


@case(SUITE, "an unknown corpus trace (corpus:NAME)", r"ct.yaml:2: defaults(.trace)?: unknown corpus trace 'nosuch'; choose from")
def suite_unknown_corpus(tmp):
    return ["suite", "validate", write(tmp, "ct.yaml", "kind: diagnose\ndefaults: {trace: 'corpus:nosuch'}\n")]


@case(SUITE, "the same suite to `run`", r"error: .*mt.yaml:2: defaults.trace: .*nosuch.pt: no such file")
def suite_missing_trace_run(tmp):
    return ["run", write(tmp, "mt.yaml", "kind: diagnose\ndefaults: {trace: nosuch.pt}\n"), "--out", str(tmp / "o")]


@case(SUITE, "a kernels run with `numel: -5` (validate said ok; run left an empty results file)",
      r"kn.yaml:2: defaults.numel: --numel must be >= 1")
def suite_numel_negative(tmp):
    return ["suite", "validate", write(tmp, "kn.yaml", "kind: kernels\ndefaults: {numel: -5, device: cpu}\n")]


@case(SUITE, "the same suite to `run` (no results file is created)", r"error: .*kn.yaml:2: defaults.numel: "
      r"--numel must be >= 1")
def suite_numel_negative_run(tmp):
    return ["run", write(tmp, "kn.yaml", "kind: kernels\ndefaults: {numel: -5, device: cpu}\n"), "--out",
            str(tmp / "o")]


@case(SUITE, "a diagnose run with `block_size: 0, steps_limit: -3`", r"db.yaml:2: defaults.block_size: --block-size "
      r"0: the replay needs a power of two from 32 to 2048")
def suite_block_size_zero(tmp):
    return ["suite", "validate", write(tmp, "db.yaml", "kind: diagnose\ndefaults: {trace: demo, block_size: 0, "
                                                       "steps_limit: -3}\n")]


@case(SUITE, "a train run with `seeds: 1000000000`", r"st.yaml:2: defaults.seeds: --seeds 1000000000: at most 1,000")
def suite_train_seeds_huge(tmp):
    return ["suite", "validate", write(tmp, "st.yaml", "kind: train\ndefaults: {seeds: 1000000000, steps: 2}\n")]


@case(SUITE, "`run --set seed=` past 2^63-1", r"error: --set seed=9+: defaults.seed: --seed 9+: must be a "
      r"whole number from 0 to 2\^63-1")
def suite_set_seed_huge(tmp):
    suite = write(tmp, "sd.yaml", "kind: memory\ndefaults: {numel: [1000], config: [fp32], device: cpu}\n")
    return ["run", suite, "--set", f"seed={HUGE}", "--out", str(tmp / "o")]


@case(SUITE, "`run` of a suite whose trace is corrupt: refused before any run is measured or any earlier "
      "result replaced", r"error: .*bad.pt: corrupt or truncated trace")
def run_with_a_corrupt_trace_keeps_the_folder(tmp):
    (tmp / "bad.pt").write_bytes(b"PK\x03\x04" + b"\0" * 60)
    (tmp / "o").mkdir()
    (tmp / "o" / "d.json").write_text('{"earlier": "results"}')
    suite = write(tmp, "s.yaml", "runs:\n  - {name: mem, kind: memory, defaults: {numel: [1000], config: [fp32], "
                                 "device: cpu}}\n  - {name: d, kind: diagnose, defaults: {trace: bad.pt, "
                                 "config: [bf16]}}\n")
    return ["run", suite, "--out", str(tmp / "o"), "--no-report"]


# -- running the catalogue --------------------------------------------------------------------

def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (hidden ones too) -> sha256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def subprocess_env(extra: dict | None = None) -> dict:
    env = {"COLUMNS": "200", "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT),
           "HOME": os.environ.get("HOME", "/tmp"), "TRITON_INTERPRET": "1"}
    return {**env, **(extra or {})}


def run_subprocess(argv: list[str], cwd: Path, env: dict | None = None, timeout: float = 300):
    return subprocess.run([sys.executable, "-m", "qstate_cli", *argv], capture_output=True, text=True,
                          cwd=cwd, env=subprocess_env(env), timeout=timeout)


def markdown_table() -> str:
    """docs/errors.md's tables: each case run now, as a real subprocess, in a fresh folder."""
    import tempfile

    from concurrent.futures import ThreadPoolExecutor

    def run(c: Case) -> tuple[int, str]:
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d).resolve()
            r = run_subprocess(c.make(tmp), tmp, c.env)
            return r.returncode, r.stderr.strip().replace(str(tmp), "DIR")

    with ThreadPoolExecutor(max_workers=2) as pool:  # two subprocesses at a time
        outcomes = list(pool.map(run, CASES))
    lines, group = [], None
    for c, (code, err) in zip(CASES, outcomes):
        if c.group != group:
            group = c.group
            lines += ["", f"### {group}", "", "| what is tried | exit | the one line on stderr |", "|---|---|---|"]
        cell = err.replace("|", "\\|").replace("`", "'").replace("\n", " ⏎ ")
        lines.append(f"| {c.what} | {code} | `{cell}` |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown_table())
