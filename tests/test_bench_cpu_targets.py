"""scripts/bench_cpu.py's last line checks the AdamW targets on the measured minimums (a
benchmark, not a timed test: the verdict is computed from given rows here, nothing is timed):
each 4-bit preset at <= 2x torch fused AdamW, and faster than the peers."""
from script_module import load_script

bench = load_script("bench_cpu")
BASE = ("torch AdamW fused (fp32 states)", "torch-fused", 5.0)
OURS = [("qstate nearest-4bit", "cpu-numba", 5.5), ("qstate sr-4bit", "cpu-numba", 7.0),
        ("qstate bred-4bit", "cpu-numba", 6.0)]
PEERS = [("torchao AdamW4bit (compiled)", "torchao", 140.0), ("bitsandbytes AdamW8bit", "bnb", 70.0)]


def test_the_targets_hold_on_the_slowest_preset():
    line = bench.targets([BASE, *OURS, ("qstate bnb-8bit", "cpu-numba", 15.0), *PEERS])
    assert line == ("targets: 4-bit presets <= 2x torch fused: yes (slowest sr-4bit 1.40x); faster than the "
                    "peers: yes (fastest peer bitsandbytes AdamW8bit 10.0x the slowest preset's time)")


def test_a_preset_over_2x_or_a_faster_peer_is_a_no():
    slow = [*OURS[:2], ("qstate bred-4bit", "cpu-numba", 10.5)]
    assert "<= 2x torch fused: NO (slowest bred-4bit 2.10x)" in bench.targets([BASE, *slow, *PEERS])
    line = bench.targets([BASE, *OURS, ("bitsandbytes AdamW8bit", "bnb", 6.5)])
    assert "faster than the peers: NO" in line and "<= 2x torch fused: yes" in line


def test_without_the_presets_or_peers_it_says_what_it_can():
    assert bench.targets([BASE, ("qstate bnb-8bit", "cpu-numba", 15.0)]) is None
    assert bench.targets([BASE, *OURS]).endswith("(slowest sr-4bit 1.40x)")
