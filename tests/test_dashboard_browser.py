"""The rendered dashboard in a real headless Chromium (Debian's package, installed here when missing).

Pages load from disk (file://) with no console errors and no request leaving file://; every figure is drawn (an
SVG with traces); a screenshot is not blank; the page filters work; a results store whose strings carry
`<script>` and `onerror=` renders them as text and runs nothing. Rendered from the synthetic store of
tests/dashboard_runs.py, a run with hostile strings, and one small real `bench run`.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from playwright.sync_api import BrowserContext, ConsoleMessage, Page, sync_playwright

from tests import dashboard_runs as store
from tests.browser import CHROMIUM_ARGS, ensure_chromium
from tests.conftest import run_bench, write_suite
from tests.synthetic import commit_id, params, record, write_run

# Each string tries another way into the page; none may run. `window.__pwned` is set by any that does.
HOSTILE_NAME = "<script>window.__pwned=1;alert(1)</script>"
HOSTILE_DESCRIPTION = "<img src=x onerror=window.__pwned=2;alert(2)> & </script><!--"
HOSTILE_IMPL = '<img src=x onerror="window.__pwned=3">'
HOSTILE_REASON = "<b onmouseover=alert(4)>bold</b><script>window.__pwned=4</script>"
HOSTILE_DEVICE = '"><svg onload=window.__pwned=5>'
LOCAL_ONLY = ("file://", "data:", "blob:", "about:")


def hostile_run(root: Path) -> Path:
    p = params("local", 128)
    records = [record("c1", "dense", store.samples(1e-3), params=p, device=HOSTILE_DEVICE),
               record("c1", HOSTILE_IMPL, None, params=p, status="failed", reason=HOSTILE_REASON,
                      device=HOSTILE_DEVICE),
               record("c2", "dense", store.samples(4e-3), params=params("local", 256), device=HOSTILE_DEVICE)]
    run = write_run(root, commit=commit_id(9), suite="hostile", records=records,
                    started_at="2026-02-01T00:00:00.000000Z")
    info = json.loads((run / "run.json").read_text())
    info["suite"] = {"name": HOSTILE_NAME, "file": None,
                     "content": {"name": HOSTILE_NAME, "description": HOSTILE_DESCRIPTION}}
    info["run_id"] = HOSTILE_NAME
    (run / "run.json").write_text(json.dumps(info))
    return run


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Synthetic store + hostile run + one small real run, rendered by the real command line."""
    root = tmp_path_factory.mktemp("browser")
    results = root / "results"
    store.write_store(results)
    hostile_run(results)
    suite = write_suite(root, {
        "name": "real", "description": "a small real run", "impls": ["dense", "sdpa"],
        "defaults": {"heads": 2, "head_dim": 16, "pattern": "local", "window": 8, "device": "cpu"},
        "sweep": {"seq_len": [32, 64]}, "measure": {"warmup": 1, "repeat": 6, "max_time_s": 0.05}})
    done = run_bench("run", str(suite), "--out", str(results), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = root / "dash"
    done = run_bench("dashboard", "--results", str(results), "-o", str(out), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrowserContext]:
    executable = ensure_chromium()
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=executable, headless=True,
            args=[a for a in CHROMIUM_ARGS if a != "--headless"], viewport={"width": 1280, "height": 900})
        yield ctx
        ctx.close()


class PageLog:
    """Everything a page did that a test checks: console errors, uncaught errors, requests, dialogs."""

    def __init__(self, page: Page) -> None:
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.dialogs: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))
        page.on("request", lambda request: self.requests.append(request.url))
        page.on("dialog", self._dialog)

    def _console(self, message: ConsoleMessage) -> None:
        if message.type == "error":  # Content-Security-Policy violations are reported as errors too
            self.errors.append(f"console {message.type}: {message.text}")

    def _dialog(self, dialog) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    @property
    def remote(self) -> list[str]:
        return [u for u in self.requests if not u.startswith(LOCAL_ONLY)]


def open_page(context: BrowserContext, path: Path) -> tuple[Page, PageLog]:
    page = context.new_page()
    log = PageLog(page)
    page.goto(path.as_uri(), wait_until="load")
    return page, log


def draw_all(page: Page) -> int:
    """Scroll every visible figure into view (they draw lazily) and wait until each is drawn; returns the count."""
    plots = page.locator("section.facet:not([hidden]) .plot[data-figure]")
    for i in range(plots.count()):
        plots.nth(i).scroll_into_view_if_needed()
        page.wait_for_function("el => el.getAttribute('data-drawn') === 'yes'", arg=plots.nth(i).element_handle(),
                               timeout=15_000)
    return plots.count()


