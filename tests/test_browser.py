"""The classroom page in a real headless Chromium: the answer streams in and the live panel moves.

Needs Debian's `chromium` and `chromium-driver` (apt-get install chromium chromium-driver) and
`selenium`; without them the test is skipped and says why. .ci/run installs them first.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import shutil
import threading
import time

import httpx
import pytest

from conftest import REPO_ROOT, load_script

launcher = importlib.import_module("kit.launcher")
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
SCREENSHOT = os.environ.get("PAGE_SCREENSHOT")   # a path: also save what the browser shows

if not os.path.exists(CHROMIUM) or not os.path.exists(CHROMEDRIVER):
    pytest.skip(f"no headless browser: needs {CHROMIUM} and chromedriver "
                "(apt-get install chromium chromium-driver)", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def test_page_streams_an_answer_and_the_panel_updates(browser, tiny_model_dir):
    with launcher.serve_in_subprocess(str(tiny_model_dir), device="cpu", env={"OMP_NUM_THREADS": "1"}) as url:
        browser.get(url + "/")
        wait = WebDriverWait(browser, 60)
        wait.until(lambda d: d.find_element(By.ID, "served").text == "0")   # the panel polled /engine/stats
        assert browser.find_element(By.ID, "engine-name").text == "BaselineEngine"
        assert not browser.find_element(By.ID, "features").is_displayed()   # Chapter 1's engine has none
        prompt = browser.find_element(By.ID, "prompt")
        prompt.clear()
        prompt.send_keys("Tell me about the sea.")
        browser.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_element(By.ID, "rate").text not in ("-", "…"))
        assert browser.find_element(By.ID, "answer").text.strip()
        assert browser.find_element(By.ID, "ttft").text.endswith(" ms")
        wait.until(lambda d: d.find_element(By.ID, "served").text == "1")
        assert browser.find_elements(By.CSS_SELECTOR, "#batches div")
        if SCREENSHOT:
            browser.save_screenshot(str(REPO_ROOT / SCREENSHOT))


@contextlib.contextmanager
def serve_in_thread(app):
    """uvicorn in a thread of this process, on a free loopback port: for an app built around a test engine."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=launcher.free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.config.port}"
    deadline = time.monotonic() + 30
    while not launcher.healthy(url):
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(30)


def test_page_shows_the_engines_features(browser, tiny_engine):
    from test_server_ops import FeaturedEngine

    app = load_script("05_server").make_app(FeaturedEngine(tiny_engine))
    with serve_in_thread(app) as url:
        browser.get(url + "/")
        line = WebDriverWait(browser, 30).until(
            lambda d: d.find_element(By.ID, "features").is_displayed() and d.find_element(By.ID, "features"))
        assert line.text == ("quant int8 · prefix caching · kv memory 512 MiB · block size 16 · "
                             "max num seqs 32 · max num batched tokens 256")


def test_a_keyed_server_asks_for_its_key_before_any_send(browser, tiny_engine):
    """Under --api-key both pollers get a 401: the page says so and shows the key field at once,
    before anyone presses Send; once the key is typed the panel fills in, and the tab keeps it."""
    ops = importlib.import_module("kit.server_ops").ServerOps(api_key="class-secret")
    app = load_script("05_server").make_app(tiny_engine, ops=ops)
    with serve_in_thread(app) as url:
        browser.get(url + "/")
        wait = WebDriverWait(browser, 30)
        key = wait.until(lambda d: d.find_element(By.ID, "api-key").is_displayed() and d.find_element(By.ID, "api-key"))
        assert "needs an API key" in browser.find_element(By.ID, "key-notice").text
        assert browser.find_element(By.ID, "engine-name").text == ""   # what the engine is, is behind the key
        assert browser.find_element(By.ID, "answer").text == ""        # no Send was needed to get here
        if SCREENSHOT:
            browser.save_screenshot(str(REPO_ROOT / SCREENSHOT).replace(".png", "-key.png"))
        key.send_keys("wrong\n")
        wait.until(lambda d: "refused" in d.find_element(By.ID, "key-notice").text)
        browser.find_element(By.ID, "api-key").send_keys("class-secret\n")
        wait.until(lambda d: d.find_element(By.ID, "engine-name").text == "BaselineEngine")
        wait.until(lambda d: not d.find_element(By.ID, "key-form").is_displayed())
        assert browser.find_element(By.ID, "served").text == "0"
        browser.refresh()   # sessionStorage: typed once per tab
        wait.until(lambda d: d.find_element(By.ID, "engine-name").text == "BaselineEngine")
        assert not browser.find_element(By.ID, "key-form").is_displayed()
        browser.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_element(By.ID, "served").text == "1")
        assert not browser.find_element(By.ID, "answer").text.startswith("Error")
        browser.execute_script("sessionStorage.clear();")


