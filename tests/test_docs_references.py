"""Every pointer to a section of the docs, `docs/<file>.md, "<Section>"` (or in brackets), in
the code, the scripts, the tests and the docs themselves names a section that exists: a
heading of that file, or a bold paragraph title (`**Subnormal tails** ...`), which a quoted
prefix may shorten. A renamed section would otherwise leave its readers at a dead end."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = re.compile(r'docs/([a-z_\-]+\.md)\)?(?:[,;:]\s*\(?|\s*\(|\s)\s*"([^"]{2,160})"')


def sections(doc: Path) -> list[str]:
    text = re.sub(r"\n```.*?\n```", "\n", doc.read_text(), flags=re.S)  # a `#` line in a code block is no heading
    heads = [re.sub(r"^#+\s*", "", line).strip() for line in text.splitlines() if line.startswith("#")]
    titles = re.findall(r"(?:^|\n)\*\*([^*]+)\*\*", text)
    return [" ".join(s.split()) for s in heads + titles]


def references() -> list[tuple[str, str, str]]:
    """(file, doc, section) of each reference; a reference may wrap over lines (and comment markers)."""
    files = [*ROOT.glob("qstate_cli/**/*.py"), *ROOT.glob("scripts/*"), *ROOT.glob("tests/*.py"),
             *ROOT.glob("docs/*.md"), ROOT / "README.md", ROOT / "Makefile", ROOT / ".ci" / "run"]
    files = [f for f in files if f.is_file()]  # scripts/__pycache__ is a folder
    found = []
    for f in files:
        joined = re.sub(r"\n\s*(?:#\s*)?", " ", f.read_text(errors="ignore"))
        found += [(str(f.relative_to(ROOT)), m.group(1), " ".join(m.group(2).split()))
                  for m in REFERENCE.finditer(joined)]
    return found


def test_every_reference_to_a_docs_section_names_one_that_exists():
    known = {doc.name: sections(doc) for doc in (ROOT / "docs").glob("*.md")}
    refs = references()
    assert len(refs) > 50  # the pattern still finds the references
    dead = [(f, doc, s) for f, doc, s in refs if doc not in known or not any(h.startswith(s) for h in known[doc])]
    assert dead == [], f"references to sections that do not exist: {dead}"
