"""The chat page in a real browser: Debian's headless Chromium driven through selenium.

Skipped only where Chromium (or selenium) is missing and CI is not "true"; in CI it runs.
"""

from __future__ import annotations

import os
import shutil

import pytest

from demo.api.app import create_app
from demo.api.server import serving
from demo.config import Config

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


def _ask(driver, text: str, n: int):
    """Type ``text``, send it, wait for reply ``n`` (1-based); returns that reply's element."""
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, "input").send_keys(text)
    driver.find_element(By.ID, "send").click()
    return _wait_replies(driver, n)[n - 1]


def _greedy(driver, max_tokens: int) -> None:
    from selenium.webdriver.common.by import By

    for field, value in (("max-tokens", max_tokens), ("temperature", 0)):
        driver.find_element(By.ID, field).clear()
        driver.find_element(By.ID, field).send_keys(str(value))


def _reply_text(reply) -> str:
    from selenium.webdriver.common.by import By

    return reply.find_element(By.CSS_SELECTOR, ".text").get_attribute("textContent")


@pytest.mark.browser
def test_chat_page_attaches_an_image_and_the_next_turn_reads_it(tmp_path):
    from selenium.webdriver.common.by import By

    from tests.demo_checkpoints import data_url, png, save_vlm
    from tests.test_demo_images import BLOCK, common, reference_for, stock, stock_ids, user

    checkpoint = save_vlm(tmp_path / "tiny-llava")
    app = create_app(Config(model=checkpoint, block_size=BLOCK, cache_tokens=1 << 13))
    image = tmp_path / "photo.png"
    image.write_bytes(png(21))
    driver = _driver(tmp_path / "profile")
    try:
        with serving(app) as url:
            driver.get(url + "/")
            assert not driver.find_elements(By.ID, "model-select")  # no adapters served
            _greedy(driver, 6)
            driver.find_element(By.ID, "image").send_keys(str(image))
            first = _ask(driver, "what is in this picture?", 1)
            second = _ask(driver, "and why?", 2)
            thumbs = driver.find_elements(By.CSS_SELECTOR, ".user img.thumb")
            assert len(thumbs) == 1 and thumbs[0].get_attribute("src").startswith("data:image/png;base64,")
            assert not driver.find_elements(By.CSS_SELECTOR, ".error")
            replies = [_reply_text(first), _reply_text(second)]
            cached = [int(r.get_attribute("data-cached-tokens")) for r in (first, second)]
    finally:
        driver.quit()
    reference = reference_for(checkpoint)
    turn1 = [user(data_url(png(21)), "what is in this picture?")]
    ids1, reply1, reply_ids1 = stock_ids(reference, turn1)
    turn2 = [*turn1, {"role": "assistant", "content": reply1}, user("and why?")]
    ids2, reply2 = stock(reference, turn2)
    assert replies == [reply1, reply2]
    seen = ids1 + reply_ids1[:-1]  # what the store holds: the reply's ids but the last
    assert cached == [0, common(seen, ids2) // BLOCK * BLOCK] and cached[1] > len(ids1) - BLOCK


@pytest.mark.browser
def test_chat_page_picks_an_adapter_and_adapters_never_share_kv(tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    from demo.model.adapters import LoraModule
    from tests.demo_checkpoints import peft_reference, save_adapter, stock_reply

    modules = tuple(
        LoraModule(name, save_adapter(tmp_path / name, seed)) for name, seed in (("a", 1), ("b", 2))
    )
    app = create_app(Config(model="builtin-tiny", cache_tokens=1 << 14, lora_modules=modules))
    question = "Here is a table: " + " ".join(
        f"| Ines {i} | {40 + i} | Porto |" for i in range(8)
    )  # one line
    driver = _driver(tmp_path / "profile")
    try:
        with serving(app) as url:
            driver.get(url + "/")
            picker = Select(driver.find_element(By.ID, "model-select"))
            assert [o.get_attribute("value") for o in picker.options] == ["builtin-tiny", "a", "b"]
            _greedy(driver, 6)
            results = []
            for name in ["a", "b", "a"]:
                driver.find_element(By.ID, "reset").click()  # a new chat: the same single question
                Select(driver.find_element(By.ID, "model-select")).select_by_value(name)
                reply = _ask(driver, question, 1)
                results.append((_reply_text(reply), int(reply.get_attribute("data-cached-tokens"))))
            assert not driver.find_elements(By.CSS_SELECTOR, ".error")
    finally:
        driver.quit()
    model_a, tokenizer = peft_reference(modules[0].path)
    model_b, _ = peft_reference(modules[1].path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    text_a, text_b = (
        stock_reply(model_a, tokenizer, prompt, 6)[1],
        stock_reply(model_b, tokenizer, prompt, 6)[1],
    )
    full = (len(prompt) - 1) // 16 * 16
    assert results == [(text_a, 0), (text_b, 0), (text_a, full)]  # b never read a's prefix
    assert text_a != text_b


@pytest.mark.browser
def test_chat_page_shows_reasoning_apart(tmp_path):
    """A reasoning model's <think> block streams into the reply's folded reasoning part, not
    its text; the next turn sends it back (the template renders reasoning_content)."""
    from selenium.webdriver.common.by import By
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.demo_checkpoints import save_agent_model, stock_reply

    checkpoint = save_agent_model(tmp_path / "agent-tiny")
    thinking = {"enable_thinking": True}  # the template opens <think> in the generation prompt
    app = create_app(Config(model=checkpoint, cache_tokens=1 << 13, default_chat_template_kwargs=thinking))
    driver = _driver(tmp_path / "profile")
    try:
        with serving(app) as url:
            driver.get(url + "/")
            _greedy(driver, 6)
            first = _ask(driver, "which city is warmer?", 1)
            reasoning = first.find_element(By.CSS_SELECTOR, ".reasoning").get_attribute("textContent")
            text = _reply_text(first)
            second = _ask(driver, "and why?", 2)
            assert not driver.find_elements(By.CSS_SELECTOR, ".error")
            assert second.find_element(By.CSS_SELECTOR, ".reasoning").get_attribute("textContent")
    finally:
        driver.quit()
    tok = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "which city is warmer?"}],
        add_generation_prompt=True,
        tokenize=False,
        **thinking,
    )
    assert (reasoning, text) == (
        stock_reply(model, tok, tok(prompt, add_special_tokens=False)["input_ids"], 6)[1],
        "",
    )
