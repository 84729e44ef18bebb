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


def test_each_repeat_replays_the_configurations_in_another_order(tmp_path, capsys, monkeypatch):
    """A replay step's first configuration is slower for its place alone: repeat r starts at
    the r-th configuration, so with 3 repeats none of 3 configurations has a first place's median."""
    bench = load_script("bench_replay")
    assert bench.rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert bench.rotated(["a", "b", "c"], 4) == ["b", "c", "a"]
    orders, replay = [], bench.time_replay
    monkeypatch.setattr(bench, "time_replay", lambda trace, configs, *a: orders.append(
        [str(c) for c in configs]) or replay(trace, configs, *a))
    args = ["--traces", "synthetic", "--numel", "256", "--steps", "3", "--cache", str(tmp_path), "--repeats", "3",
            "--configs", "bred-4bit", "nearest-4bit", "bf16", "--backends", "auto"]
    assert bench.main(args) == 0
    timed = orders[1:]  # after the warm-up replay
    assert [o[0] for o in timed] == ["bred-4bit", "nearest-4bit", "bf16"]
    assert all(sorted(o) == sorted(timed[0]) for o in timed)
    rows = {line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("synth-1k")}
    assert rows >= {"bred-4bit", "nearest-4bit", "bf16"}


def test_the_last_lines_check_the_replay_target_per_trace():
    """Per trace, every configuration's wall rate on the auto backend against 100 M
    element-steps/s, with the lowest; the shared phases and the codec lines do not count."""
    bench = load_script("bench_replay")
    rows = [{"trace": "demo", "phase": p, "element_steps": 48_640_000, "auto": s, "reference": 9.0}
            for p, s in (("gather", 2.0), ("shadow", 1.0), ("sr-4bit", 0.45), ("bred-4bit", 0.3), ("loop", 4.0))]
    rows.append({"trace": "demo", "phase": "  codec of sr-4bit", "paths": {}})
    rows += [{"trace": "synth-1024k", "phase": "bnb-8bit", "element_steps": 104_857_600, "auto": 1.1}]
    assert bench.targets(rows) == [
        "targets, demo: every configuration >= 100 M element-steps/s (auto): yes (lowest sr-4bit 108)",
        "targets, synth-1024k: every configuration >= 100 M element-steps/s (auto): NO (lowest bnb-8bit 95.3)"]
    assert bench.targets(rows, "reference")[0].endswith("NO (lowest sr-4bit 5.4)")
    assert bench.targets([{"trace": "demo", "phase": "sr-4bit", "element_steps": 1, "reference": 1.0}]) == []
