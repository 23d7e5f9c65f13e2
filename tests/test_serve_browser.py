"""The page of `aiayn serve` in a real headless Chromium (Debian's chromium + chromium-driver, driven by
selenium; nothing downloads a browser): type, Ctrl+Enter, the translation, the n-best list and the
heatmap appear, hovering a target token highlights the source token it attends to most, for the
mean of the layers and for one layer. It saves a screenshot (AIAYN_SCREENSHOT names a copy). With two
pairs and --api-keys the page offers both pairs and a key field (kept across a reload), shows the
server's 400 and 403, and translates with the second pair once the key is good; a 429 and a
plain-text 503 (a proxy's, say) are shown in the server's words.

Skipped where Chromium is not installed, except under CI (CI=true), where `.ci/run` installs it."""

import contextlib
import json
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
from aiayn.translator import Translator  # noqa: E402
from serve_model import DE_EN, tiny_checkpoint  # noqa: E402

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


@contextlib.contextmanager
def opened(app, profile):
    """`app` served on loopback and its page open in Chromium: (url, driver, wait); both end after."""
    url, stop = serve(app)
    driver = None
    try:
        driver = browser(profile)
        driver.get(url)
        yield url, driver, WebDriverWait(driver, 60)
    finally:
        if driver is not None:
            driver.quit()
        stop()


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
    with opened(app, tmp_path / "profile") as (url, driver, wait):
        import httpx

        sentence = "Hund und Kind spielt im Park mit Ball"
        api = httpx.post(f"{url}/v1/translate", json={"text": [sentence], "nbest": 4, "attention": True}).json()
        line = api["translations"][0]
        best = line["hypotheses"][0]
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


def _error_shown(driver, wait, words):
    wait.until(lambda d: words in d.find_element(By.ID, "error").text)
    return driver.find_element(By.ID, "error").text


