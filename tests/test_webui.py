"""Browser chat: `python -m lavis_ds.apps.webui` served for real and used from a headless Chromium.

The page is driven as a person uses it (selenium + Debian's chromium and chromium-driver,
no browser download): it loads, an image is uploaded, questions are typed, and the answers
the demo model gives (``lavis_ds.apps.generation.generate`` on the same image, turns and settings)
must appear on the page.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from PIL import Image

from lavis_ds.datasets.records import IMAGE_PLACEHOLDER as IMG
from lavis_ds.apps.export import load_exported
from lavis_ds.apps.generation import eval_processors, generate
from lavis_ds.apps.webui import main
from run_utils import REPO, env, free_port

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
CAPTION, COLOUR = "Describe the image in a few words.", "What colour is the shape?"
# Set by .ci/run, which installs the browser: there a missing browser fails the browser test instead of skipping it.
REQUIRE_BROWSER = "LAVIS_DS_REQUIRE_BROWSER"


@pytest.fixture(scope="session")
def chromium() -> None:
    """Skips the browser test where Debian's chromium is missing, or fails it where CI requires the browser.
    Session-scoped, so that it is decided before the demo model is trained for the test."""
    if CHROMIUM.exists() and CHROMEDRIVER.exists():
        return
    missing = ("Debian's chromium and chromium-driver are not installed (/usr/bin/chromium, /usr/bin/chromedriver)")
    if os.environ.get(REQUIRE_BROWSER) == "1":
        pytest.fail(f"{missing}, and {REQUIRE_BROWSER}=1 says this run must test the web chat in a browser")
    pytest.skip(f"{missing}; .ci/run installs them with apt-get")


browser = pytest.mark.usefixtures("chromium")


@pytest.fixture(scope="module")
def server(demo_export):
    """The web chat of the demo export on a free port of 127.0.0.1: its URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lavis_ds.apps.webui", "--model", str(demo_export.folder),
                             "--port", str(port)], cwd=REPO, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:  # drain the output (a full pipe would block the server) and spot the URL
        for line in proc.stdout:
            lines.append(line)
            if f"http://127.0.0.1:{port}" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not ready.wait(180):
            raise AssertionError(f"the web chat did not start:\n{''.join(lines)[-3000:]}")
        yield f"http://127.0.0.1:{port}/"
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def driver():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    profile = tempfile.mkdtemp(prefix="lavis_ds-chromium-")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={profile}", "--window-size=1400,1000"):
        options.add_argument(flag)
    chrome = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    yield chrome
    chrome.quit()


def _bot_texts(driver) -> list[str]:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:  # streaming re-renders the message while it is read
        return [e.text.strip() for e in driver.find_elements(By.CSS_SELECTOR, "#chatbot [data-testid=bot]")]
    except StaleElementReferenceException:
        return []


def _wait(condition, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _ask(driver, question: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element(By.CSS_SELECTOR, "#question textarea")
    box.send_keys(question)
    box.send_keys(Keys.ENTER)


@browser
def test_the_page_answers_questions_about_an_uploaded_image(server, driver, demo_export, tmp_path):
    from selenium.webdriver.common.by import By

    model = load_exported(demo_export.folder)
    image_processor, _ = eval_processors(demo_export.folder)
    # A test image on which the briefly trained model says something to both questions (it may
    # answer a question with nothing, which the page would show as an empty message).
    for index in range(demo_export.num_test):
        image = demo_export.image("test", index)
        with Image.open(image) as picture:
            pixels = image_processor(picture.convert("RGB"))[None]
        # The page's defaults are the terminal chat's: greedy, up to 256 new tokens.
        first = generate(model, pixels, [f"{IMG} {CAPTION}"], max_new_tokens=256)[0]
        second = generate(model, pixels, [[f"{IMG} {CAPTION}", COLOUR]], [[first]], max_new_tokens=256)[0]
        if first and second and first != second:
            break
    else:
        raise AssertionError("the demo model answers no test image with two different non-empty answers")

    driver.get(server)
    upload = _wait(lambda: driver.find_elements(By.CSS_SELECTOR, "#image input[type=file]"), "the page to load")
    assert "No image yet" in driver.find_element(By.ID, "images-note").text
    upload[0].send_keys(str(image))
    _wait(lambda: "1 image(s) in this conversation; 1 will be shown" in driver.find_element(By.ID, "images-note").text,
          "the upload to reach the server")

    _ask(driver, CAPTION)
    _wait(lambda: _bot_texts(driver) == [first], f"the answer {first!r} (page shows {_bot_texts(driver)})")
    _ask(driver, COLOUR)  # the history is kept: the second answer is the one after the first turn
    _wait(lambda: _bot_texts(driver) == [first, second], f"the answer {second!r} (page shows {_bot_texts(driver)})")
    user_texts = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#chatbot [data-testid=user]")]
    assert any(CAPTION in text for text in user_texts) and any(COLOUR in text for text in user_texts)

    # A setting changed on the page reaches the model: one new token is the answer's first word.
    limit = driver.find_element(By.CSS_SELECTOR, "input[aria-label='number input for Max new tokens']")
    limit.clear()
    limit.send_keys("1\t")
    driver.find_element(By.ID, "clear-history").click()
    _wait(lambda: _bot_texts(driver) == [], "the history to clear")
    _ask(driver, CAPTION)
    _wait(lambda: _bot_texts(driver) == [first.split()[0]], f"the one-token answer (page shows {_bot_texts(driver)})")

    shot = tmp_path / "webui.png"
    driver.save_screenshot(str(shot))
    with Image.open(shot) as picture:
        assert picture.size[0] >= 1000


def test_bad_input_gets_a_clear_error(tmp_path, capsys, demo_export):
    assert main(["--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "lavis_ds webui:" in err and "is not an export folder" in err and "Traceback" not in err
    assert main(["--model", str(demo_export.folder), "--top-p", "1.5"]) == 2
    assert "top_p=1.5 is out of range (in (0, 1])" in capsys.readouterr().err


def test_the_pages_system_prompt_box_is_the_conversations_own(demo_export):
    """The page's handler in-process (no browser): the box's text is the system prompt the model is asked with, as
    training sent a record's own; an empty box sends the model's."""
    import torch

    from lavis_ds.apps.generation import GenerationSettings
    from lavis_ds.apps.webui import SETTING_FIELDS, _Page

    model = load_exported(demo_export.folder)
    image_processor, text_processor = eval_processors(demo_export.folder)
    page = _Page(model, image_processor, text_processor, GenerationSettings(max_new_tokens=8), 42)
    settings = [getattr(page.defaults, name) for name in SETTING_FIELDS]
    own = "You are a useful and harmless assistant"  # ms-swift's example record (tests/fixtures/chat_messages)
    *_, (_, chat, session, _) = page.ask(CAPTION, None, [], 42, own, *settings)
    assert session.system == own
    assert chat[-1]["content"] == generate(model, torch.zeros((0, 3, 1, 1)), [[CAPTION]], num_images=[0],
                                           systems=[own], max_new_tokens=8)[0]
    *_, (_, _, session, _) = page.ask(COLOUR, session, chat, 42, "  ", *settings)
    assert session.system is None
