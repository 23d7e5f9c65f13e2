"""The data path at WMT14 size, measured on this machine (issue 14): a benchmark, not a test.

    python bench/scale.py --work /work/scale [--pairs 4500000] [--skip-old]

1. Makes a synthetic parallel corpus with WMT14 en-de's shape: 4.5M pairs, source lengths drawn from
   a log-normal fitted to WMT14 en-de's English side (median ~21 words, mean ~24, a tail past 100),
   target lengths correlated with them; words drawn by their Multi30k frequencies (en and de).
2. `aiayn prepare` on it: wall time, pairs/s, peak RSS of the main process, and of the whole
   process tree: RSS summed (counts the pages the forked workers share with it once per process)
   and PSS summed (each shared page split among its sharers: the memory the job really takes).
3. `aiayn train --data-bin` (small preset, 50 steps) at 0.5M and 4.5M pairs: time from launch to the
   first step and peak RssAnon (anonymous memory: what the process owns, not the page cache that
   backs the memory maps).
4. The same for the in-memory path of commit cbc804a (before `prepare`) at 0.5M and 1M pairs.

Results go to WORK/scale.json and a Markdown table on stdout. Memory is sampled from /proc every
0.1 s, so a spike shorter than that can be missed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OLD_COMMIT = "cbc804a"  # the last commit before `aiayn prepare`: everything in memory
MULTI30K = Path(os.environ.get("AIAYN_DATA", ROOT.parent / "shared" / "data")) / "multi30k"


# ----------------------------------------------------------------------------------- the corpus


def _vocabulary(lang: str) -> tuple[np.ndarray, np.ndarray]:
    """Multi30k's words of one language and their relative frequencies."""
    with gzip.open(MULTI30K / f"train.{lang}.gz", "rt", encoding="utf-8") as f:
        counts = Counter(w for line in f for w in line.split())
    words, freq = zip(*counts.most_common())
    p = np.asarray(freq, np.float64)
    return np.asarray(words, dtype=object), p / p.sum()


def make_corpus(folder: Path, n: int, seed: int = 0, chunk: int = 100_000) -> tuple[Path, Path]:
    """`folder/train.en`, `folder/train.de` with `n` pairs (kept if already complete)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / "train.en", folder / "train.de"
    done = folder / f"done-{n}"
    if done.exists():
        return paths
    rng = np.random.default_rng(seed)
    vocab = {lang: _vocabulary(lang) for lang in ("en", "de")}
    with open(paths[0], "w", encoding="utf-8") as en, open(paths[1], "w", encoding="utf-8") as de:
        for start in range(0, n, chunk):
            m = min(chunk, n - start)
            src_len = np.clip(np.rint(rng.lognormal(np.log(21.0), 0.62, m)), 1, 250).astype(np.int64)
            tgt_len = np.clip(np.rint(src_len * rng.normal(0.95, 0.12, m)), 1, 250).astype(np.int64)
            for f, lang, lens in ((en, "en", src_len), (de, "de", tgt_len)):
                words, p = vocab[lang]
                flat = words[rng.choice(len(words), size=int(lens.sum()), p=p)]
                ends = np.cumsum(lens)
                f.write("".join(" ".join(flat[e - k : e]) + "\n" for e, k in zip(ends.tolist(), lens.tolist())))
    done.touch()
    return paths


def head(src: tuple[Path, Path], folder: Path, n: int) -> tuple[Path, Path]:
    """The first `n` pairs of a corpus, as files of their own."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "train.en", folder / "train.de"
    if not (folder / f"done-{n}").exists():
        for a, b in zip(src, out):
            with open(a, encoding="utf-8") as fi, open(b, "w", encoding="utf-8") as fo:
                for i, line in enumerate(fi):
                    if i == n:
                        break
                    fo.write(line)
        (folder / f"done-{n}").touch()
    return out


# ------------------------------------------------------------------------------ measuring


