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


LAYOUT_JS = """(() => ({
  page: document.documentElement.scrollWidth, inner: window.innerWidth,
  scrollers: [...document.querySelectorAll('table')].filter(t => {
      const box = t.parentElement; return box.scrollWidth > box.clientWidth + 1
        && getComputedStyle(box).overflowX === 'auto'; }).length,
  rows: document.querySelectorAll('tr').length,
  shown: [...document.querySelectorAll('tr')].filter(r => r.checkVisibility()).length,
  folded: document.querySelectorAll('details:not([open])').length}))()"""


def _layout(path, width: int | None = None, media: str | None = None) -> dict:
    """The page's width, its tables that scroll in their own box, and how many table rows
    are shown (checkVisibility: a row in a closed <details> is not), at `width` px (a phone) or for `media`."""
    from chromium_cdp import Browser

    browser = Browser(CHROMIUM)
    try:
        target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        browser.send("Page.enable", session=session)
        if width:
            browser.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": 844, "deviceScaleFactor": 1,
                                                                "mobile": True}, session=session)
        if media:
            browser.send("Emulation.setEmulatedMedia", {"media": media}, session=session)
        browser.send("Page.navigate", {"url": f"file://{path}"}, session=session)
        browser.wait_for("Page.loadEventFired", session)
        return browser.send("Runtime.evaluate", {"expression": LAYOUT_JS, "returnByValue": True},
                            session=session)["result"]["value"]
    finally:
        browser.close()


def test_report_fits_a_phone_and_prints_every_folded_row(tmp_path):
    """At 390 px the page was 865 px wide (a 1190 px table, no box of its own to scroll in);
    printed, the rows of every folded table (the diagnose summary among them) were left out."""
    docs, sources = load_documents([DATA / f"{k}.json" for k in ("kernels", "memory", "diagnose", "train")])
    html = tmp_path / "report.html"
    write_report(docs, html=html, sources=sources)
    phone = _layout(html, width=390)
    assert phone["inner"] == 390 and phone["page"] <= 390, phone
    assert phone["scrollers"] >= 1, phone  # the size sweep scrolls inside its own box
    screen = _layout(html)
    assert screen["folded"] >= 1 and screen["shown"] < screen["rows"], screen  # folded on screen
    printed = _layout(html, media="print")
    assert printed["folded"] == screen["folded"] and printed["shown"] == printed["rows"], printed
