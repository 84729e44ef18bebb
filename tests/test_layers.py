"""The package's imports point one way (README, "How the code is laid out"): a module may
import its own package and the layers below it, never a layer above or a peer of its own
layer, and no two modules import each other, directly or around a loop.

Static analysis of every `import` in qstate_cli (ast), including imports inside functions
(a lazy import is still a dependency). The kinds table names engines and report sections
as "module:attribute" strings, imported on first use: that is a table of names, not an
import, and it is how the lower layers reach the upper ones without depending on them.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "qstate_cli"

# Highest first; a unit may import units of lower layers and itself only.
LAYERS = [
    ("__main__",),  # python -m qstate_cli
    ("cli",),  # the command line: thin, one error boundary
    ("suites",),  # YAML suites: points -> the kinds' engines
    ("compare",),  # verdicts (uses the report's tables)
    ("report",),  # HTML / Markdown renderers and plots
    ("bench", "diagnose", "doctor", "train"),  # engines: options in, Result out
    ("trace",),  # trace format, recorder, demo
    ("optim",),  # reference rules, optimizers, the one seam to the kernels (optim/fused.py)
    ("kernels",),  # Triton kernels and their launchers
    ("models", "theory", "options", "progress", "mplconfig"),
    ("quant", "fp32_math", "runtime", "hostmem", "results", "kinds"),  # the math; where work runs; result files; the kinds table
    ("atomic",),  # writes that a reader never sees half done
    ("errors", "__init__"),
]
RANK = {unit: len(LAYERS) - i for i, units in enumerate(LAYERS) for unit in units}


def module_name(path: Path) -> str:
    parts = path.with_suffix("").relative_to(PACKAGE.parent).parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every qstate_cli module or package `path` imports (absolute names)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "qstate_cli"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "qstate_cli":
                continue
            names = [f"{target}.{a.name}" for a in node.names]
            found |= {m for m in names if _exists(m)}
            if not all(_exists(m) for m in names):  # attributes of the module or package itself
                found.add(target)
    return found


def _exists(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").is_file() or (PACKAGE / rel / "__init__.py").is_file()


def unit(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_unit_has_a_layer():
    units = {unit(m) for m in graph()}
    assert units == set(RANK), f"not in LAYERS: {sorted(units - set(RANK))}; gone: {sorted(set(RANK) - units)}"


def test_imports_point_down():
    upward = []
    for mod, targets in graph().items():
        for target in targets:
            a, b = unit(mod), unit(target)
            if a != b and RANK[b] >= RANK[a]:
                upward.append(f"{mod} imports {target} ({a} is not above {b})")
    assert not upward, "\n".join(sorted(upward))


def test_no_import_cycles():
    g = {m: {t for t in ts if t != m} for m, ts in graph().items()}
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in list(g):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_an_upward_and_a_cyclic_import(tmp_path, monkeypatch):
    """The checks can fail: a copy of the package with a kernel importing the CLI and two
    modules importing each other is caught by both."""
    import shutil

    copy = tmp_path / "qstate_cli"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "kernels" / "common.py").write_text((copy / "kernels" / "common.py").read_text()
                                                + "\nfrom ..cli import app  # noqa\n")
    (copy / "quant" / "cycle_a.py").write_text("from . import cycle_b\n")
    (copy / "quant" / "cycle_b.py").write_text("from . import cycle_a\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", copy)
    import pytest

    with pytest.raises(AssertionError, match="qstate_cli.kernels.common imports qstate_cli.cli"):
        test_imports_point_down()
    with pytest.raises(AssertionError, match="cycle_a <-> qstate_cli.quant.cycle_b"):
        test_no_import_cycles()
