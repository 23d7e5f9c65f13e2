"""`aiayn serve`: the command line of the translation server (the app itself is `aiayn.serve.app`).

Flags are checked and the checkpoint is loaded before anything listens, so a bad flag or checkpoint
is a one-line error. The socket is bound here (port 0 picks a free one, printed on stderr); uvicorn
then serves the app until SIGINT or SIGTERM, drains the requests in flight and the command exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import signal
import socket
import sys
from collections.abc import Iterator
from typing import Any

from aiayn import memory
from aiayn.config import INFERENCE_PRECISIONS
from aiayn.errors import AiaynError
from aiayn.serve.scheduler import Limits

# ----------------------------------------------------------------------------------- the CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Limits()
    p.add_argument("--checkpoint", required=True, action="append",
                   help="checkpoint directory, or a run directory (uses best/); once per language pair to serve "
                        "several (the first is the default of /v1 and of the page)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback by default)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0: any free port (printed)")
    p.add_argument("--beam", type=int, default=d.beam, help="default beam size (1 = greedy)")
    p.add_argument("--precision", choices=INFERENCE_PRECISIONS, default="fp32",
                   help="bf16: a bfloat16 copy of the model; int8: linear layers on int8 weights (CPU only)")
    from aiayn.translate import add_stop_rule_argument  # here: torch is imported only when serve runs

    add_stop_rule_argument(p)
    p.add_argument("--device", default="auto", help="auto (a GPU where there is one), cpu, cuda or cuda:N")
    p.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens, help="source tokens per batch")
    p.add_argument("--max-wait-ms", type=float, default=d.max_wait_ms,
                   help="how long a batch may wait for more lines, after its oldest line arrived or the previous batch "
                        "ended (0: batches only what is waiting)")
    g = p.add_argument_group("limits", "what one request may ask for, and what the server holds at once "
                                       "(docs/serving.md, Limits)")
    g.add_argument("--max-queue", type=int, default=d.max_queue, help="lines of all requests waiting for a batch "
                                                                      "(more: 503 with Retry-After)")
    g.add_argument("--max-lines", type=int, default=d.max_lines, help="lines in one request, as the client sends them (more: 413)")
    g.add_argument("--max-chars", type=int, default=d.max_chars, help="characters per line (more: 413)")
    g.add_argument("--max-beam", type=int, default=d.max_beam, help="the largest beam a request may ask for (more: 422)")
    g.add_argument("--max-nbest", type=int, default=d.max_nbest,
                   help="the most hypotheses per line (n-best, LibreTranslate alternatives + 1) a request may ask for")
    g.add_argument("--max-work", type=int, default=d.max_work,
                   help="work one request may ask for, in token slots: per line beam x (source + longest output "
                        "tokens), plus with attention nbest x layers x output x source (more: 413)")
    g.add_argument("--max-share", type=float, default=d.max_share,
                   help="while other requests wait, the most of a batch's source tokens one request takes (0-1]")
    g.add_argument("--max-client-lines", type=int, default=d.max_client_lines,
                   help="lines one client (its API key, else its IP address) may have in the server at once, "
                        "tokenized, queued or searched; at least --max-lines (more: 429 with Retry-After)")
    g.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="open connections and requests in flight (more: 503)")
    g.add_argument("--max-body-memory", type=int, default=d.max_body_memory_mib, metavar="MIB",
                   help="MiB of request bodies over 64 KiB held at once, from before each is read until it is answered "
                        "(more: 503 with Retry-After, the body unread); at least one body of --max-lines x "
                        "--max-chars x 12 + 64 KiB")
    g.add_argument("--head-timeout", type=float, default=d.head_timeout_s,
                   help="seconds a client has to send a request's line and headers, from the connection's start or "
                        "the first byte of its next request (more: 408, the connection is closed); also the longest "
                        "an answer may stall unread (then its connection is closed)")
    g.add_argument("--body-timeout", type=float, default=d.body_timeout_s,
                   help="seconds a client has to send a request body (more: 408, the connection is closed)")
    g.add_argument("--shutdown-timeout", type=int, default=d.shutdown_timeout_s,
                   help="on SIGINT/SIGTERM, seconds the requests in flight have to finish before they are cancelled")
    p.add_argument("--api-keys", metavar="FILE", default=None,
                   help="a file of API keys, one a line (# comments): every translation request must name one "
                        "(LibreTranslate's api_key field, or in the request head: Authorization: Bearer KEY, "
                        "X-API-Key: KEY or ?api_key=KEY, which a body over 64 KiB should use: such bodies without "
                        "one share half of --max-body-memory). Default: no key asked")
    p.add_argument("--cors-origins", default="", metavar="ORIGINS",
                   help="comma-separated web origins (https://example.org, or *) whose pages may call the API from a "
                        "browser; default: none (CORS off)")


def _limits(args: argparse.Namespace) -> Limits:
    if not 0 <= args.port <= 65535:
        raise AiaynError(f"--port must be between 0 and 65535, got {args.port}")
    for flag in ("max_batch_tokens", "max_queue", "max_lines", "max_chars", "max_beam", "max_nbest", "max_work",
                 "max_connections", "max_body_memory"):
        if getattr(args, flag) < 1:
            raise AiaynError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if not 1 <= args.beam <= args.max_beam:
        raise AiaynError(f"--beam must be between 1 and --max-beam ({args.max_beam}), got {args.beam}")
    if args.max_lines > args.max_queue:
        raise AiaynError(f"--max-lines ({args.max_lines}) must be at most --max-queue ({args.max_queue}): "
                         "a request must fit in the queue")
    if args.max_client_lines < args.max_lines:
        raise AiaynError(f"--max-client-lines ({args.max_client_lines}) must be at least --max-lines "
                         f"({args.max_lines}): a client's request must fit")
    bodies = Limits(max_lines=args.max_lines, max_chars=args.max_chars, max_body_memory_mib=args.max_body_memory)
    if not bodies.holds_largest_body():
        raise AiaynError(f"--max-body-memory ({args.max_body_memory} MiB) must hold the largest body, --max-lines x "
                         f"--max-chars x 12 + 64 KiB ({bodies.max_body / 2**20:.1f} MiB): raise it, or lower those")
    if not 0 <= args.max_wait_ms < 60_000:
        raise AiaynError(f"--max-wait-ms must be between 0 and 60000, got {args.max_wait_ms}")
    if not 0 < args.max_share <= 1:
        raise AiaynError(f"--max-share must be in (0, 1], got {args.max_share}")
    for flag in ("head_timeout", "body_timeout", "shutdown_timeout"):
        if not 0 < getattr(args, flag) <= 3600:
            raise AiaynError(f"--{flag.replace('_', '-')} must be between 0 and 3600 seconds, got {getattr(args, flag)}")
    return Limits(beam=args.beam, max_batch_tokens=args.max_batch_tokens, max_wait_ms=args.max_wait_ms,
                  max_queue=args.max_queue, max_lines=args.max_lines, max_chars=args.max_chars,
                  max_beam=args.max_beam, max_nbest=args.max_nbest, max_work=args.max_work,
                  max_share=args.max_share, max_client_lines=args.max_client_lines,
                  max_connections=args.max_connections, max_body_memory_mib=args.max_body_memory,
                  head_timeout_s=args.head_timeout, body_timeout_s=args.body_timeout,
                  shutdown_timeout_s=args.shutdown_timeout)


def _bracketed(host: str) -> str:
    """An IPv6 address in brackets, as a URL (and host:port) writes it: "::1:8000" names no port."""
    return f"[{host}]" if ":" in host else host


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise AiaynError(f"--host {host}: cannot resolve ({e.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    # the protocol number matters: asyncio sets TCP_NODELAY only on sockets that name IPPROTO_TCP, and
    # without it every response (headers and body are two writes) waited 40 ms for a delayed ACK
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        hint = (f"--host {host} is not an address of this machine: choose another --host"
                if e.errno == errno.EADDRNOTAVAIL else "choose another --port")
        raise AiaynError(f"cannot listen on {_bracketed(host)}:{port} ({e.strerror or e}); {hint}") from None
    sock.listen(2048)
    return sock


@contextlib.contextmanager
def _signals_end_quietly() -> Iterator[None]:
    """uvicorn drains on SIGINT/SIGTERM and then raises the signal again for the handler it found;
    this one ignores it, so that a drained server exits 0."""
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def read_api_keys(path: str | None) -> frozenset[str] | None:
    """The keys of --api-keys FILE: one a line, blank lines and # comments skipped; None without the flag."""
    if path is None:
        return None
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as e:
        raise AiaynError(f"--api-keys {path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise AiaynError(f"--api-keys {path}: not UTF-8 text; write one key a line") from None
    keys = frozenset(k for k in (line.split("#", 1)[0].strip() for line in text.splitlines()) if k)
    if not keys:
        raise AiaynError(f"--api-keys {path}: no key in it; write one key a line")
    return keys


def load_models(checkpoints: list[str], precision: str, stop_rule: str | None = None,
                device: str = "cpu") -> list[Any]:
    """One `aiayn.serve.app.Model` per --checkpoint, and per target language of a multilingual one
    (its >>xx<< tokens: target xx); two for one language pair are an error."""
    from aiayn.serve.app import Model

    models: list[Model] = []
    for path in checkpoints:
        translator, (src, tgt), where = load(path, precision, stop_rule, device)
        codes = sorted(translator.tokenizers.src.language_codes)
        for target, token in [(c[2:-2], c) for c in codes] or [(tgt, "")]:
            same = [m.checkpoint for m in models if m.pair == (src, target)]
            if same:
                raise AiaynError(f"--checkpoint {path} translates {src} to {target}, as --checkpoint {same[0]} does; "
                                 "serve one model per language pair")
            models.append(Model(translator, src, target, where, token))
    return models


def load(checkpoint: str, precision: str, stop_rule: str | None = None,
         device: str = "cpu") -> tuple[Any, tuple[str, str], str]:
    """The server's translator (its own model, frozen once, on `device`), the language pair and the
    checkpoint path."""
    from aiayn.checkpoint import language_pair, load_checkpoint, resolve_checkpoint
    from aiayn.serve.batch import refuse_long
    from aiayn.translator import Translator

    ckpt = load_checkpoint(resolve_checkpoint(checkpoint))
    pair = language_pair(ckpt.config)
    if pair is None:
        how = ("import it again with --src LANG --tgt LANG" if "imported_from" in ckpt.config
               else 'set them in it, e.g. "train": {"src": "de", "tgt": "en", ...}')
        raise AiaynError(f"{ckpt.path}/config.json names no source and target language (train.src, train.tgt), "
                         f"which the server announces; {how}")
    rule = {"stop_rule": stop_rule} if stop_rule else {}
    translator = Translator.from_loaded(ckpt, precision=precision, device=device, note=refuse_long, **rule)
    return translator, pair, str(ckpt.path)


def uvicorn_config(app: Any, limits: Limits) -> Any:
    """uvicorn's settings for `app`. limit_concurrency: past it the protocol answers 503 before the
    app runs; timeout_graceful_shutdown: a request still in flight then (a stalled upload, say) is
    cancelled, so SIGTERM always ends; http: the h11 protocol with a deadline on request heads
    (`aiayn.serve.protocol`), which counts what it answers itself in the app's metrics."""
    import uvicorn

    from aiayn.serve.protocol import with_head_timeout

    return uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                          limit_concurrency=limits.max_connections, timeout_graceful_shutdown=limits.shutdown_timeout_s,
                          http=with_head_timeout(limits.head_timeout_s, app.state.server.metrics))