def undrawn_figures(page: Page) -> list[str]:
    """Ids of visible figures without an SVG holding at least one trace (scatter, bar and heatmap layers)."""
    return page.evaluate("""() => Array.from(document.querySelectorAll('section.facet:not([hidden]) .plot'))
        .filter(div => !(div.querySelector('.main-svg') &&
                         div.querySelectorAll('g.trace.scatter, g.trace.bars, g.hm, g.heatmaplayer image').length > 0))
        .map(div => div.getAttribute('data-figure'))""")


EXPECTED_VIEWS = {"suite-sweep.html": {"time", "speedup", "memory", "breakeven", "breakeven_ratio", "correctness"},
                  "suite-multi.html": {"time", "comm", "correctness"},
                  "suite-h100.html": {"time", "speedup", "peak", "correctness"},
                  "suite-nightly.html": {"time", "speedup", "correctness", "history"},
                  "suite-real.html": {"time", "speedup", "correctness", "harness"},
                  "suite-workloads.html": {"time", "speedup", "memory", "correctness"}}


def test_every_page_loads_offline_and_draws_every_figure(context: BrowserContext, dashboard: Path) -> None:
    pages = sorted(dashboard.glob("*.html"))
    assert len(pages) == 8  # index + sweep, multi, h100, nightly, workloads, hostile, real
    total = 0
    for path in pages:
        page, log = open_page(context, path)
        total += draw_all(page)
        assert undrawn_figures(page) == [], path.name
        assert log.errors == [], (path.name, log.errors)
        assert log.remote == [], (path.name, log.remote)
        assert any(u.endswith("/assets/plotly.min.js") for u in log.requests) or path.name == "index.html"
        views = set(page.eval_on_selector_all("figure.view", "els => els.map(e => e.className.split('view-')[1])"))
        assert EXPECTED_VIEWS.get(path.name, set()) <= views, (path.name, views)
        page.close()
    assert total >= 25


def test_model_figures_say_model(context: BrowserContext, dashboard: Path) -> None:
    page, _ = open_page(context, dashboard / "suite-h100.html")
    assert page.locator("section.facet h2 .badge.model").inner_text() == "MODEL"
    draw_all(page)
    titles = page.locator(".plot .gtitle").all_text_contents()
    assert len(titles) == page.locator(".plot").count() >= 4
    assert all(t.startswith("MODEL - ") and "MODEL (not measured)" in t and store.H100 in t for t in titles)
    legend = page.locator("figure:not(.view-correctness) .plot .legendtext").all_text_contents()
    assert legend and all(name.endswith("[model]") for name in legend)
    page.close()


def test_screenshot_is_not_blank(context: BrowserContext, dashboard: Path) -> None:
    page, _ = open_page(context, dashboard / "suite-sweep.html")
    first = page.locator(".plot[data-figure]").first
    first.scroll_into_view_if_needed()
    page.wait_for_function("el => el.getAttribute('data-drawn') === 'yes'", arg=first.element_handle())
    image = np.asarray(Image.open(io.BytesIO(first.screenshot())).convert("L"), dtype=float)
    assert image.shape[0] > 200 and image.std() > 10  # an all-white (or all-anything) image has std 0
    assert (image < 128).mean() > 0.005  # dark pixels: axes, text and lines were drawn
    page.close()


def test_filters_show_only_matching_sections(context: BrowserContext, dashboard: Path) -> None:
    page, _ = open_page(context, dashboard / "suite-sweep.html")
    sections = page.locator("section.facet")
    assert sections.count() == 3
    page.select_option("select[data-filter=pattern]", "block_random")
    visible = page.locator("section.facet:not([hidden])")
    assert visible.count() == 1 and visible.first.get_attribute("data-pattern") == "block_random"
    assert page.locator("#shown-count").inner_text() == "1 of 3 sections shown"
    assert draw_all(page) >= 5 and undrawn_figures(page) == []
    page.select_option("select[data-filter=dtype]", "float16")
    assert page.locator("section.facet:not([hidden])").count() == 0 and page.locator("#no-match").is_visible()
    page.select_option("select[data-filter=pattern]", "")
    assert page.locator("section.facet:not([hidden])").count() == 1
    devices = page.locator("select[data-filter=device] option").all_inner_texts()
    assert devices == ["all (1)", store.CPU]
    assert page.evaluate("() => window.location.hash") == "#dtype=float16"
    page.close()
    # a link with filters in its fragment opens filtered; unknown values fall back to "all"
    page = context.new_page()
    page.goto((dashboard / "suite-sweep.html").as_uri() + "#pattern=block_random&mode=nonsense", wait_until="load")
    visible = page.locator("section.facet:not([hidden])")
    assert visible.count() == 1 and visible.first.get_attribute("data-pattern") == "block_random"
    assert page.locator("select[data-filter=mode]").input_value() == ""
    page.close()


