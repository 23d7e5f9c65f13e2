"""Serving speed: `aiayn serve` under 1, 4, 16 and 64 concurrent clients, one sentence per request
over loopback, against (a) the same server with batching off (one request at a time, as
OpenNMT-py's server and LibreTranslate work) and (b) `aiayn translate` on the whole file, in one run.

    python bench/serve.py --checkpoint runs/multi30k-de-en/averaged-10 --threads 1 [--clients 1,4,16,64] [--rss 20000]

Sentences: Multi30k test_2016_flickr (source side, 1000 lines); each client sends the next unsent
sentence as soon as its previous one is answered (`POST /v1/translate`, the server's beam). For each
level: sentences/s over the whole level and latency percentiles p50/p95/p99 per request. "Batching
off" is the same server with `--max-batch-tokens 1 --max-wait-ms 0`: every batch holds one line.
(b) is `aiayn translate`'s own path timed in process (`Translator.search` over 500-line chunks, as
the CLI reads them; model loading excluded), before the levels and after each pass. The levels run
`--repeat` times (3) and every figure, the ceiling's included, is the best of its passes: on a
shared machine one pass can be slowed by other work, and the best pass is the least disturbed.
The CLI's own translations are compared with every server answer (the count of identical lines is
printed). The 1-client target compares the server's median latency with a direct
`Translator.translate([line])` call on the same sentences.

Fairness (--fairness N, after the levels, on the batching server): `--fair-clients` clients send N
one-line requests in all, first alone ("idle"), then while one more client sends 1,024-line requests
back to back; one batch time is the server's mean batch (its /metrics) over a 1,024-line request
alone. The target: the one-line p99 beside the long requests within 2x the idle p99 plus one batch
time (the ratio printed is p99 / (2 x idle p99 + batch), at most 1).

With --rss N the batching server then takes N more requests from 64 clients, and its resident set
size (VmRSS) is printed after 1,000 and after N requests. Clients and server share the machine's
cores: the numbers include the clients' cost, as a loopback benchmark does.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from aiayn.data.text import multi30k_paths, read_lines
from aiayn.translator import Translator

SRC = str(Path(__file__).resolve().parents[1] / "src")


def percentile(xs: list[float], q: float) -> float:
    """The nearest-rank percentile: the smallest value with at least q% of `xs` at or below it."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


class Server:
    def __init__(self, checkpoint: str, *flags: str) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "aiayn", "serve", "--checkpoint", checkpoint, "--port", "0",
                                      *flags], stderr=subprocess.PIPE, text=True, env=env)
        m = re.search(r"http://[^/]+:(\d+)/", self.proc.stderr.readline())
        if not m:
            raise SystemExit("the server did not start")
        self.url = f"http://127.0.0.1:{m.group(1)}"
        while True:
            try:
                if httpx.get(f"{self.url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def rss_mib(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)


def load(url: str, lines: list[str], clients: int) -> tuple[float, list[float], list[str]]:
    """Sends every line once from `clients` concurrent clients, each a thread with its own keep-alive
    connection (the standard library's http.client: it costs the shared CPUs far less per request
    than an asyncio client); returns (seconds, latencies, outputs)."""
    out: list[str] = [""] * len(lines)
    latency: list[float] = []
    todo = iter(range(len(lines)))
    lock = threading.Lock()
    host, port = url.removeprefix("http://").split(":")

    def client() -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=600)
        conn.connect()
        # http.client writes a request's headers and body separately: without TCP_NODELAY, Nagle's
        # algorithm holds the body back until the server's delayed ACK (40 ms) on a kept-alive
        # connection. urllib3/requests and browsers set it; so does this client.
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                body = json.dumps({"text": [lines[i]], "split_sentences": False})  # a line, as translate reads it
                start = time.perf_counter()
                conn.request("POST", "/v1/translate", body, {"Content-Type": "application/json"})
                r = conn.getresponse()
                data = r.read()
                latency.append(time.perf_counter() - start)
                if r.status != 200:
                    raise SystemExit(f"HTTP {r.status}: {data[:200]!r}")
                out[i] = json.loads(data)["translations"][0]["hypotheses"][0]["text"]
        finally:
            conn.close()

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, latency, out