def run(args: argparse.Namespace) -> int:
    from aiayn.translate import inference_device

    limits = _limits(args)
    device = inference_device(args.device, args.precision)
    # Decoding meets new shapes at nearly every step (rows = live sentences x beams): uncapped,
    # a server grows steadily; capped it stays flat at the same speed (docs/serving.md).
    memory.cap_onednn_caches()
    try:
        import uvicorn

        from aiayn.serve.app import create_app
    except ImportError as e:
        raise AiaynError(f"aiayn serve needs {e.name}: pip install 'aiayn[serve]'") from None
    keys = read_api_keys(args.api_keys)
    origins = [o.strip() for o in args.cors_origins.split(",") if o.strip()]
    models = load_models(args.checkpoint, args.precision, args.stop_rule, str(device))
    app = create_app(models, limits, api_keys=keys, cors_origins=origins)
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    pairs = ", ".join(f"{m.source}->{m.target}" for m in models)
    where = _bracketed(host)
    print(f"aiayn serve: {pairs} on http://{where}:{port}/ (ready once /health says so); "
          "Ctrl-C or SIGTERM stops after the requests in flight", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn_config(app, limits))
    with _signals_end_quietly():
        server.run(sockets=[sock])
    print("aiayn serve: stopped", file=sys.stderr, flush=True)
    return 0