def rect(driver, element_id: str) -> dict:
    return driver.execute_script(f"return document.getElementById('{element_id}').getBoundingClientRect().toJSON();")


def screenshot_script():
    """scripts/screenshot_scheduler.py, which sends a class's traffic (the book's screenshot uses it too)."""
    spec = importlib.util.spec_from_file_location("screenshot_scheduler", REPO_ROOT / "scripts/screenshot_scheduler.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CB_ENGINE = "minivllm:LLM"


@pytest.fixture(scope="module")
def cb_server(tiny_model_dir):
    """Chapter 9's engine behind the server, small enough that thirty requests queue and share blocks."""
    args = ("--prefix-caching", "--kv-memory", "2MB", "--max-num-seqs", "16", "--max-num-batched-tokens", "128")
    with launcher.serve_in_subprocess(str(tiny_model_dir), engine=CB_ENGINE, device="cpu",
                                      env={"OMP_NUM_THREADS": "1"}, args=args) as url:
        yield url


def test_the_batch_chart_draws_each_step_once(browser, cb_server):
    """One request of K tokens is K steps (one prefill, K - 1 decodes): K more bars, however many
    times the page polled meanwhile (on a fresh server, exactly K)."""
    k, url = 16, cb_server
    before = httpx.get(f"{url}/engine/scheduler").json()["step"]
    served = httpx.get(f"{url}/engine/stats").json()["served"]
    browser.get(url + "/")
    wait = WebDriverWait(browser, 60)
    wait.until(lambda d: d.find_element(By.ID, "served").text == str(served))
    httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": k, "ignore_eos": True}, timeout=60)
    wait.until(lambda d: d.find_element(By.ID, "served").text == str(served + 1))
    rows = wait.until(lambda d: d.execute_script(   # in one go: the page redraws its rows on every poll
        "return [...document.querySelectorAll('#requests tbody tr.finished')].map((tr) => tr.textContent);"))
    time.sleep(1.2)   # two more polls: nothing new to draw
    assert len(browser.find_elements(By.CSS_SELECTOR, "#batches div")) == min(before + k, 60)
    assert len(rows) == 1 and "length" in rows[0]   # kept on the page a few seconds after it left


def test_the_scheduler_panel_under_thirty_streams(browser, cb_server):
    """Thirty students' streams at once: a row per request, the KV grid coloured by its owners,
    the class's shared system prompt as blocks with several owners (prefix caching)."""
    script, url = screenshot_script(), cb_server
    script.warm_prefix_cache(url)
    browser.get(url + "/")
    wait = WebDriverWait(browser, 30, poll_frequency=0.1)
    wait.until(lambda d: d.find_element(By.ID, "scheduler").is_displayed())
    traffic = script.class_traffic(url, 30, max_tokens=lambda i: 150 + 5 * i)
    seen = wait.until(lambda d: (lambda c: c if c["rows"] >= 20 and c["waiting"] and c["decode"]
                                 and c["shared"] else None)(script.page_counts(d)))
    owners = browser.execute_script(
        "return [[...document.querySelectorAll('#kv-grid [data-owner]')].map((e) => e.dataset.owner),"
        " [...document.querySelectorAll('#requests tbody tr')].map((tr) => tr.dataset.id)];")
    assert owners[0] and set(owners[0]) <= set(owners[1]), owners   # every coloured block is a listed request's
    assert browser.find_element(By.ID, "sched-running").text.endswith("/ 16")
    if SCREENSHOT:
        browser.save_screenshot(str(REPO_ROOT / SCREENSHOT).replace(".png", "-scheduler.png"))
    traffic.join(60)
    assert not traffic.is_alive() and all(n > 10 for n in traffic.events), seen


def test_the_chat_stays_in_view_beside_the_scheduler_at_1280x900(browser, cb_server):
    """A projector's 1280x900: the chat on the left, the engine's panel and scheduler on the right,
    and the chat still in view when the page is scrolled down to the KV pool."""
    browser.set_window_size(1280, 900)
    try:
        inner = browser.execute_script("return [window.innerWidth, window.innerHeight];")
        browser.set_window_size(2 * 1280 - inner[0], 2 * 900 - inner[1])   # the page's own area is 1280x900
        browser.get(cb_server + "/")
        WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "scheduler").is_displayed())
        width, height = browser.execute_script("return [window.innerWidth, window.innerHeight];")
        assert (width, height) == (1280, 900)
        if SCREENSHOT:
            browser.save_screenshot(str(REPO_ROOT / SCREENSHOT).replace(".png", "-1280x900.png"))
        for scrolled in (False, True):
            if scrolled:
                browser.execute_script("window.scrollTo(0, document.body.scrollHeight);")
            chat, panel, scheduler = (rect(browser, name) for name in ("chat", "panel", "scheduler"))
            assert 0 <= chat["top"] and chat["bottom"] <= height, (scrolled, chat)       # all of it in view
            assert scheduler["left"] >= chat["right"] and panel["left"] >= chat["right"]  # beside it
            assert scheduler["top"] < height and scheduler["bottom"] > 0, scheduler
    finally:
        browser.set_window_size(1400, 900)