def visible_workloads(page: Page) -> list[str]:
    return page.eval_on_selector_all("section.facet:not([hidden])", "els => els.map(e => e.dataset.workload)")


def test_workload_filter_shows_only_its_sections(context: BrowserContext, dashboard: Path) -> None:
    page, log = open_page(context, dashboard / "suite-workloads.html")
    assert page.locator("section.facet").count() == 5
    options = page.locator("select[data-filter=workload] option").all_inner_texts()
    assert options == ["all (4)", "MHA H8", "GQA H32/8", "MQA H8/1", "GQA H32/8 · q_len 1"]
    page.select_option("select[data-filter=workload]", "GQA H32/8")  # exactly: not the decode section
    assert visible_workloads(page) == ["GQA H32/8"]
    assert page.locator("#shown-count").inner_text() == "1 of 5 sections shown"
    assert "GQA H32/8" in page.locator("section.facet:not([hidden]) h2").inner_text()
    assert draw_all(page) >= 3 and undrawn_figures(page) == []
    assert page.evaluate("() => decodeURIComponent(window.location.hash)") == "#workload=GQA+H32/8"
    page.select_option("select[data-filter=workload]", "MHA H8")  # prefill in float32, documents in bfloat16
    assert visible_workloads(page) == ["MHA H8", "MHA H8"]
    page.select_option("select[data-filter=dtype]", "bfloat16")
    (documents,) = page.locator("section.facet:not([hidden])").all()
    assert documents.get_attribute("data-dtype") == "bfloat16"
    assert draw_all(page) >= 3 and undrawn_figures(page) == []
    time_axis = documents.locator("figure.view-time .xtitle").text_content()
    assert time_axis == "packed documents (count)"  # time against the number of documents, not one point
    assert documents.locator("figure.view-time .legendtext").all_text_contents() == ["dense", "flex", "sdpa"]
    assert log.errors == [] and log.remote == []
    page.close()
    # a link to the decode workload (its value has spaces, '/' and '·') opens filtered
    page = context.new_page()
    page.goto((dashboard / "suite-workloads.html").as_uri() + "#workload=GQA+H32%2F8+%C2%B7+q_len+1",
              wait_until="load")
    assert visible_workloads(page) == ["GQA H32/8 · q_len 1"]
    assert page.locator("select[data-filter=workload]").input_value() == "GQA H32/8 · q_len 1"
    page.close()


def test_hostile_strings_render_as_text_and_run_nothing(context: BrowserContext, dashboard: Path) -> None:
    (hostile_page,) = [p for p in dashboard.glob("suite.*.html")]
    for path in (dashboard / "index.html", hostile_page):
        page, log = open_page(context, path)
        draw_all(page)
        if path == hostile_page:
            assert page.locator("h1 .suite-name").inner_text() == HOSTILE_NAME
            assert page.locator("p.description").inner_text() == HOSTILE_DESCRIPTION
            assert HOSTILE_DEVICE in page.locator("section.facet h2").first.inner_text()
            assert page.locator("select[data-filter=device] option").all_inner_texts()[1] == HOSTILE_DEVICE
            # hover over the failed cell of the correctness matrix: the reason shows as literal text
            matrix = page.locator("figure.view-correctness .plot")
            matrix.scroll_into_view_if_needed()
            impl_tick = page.locator("figure.view-correctness .ytick text", has_text="onerror")
            assert impl_tick.text_content() == HOSTILE_IMPL
            box = matrix.locator(".nsewdrag").first.bounding_box()
            tick = impl_tick.bounding_box()
            page.mouse.move(box["x"] + box["width"] * 0.25, tick["y"] + tick["height"] / 2)
            page.wait_for_selector(".hoverlayer .hovertext", timeout=5_000)
            hover_text = page.locator(".hoverlayer .hovertext").first.text_content()
            assert "bold" in hover_text and "<script>window.__pwned=4</script>" in hover_text
        else:
            assert page.get_by_text(HOSTILE_NAME).first.is_visible()
        assert page.evaluate("() => window.__pwned") is None
        assert page.locator("img[src=x], svg[onload], b[onmouseover]").count() == 0
        assert page.evaluate("() => document.querySelectorAll('script').length") == (3 if path != dashboard /
                                                                                     "index.html" else 0)
        assert log.dialogs == [] and log.errors == [] and log.remote == []
        # defence in depth: the page's Content-Security-Policy refuses inline script even if one got in
        ran = page.evaluate("""() => { const s = document.createElement('script');
            s.textContent = 'window.__inline = 1'; document.body.appendChild(s); return window.__inline; }""")
        assert ran is None and any("Content Security Policy" in e for e in log.errors)
        page.close()
