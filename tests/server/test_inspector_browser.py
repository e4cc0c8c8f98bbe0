"""The thread inspector in a real headless browser: Debian's chromium driven by selenium.

Nothing downloads a browser: the test points selenium at /usr/bin/chromium and
/usr/bin/chromedriver (`.ci/run` installs the Debian packages when they are missing), so
Selenium Manager is never asked. Without them the test is skipped, unless
THREADKEEPER_REQUIRE_BROWSER=1 (CI sets it), where it fails.

A thread is seeded through the running proxy (cut, summarized, a guarded refund call left
`issued`); the browser signs in through the form and the DOM is checked against the
store: the cut line sits at the thread's window_start, the summary shown is the summary
the last request sent, the token bar's sent segments add up to that request's prompt
tokens, and the resolve form settles the ledger entry. The same pages are read again with
JavaScript off. THREADKEEPER_UPDATE_SCREENSHOT=1 rewrites docs/inspector.png.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from proxy import admin
from proxy.server.state import STORE

from .conftest import Proxy
from .test_inspector_e2e import HOSTILE, OPERATOR, inspector, seed_thread

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "inspector.png"
UI = "/threadkeeper/ui"
WAIT_SECONDS = 15  # an upper bound on one page load, never a pause


def _require_browser() -> None:
    if CHROMIUM.exists() and CHROMEDRIVER.exists():
        return
    if os.environ.get("THREADKEEPER_REQUIRE_BROWSER") == "1":
        pytest.fail(
            f"{CHROMIUM} and {CHROMEDRIVER} are required (apt-get install chromium chromium-driver)"
        )
    pytest.skip("Debian's chromium and chromium-driver are not installed")


@contextmanager
def chromium(*, javascript: bool, width: int | None = None) -> Iterator[Any]:
    """`width`: the viewport emulated, in CSS pixels, as on a phone's screen."""
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root in a container
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1100,860",
        "--no-first-run",
        "--disable-extensions",
    ):
        options.add_argument(argument)
    if not javascript:
        options.add_experimental_option(
            "prefs", {"profile.managed_default_content_settings.javascript": 2}
        )
    service = webdriver.ChromeService(executable_path=str(CHROMEDRIVER))
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(WAIT_SECONDS)
    if width is not None:
        metrics = {"width": width, "height": 800, "deviceScaleFactor": 1, "mobile": False}
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
    try:
        yield driver
    finally:
        driver.quit()


def _wait_for(driver: Any, css: str) -> Any:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_SECONDS).until(
        expected_conditions.presence_of_element_located((By.CSS_SELECTOR, css))
    )