def _status(pid: int, key: str, file: str = "status") -> int:
    """A /proc/PID/status (or smaps_rollup) field in bytes (0 once the process is gone)."""
    try:
        with open(f"/proc/{pid}/{file}") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _tree(pid: int) -> list[int]:
    """pid and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def run_measured(cmd: list[str], env: dict[str, str], log: Path, first_step: Path | None = None,
                 timeout: float = 3 * 3600) -> dict[str, float]:
    """Run `cmd`; sample its memory every 0.1 s. With `first_step` (a metrics.jsonl), also the time
    from launch to the first logged training step."""
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    peak = {"rss_main": 0, "rss_tree": 0, "pss_tree": 0, "rss_anon": 0}
    first = None
    loads = []
    while proc.poll() is None:
        peak["rss_main"] = max(peak["rss_main"], _status(proc.pid, "VmRSS"))
        peak["rss_anon"] = max(peak["rss_anon"], _status(proc.pid, "RssAnon"))
        tree = _tree(proc.pid)
        peak["rss_tree"] = max(peak["rss_tree"], sum(_status(p, "VmRSS") for p in tree))
        # PSS shares each page among the processes mapping it: the honest sum for forked workers
        peak["pss_tree"] = max(peak["pss_tree"], sum(_status(p, "Pss", "smaps_rollup") for p in tree))
        if first_step is not None and first is None and first_step.exists() and '"kind": "train"' in first_step.read_text():
            first = time.time() - t0
        loads.append(os.getloadavg()[0])
        if time.time() - t0 > timeout:
            proc.kill()
        time.sleep(0.1)
    res = {"rc": proc.returncode, "wall_s": round(time.time() - t0, 1), "load_avg": round(float(np.mean(loads)), 2),
           **{k: round(v / 2**20) for k, v in peak.items()}}
    if first_step is not None:
        res["first_step_s"] = round(first, 1) if first is not None else None
    return res


def old_source(work: Path) -> Path:
    """The source tree of OLD_COMMIT (the in-memory data path), extracted once."""
    dest = work / f"src-{OLD_COMMIT}"
    if not (dest / "src").is_dir():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", OLD_COMMIT, "src"], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest / "src"


def table_row(name: str, r: dict) -> str:
    """One measurement's row of the table; a run that failed says so (its time and memory are those of
    the failure, not of the work)."""
    what, pairs = name.rsplit(" ", 1)
    if r["rc"] != 0:
        return f"| {what} | {pairs} | failed (exit {r['rc']}; see its log in --work) | | | | |"
    return (f"| {what} | {pairs} | {r['wall_s']} | {r.get('first_step_s', '')} "
            f"| {r['rss_main']} / {r['rss_tree']} / {r['pss_tree']} | {r['rss_anon']} | {r['load_avg']} |")


def check(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Sizes the run can measure, as one-line usage errors: the smaller corpora are the first lines of
    the --pairs one, so a larger size was measured on --pairs pairs and labelled with its own."""
    if min(args.pairs, args.small, args.steps, *args.old) < 1:
        ap.error("--pairs, --small, --old and --steps take numbers above 0")
    if max([args.small, *args.old]) > args.pairs:
        ap.error(f"--small and --old take at most --pairs ({args.pairs}) pairs, got {args.small} and {args.old}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/work/scale"))
    ap.add_argument("--pairs", type=int, default=4_500_000)
    ap.add_argument("--small", type=int, default=500_000, help="the smaller corpus for train")
    ap.add_argument("--old", type=int, nargs="*", default=[500_000, 1_000_000], help="sizes for the in-memory path")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--src", type=Path, default=ROOT / "src", help="the aiayn source tree to measure (a snapshot)")
    ap.add_argument("--precision", default="auto",
                    help="of train (auto: what a user gets, bf16 autocast on a CPU with oneDNN bf16 kernels)")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the prepare results of an earlier run in WORK/scale.json and its prepared data")
    args = ap.parse_args()
    check(ap, args)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    env = {**os.environ, "PYTHONPATH": str(args.src), "XDG_CACHE_HOME": str(work / "cache"), "PYTHONUNBUFFERED": "1"}
    out_json = work / "scale.json"
    results: dict[str, dict] = json.loads(out_json.read_text()) if args.reuse and out_json.exists() else {}
    results = {k: v for k, v in results.items() if k.startswith(("make corpus", "prepare"))}

    def record(name: str, res: dict) -> None:
        results[name] = res
        print(name, res, flush=True)
        out_json.write_text(json.dumps(results, indent=2))

    t = time.time()
    full = make_corpus(work / f"corpus-{args.pairs}", args.pairs)
    if "make corpus" not in results:
        record("make corpus", {"pairs": args.pairs, "wall_s": round(time.time() - t, 1)})
    sizes = sorted({args.small, *args.old} - {args.pairs})
    corpora = {args.pairs: full, **{n: head(full, work / f"corpus-{n}", n) for n in sizes}}

    prepared = {}
    for n in sorted({args.small, args.pairs}):
        out = work / f"bin-{n}"
        if args.reuse and f"prepare {n}" in results and (out / "manifest.json").is_file():
            prepared[n] = out
            continue
        cmd = [py, "-m", "aiayn", "prepare", "--train-src", str(corpora[n][0]), "--train-tgt", str(corpora[n][1]),
               "--out", str(out), "--vocab-size", "8000", "--workers", str(args.workers)]
        res = run_measured(cmd, env, work / f"prepare-{n}.log")
        res["pairs_per_s"] = round(n / res["wall_s"])
        record(f"prepare {n}", res)
        prepared[n] = out

    train_common = ["--preset", args.preset, "--max-steps", str(args.steps), "--log-every", "1", "--save-every", "0",
                    "--valid-bleu", "0", "--max-tokens", "4096", "--precision", args.precision]
    for n, data in prepared.items():
        run = work / f"run-bin-{n}"
        subprocess.run(["rm", "-rf", str(run)], check=True)
        cmd = [py, "-m", "aiayn", "train", "--data-bin", str(data), "--out", str(run), *train_common]
        record(f"train --data-bin {n}", run_measured(cmd, env, work / f"train-bin-{n}.log", run / "metrics.jsonl"))

    old_env = {**env, "PYTHONPATH": str(old_source(work))}
    for n in args.old:
        run = work / f"run-old-{n}"
        subprocess.run(["rm", "-rf", str(run)], check=True)
        cmd = [py, "-m", "aiayn", "train", "--train-src", str(corpora[n][0]), "--train-tgt", str(corpora[n][1]),
               "--out", str(run), "--vocab-size", "8000", *train_common]
        record(f"train in-memory {n}", run_measured(cmd, old_env, work / f"train-old-{n}.log", run / "metrics.jsonl"))

    print("\n| measurement | pairs | wall s | first step s | peak RSS MiB: main / tree RSS / tree PSS | peak RssAnon MiB "
          "| load |")
    print("|---|---|---|---|---|---|---|")
    runs = {name: r for name, r in results.items() if "rc" in r}
    for name, r in runs.items():
        print(table_row(name, r))
    return 1 if any(r["rc"] != 0 for r in runs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
