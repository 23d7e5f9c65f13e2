"""The page of `aiayn serve` in a real headless Chromium (Debian's chromium + chromium-driver, driven by
selenium; nothing downloads a browser): type, Ctrl+Enter, the translation, the n-best list and the
heatmap appear, hovering a target token highlights the source token it attends to most, for the
mean of the layers and for one layer. It saves a screenshot (AIAYN_SCREENSHOT names a copy).

Skipped where Chromium is not installed, except under CI (CI=true), where `.ci/run` installs it."""

import os
import shutil
import socket
import threading
import time

import pytest
import torch

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)) and os.environ.get("CI") != "true":
    pytest.skip("needs Debian's chromium and chromium-driver (installed by .ci/run)", allow_module_level=True)
pytest.importorskip("fastapi")
webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

from aiayn.serve.scheduler import Limits  # noqa: E402
from aiayn.serve.app import create_app  # noqa: E402
from aiayn.translate import Translator  # noqa: E402
from serve_model import tiny_checkpoint  # noqa: E402

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1100,1000"]


def browser(profile):
    os.environ.setdefault("SE_OFFLINE", "true")  # selenium must not fetch a driver: both paths are given
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS + [f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))


def serve(app):
    """uvicorn on a free loopback port in a thread; returns (url, stop)."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    end = time.monotonic() + 60
    while not (server.started and app.state.server.ready):
        assert time.monotonic() < end and thread.is_alive(), "the server did not start"
        time.sleep(0.05)

    def stop():
        server.should_exit = True
        thread.join(30)

    return f"http://127.0.0.1:{port}", stop


def argmax(row):
    return max(range(len(row)), key=row.__getitem__)


@pytest.fixture
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine is shared; a tiny model gains nothing from more
    yield
    torch.set_num_threads(old)


def test_page_translates_draws_attention_and_highlights_on_hover(tmp_path_factory, tmp_path, one_thread):
    ckpt = tiny_checkpoint(tmp_path_factory.getbasetemp())
    app = create_app(Translator.from_checkpoint(ckpt), Limits(), ("de", "en"), checkpoint=str(ckpt))
    url, stop = serve(app)
    driver = None
    try:
        import httpx

        sentence = "Hund und Kind spielt im Park mit Ball"
        api = httpx.post(f"{url}/v1/translate", json={"text": [sentence], "nbest": 4, "attention": True}).json()
        line = api["translations"][0]
        best = line["hypotheses"][0]
        driver = browser(tmp_path / "profile")
        driver.get(url)
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: d.find_element(By.ID, "pair").text == "de → en")
        box = driver.find_element(By.ID, "source")
        box.send_keys(sentence)
        ActionChains(driver).key_down(Keys.CONTROL).send_keys(Keys.ENTER).key_up(Keys.CONTROL).perform()
        wait.until(lambda d: d.find_element(By.ID, "translation").text.strip() != "")

        assert driver.find_element(By.ID, "translation").text == best["text"]
        assert best["text"].startswith("dog and child plays in the park")
        items = driver.find_elements(By.CSS_SELECTOR, "#nbest li")
        texts = driver.execute_script("return [...document.querySelectorAll('#nbest li')].map(li => li.firstChild.textContent)")
        assert texts == [h["text"] for h in line["hypotheses"]] and len(items) == len(line["hypotheses"])
        assert items[0].find_element(By.CLASS_NAME, "score").text == f"{best['score']:.4f}"
        src = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#src-tokens .src-token")]
        tgt = driver.find_elements(By.CSS_SELECTOR, "#tgt-tokens .tgt-token")
        assert src == line["source_tokens"] and [e.text for e in tgt] == best["tokens"]
        canvas = driver.find_element(By.ID, "heatmap")
        assert canvas.get_attribute("data-rows") == str(len(best["tokens"]))
        assert canvas.get_attribute("data-cols") == str(len(src))
        painted = driver.execute_script(
            "const c = arguments[0], d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
            "let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i + 3] > 0 && d[i + 1] < 150) n++; return n;",
            canvas)
        assert painted > 200  # the heatmap's red cells are drawn

        layers = best["attention"]
        mean = [[sum(layer[t][s] for layer in layers) / len(layers) for s in range(len(src))]
                for t in range(len(tgt))]
        for t in range(len(tgt)):  # hover each target token: its most attended source token is marked
            ActionChains(driver).move_to_element(tgt[t]).perform()
            focus = driver.find_element(By.ID, "src-tokens").get_attribute("data-focus")
            assert focus == str(argmax(mean[t]))
            marked = driver.find_elements(By.CSS_SELECTOR, "#src-tokens .src-token.focus")
            assert [e.text for e in marked] == [src[argmax(mean[t])]]
            assert "active" in tgt[t].get_attribute("class")
        # the toy model translates word by word: "dog" attends to "Hund" most
        ActionChains(driver).move_to_element(tgt[[e.text for e in tgt].index("▁dog")]).perform()
        assert driver.find_element(By.CSS_SELECTOR, "#src-tokens .src-token.focus").text == "▁Hund"
        shot = tmp_path / "serve-page.png"
        assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        if os.environ.get("AIAYN_SCREENSHOT"):
            shutil.copy(shot, os.environ["AIAYN_SCREENSHOT"])

        Select(driver.find_element(By.ID, "layer")).select_by_value("0")  # one layer instead of the mean
        tgt = driver.find_elements(By.CSS_SELECTOR, "#tgt-tokens .tgt-token")
        ActionChains(driver).move_to_element(tgt[0]).perform()
        assert driver.find_element(By.ID, "src-tokens").get_attribute("data-focus") == str(argmax(layers[0][0]))
    finally:
        if driver is not None:
            driver.quit()
        stop()