def level(server: Server, lines: list[str], clients: int, reference: list[str]) -> dict:
    seconds, lat, out = load(server.url, lines, clients)
    row = {"sentences": len(lines), "sent_s": len(lines) / seconds, "p50_ms": 1000 * percentile(lat, 50),
           "p95_ms": 1000 * percentile(lat, 95), "p99_ms": 1000 * percentile(lat, 99),
           "same": sum(a == b for a, b in zip(out, reference))}
    print(f"  {clients:3d} clients: {row['sent_s']:7.1f} sentences/s, p50 {row['p50_ms']:6.0f} ms, p95 "
          f"{row['p95_ms']:6.0f} ms, p99 {row['p99_ms']:6.0f} ms; {row['same']}/{len(lines)} equal to aiayn translate",
          flush=True)
    return row


def ceiling(translator: Translator, lines: list[str]) -> float:
    """Sentences/s of `aiayn translate`'s path: Translator.search over 500-line chunks."""
    start = time.perf_counter()
    for k in range(0, len(lines), 500):
        translator.search(lines[k:k + 500])
    return len(lines) / (time.perf_counter() - start)


def one_client(translator: Translator, server: Server, lines: list[str]) -> tuple[float, float]:
    """Median latency (ms) of a direct `Translator.translate([line])` call and of the same line sent
    to the server by one client, taken in turns so that both see the same machine load."""
    direct, served = [], []
    for line in lines:
        start = time.perf_counter()
        translator.translate([line])
        direct.append(time.perf_counter() - start)
        served.append(load(server.url, [line], 1)[1][0])
    return 1000 * statistics.median(direct), 1000 * statistics.median(served)


def batch_seconds(url: str) -> tuple[float, float]:
    """The server's (sum, count) of batch seconds so far, from /metrics."""
    text, values = httpx.get(f"{url}/metrics").text, []
    for k in ("sum", "count"):
        m = re.search(rf"^aiayn_batch_seconds_{k} (\S+)$", text, re.M)
        if m is None:
            raise SystemExit(f"the server's /metrics has no aiayn_batch_seconds_{k}")
        values.append(float(m.group(1)))
    return values[0], values[1]


