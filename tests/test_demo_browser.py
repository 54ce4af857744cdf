"""The chat page in a real browser: Debian's headless Chromium driven through selenium.

Skipped only where Chromium (or selenium) is missing and CI is not "true"; in CI it runs.
"""

from __future__ import annotations

import os
import shutil

import pytest

from demo.api import create_app
from demo.config import Config
from demo.server import serving

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1000,1000",
]


def _driver(profile_dir):
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.path.exists(p)]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("selenium")
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"browser test needs {missing} in CI (apt-get install chromium chromium-driver)")
        pytest.skip(f"missing {missing}")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*FLAGS, f"--user-data-dir={profile_dir}"]:
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))


def _wait_replies(driver, n: int, timeout: float = 90):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, '.assistant[data-done="1"]')) >= n
    )
    return driver.find_elements(By.CSS_SELECTOR, ".assistant")


@pytest.mark.browser
def test_chat_page_streams_two_turns_and_shows_reuse(tmp_path):
    from PIL import Image, ImageStat
    from selenium.webdriver.common.by import By

    # The real default model, so this is what a person sees on `python -m demo`.
    app = create_app(Config(model="builtin", cache_tokens=1 << 14, default_max_tokens=32))
    driver = _driver(tmp_path / "profile")
    try:
        with serving(app) as url:
            driver.get(url + "/")
            assert "random" in driver.find_element(By.ID, "builtin-notice").text
            driver.find_element(By.ID, "max-tokens").clear()
            driver.find_element(By.ID, "max-tokens").send_keys("24")
            driver.find_element(By.ID, "sample").click()  # fills the box with a long table + question
            driver.find_element(By.ID, "send").click()
            first = _wait_replies(driver, 1)[0]
            driver.find_element(By.ID, "input").send_keys("And who is the youngest?")
            driver.find_element(By.ID, "send").click()
            replies = _wait_replies(driver, 2)
            screenshot = tmp_path / "chat.png"
            driver.save_screenshot(str(screenshot))
            if os.environ.get("RADIXKV_SCREENSHOT"):  # keep a copy to look at by hand
                shutil.copy(screenshot, os.environ["RADIXKV_SCREENSHOT"])
            assert not driver.find_elements(By.CSS_SELECTOR, ".error")
            assert len(driver.find_elements(By.CSS_SELECTOR, ".user")) == 2
            stats = [r.find_element(By.CSS_SELECTOR, ".stats").text for r in replies]
            assert all("time to first token" in s and "from the cache" in s for s in stats), stats
            assert int(first.get_attribute("data-cached-tokens")) == 0
            reused = int(replies[1].get_attribute("data-cached-tokens"))
            assert reused > 500 and reused % 16 == 0, stats  # the whole first turn, block-rounded
            assert f" {reused} of " in f" {stats[1]} ", stats  # and the page shows that number
            assert " 0 of " in stats[0], stats
            assert replies[1].find_element(By.CSS_SELECTOR, ".text").text.strip()  # text was streamed in
    finally:
        driver.quit()
    image = Image.open(screenshot).convert("L")
    assert image.size[0] >= 800 and ImageStat.Stat(image).stddev[0] > 10  # not blank
    app.extensions["radixkv"]["engine"].check_invariants()
