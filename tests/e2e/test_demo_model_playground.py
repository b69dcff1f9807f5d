"""The gateway's web playground in a real browser (Debian's headless chromium, through selenium) against the demo
model's cluster: a tenant enters its key, picks the model, submits a prompt, watches the stages' progress and
the video plays; the job is listed and deleted from the page; on a phone-sized screen the page fits its width;
and the browser's console shows no Content-Security-Policy violation and no script error throughout.

The screenshot of the finished video is written to the test's tmp_path, or to $STAGEDIFF_PLAYGROUND_SCREENSHOT
where that is set (docs/images/playground.png is made so).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.wait import WebDriverWait

from tests.helpers.browser import chromium, console_lines, missing_programs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

PROMPT = "a red circle moving right on a dark background"
SEED = 7
VIDEO_TIMEOUT_S = 300
SCREENSHOT = (1280, 1560)
PHONE = (390, 844)
# True once the result's <video> has data and has played (or played to its end).
VIDEO_PLAYS = """
const video = document.querySelector("#media video");
return video !== null && video.readyState >= 2 && (video.currentTime > 0 || video.ended);
"""


def _wait(driver: WebDriver, timeout: float = 30) -> WebDriverWait:
    # The page redraws its lists as answers come: an element found a moment ago may be gone, then look again.
    return WebDriverWait(driver, timeout, poll_frequency=0.2, ignored_exceptions=(StaleElementReferenceException,))


def _text(driver: WebDriver, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def _enter_key(driver: WebDriver, key: str) -> None:
    field = driver.find_element(By.ID, "api-key")
    field.clear()
    field.send_keys(key)
    driver.find_element(By.CSS_SELECTOR, "#key-form button[type=submit]").click()


def _models(driver: WebDriver) -> list[str]:
    return [option.get_attribute("value") for option in Select(driver.find_element(By.ID, "model")).options]


def test_playground_makes_and_plays_a_demo_video(demo_cluster, tmp_path: Path) -> None:
    missing = missing_programs()
    assert not missing, f"install Debian's chromium and chromium-driver (apt-get install ...): {missing} not on PATH"
    cluster, keys = demo_cluster
    screenshot = Path(os.environ.get("STAGEDIFF_PLAYGROUND_SCREENSHOT") or tmp_path / "playground.png")
    console: list[str] = []
    with chromium(tmp_path / "profile", tmp_path) as driver:
        # / redirects to the page; without a key the cluster's tenants refuse the models, and the page says so.
        driver.get(f"{cluster.http_url}/")
        assert driver.current_url == f"{cluster.http_url}/playground/"
        _wait(driver).until(lambda _: "API key was refused" in _text(driver, "error"))
        assert _models(driver) == []

        _enter_key(driver, keys["globex"])
        _wait(driver).until(lambda _: len(_models(driver)) == 1)
        Select(driver.find_element(By.ID, "model")).select_by_index(0)
        assert "makes videos" in _text(driver, "model-info")
        # The demo model's defaults fill the form; it serves no adapter to globex and no step cache.
        assert driver.find_element(By.ID, "num_frames").get_attribute("value") == "17"
        assert driver.find_element(By.ID, "num_frames").get_attribute("step") == "4"
        assert not driver.find_element(By.ID, "lora-fields").is_displayed()
        assert not driver.find_element(By.ID, "image-field").is_displayed()

        driver.find_element(By.ID, "prompt").send_keys(PROMPT)
        driver.find_element(By.ID, "seed").send_keys(str(SEED))
        driver.find_element(By.ID, "submit").click()

        # Each stage's progress bar appears as its events come, and the video plays once the job completes.
        _wait(driver, VIDEO_TIMEOUT_S).until(lambda _: driver.execute_script(VIDEO_PLAYS))
        stages = [bar.get_attribute("id") for bar in driver.find_elements(By.CSS_SELECTOR, "#stages progress")]
        assert stages == ["stage-text-encoder", "stage-dit", "stage-vae"]
        assert [_text(driver, f"{stage}-count") for stage in stages] == ["1/1", "20/20", "5/5"]
        assert "completed" in _text(driver, "status")
        assert f"seed {SEED}" in _text(driver, "output-details")
        assert driver.find_element(By.ID, "output-download").get_attribute("href").startswith("blob:")
        # The whole page, from the top (the page scrolled to the button pressed).
        driver.set_window_size(*SCREENSHOT)
        driver.execute_script("window.scrollTo(0, 0)")
        driver.save_screenshot(str(screenshot))

        # The job is listed; deleting it from the page takes it off the list (and off the cluster).
        job_id = driver.execute_script("return state.job")
        listed = f'#jobs li[data-job="{job_id}"]'
        _wait(driver).until(lambda _: PROMPT in driver.find_element(By.CSS_SELECTOR, listed).text)
        driver.find_element(By.CSS_SELECTOR, f"{listed} button.delete").click()
        _wait(driver).until(expected_conditions.alert_is_present()).accept()
        _wait(driver).until(lambda _: not driver.find_elements(By.CSS_SELECTOR, listed))
        console += console_lines(driver)

        # On a phone-sized screen, in the same tab: the key is remembered, and nothing is wider than the screen.
        driver.set_window_size(*PHONE)
        driver.refresh()
        _wait(driver).until(lambda _: len(_models(driver)) == 1)
        assert driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
        assert driver.find_element(By.ID, "submit").is_displayed()
        console += console_lines(driver)

    assert screenshot.stat().st_size > 0
    # The only console errors are the refusals of the first visit, made without a key.
    assert not [line for line in console if "Content Security Policy" in line], console
    assert not [line for line in console if "Uncaught" in line], console
    assert not [line for line in console if line.startswith("SEVERE") and " 401 " not in line], console