def _sign_in(driver: Any, base: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get(f"{base}{UI}/login")
    driver.find_element(By.ID, "token").send_keys(OPERATOR)
    driver.find_element(By.ID, "sign-in").click()
    _wait_for(driver, "#search")


def _text(element: Any) -> str:
    return str(element.get_attribute("textContent"))


def _thread_facts(driver: Any) -> dict[str, Any]:
    from selenium.webdriver.common.by import By

    cut = driver.find_element(By.ID, "cut")
    items = driver.find_elements(By.CSS_SELECTOR, "#timeline > li")
    order = [(li.get_attribute("class"), li.get_attribute("data-seq")) for li in items]
    cut_at = order.index(("cut", None))
    after_cut = next(int(seq) for cls, seq in order[cut_at:] if "item" in cls.split())
    return {
        "cut_start": int(cut.get_attribute("data-window-start")),
        "first_item_after_cut": after_cut,
        "cut_away": [
            int(seq) for cls, seq in order if "item" in cls.split() and "cut-away" in cls.split()
        ],
        "summary": [_text(p) for p in driver.find_elements(By.CSS_SELECTOR, "li.summary pre")],
        "full_texts": [_text(p) for p in driver.find_elements(By.CSS_SELECTOR, "pre.full-text")],
        "ledger": {
            li.get_attribute("data-key"): li.get_attribute("data-status")
            for li in driver.find_elements(By.CSS_SELECTOR, "li.ledger")
        },
        "title": driver.title,
        "toggles_hidden": [
            b.get_attribute("hidden") is not None
            for b in driver.find_elements(By.CSS_SELECTOR, "[data-toggle-all]")
        ],
    }


def _browse_with_javascript(
    base: str, thread_id: str, request_id: str, shot: Path
) -> dict[str, Any]:
    from selenium.webdriver.common.by import By

    facts: dict[str, Any] = {}
    with chromium(javascript=True) as driver:
        _sign_in(driver, base)
        driver.find_element(By.CSS_SELECTOR, f'tr[data-thread="{thread_id}"] a').click()
        _wait_for(driver, "#timeline")
        facts["thread"] = _thread_facts(driver)
        driver.find_element(By.CSS_SELECTOR, '[data-toggle-all="open"]').click()
        facts["opened"] = all(
            d.get_attribute("open") is not None
            for d in driver.find_elements(By.CSS_SELECTOR, "details.text")
        )

        driver.find_element(By.CSS_SELECTOR, f'#requests a[href$="{request_id}"]').click()
        bar = _wait_for(driver, "#token-bar")
        segments = driver.find_elements(By.CSS_SELECTOR, "#token-bar .seg")
        facts["segments"] = [
            {
                "name": s.get_attribute("data-segment"),
                "tokens": int(s.get_attribute("data-tokens")),
                "sent": s.get_attribute("data-sent") == "true",
                "width": s.rect["width"],
                "label": _text(s),
            }
            for s in segments
        ]
        facts["bar_width"] = bar.rect["width"]
        facts["window"] = int(bar.get_attribute("data-window"))
        facts["estimated"] = int(_text(driver.find_element(By.ID, "estimated")))
        facts["stand_ins"] = [
            (s.get_attribute("data-kind"), _text(s.find_element(By.TAG_NAME, "pre")))
            for s in driver.find_elements(By.CSS_SELECTOR, ".stand-in")
        ]
        facts["decisions"] = [
            b.get_attribute("data-action")
            for b in driver.find_elements(By.CSS_SELECTOR, "tr.block")
        ]
        driver.save_screenshot(str(shot))

        driver.find_element(By.LINK_TEXT, "Unknown outcomes").click()
        form = _wait_for(driver, 'tr[data-key="refund:ORD-1"] form.resolve')
        form.find_element(By.CSS_SELECTOR, 'input[value="failed"]').click()
        form.find_element(By.CSS_SELECTOR, 'button[type="submit"]').click()
        facts["resolved"] = _text(_wait_for(driver, "#resolved"))
        facts["still_listed"] = bool(
            driver.find_elements(By.CSS_SELECTOR, 'tr[data-key="refund:ORD-1"]')
        )
        driver.find_element(By.LINK_TEXT, "Threads").click()
        driver.find_element(By.CSS_SELECTOR, f'tr[data-thread="{thread_id}"] a').click()
        _wait_for(driver, "#timeline")
        facts["ledger_after"] = _thread_facts(driver)["ledger"]
    return facts


def _browse_without_javascript(base: str, thread_id: str) -> dict[str, Any]:
    from selenium.webdriver.common.by import By

    with chromium(javascript=False) as driver:
        _sign_in(driver, base)  # the form posts without any script
        driver.find_element(By.CSS_SELECTOR, f'tr[data-thread="{thread_id}"] a').click()
        _wait_for(driver, "#timeline")
        facts = _thread_facts(driver)
        first = driver.find_element(By.CSS_SELECTOR, "details.text")
        first.find_element(By.TAG_NAME, "summary").click()  # <details> opens natively
        facts["opened_natively"] = first.get_attribute("open") is not None
        facts["full_text_visible"] = first.find_element(By.CSS_SELECTOR, "pre").is_displayed()
        return facts


async def test_inspector_pages_in_chromium(
    make_proxy: Callable[..., Awaitable[Proxy]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _require_browser()
    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium Manager, were it ever asked, stays offline
    proxy = await inspector(make_proxy)
    seeded = await seed_thread(proxy)
    store = proxy.app[STORE]  # type: ignore[index]
    shown = await admin.show_thread(store, seeded.thread_id, "acme")
    record = (await store.explain_get("acme", seeded.request_id)).record
    base = proxy.base_url.removesuffix("/v1")
    shot = tmp_path / "inspector.png"

    facts = await asyncio.to_thread(
        _browse_with_javascript, base, seeded.thread_id, seeded.request_id, shot
    )

    start = shown["window_start"]
    thread = facts["thread"]
    assert start is not None and start > 1, "the seeded thread was cut"
    assert thread["cut_start"] == start and thread["first_item_after_cut"] == start
    assert thread["cut_away"] == list(range(start))
    sent_summaries = [text for kind, text in facts["stand_ins"] if kind == "summary"]
    assert sent_summaries and thread["summary"][-1] == sent_summaries[0]
    assert thread["summary"] == [block["text"] for block in shown["summary"]]
    assert thread["title"].startswith("Thread t-orders"), "the hostile script did not run"
    assert HOSTILE in thread["full_texts"][1], "the hostile text is shown as text"
    assert thread["ledger"] == {"refund:ORD-1": "issued"}
    assert thread["toggles_hidden"] == [False, False] and facts["opened"]

    projection = record["projection"]
    sent = [s for s in facts["segments"] if s["sent"]]
    assert [s["name"] for s in sent] == ["pinned", "tools", "summary", "history", "current"]
    assert sum(s["tokens"] for s in sent) == projection["prompt_tokens"] == facts["estimated"]
    assert next(s for s in sent if s["name"] == "summary")["tokens"] > 0
    assert sum(s["tokens"] for s in facts["segments"]) == facts["window"] == projection["window"]
    drawn = sum(s["width"] for s in facts["segments"])
    assert abs(drawn - facts["bar_width"]) <= 3, "the segments fill the bar (inside its border)"
    for segment in facts["segments"]:  # drawn in proportion to the window, labelled
        share = segment["tokens"] / facts["window"]
        assert abs(segment["width"] - share * drawn) <= 1.5, segment
        assert segment["label"].endswith(str(segment["tokens"]))
    assert "summarized" in facts["decisions"]

    assert facts["resolved"] == "Resolved refund:ORD-1." and not facts["still_listed"]
    assert facts["ledger_after"] == {"refund:ORD-1": "failed"}
    entry = await store.ledger_get("acme", "tenant", "refund:ORD-1")
    assert entry is not None and entry.status == "failed"

    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("THREADKEEPER_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(shot, SCREENSHOT)

    plain = await asyncio.to_thread(_browse_without_javascript, base, seeded.thread_id)
    assert (plain["cut_start"], plain["first_item_after_cut"]) == (start, start)
    assert plain["summary"] == thread["summary"]
    assert plain["toggles_hidden"] == [True, True], "no script ran"
    assert plain["opened_natively"] and plain["full_text_visible"]


NARROW = 400  # CSS pixels: a phone held upright
LAYOUT = """
const view = document.documentElement.clientWidth;
const box = (element) => {
  const r = element.getBoundingClientRect();
  return {left: r.left, right: r.right, width: r.width, height: r.height};
};
const signOut = [...document.querySelectorAll("header button")]
  .find((b) => b.textContent.trim() === "Sign out");
return {
  view: view,
  page_width: document.documentElement.scrollWidth,
  title: box(document.querySelector("main h1")),
  sign_out: signOut ? box(signOut) : null,
  request_ids: [...document.querySelectorAll("#requests a, main h1")]
    .map((e) => box(e)),
};
"""


def _narrow_layouts(base: str, thread_id: str, request_id: str) -> dict[str, Any]:
    from urllib.parse import urlencode

    thread = f"{UI}/thread?{urlencode({'tenant': 'acme', 'id': thread_id})}"
    pages = {
        "threads": f"{UI}/",
        "thread": thread,
        "request": f"{UI}/requests/{request_id}",
        "ledger": f"{UI}/ledger",
    }
    found: dict[str, Any] = {}
    with chromium(javascript=True, width=NARROW) as driver:
        _sign_in(driver, base)
        for name, path in pages.items():
            driver.get(f"{base}{path}")
            _wait_for(driver, "main h1")
            found[name] = driver.execute_script(LAYOUT)
    return found


async def test_a_400_px_screen_shows_request_ids_and_sign_out_inside_the_viewport(
    make_proxy: Callable[..., Awaitable[Proxy]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 20 item 17: the request id overflowed a 400 px screen and "Sign out" sat
    off to its right."""
    _require_browser()
    monkeypatch.setenv("SE_OFFLINE", "true")
    proxy = await inspector(make_proxy)
    seeded = await seed_thread(proxy, turns=4)
    base = proxy.base_url.removesuffix("/v1")
    layouts = await asyncio.to_thread(_narrow_layouts, base, seeded.thread_id, seeded.request_id)
    for name, layout in layouts.items():
        view = layout["view"]
        assert NARROW - 20 <= view <= NARROW, (name, layout)  # less a vertical scrollbar
        assert layout["page_width"] <= view, (name, "the page scrolls sideways", layout)
        out = layout["sign_out"]
        assert out is not None and out["width"] > 0, (name, "Sign out is shown")
        assert 0 <= out["left"] and out["right"] <= view, (name, "Sign out is on screen", out)
        for shown in [layout["title"], *layout["request_ids"]]:
            assert 0 <= shown["left"] and shown["right"] <= view, (name, "overflows", shown)
    assert layouts["thread"]["request_ids"][1:], "the thread page lists its requests"