def fairness(server: Server, lines: list[str], clients: int, requests: int) -> dict:
    """One-line p99 latency of `clients` clients alone and beside a client that sends 1,024-line
    requests back to back, and the server's mean batch time over one 1,024-line request alone."""
    long = json.dumps({"text": (lines * (1024 // len(lines) + 1))[:1024], "split_sentences": False})
    short = lines[:requests]
    before = batch_seconds(server.url)
    r = httpx.post(f"{server.url}/v1/translate", content=long, headers={"Content-Type": "application/json"}, timeout=600)
    if r.status_code != 200:
        raise SystemExit(f"the 1,024-line request: HTTP {r.status_code}: {r.text[:200]}")
    after = batch_seconds(server.url)
    batch = (after[0] - before[0]) / max(1.0, after[1] - before[1])
    idle = load(server.url, short, clients)[1]
    stop, sent = threading.Event(), [0]
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)

    def long_client() -> None:  # until stopped; its last request is dropped when the socket closes
        try:
            while not stop.is_set():
                conn.request("POST", "/v1/translate", long, {"Content-Type": "application/json"})
                r = conn.getresponse()
                r.read()
                sent[0] += r.status == 200
        except OSError:
            pass

    thread = threading.Thread(target=long_client)
    thread.start()
    while batch_seconds(server.url)[1] == after[1]:  # its first batch runs
        time.sleep(0.01)
    beside = load(server.url, short, clients)[1]
    stop.set()
    if conn.sock is not None:
        conn.sock.shutdown(socket.SHUT_RDWR)
    thread.join()
    row = {"clients": clients, "requests": len(short), "idle_p99_ms": 1000 * percentile(idle, 99),
           "beside_p99_ms": 1000 * percentile(beside, 99), "beside_p50_ms": 1000 * percentile(beside, 50),
           "batch_ms": 1000 * batch, "long_requests": sent[0]}
    row["ratio"] = row["beside_p99_ms"] / (2 * row["idle_p99_ms"] + row["batch_ms"])
    print(f"fairness: one-line p99 {row['idle_p99_ms']:.0f} ms alone, {row['beside_p99_ms']:.0f} ms beside "
          f"1,024-line requests ({sent[0]} answered meanwhile); one batch {row['batch_ms']:.0f} ms", flush=True)
    return row


def memory(checkpoint: str, lines: list[str], total: int, flags: list[str]) -> dict[int, float]:
    """RSS (MiB) of a fresh batching server after 1,000 requests and then every quarter of `total`."""
    server = Server(checkpoint, *flags)
    rss, done = {}, 0
    try:
        for mark in sorted({1000, *(total * k // 4 for k in range(1, 5))}):
            n = mark - done
            load(server.url, (lines * (n // len(lines) + 1))[:n], 64)
            done = mark
            rss[mark] = server.rss_mib()
            print(f"  RSS after {mark:6d} requests: {rss[mark]:.1f} MiB", flush=True)
    finally:
        server.stop()
    return rss


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    """Bad counts as one-line usage errors before minutes of set-up (they failed with a traceback
    at the first level, or at the end, losing every figure); the client levels."""
    if not all(c.isdigit() and int(c) > 0 for c in args.clients.split(",")):
        p.error(f"--clients takes comma-separated whole numbers above 0, got {args.clients!r}")
    for flag in ("few", "direct", "repeat", "fair_clients"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} takes a number above 0, got {getattr(args, flag)}")
    for flag in ("rss", "threads", "fairness"):
        if getattr(args, flag) < 0:
            p.error(f"--{flag} takes 0 or more, got {getattr(args, flag)}")
    return [int(c) for c in args.clients.split(",")]


def cli_translations(checkpoint: str, lines: list[str]) -> list[str]:
    """`aiayn translate`'s output for `lines`: what every answer must equal. Its one-line error
    (a path that is no checkpoint, say) ends the run as it is."""
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "src.txt"
        plain.write_text("\n".join(lines) + "\n", encoding="utf-8")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p))
        cli = subprocess.run([sys.executable, "-m", "aiayn", "translate", "--checkpoint", checkpoint,
                              "--input", str(plain)], capture_output=True, text=True, env=env)
    if cli.returncode != 0:
        raise SystemExit((cli.stderr.strip().splitlines() or [f"aiayn translate failed ({cli.returncode})"])[-1])
    return cli.stdout.splitlines()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--src", default="de")
    p.add_argument("--tgt", default="en")
    p.add_argument("--clients", default="1,4,16,64")
    p.add_argument("--few", type=int, default=300, help="sentences for the levels below 16 clients (the rest: all)")
    p.add_argument("--direct", type=int, default=100, help="sentences for the 1-client latency comparison")
    p.add_argument("--rss", type=int, default=0, help="requests of the memory run (0: none)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads for the server, the CLI and the direct calls (0: torch's default); "
                        "1 keeps a shared, busy machine from stalling multi-threaded operations")
    p.add_argument("--repeat", type=int, default=3,
                   help="passes over the levels; each figure is the best pass (the ceiling's too: the machine is shared)")
    p.add_argument("--fairness", type=int, default=200,
                   help="one-line requests of the fairness row, alone and beside 1,024-line requests (0: none)")
    p.add_argument("--fair-clients", type=int, default=4, help="clients that send the fairness row's one-line requests")
    p.add_argument("--serve-flags", default="", help="more flags for the batching server, e.g. '--max-wait-ms 20'")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)
    levels = check(p, args)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the servers and the CLI
        import torch

        torch.set_num_threads(args.threads)
    lines = read_lines(multi30k_paths("test_2016_flickr", args.src, args.tgt)[0])
    results: dict = {"checkpoint": args.checkpoint, "serve_flags": args.serve_flags, "sentences": len(lines),
                     "cpus": os.cpu_count(), "threads": args.threads, "load_average_start": os.getloadavg()[0]}
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start", flush=True)

    reference = cli_translations(args.checkpoint, lines)

    translator = Translator.from_checkpoint(args.checkpoint)
    translator.translate(lines[:16])  # warm-up
    serve_flags = shlex.split(args.serve_flags)  # the batching server's, in the levels and the memory run
    servers = {"batching": Server(args.checkpoint, *serve_flags),
               "one_at_a_time": Server(args.checkpoint, "--max-batch-tokens", "1", "--max-wait-ms", "0")}
    try:
        ceilings = [ceiling(translator, lines)]
        print(f"(b) aiayn translate on the whole file: {ceilings[0]:.1f} sentences/s", flush=True)
        rows: dict[str, dict[int, dict]] = {name: {} for name in servers}
        for r in range(args.repeat):  # each figure is the best of `repeat` passes, the ceiling's too
            for c in levels:  # the two servers take turns level by level
                for name, server in servers.items():
                    print(f"pass {r + 1}, server, {name.replace('_', ' ')}:", flush=True)
                    few = lines[:len(lines) if c >= 16 else args.few]
                    row = level(server, few, c, reference)
                    worst = min(row["same"], rows[name][c]["worst_same"]) if c in rows[name] else row["same"]
                    if c not in rows[name] or row["sent_s"] > rows[name][c]["sent_s"]:
                        rows[name][c] = row
                    rows[name][c]["worst_same"] = worst  # answers equal to translate's, in the worst pass
            ceilings.append(ceiling(translator, lines))
            print(f"(b) again: {ceilings[-1]:.1f} sentences/s", flush=True)
        # last, when the server and the direct translator have both met many batch shapes (oneDNN
        # builds its kernels per shape, so a fresh process pays once for each new one)
        direct_ms, served_ms = one_client(translator, servers["batching"], lines[:args.direct])
        print(f"1 client, in turns: direct Translator.translate median {direct_ms:.0f} ms, server {served_ms:.0f} ms",
              flush=True)
        if args.fairness:
            results["fairness"] = fairness(servers["batching"], lines, args.fair_clients, args.fairness)
    finally:
        for server in servers.values():
            server.stop()
    best = max(ceilings)  # the fastest run: the stricter comparison
    results.update(rows, ceiling_sent_s=ceilings, direct_p50_ms=direct_ms, served_p50_ms=served_ms)
    if args.rss:
        results["rss_mib"] = memory(args.checkpoint, lines, args.rss, serve_flags)
    results["load_average_end"] = os.getloadavg()[0]
    report(results, levels, best, args.rss)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


def report(results: dict, levels: list[int], best: float, rss_total: int) -> None:
    on, off = results["batching"], results["one_at_a_time"]
    print("\n| clients | batching: sent/s | p50 ms | p95 ms | p99 ms | one at a time: sent/s | p50 ms | p95 ms | p99 ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in levels:
        a, b = on[c], off[c]
        print(f"| {c} | {a['sent_s']:.1f} | {a['p50_ms']:.0f} | {a['p95_ms']:.0f} | {a['p99_ms']:.0f} | "
              f"{b['sent_s']:.1f} | {b['p50_ms']:.0f} | {b['p95_ms']:.0f} | {b['p99_ms']:.0f} |")
    top = max(levels)
    print(f"\n{top} clients: {on[top]['sent_s'] / off[top]['sent_s']:.1f}x batching off (target >= 4x), "
          f"{100 * on[top]['sent_s'] / best:.0f}% of aiayn translate's {best:.1f} sentences/s (target >= 70%)")
    same = [(row["worst_same"], row["sentences"]) for server in (on, off) for row in server.values()]
    print(f"answers equal to aiayn translate's: {sum(a for a, _ in same)} of {sum(b for _, b in same)} per pass, "
          "in the worst pass of each level")
    d, s = results["direct_p50_ms"], results["served_p50_ms"]
    print(f"1 client: median {s:.0f} ms = {s / d:.2f}x a direct Translator.translate call ({d:.0f} ms; target <= 1.2x)")
    if "fairness" in results:
        f = results["fairness"]
        print(f"fairness, {f['clients']} one-line clients beside one sending 1,024-line requests: p99 "
              f"{f['beside_p99_ms']:.0f} ms = {f['ratio']:.2f} x (2 x idle p99 {f['idle_p99_ms']:.0f} ms + one batch "
              f"{f['batch_ms']:.0f} ms) (target <= 1)")
    if "rss_mib" in results:
        r = results["rss_mib"]
        print(f"RSS: {r[1000]:.1f} MiB after 1,000 requests, {r[rss_total]:.1f} MiB after {rss_total:,} "
              f"({100 * (r[rss_total] / r[1000] - 1):+.1f}%; target within 10%)")
    print(f"load average {results['load_average_start']:.1f} at the start, {results['load_average_end']:.1f} at the end")


if __name__ == "__main__":
    main()
