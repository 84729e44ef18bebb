"""Smoke test of the replay benchmark (scripts/bench_replay.py; a benchmark, not a timed
test): on a toy synthetic trace it records the trace once into the given folder, replays it
through both backends and prints one row per phase with both throughputs and their ratio.
No timing is asserted."""
from qstate_cli.trace import load_trace
from script_module import load_script


def test_bench_replay_prints_rates_and_ratios_on_a_toy_trace(tmp_path, capsys):
    bench = load_script("bench_replay")
    args = ["--traces", "synthetic", "--numel", "256", "--steps", "3", "--cache", str(tmp_path),
            "--configs", "bred-4bit", "--backends", "auto", "reference"]
    assert bench.main(args) == 0
    (path,) = tmp_path.glob("bench-synthetic-heavy-4x256-3steps-*.pt")
    trace = load_trace(path)
    assert (trace.n_steps, trace.recorded_elements) == (3, 4 * 256)
    lines = capsys.readouterr().out.splitlines()
    head = next(line for line in lines if line.startswith("trace"))
    assert "auto/ref" in head
    rows = {line.split()[1]: line.split() for line in lines if line.startswith("synth-1k")}
    assert set(rows) >= {"gather", "shadow", "bred-4bit", "loop"}
    rates = [float(x) for x in rows["bred-4bit"][2:]]
    assert len(rates) == 9 and all(r >= 0 for r in rates)  # wall s, M/s, cpu s, M/cpu-s per backend; ratio
    assert all(rates[k] > 0 for k in (0, 1, 4, 5, 8))  # the wall times (CPU time ticks may read 0 at this size)
    assert bench.main(args) == 0  # the second run reuses the cached trace
    assert len(list(tmp_path.glob("*.pt"))) == 1
