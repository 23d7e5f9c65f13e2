"""The page of `aiayn serve` with an API key that is not ASCII (`--api-keys` reads UTF-8): a header carries
bytes, each character of the key a Latin-1 byte in a browser's fetch (one past U+00FF: a TypeError), so
such a key travels in the body, LibreTranslate's field, as before the page sent keys in X-API-Key.
Skipped where Chromium is not installed, as tests/test_serve_browser.py."""

import pytest

from test_serve_browser import By, opened  # (importing it skips this module where Chromium is not installed)
from test_serve_browser import one_thread  # noqa: F401 (a fixture)

from aiayn.serve.app import create_app
from aiayn.serve.scheduler import Limits
from aiayn.translator import Translator
from serve_model import tiny_checkpoint


@pytest.mark.parametrize("key", ["schlüssel", "ключ"])
def test_page_translates_with_a_key_that_is_not_ascii(tmp_path_factory, tmp_path, one_thread, key):
    """ü went as the byte 0xfc, read back as U+FFFD ("403: Invalid API key"); ключ failed in fetch
    itself. Sent in the body, both are the key the file holds."""
    ckpt = tiny_checkpoint(tmp_path_factory.getbasetemp())
    translator = Translator.from_checkpoint(ckpt)
    app = create_app(translator, Limits(), ("de", "en"), api_keys=frozenset({key}))
    with opened(app, tmp_path / "profile") as (url, driver, wait):
        wait.until(lambda d: d.find_element(By.ID, "key-choice").is_displayed())
        driver.find_element(By.ID, "api-key").send_keys(key)
        driver.find_element(By.ID, "source").send_keys("ein Hund")
        driver.find_element(By.ID, "go").click()
        wait.until(lambda d: d.find_element(By.ID, "translation").text.strip() != ""
                   or d.find_element(By.ID, "error").text != "")
        assert driver.find_element(By.ID, "error").text == ""
        assert driver.find_element(By.ID, "translation").text == translator.translate(["ein Hund"], beam=4)[0]
