"""GitHub-flavoured Markdown for PR comments and step summaries.

Every string from a result file is escaped (HTML specials as entities, `|` and line
breaks neutralized) so a hostile name cannot inject markup into a comment; and, since
the report is posted to pull requests, nothing from a file can become a link, an image
or a notification: `[`, `]` and `\\` are backslash-escaped (no `[text](url)` nor `![img](url)`,
nor `\\[x\\](url)`, which an unescaped backslash would reopen),
a WORD JOINER (U+2060, invisible) follows every `@` (no @mention) and breaks `://` and
`www.` (no autolink). Nor can it format the comment: `*`, a backtick, `$` (GitHub's math,
`$...$` and `$$...$$`) and `~` (strikethrough) are backslash-escaped, and `_` wherever it
could open or close emphasis (not between two letters or digits: `final_val_loss` stays as
it is). The text reads the same.
"""
from __future__ import annotations

import re

from .model import Report, Table

_HTML = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"})


_WJ = "\u2060"  # WORD JOINER: invisible, and breaks GitHub's mention and autolink detection
_MARKDOWN = str.maketrans({"\\": "\\\\", "[": "\\[", "]": "\\]", "@": "@" + _WJ,
                           "*": "\\*", "`": "\\`", "$": "\\$", "~": "\\~"})
_UNDERSCORE = re.compile(r"(?<![^\W_])_|_(?![^\W_])")  # an `_` without a letter or digit on one side


def escape(text) -> str:
    out = str(text).translate(_HTML).translate(_MARKDOWN).replace("|", "\\|").replace("\r", " ").replace("\n", " ")
    return _no_links(_UNDERSCORE.sub(r"\\_", out))


def escape_in_html(text) -> str:
    """escape() for text inside a raw HTML line (`<summary>`), where Markdown's backslash
    escapes are not read and would show: HTML entities, the word joiners, no backslashes."""
    out = str(text).translate(_HTML).replace("@", "@" + _WJ).replace("\r", " ").replace("\n", " ")
    return _no_links(out)


def _no_links(out: str) -> str:
    return out.replace("://", ":" + _WJ + "//").replace("www.", "www" + _WJ + ".")


def code_span(text) -> str:
    """`text` as a Markdown code span for a table cell: shown as it is and grep-able (no
    mention, link, autolink or HTML inside one), its fence one backtick longer than any run
    of backticks in it, `|` escaped for the table (GFM unescapes it inside the span) and
    line breaks as spaces."""
    text = str(text).replace("\r", " ").replace("\n", " ").replace("|", "\\|")
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    pad = " " if text[:1] in ("`", " ") or text[-1:] in ("`", " ") else ""  # CommonMark strips one space a side
    return f"{fence}{pad}{text}{pad}{fence}"


def table_body(t: Table, cell=None) -> str:
    """The table's Markdown lines: headers, alignment (numbers right), rows; each cell through
    `cell(column, text)` (default: escape)."""
    cell = cell or (lambda _, text: escape(text))
    lines = ["| " + " | ".join(escape(h) for h in t.headers) + " |",
             "|" + "|".join(" ---: " if _numeric_col(t, i) else " --- " for i in range(len(t.headers))) + "|"]
    lines += ["| " + " | ".join(cell(j, c) for j, c in enumerate(row)) + " |" for row in t.rows]
    return "\n".join(lines)


def folded(title: str, rows: int, body: str) -> str:
    """A table folded under `<details>`, its summary the title and row count."""
    return (f"<details><summary>{escape_in_html(title)} ({rows} row{'s' * (rows != 1)})</summary>\n\n{body}"
            f"\n\n</details>")


def table_md(t: Table, heading: str = "###") -> str:
    body = table_body(t)
    note = f"\n\n{escape(t.note)}" if t.note else ""
    if t.long:
        return folded(t.title or "Table", len(t.rows), body + note)
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
        if sec.markdown is not None:  # the kind's own (compare: the verdict as `qstate compare` prints it)
            out += [sec.markdown, ""]
            continue
        out += [f"- {escape(line)}" for line in sec.lead] + ([""] if sec.lead else [])
        for plot in sec.plots:
            if plot.link:
                out += [f"![{escape(plot.title)}]({plot.link.replace(' ', '%20')})", ""]
        for t in sec.tables:
            out += [table_md(t, "####"), ""]
    return "\n".join(out).rstrip() + "\n"
