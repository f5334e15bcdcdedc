"""The classroom page in a real headless Chromium: the answer streams in and the live panel moves.

Needs Debian's `chromium` and `chromium-driver` (apt-get install chromium chromium-driver) and
`selenium`; without them the test is skipped and says why. .ci/run installs them first.
"""

from __future__ import annotations

import importlib

import os
import shutil

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
