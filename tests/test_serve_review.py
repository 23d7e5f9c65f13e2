"""`aiayn serve` as real clients use it, from a cold review: what a client sends within the documented
limits is served, and a request sent wrongly is told what to fix."""

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from aiayn.serve.app import Model, create_app  # noqa: E402
from aiayn.serve.scheduler import Limits  # noqa: E402
from aiayn.translator import Translator  # noqa: E402
from serve_model import tiny_checkpoint  # noqa: E402
from test_serve import ready  # noqa: E402
from test_serve_libre import _one_thread  # noqa: E402, F401 (autouse: one thread for the module)

MAX_CHARS = 40


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """de->en, and the same model as a multilingual one's target fr (its lines led by >>fr<<)."""
    ckpt = tiny_checkpoint(tmp_path_factory.getbasetemp())
    translator = Translator.from_checkpoint(ckpt)
    models = [Model(translator, "de", "en", str(ckpt)), Model(translator, "de", "fr", str(ckpt), ">>fr<<")]
    with TestClient(create_app(models, Limits(max_wait_ms=1, max_chars=MAX_CHARS))) as c:
        yield ready(c)


LINE = ("ein Mann " * 10)[:MAX_CHARS]  # exactly --max-chars, one sentence


@pytest.mark.parametrize("path,body", [
    ("/translate", {"q": LINE, "source": "de", "target": "fr"}),
    ("/v1/translate", {"text": [LINE], "source": "de", "target": "fr"}),
    ("/v1/translate", {"text": [LINE], "source": "de", "target": "fr", "split_sentences": False}),
])
def test_a_line_of_max_chars_is_served_to_a_multilingual_target(client, path, body):
    """--max-chars bounds the client's line: the >>fr<< the server puts before it is not the client's
    (a line of /frontend/settings' charLimit was refused, "47 characters, more than --max-chars 40")."""
    assert len(LINE) == MAX_CHARS
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    over = client.post(path, json={**body, **({"q": LINE + "x"} if "q" in body else {"text": [LINE + "x"]})})
    assert over.status_code in (400, 413) and f"{MAX_CHARS + 1}" in over.json()["error"]


@pytest.mark.parametrize("headers", [{"Content-Type": "application/x-www-form-urlencoded"},  # curl -d's
                                     {"Content-Type": "text/plain"}, {}])
def test_a_v1_body_not_sent_as_json_is_told_to_say_so(client, headers):
    """`curl -d '{"text": [...]}'` sends a form's Content-Type: FastAPI does not read the body as JSON and
    the answer said "Input should be a valid dictionary or object", of a body that is one."""
    r = client.post("/v1/translate", content=b'{"text": ["ein Mann"]}', headers=headers)
    assert r.status_code == 422
    assert r.json() == {"error": "body: not sent as JSON; send a JSON object with the header Content-Type: "
                                 "application/json", "field": "body"}
    ok = client.post("/v1/translate", content=b'{"text": ["ein Mann"]}', headers={"Content-Type": "application/json"})
    assert ok.status_code == 200
    array = client.post("/v1/translate", content=b'["ein Mann"]', headers={"Content-Type": "application/json"})
    assert array.status_code == 422 and "valid dictionary" in array.json()["error"]  # JSON, but no object