def test_page_picks_a_pair_and_sends_the_api_key_the_server_asks_for(tmp_path_factory, tmp_path, one_thread):
    """Two pairs and --api-keys: the page offers both pairs, asks for a key (kept across a reload),
    shows the server's 400/403 words, and translates with the second pair once the key is good."""
    from aiayn.serve.app import Model

    base = tmp_path_factory.getbasetemp()
    de_en, en_de = tiny_checkpoint(base), tiny_checkpoint(base, reverse=True)
    reverse = Translator.from_checkpoint(en_de)
    models = [Model(Translator.from_checkpoint(de_en), "de", "en", str(de_en)), Model(reverse, "en", "de", str(en_de))]
    app = create_app(models, Limits(), api_keys=frozenset({"k1"}))
    with opened(app, tmp_path / "profile") as (url, driver, wait):
        wait.until(lambda d: d.find_element(By.ID, "pair-choice").is_displayed())
        pairs = Select(driver.find_element(By.ID, "pairs"))
        assert [o.text for o in pairs.options] == ["de → en", "en → de"]
        key = driver.find_element(By.ID, "api-key")
        assert key.is_displayed() and key.get_attribute("value") == ""
        sentence = "a dog plays in the park with ball"
        box = driver.find_element(By.ID, "source")
        box.send_keys(sentence)
        go = driver.find_element(By.ID, "go")
        go.click()  # no key yet: the server's 400, in its words
        assert _error_shown(driver, wait, "API key") == "400: Please contact the server operator to get an API key"
        key.send_keys("nope")
        go.click()
        assert _error_shown(driver, wait, "Invalid") == "403: Invalid API key"

        key.clear()
        key.send_keys("k1")
        driver.refresh()  # the key is kept in localStorage
        wait.until(lambda d: d.find_element(By.ID, "api-key").get_attribute("value") == "k1")
        Select(driver.find_element(By.ID, "pairs")).select_by_visible_text("en → de")
        driver.find_element(By.ID, "source").send_keys(sentence)
        driver.find_element(By.ID, "go").click()
        wait.until(lambda d: d.find_element(By.ID, "translation").text.strip() != "")
        assert driver.find_element(By.ID, "error").text == ""
        want = reverse.translate([sentence], beam=4)[0]
        assert driver.find_element(By.ID, "translation").text == want
        # the en -> de model's German words (which and in what order is the tiny model's, and differs by
        # CPU: on an AMD Zen 5 "mit" came out "läuft")
        assert {"Hund", "Park", "Ball"} <= set(want.split()) <= set(DE_EN)
        assert [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#src-tokens .src-token")][:2] == ["▁a", "▁dog"]
        layers = Select(driver.find_element(By.ID, "layer")).options
        assert len(layers) == 1 + reverse.model.cfg.decoder_layers

        box = driver.find_element(By.ID, "source")  # a line of two sentences: each is offered
        box.clear()
        box.send_keys("a dog plays. a child runs.")
        driver.find_element(By.ID, "go").click()
        wait.until(lambda d: len(Select(d.find_element(By.ID, "line")).options) == 2)
        assert [o.text for o in Select(driver.find_element(By.ID, "line")).options] == ["1.1: a dog plays.",
                                                                                        "1.2: a child runs."]
        assert driver.find_element(By.ID, "translation").text == " ".join(reverse.translate(["a dog plays.",
                                                                                             "a child runs."]))


def test_page_shows_the_servers_words_for_a_429_and_a_plain_text_503(tmp_path_factory, tmp_path, one_thread):
    """A client over --max-client-lines gets LibreTranslate's 429; a proxy in front of the server may
    answer a plain-text 503: the page shows both as they were written."""
    ckpt = tiny_checkpoint(tmp_path_factory.getbasetemp())
    app = create_app(Translator.from_checkpoint(ckpt), Limits(max_lines=2, max_client_lines=2), ("de", "en"))
    with opened(app, tmp_path / "profile") as (url, driver, wait):
        wait.until(lambda d: d.find_element(By.ID, "pair").text == "de → en")
        srv = app.state.server
        srv.clients.held["ip:127.0.0.1"] = 2  # as if two lines of this client were in the server
        driver.find_element(By.ID, "source").send_keys("ein Hund")
        driver.find_element(By.ID, "go").click()
        assert _error_shown(driver, wait, "429").startswith("429: IP address 127.0.0.1 has 2 lines in the server")
        del srv.clients.held["ip:127.0.0.1"]
        driver.execute_script(  # a plain-text answer, as a proxy in front may give
            "const real = window.fetch; window.fetch = (u, o) => u === '/v1/translate' ? "
            "Promise.resolve(new Response('Exceeded concurrency limit.', {status: 503})) : real(u, o);")
        driver.find_element(By.ID, "go").click()
        assert _error_shown(driver, wait, "503") == "503: Exceeded concurrency limit."


def test_page_shows_no_pair_selector_or_key_field_a_server_does_not_need(tmp_path_factory, tmp_path, one_thread):
    """One pair, no --api-keys: the pair selector and the key field ("this server asks for one") stay
    hidden (the stylesheet's `label { display: inline-block }` once beat the `hidden` attribute)."""
    ckpt = tiny_checkpoint(tmp_path_factory.getbasetemp())
    app = create_app(Translator.from_checkpoint(ckpt), Limits(), ("de", "en"))
    with opened(app, tmp_path / "profile") as (url, driver, wait):
        wait.until(lambda d: d.find_element(By.ID, "pair").text == "de → en")
        assert not driver.find_element(By.ID, "pair-choice").is_displayed()
        assert not driver.find_element(By.ID, "key-choice").is_displayed()
        assert not driver.find_element(By.ID, "error").is_displayed()
        assert driver.find_element(By.ID, "error").get_attribute("role") == "alert"  # a refusal is read out


def test_page_shows_the_newest_translation_not_a_late_answer_to_an_older_request(tmp_path_factory, tmp_path,
                                                                                 one_thread):
    """Ctrl+Enter while a translation is in flight: the newer text's translation stays, whatever
    answer arrives last (the older one, delayed here, used to overwrite it), and its n-best are
    asked within --max-nbest (the page asked for 4 on any server: a 422 with --max-nbest 2)."""
    ckpt = tiny_checkpoint(tmp_path_factory.getbasetemp())
    translator = Translator.from_checkpoint(ckpt)
    app = create_app(translator, Limits(max_nbest=2), ("de", "en"))
    with opened(app, tmp_path / "profile") as (url, driver, wait):
        wait.until(lambda d: d.find_element(By.ID, "pair").text == "de → en")
        driver.execute_script(  # the first answer arrives 2 s late; the page's abort is not honoured
            "window.sent = 0; const real = window.fetch;"
            "window.fetch = async (u, o) => { if (u !== '/v1/translate') return real(u, o);"
            "  const first = window.sent++ === 0; const r = await real(u, {...o, signal: undefined});"
            "  if (first) await new Promise((done) => setTimeout(done, 2000)); return r; };")
        box = driver.find_element(By.ID, "source")
        box.send_keys("Hund und Kind spielt im Park mit Ball")
        box.send_keys(Keys.CONTROL, Keys.ENTER)
        wait.until(lambda d: d.execute_script("return window.sent") == 1)
        box.clear()
        box.send_keys("rot blau")
        box.send_keys(Keys.CONTROL, Keys.ENTER)
        wait.until(lambda d: d.execute_script("return window.sent") == 2)
        want = translator.translate(["rot blau"], beam=4)[0]
        wait.until(lambda d: d.find_element(By.ID, "translation").text == want)
        time.sleep(3)  # the first answer has come by now
        assert driver.find_element(By.ID, "translation").text == want
        assert [o.text for o in Select(driver.find_element(By.ID, "line")).options] == ["1: rot blau"]
        assert len(driver.find_elements(By.CSS_SELECTOR, "#nbest li")) == 2
        assert driver.find_element(By.ID, "error").text == "" and driver.find_element(By.ID, "go").is_enabled()


def test_page_line_labels_never_cut_an_emoji_in_half(tmp_path_factory, tmp_path, one_thread):
    """The line selector shows a line's first 40 characters: code points, not UTF-16 units (a label
    ending in half a surrogate pair showed a replacement box, and webdriver could not even read it)."""
    ckpt = tiny_checkpoint(tmp_path_factory.getbasetemp())
    app = create_app(Translator.from_checkpoint(ckpt), Limits(), ("de", "en"))
    with opened(app, tmp_path / "profile") as (url, driver, wait):
        wait.until(lambda d: d.find_element(By.ID, "pair").text == "de → en")
        line = "Hund" + " x" * 17 + " \U0001F600\U0001F600"  # the first emoji spans UTF-16 units 39 and 40
        driver.execute_script("document.getElementById('source').value = arguments[0]", line)
        driver.find_element(By.ID, "go").click()
        wait.until(lambda d: d.find_element(By.ID, "translation").text.strip() != "")
        label = driver.execute_script("return document.querySelector('#line option').text")
        assert label == "1: " + line[:40]


def test_page_attention_of_a_target_token_by_keyboard(tmp_path_factory, tmp_path, one_thread):
    """Tab from the layer selector reaches the target tokens: a focused token highlights the source
    token it attends to most, as hovering it does (the tokens took no focus: mouse only)."""
    ckpt = tiny_checkpoint(tmp_path_factory.getbasetemp())
    app = create_app(Translator.from_checkpoint(ckpt), Limits(), ("de", "en"))
    with opened(app, tmp_path / "profile") as (url, driver, wait):
        wait.until(lambda d: d.find_element(By.ID, "pair").text == "de → en")
        driver.find_element(By.ID, "source").send_keys("Hund und Kind spielt im Park")
        driver.find_element(By.ID, "go").click()
        wait.until(lambda d: d.find_element(By.ID, "translation").text.strip() != "")
        driver.find_element(By.ID, "layer").send_keys(Keys.TAB)
        focused = driver.switch_to.active_element
        assert "tgt-token" in focused.get_attribute("class") and focused.get_attribute("data-index") == "0"
        assert "active" in focused.get_attribute("class")
        assert driver.find_element(By.ID, "src-tokens").get_attribute("data-focus") != "-1"
        focused.send_keys(Keys.TAB)
        assert driver.switch_to.active_element.get_attribute("data-index") == "1"


def test_page_heatmap_of_a_long_line_keeps_its_shape_on_a_narrow_window(tmp_path_factory, tmp_path, one_thread):
    """A heatmap wider than the page scrolls sideways instead of being squeezed to the page's width
    with its height kept (cells and labels drawn narrower than they are tall)."""
    ckpt = tiny_checkpoint(tmp_path_factory.getbasetemp())
    app = create_app(Translator.from_checkpoint(ckpt), Limits(), ("de", "en"))
    with opened(app, tmp_path / "profile") as (url, driver, wait):
        driver.set_window_size(600, 900)
        wait.until(lambda d: d.find_element(By.ID, "pair").text == "de → en")
        driver.find_element(By.ID, "source").send_keys(" ".join(["Hund und Kind spielt im Park mit Ball"] * 3))
        driver.find_element(By.ID, "go").click()
        wait.until(lambda d: d.find_element(By.ID, "translation").text.strip() != "")
        canvas = driver.find_element(By.ID, "heatmap")
        drawn, shown = driver.execute_script(
            "const c = arguments[0]; return [parseFloat(c.style.width), c.getBoundingClientRect().width];", canvas)
        assert drawn > 600 and abs(shown - drawn) < 1


def test_page_empty_beam_and_alpha_fields_ask_for_the_servers_defaults(tmp_path_factory, tmp_path, one_thread):
    """A cleared beam or alpha field means the server's default (beam 3 here, alpha 0.6), not a
    greedy search with no length penalty (Number("") read as 0)."""
    ckpt = tiny_checkpoint(tmp_path_factory.getbasetemp())
    app = create_app(Translator.from_checkpoint(ckpt), Limits(beam=3), ("de", "en"))
    with opened(app, tmp_path / "profile") as (url, driver, wait):
        wait.until(lambda d: d.find_element(By.ID, "beam").get_attribute("value") == "3")
        driver.execute_script("window.sent = []; const real = window.fetch; window.fetch = (u, o) => "
                              "{ if (u === '/v1/translate') sent.push(JSON.parse(o.body)); return real(u, o); };")
        driver.find_element(By.ID, "beam").clear()
        driver.find_element(By.ID, "alpha").clear()
        driver.find_element(By.ID, "source").send_keys("Hund und Kind spielt im Park")
        driver.find_element(By.ID, "go").click()
        wait.until(lambda d: d.find_element(By.ID, "translation").text.strip() != "")
        sent = driver.execute_script("return window.sent")[0]
        assert sent.get("beam", 3) == 3 and sent.get("alpha", 0.6) == 0.6 and sent["nbest"] == 3
        assert len(driver.find_elements(By.CSS_SELECTOR, "#nbest li")) == 3


def test_page_clears_a_translation_once_a_later_request_fails(tmp_path_factory, tmp_path, one_thread):
    """A translation, then a refused request (a 429): the old translation, n-best and map are gone,
    not left beside the new error as if they answered the text now in the box."""
    ckpt = tiny_checkpoint(tmp_path_factory.getbasetemp())
    app = create_app(Translator.from_checkpoint(ckpt), Limits(max_lines=2, max_client_lines=2), ("de", "en"))
    with opened(app, tmp_path / "profile") as (url, driver, wait):
        wait.until(lambda d: d.find_element(By.ID, "pair").text == "de → en")
        box = driver.find_element(By.ID, "source")
        box.send_keys("Hund und Kind spielt im Park")
        driver.find_element(By.ID, "go").click()
        wait.until(lambda d: d.find_element(By.ID, "translation").text.strip() != "")
        assert driver.find_element(By.ID, "inside").is_displayed()
        app.state.server.clients.held["ip:127.0.0.1"] = 2  # the next request is refused with a 429
        box.clear()
        box.send_keys("rot blau")
        driver.find_element(By.ID, "go").click()
        assert _error_shown(driver, wait, "429").startswith("429: ")
        assert driver.find_element(By.ID, "translation").text == ""
        assert not driver.find_element(By.ID, "inside").is_displayed()


def test_page_shows_right_to_left_text_right_to_left(tmp_path_factory, tmp_path, one_thread):
    """Hebrew or Arabic in the box, in a translation or in the n-best list is laid out right to left
    (dir="auto": the direction of each text's first strong character); English stays left to right."""
    ckpt = tiny_checkpoint(tmp_path_factory.getbasetemp())
    app = create_app(Translator.from_checkpoint(ckpt), Limits(), ("de", "en"))
    with opened(app, tmp_path / "profile") as (url, driver, wait):
        wait.until(lambda d: d.find_element(By.ID, "pair").text == "de → en")
        rtl = "שלום עולם."
        hyp = {"text": rtl, "score": -1.0, "tokens": ["▁שלום", "▁עולם", "."]}
        answer = {"translations": [{"source_tokens": ["▁x", "</s>"], "hypotheses": [hyp]}], "beam": 4, "alpha": 0.6}
        driver.execute_script(  # a he model's answer, as a server of one would give it
            "const real = window.fetch; window.fetch = (u, o) => u === '/v1/translate' ? "
            "Promise.resolve(new Response(arguments[0], {status: 200})) : real(u, o);", json.dumps(answer))
        direction = "return getComputedStyle(arguments[0]).direction"
        box = driver.find_element(By.ID, "source")
        box.send_keys("مرحبا بالعالم")
        assert driver.execute_script(direction, box) == "rtl"
        driver.find_element(By.ID, "go").click()
        wait.until(lambda d: d.find_element(By.ID, "translation").text == rtl)
        assert driver.execute_script(direction, driver.find_element(By.ID, "translation")) == "rtl"
        assert driver.execute_script(direction, driver.find_element(By.CSS_SELECTOR, "#nbest li")) == "rtl"
        box.clear()
        box.send_keys("ein Hund")
        assert driver.execute_script(direction, box) == "ltr"
