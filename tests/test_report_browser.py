"""The HTML report in a real browser: headless Chromium (Debian's `chromium`, installed by
.ci/run) decodes every plot and fetches nothing from the network."""
from pathlib import Path

import pytest

from qstate_cli.report import load_documents, write_report

from chromium_cdp import find_chromium, open_page

DATA = Path(__file__).resolve().parent / "data" / "results"
CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed "
                                "(apt-get install chromium; .ci/run installs it)")


def _local(url: str, page: str) -> bool:
    return url.startswith("data:") or url == page


def test_report_opens_offline_with_every_plot_decoded(tmp_path):
    docs, sources = load_documents([DATA / f"{k}.json" for k in ("kernels", "memory", "diagnose", "train")])
    html = tmp_path / "report.html"
    write_report(docs, html=html, sources=sources)
    page = open_page(CHROMIUM, html)
    assert page["title"].startswith("qstate report")
    assert page["count"] == 8 and all(w > 300 for w in page["widths"]), page["widths"]
    assert page["resources"] == [] and page["scripts"] == 0
    assert page["requested"][0] == page["url"]
    assert [u for u in page["requested"] if not _local(u, page["url"])] == []


def test_the_check_sees_a_fetch_and_a_broken_image(tmp_path):
    """The same check on a page that does fetch: it must notice (a test that can fail)."""
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><title>bad</title><img src="http://127.0.0.1:9/plot.png">'
                   '<img src="data:image/png;base64,AAAA">')
    page = open_page(CHROMIUM, bad)
    assert page["widths"] == [0, 0]
    assert [u for u in page["requested"] if not _local(u, page["url"])] == ["http://127.0.0.1:9/plot.png"]
