"""Serving speed: `aiayn serve` under 1, 4, 16 and 64 concurrent clients, one sentence per request
over loopback, against (a) the same server with batching off (one request at a time, as
OpenNMT-py's server and LibreTranslate work) and (b) `aiayn translate` on the whole file, in one run.

    python bench/serve.py --checkpoint /work/runs/m30k-de-en [--clients 1,4,16,64] [--rss 20000]

Sentences: Multi30k test_2016_flickr (source side, 1000 lines); each client sends the next unsent
sentence as soon as its previous one is answered (`POST /v1/translate`, the server's beam). For each
level: sentences/s over the whole level and latency percentiles p50/p95/p99 per request. "Batching
off" is the same server with `--max-batch-tokens 1 --max-wait-ms 0`: every batch holds one line.
(b) is `aiayn translate`'s own path timed in process (`Translator.search` over 500-line chunks, as
the CLI reads them; model loading excluded); its translations, from the CLI itself, are compared
with every server answer (the count of identical lines is printed). The 1-client target compares the
server's median latency with a direct `Translator.translate([line])` call on the same sentences.

With --rss N the batching server then takes N more requests from 64 clients, and its resident set
size (VmRSS) is printed after 1,000 and after N requests. Clients and server share the machine's
cores: the numbers include the clients' cost, as a loopback benchmark does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from aiayn.data import multi30k_paths, read_lines
from aiayn.translate import Translator

SRC = str(Path(__file__).resolve().parents[1] / "src")


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs)) - 1))]


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


async def load(url: str, lines: list[str], clients: int) -> tuple[float, list[float], list[str]]:
    """Sends every line once from `clients` concurrent clients; returns (seconds, latencies, outputs)."""
    out: list[str] = [""] * len(lines)
    latency: list[float] = []
    todo = iter(range(len(lines)))
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as http:
        async def client() -> None:
            for i in todo:
                start = time.perf_counter()
                r = await http.post("/v1/translate", json={"text": [lines[i]]})
                latency.append(time.perf_counter() - start)
                r.raise_for_status()
                out[i] = r.json()["translations"][0]["hypotheses"][0]["text"]

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        return time.perf_counter() - start, latency, out


def run_levels(server: Server, lines: list[str], levels: list[int], counts: dict[int, int],
               reference: list[str]) -> dict[int, dict]:
    rows = {}
    for c in levels:
        n = counts[c]
        seconds, lat, out = asyncio.run(load(server.url, lines[:n], c))
        same = sum(a == b for a, b in zip(out, reference))
        rows[c] = {"sentences": n, "sent_s": n / seconds, "p50_ms": 1000 * percentile(lat, 50),
                   "p95_ms": 1000 * percentile(lat, 95), "p99_ms": 1000 * percentile(lat, 99), "same": same}
        print(f"  {c:3d} clients: {rows[c]['sent_s']:7.1f} sentences/s, p50 {rows[c]['p50_ms']:6.0f} ms, "
              f"p95 {rows[c]['p95_ms']:6.0f} ms, p99 {rows[c]['p99_ms']:6.0f} ms; {same}/{n} equal to aiayn translate",
              flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--src", default="de")
    p.add_argument("--tgt", default="en")
    p.add_argument("--clients", default="1,4,16,64")
    p.add_argument("--few", type=int, default=300, help="sentences for the levels below 16 clients (the rest: all)")
    p.add_argument("--direct", type=int, default=100, help="sentences for the direct-call latency")
    p.add_argument("--rss", type=int, default=0, help="requests of the memory run (0: none)")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    path = multi30k_paths("test_2016_flickr", args.src, args.tgt)[0]
    lines = read_lines(path)
    counts = {c: (len(lines) if c >= 16 else min(args.few, len(lines))) for c in levels}
    results: dict = {"checkpoint": args.checkpoint, "sentences": len(lines), "cpus": os.cpu_count()}

    with tempfile.TemporaryDirectory() as tmp:  # the CLI's translations: what every answer must equal
        plain = Path(tmp) / "src.txt"
        plain.write_text("\n".join(lines) + "\n", encoding="utf-8")
        cli = subprocess.run([sys.executable, "-m", "aiayn", "translate", "--checkpoint", args.checkpoint,
                              "--input", str(plain)], capture_output=True, text=True, check=True,
                             env=dict(os.environ, PYTHONPATH=SRC))
    reference = cli.stdout.splitlines()

    translator = Translator.from_checkpoint(args.checkpoint)
    translator.translate(lines[:16])  # warm-up
    start = time.perf_counter()
    for k in range(0, len(lines), 500):
        translator.search(lines[k:k + 500])
    ceiling = len(lines) / (time.perf_counter() - start)
    direct = []
    for line in lines[:args.direct]:
        start = time.perf_counter()
        translator.translate([line])
        direct.append(time.perf_counter() - start)
    direct_ms = 1000 * statistics.median(direct)
    del translator
    results.update(ceiling_sent_s=ceiling, direct_p50_ms=direct_ms)
    print(f"(b) aiayn translate, whole file: {ceiling:.1f} sentences/s; direct Translator.translate([line]): "
          f"median {direct_ms:.0f} ms", flush=True)

    for name, flags in (("batching", ()), ("one_at_a_time", ("--max-batch-tokens", "1", "--max-wait-ms", "0"))):
        print(f"server, {name.replace('_', ' ')}:", flush=True)
        server = Server(args.checkpoint, *flags)
        try:
            results[name] = run_levels(server, lines, levels, counts, reference)
            if name == "batching" and args.rss:
                rss = {}
                done = 0
                for mark in (1000, args.rss):
                    n = mark - done
                    asyncio.run(load(server.url, (lines * (n // len(lines) + 1))[:n], 64))
                    done = mark
                    rss[mark] = server.rss_mib()
                    print(f"  RSS after {mark} more requests: {rss[mark]:.1f} MiB", flush=True)
                results["rss_mib"] = rss
        finally:
            server.stop()

    top, one = max(levels), min(levels)
    on, off = results["batching"], results["one_at_a_time"]
    print(f"\n| clients | batching: sent/s | p50 ms | p95 ms | p99 ms | one at a time: sent/s | p50 ms | p95 ms | p99 ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in levels:
        a, b = on[c], off[c]
        print(f"| {c} | {a['sent_s']:.1f} | {a['p50_ms']:.0f} | {a['p95_ms']:.0f} | {a['p99_ms']:.0f} | "
              f"{b['sent_s']:.1f} | {b['p50_ms']:.0f} | {b['p95_ms']:.0f} | {b['p99_ms']:.0f} |")
    print(f"\n{top} clients: {on[top]['sent_s'] / off[top]['sent_s']:.1f}x batching off (target >= 4x), "
          f"{100 * on[top]['sent_s'] / ceiling:.0f}% of aiayn translate's {ceiling:.1f} sentences/s (target >= 70%)")
    print(f"{one} client: median {on[one]['p50_ms']:.0f} ms = {on[one]['p50_ms'] / direct_ms:.2f}x a direct "
          f"Translator.translate call ({direct_ms:.0f} ms; target <= 1.2x)")
    if "rss_mib" in results:
        r = results["rss_mib"]
        print(f"RSS: {r[1000]:.1f} MiB after 1,000 requests, {r[args.rss]:.1f} MiB after {args.rss:,} "
              f"({100 * (r[args.rss] / r[1000] - 1):+.1f}%; target within 10%)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
