"""The CPU path's package docstring is its map (kernels/cpu/__init__.py): every module of the
package is named there, so a newcomer finds the room for a change from it."""
import re
from pathlib import Path

import qstate_cli.kernels.cpu as cpu


def test_the_package_docstring_names_every_module():
    folder = Path(cpu.__file__).parent
    named = set(re.findall(r"\b([a-z0-9_]+)\.py\b", cpu.__doc__))
    modules = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    assert modules - named == set(), f"modules missing from kernels/cpu/__init__.py's map: {sorted(modules - named)}"
