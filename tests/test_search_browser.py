"""The search page in headless Chromium (Debian's package, driven by Playwright) against a real server."""

from __future__ import annotations

import shutil

import pytest

from openalign.search.api import background_server, create_app, load_searcher
from openalign.search.demo import build_demo_index

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    index = build_demo_index(tmp_path_factory.mktemp("demo"), n_images=30, progress=False)
    with background_server(create_app(load_searcher(index))) as url:
        yield url


@pytest.fixture(scope="module")
def page(server):
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda err: errors.append(str(err)))
        page.goto(server)
        yield page
        browser.close()
        assert not errors, errors


def loaded_images(page) -> int:
    return page.evaluate(
        "[...document.querySelectorAll('.result img')].filter(i => i.complete && i.naturalWidth > 0).length"
    )


def test_typing_a_query_shows_result_images(page):
    page.wait_for_function("document.getElementById('status').textContent.includes('30 images')")
    page.fill("#query", "a red circle")
    page.select_option("#k", "10")
    page.press("#query", "Enter")
    page.wait_for_selector(".result img")
    page.wait_for_function("document.querySelectorAll('.result img').length === 10")
    page.wait_for_function("[...document.querySelectorAll('.result img')].every(i => i.complete && i.naturalWidth > 0)")
    assert loaded_images(page) == 10
    scores = [float(s) for s in page.locator(".result .score").all_inner_texts()]
    assert scores == sorted(scores, reverse=True)
    assert "10 results" in page.inner_text("#message")


def test_modifiers_and_clicking_a_result_searches_by_it(page):
    page.click("#add-plus")
    page.fill("#modifiers .plus input", "blue")
    page.click("#add-minus")
    page.fill("#modifiers .minus input", "stripes")
    page.click("#go")
    page.wait_for_function("document.getElementById('message').textContent.includes('results')")
    third = page.locator(".result").nth(2)
    clicked_id = third.get_attribute("data-id")
    page.fill("#query", "")
    while page.locator("#modifiers button").count():
        page.locator("#modifiers button").first.click()
    third.click()
    # The clicked image becomes the query; the best match of an image is itself, at cosine 1.
    page.wait_for_function(f"document.querySelector('.result')?.dataset.id === '{clicked_id}'")
    assert not page.locator("#query-image").is_hidden()
    assert float(page.locator(".result .score").first.inner_text()) == pytest.approx(1.0, abs=1e-3)


def test_picking_an_image_file_and_showing_errors(page, tmp_path):
    from PIL import Image

    page.click("#clear-image")
    Image.new("RGB", (50, 40), (20, 200, 30)).save(tmp_path / "green.png")
    page.set_input_files("#file", str(tmp_path / "green.png"))
    page.wait_for_selector("#query-image:not([hidden])")
    page.click("#go")
    page.wait_for_function("document.getElementById('message').textContent.includes('results')")
    assert loaded_images(page) > 0
    page.click("#clear-image")
    page.fill("#query", "")
    page.click("#go")
    assert "type something" in page.inner_text("#message")
