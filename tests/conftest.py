import signal
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/reference.py

# Tests send Ctrl-C and SIGHUP to the commands they start, as a terminal would. A test run started in
# the background (a script's `&`, `nohup`) has them ignored, and its children would inherit that (and
# keep it: aiayn leaves a signal ignored at start ignored, as a background job wants). A handler set
# here is reset to the default in a child (exec), while this run still ignores them (nohup holds).
for _sig in (signal.SIGINT, signal.SIGHUP):
    if signal.getsignal(_sig) == signal.SIG_IGN:
        signal.signal(_sig, lambda signum, frame: None)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _user_cache_in_tmp(tmp_path_factory):
    """The user cache (tokenizers, downloads) goes to a temporary folder, never ~/.cache, for the whole
    session: session- and module-scoped fixtures and child processes included."""
    import os

    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(autouse=True)
def _onednn_caches_as_the_user_left_them():
    """`train()` caps oneDNN's kernel caches through os.environ for its process; a test must not pass
    that on to the next one (nor to the servers it starts, whose own capping is under test)."""
    import os

    from aiayn.memory import ONEDNN_CACHES

    old = {k: os.environ.get(k) for k in ONEDNN_CACHES}
    for k in ONEDNN_CACHES:
        os.environ.pop(k, None)
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
