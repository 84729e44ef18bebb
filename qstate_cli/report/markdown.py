"""GitHub-flavoured Markdown for PR comments and step summaries.

Every string from a result file is escaped (HTML specials as entities, `|` and line
breaks neutralized) so a hostile name cannot inject markup into a comment; and, since
the report is posted to pull requests, nothing from a file can become a link, an image
or a notification: `[`, `]` and `\\` are backslash-escaped (no `[text](url)` nor `![img](url)`,
nor `\\[x\\](url)`, which an unescaped backslash would reopen),
a WORD JOINER (U+2060, invisible) follows every `@` (no @mention) and breaks `://` and
`www.` (no autolink). The text reads the same.
"""
from __future__ import annotations

from .model import Report, Table

_HTML = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"})


_WJ = "\u2060"  # WORD JOINER: invisible, and breaks GitHub's mention and autolink detection
_MARKDOWN = str.maketrans({"\\": "\\\\", "[": "\\[", "]": "\\]", "@": "@" + _WJ})


def escape(text) -> str:
    out = str(text).translate(_HTML).translate(_MARKDOWN).replace("|", "\\|").replace("\r", " ").replace("\n", " ")
    return out.replace("://", ":" + _WJ + "//").replace("www.", "www" + _WJ + ".")


def table_md(t: Table, heading: str = "###") -> str:
    lines = ["| " + " | ".join(escape(h) for h in t.headers) + " |",
             "|" + "|".join(" ---: " if _numeric_col(t, i) else " --- " for i in range(len(t.headers))) + "|"]
    lines += ["| " + " | ".join(escape(c) for c in row) + " |" for row in t.rows]
    body = "\n".join(lines)
    note = f"\n\n{escape(t.note)}" if t.note else ""
    if t.long:
        return f"<details><summary>{escape(t.title or 'Table')} ({len(t.rows)} row{'s' * (len(t.rows) != 1)})</summary>\n\n{body}{note}\n\n</details>"
    title = f"{heading} {escape(t.title)}\n\n" if t.title else ""
    return f"{title}{body}{note}"


def _numeric_col(t: Table, i: int) -> bool:
    cells = [row[i] for row in t.rows if row[i] not in ("–", "")]
    return bool(cells) and all(c.replace(",", "").replace("%", "").replace("+", "").replace("-", "", 1)
                               .replace(".", "", 1).replace("e", "", 1).replace("-", "").isdigit() for c in cells)


def markdown_text(report: Report) -> str:
    out = [f"## {escape(report.title)}", ""]
    out += [f"> **Note:** {escape(b)}" for b in report.banners]
    if report.banners:
        out.append("")
    out += [f"- {escape(line)}" for line in report.summary]
    out += ["", "<details><summary>Environment</summary>", "", table_md(report.env), "", "</details>", ""]
    for sec in report.sections:
        out += [f"### {escape(sec.title)}", "", f"<sub>from {escape(sec.source)}</sub>", ""]
        out += [escape(n) + "\n" for n in sec.notes]
        for plot in sec.plots:
            if plot.link:
                out += [f"![{escape(plot.title)}]({plot.link.replace(' ', '%20')})", ""]
        for t in sec.tables:
            out += [table_md(t, "####"), ""]
    return "\n".join(out).rstrip() + "\n"
