"""`aiayn serve --api-keys` behind a gateway that adds an `Authorization: Bearer` of its own: the
client's key in the same head (`X-API-Key`, `?api_key=`, as the page and large uploads send it)
still names the client."""

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from aiayn.serve.app import create_app  # noqa: E402
from aiayn.serve.clients import BodyMemory, head_key  # noqa: E402
from aiayn.serve.scheduler import Limits  # noqa: E402
from test_serve import ready  # noqa: E402
from test_serve_edges import de_en  # noqa: E402,F401 (de_en: a fixture)
from test_serve_libre import _one_thread  # noqa: E402,F401 (autouse: one thread)


def test_a_gateways_bearer_does_not_hide_the_clients_key_in_the_head(de_en):
    """head_key took the Bearer first: behind a gateway that adds its own token, a client naming its
    key by X-API-Key or ?api_key= (the page does, and the docs ask it of large bodies) got 403."""
    limits = Limits(max_wait_ms=5, max_lines=10, max_chars=1000, max_body_memory_mib=1)
    with TestClient(create_app(de_en, limits, ("de", "en"), api_keys=frozenset({"k1"}))) as c:
        ready(c)
        gateway = {"Authorization": "Bearer gateway-token"}
        r = c.post("/v1/translate", json={"text": ["ein Mann"]}, headers={**gateway, "X-API-Key": "k1"})
        assert r.status_code == 200, r.text
        r = c.post("/v1/translate", json={"text": ["ein Mann"]}, headers=gateway, params={"api_key": "k1"})
        assert r.status_code == 200, r.text
        r = c.post("/v1/translate", json={"text": ["ein Mann"]}, headers={**gateway, "X-API-Key": "nope"})
        assert (r.status_code, r.json()) == (403, {"error": "Invalid API key"})


def test_a_large_body_with_the_clients_key_beside_a_gateways_bearer_is_no_strangers():
    """The same for the memory of large bodies: such a body was held as a stranger's (or refused)."""
    memory = BodyMemory(1 << 20, 200_000, frozenset({"k1"}))
    scope = {"headers": [(b"authorization", b"Bearer gateway-token"), (b"x-api-key", b"k1")], "query_string": b""}
    assert not memory.hold(scope, 150_000).stranger
    assert head_key(scope, memory.keys) == "k1" and head_key(scope) == "gateway-token"
    assert head_key({**scope, "headers": scope["headers"][:1], "query_string": b"api_key=k1"}, memory.keys) == "k1"