def test_the_projector_layout_fits_1280x720_and_the_chat_keeps_its_conversation(browser, cb_server):
    """1280x720, no scroll: the chat, the scheduler, the whole KV pool and the chart with its axes
    at once; one tokens/s figure on the page; a second question goes out with the first turn."""
    browser.set_window_size(1280, 720)
    try:
        inner = browser.execute_script("return [window.innerWidth, window.innerHeight];")
        browser.set_window_size(2 * 1280 - inner[0], 2 * 720 - inner[1])   # the page's own area is 1280x720
        browser.get(cb_server + "/")
        wait = WebDriverWait(browser, 30)
        wait.until(lambda d: d.find_element(By.ID, "scheduler").is_displayed()
                   and d.find_elements(By.CSS_SELECTOR, "#kv-grid i"))
        browser.execute_script(   # what the page sends, kept for the test
            "window.sent = []; const f = window.fetch; window.fetch = (url, o) => "
            "{ if (url.includes('chat')) window.sent.push(JSON.parse(o.body)); return f(url, o); };")
        for question in ("Name a colour.", "And another one?"):
            prompt = browser.find_element(By.ID, "prompt")
            prompt.clear()
            prompt.send_keys(question + "\n")
            wait.until(lambda d: d.find_element(By.ID, "rate").text.endswith(" s"))
        width, height = browser.execute_script("return [window.innerWidth, window.innerHeight];")
        assert (width, height) == (1280, 720)
        if SCREENSHOT:
            browser.save_screenshot(str(REPO_ROOT / SCREENSHOT).replace(".png", "-1280x720.png"))
        assert browser.execute_script("return document.documentElement.scrollHeight;") <= height   # no scroll
        last_cell = browser.execute_script("return document.querySelector('#kv-grid i:last-child')"
                                           ".getBoundingClientRect().toJSON();")
        for box in [rect(browser, name) for name in ("chat", "scheduler", "kv-grid", "chart", "requests-box")] + [last_cell]:
            assert 0 <= box["top"] and box["bottom"] <= height and 0 <= box["left"] and box["right"] <= width, box
        rates = browser.execute_script(
            "return [...document.querySelectorAll('dt')].filter((e) => e.offsetParent && e.textContent.includes('tokens/s'))"
            ".map((e) => e.textContent);")
        assert len(rates) == 1, rates
        assert int(browser.find_element(By.ID, "y-top").text) >= 1
        assert "steps" in browser.find_element(By.ID, "x-axis").text
        sent = browser.execute_script("return window.sent;")
        assert [m["role"] for m in sent[1]["messages"]] == ["user", "assistant", "user"], sent
        assert sent[1]["messages"][0]["content"] == "Name a colour." and sent[1]["messages"][1]["content"]
    finally:
        browser.set_window_size(1400, 900)
