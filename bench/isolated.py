"""aiayn (fp32, int8) against CTranslate2 (fp32, int8) on one checkpoint, each engine in its own
process, under the CPU's native instruction set and restricted to AVX2; `bench/decode.py --isolated`.

Why processes: peak memory (RSS) is per process, and the instruction set is chosen by environment
variables read once when a library loads. The AVX2 restriction names every library involved:
oneDNN (aiayn's fp32 GEMMs, `ONEDNN_MAX_CPU_ISA`), ATen's own kernels (`ATEN_CPU_CAPABILITY`),
FBGEMM (aiayn's int8 GEMMs, `FBGEMM_ENABLE_INSTRUCTIONS`), MKL (`MKL_ENABLE_INSTRUCTIONS`) and
CTranslate2 (`CT2_FORCE_CPU_ISA`); every process gets all of them. The CTranslate2 worker imports
ctranslate2 only (no torch: a CTranslate2 user does not pay torch's ~200 MB), both CTranslate2
rows run the same float32 export (`aiayn export --to ctranslate2`), int8 as its `compute_type`.

Every worker gets the same length-sorted batches of the same source ids and the same length limits
(floor(source length + 50)), runs greedy and beam search once each after an untimed pass of each, on
`--threads` threads, and reports seconds, the ids it produced, and its peak RSS, whole and above
what its imports alone took (torch's ~220 MB against ctranslate2's ~25 MB). The parent runs
the workers `--repeat` times, interleaved (the order turns each round), and keeps each one's
fastest round; the speed ratio of aiayn int8 to CTranslate2 int8 is also given per round.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ISA_ENV = {
    "native": {},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "CT2_FORCE_CPU_ISA": "AVX2",
             "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
ENGINES = ("aiayn fp32", "aiayn int8", "ct2 fp32", "ct2 int8")


def peak_rss_mb() -> float:
    """This process's peak resident memory (MiB): VmHWM, its own address space's high-water mark.
    Not `ru_maxrss`: on Linux that keeps the peak of the image before `exec`, which for a worker
    started by this script is a copy of the parent, torch and the model included. (aiayn.memory
    imports neither torch nor anything large: the CTranslate2 worker stays free of torch.)"""
    from aiayn.memory import status_bytes

    hwm = status_bytes("VmHWM")
    return hwm / 2**20 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _aiayn_worker(job: dict[str, Any], precision: str) -> tuple[dict[str, Any], float]:
    import torch

    from aiayn.checkpoint import load_checkpoint
    from aiayn.kernels import quantize_int8
    from aiayn.memory import keep_freed_memory
    from aiayn.search import beam_search, greedy_search
    from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID

    torch.set_num_threads(job["threads"])
    keep_freed_memory()  # as `aiayn translate` and `aiayn evaluate` run
    base = peak_rss_mb()
    model = load_checkpoint(job["checkpoint"]).model.requires_grad_(False).eval()
    if precision == "int8":  # what `Translator(precision="int8")` runs: the model's linear layers in int8
        quantize_int8(model, output=job["int8_output"])
    enc, a, b = job["encoded"], job["a"], job["b"]

    def padded(idx: list[int]) -> torch.Tensor:
        src = torch.full((len(idx), max(len(enc[i]) for i in idx)), PAD_ID, dtype=torch.long)  # (B, S)
        for r, i in enumerate(idx):
            src[r, : len(enc[i])] = torch.tensor(enc[i])
        return src

    def search(mode: str, idx: list[int]) -> list[list[int]]:
        if mode == "greedy":
            return greedy_search(model, padded(idx), BOS_ID, EOS_ID, a, b)
        return [h[0][0] for h in beam_search(model, padded(idx), BOS_ID, EOS_ID, job["beam"], job["alpha"], a, b)]

    return _timed(job, search), base


def _ct2_worker(job: dict[str, Any], compute: str) -> tuple[dict[str, Any], float]:
    import ctranslate2

    base = peak_rss_mb()
    tr = ctranslate2.Translator(job["export"], device="cpu", compute_type={"fp32": "float32"}.get(compute, compute), intra_threads=job["threads"],
                                inter_threads=1)
    enc, vocab, index = job["encoded"], job["src_vocab"], {p: i for i, p in enumerate(job["tgt_vocab"])}
    limits = [max(1, int(len(e) * job["a"] + job["b"])) for e in enc]

    def search(mode: str, idx: list[int]) -> list[list[int]]:  # as aiayn's CT2Translator.translate_ids
        beam = 1 if mode == "greedy" else job["beam"]
        res = tr.translate_batch([[vocab[t] for t in enc[i]] for i in idx], beam_size=beam, num_hypotheses=1,
                                 length_penalty=job["alpha"] if beam > 1 else 0.0,
                                 max_decoding_length=max(limits[i] for i in idx), max_input_length=0,
                                 suppress_sequences=[[job["pad"]], [job["bos"]]],
                                 max_batch_size=10**9, batch_type="tokens")
        return [[index[p] for p in r.hypotheses[0]][: limits[i]] for i, r in zip(idx, res)]

    return _timed(job, search), base


def _timed(job: dict[str, Any], search: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in job["modes"]:
        for idx in job["groups"]:  # warm-up, one untimed pass: lazy initialisation and the first touch
            search(mode, idx)  # of fresh memory are paid once by a long translation or a server, not per batch
        ids: list[list[int]] = [[] for _ in job["encoded"]]
        t0 = time.perf_counter()
        for idx in job["groups"]:
            for i, row in zip(idx, search(mode, idx)):
                ids[i] = row
        out[mode] = {"seconds": time.perf_counter() - t0, "ids": ids}
    return out


def worker(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    kind, precision = job["engine"].split()
    res, base = _aiayn_worker(job, precision) if kind == "aiayn" else _ct2_worker(job, precision)
    Path(job["result"]).write_text(json.dumps({"modes": res, "rss_mb": peak_rss_mb(), "rss_import_mb": base}))
    return 0


def run_worker(job: dict[str, Any], isa: str, work: Path) -> dict[str, Any]:
    """One engine in a fresh process under `isa`; its results."""
    name = f"{job['engine'].replace(' ', '-')}-{isa}"
    job = {**job, "result": str(work / f"{name}.result.json")}
    path = work / f"{name}.job.json"
    path.write_text(json.dumps(job))
    env = {**os.environ, **ISA_ENV[isa]}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, __file__, "worker", str(path)], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{r.stderr[-3000:]}")
    return json.loads(Path(job["result"]).read_text())


def compare(checkpoint: str, encoded: list[list[int]], groups: list[list[int]], refs: list[str], beam: int,
            alpha: float, threads: int, repeat: int, isas: list[str], int8_output: bool = True) -> dict[str, Any]:
    """The four engines under each of `isas`, `repeat` rounds; prints the table, returns the rows."""
    import tempfile

    from aiayn.checkpoint import load_checkpoint
    from aiayn.evaluate import corpus_scores
    from aiayn.export import export_ctranslate2
    from aiayn.tokenizer import BOS_ID, PAD_ID, PIECES, vocabulary

    ck = load_checkpoint(checkpoint)
    tmp = tempfile.TemporaryDirectory(prefix="aiayn-isolated-")  # removed when the run ends
    work = Path(tmp.name)
    export = export_ctranslate2(ck.path, work / "ct2")  # float32; the int8 row quantizes it on load
    modes = ["greedy", f"beam {beam}"]
    job = {"checkpoint": str(ck.path), "export": str(export), "encoded": encoded, "groups": groups, "a": 1.0,
           "b": 50, "beam": beam, "alpha": alpha, "threads": threads, "modes": modes, "int8_output": int8_output,
           "src_vocab": vocabulary(ck.tokenizers.src), "tgt_vocab": vocabulary(ck.tokenizers.tgt),
           "pad": PIECES[PAD_ID], "bos": PIECES[BOS_ID]}
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in range(repeat):
        order = list(ENGINES[r % len(ENGINES):] + ENGINES[: r % len(ENGINES)])  # turn the order each round
        for isa in isas:
            for engine in order:
                res = run_worker({**job, "engine": engine}, isa, work)
                results.setdefault((engine, isa), []).append(res)
                print(f"  round {r + 1} {isa:<6} {engine:<10} " + "  ".join(
                    f"{m} {res['modes'][m]['seconds']:6.2f} s" for m in modes) + f"  peak RSS {res['rss_mb']:.0f} MiB",
                    flush=True)
    rows = []
    n = len(encoded)
    for (engine, isa), runs in results.items():
        for mode in modes:
            best = min(x["modes"][mode]["seconds"] for x in runs)
            ids = runs[0]["modes"][mode]["ids"]
            fp32 = results[("aiayn fp32", isa)][0]["modes"][mode]["ids"]
            tok = sum(map(len, ids))
            rows.append({"engine": engine, "isa": isa, "mode": mode, "seconds": best, "sent_per_s": n / best,
                         "tok_per_s": tok / best, "bleu": corpus_scores([ck.tokenizers.tgt.decode(h) for h in ids],
                                                                         refs)["bleu"],
                         "same_as_aiayn_fp32": sum(x == y for x, y in zip(ids, fp32)),
                         "rss_mb": max(x["rss_mb"] for x in runs), "rss_import_mb": runs[0]["rss_import_mb"]})
    print(f"\n| engine | ISA | search | seconds | sentences/s | target tokens/s | BLEU | identical to aiayn fp32 | "
          f"peak RSS (MiB) | above its imports (MiB) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for x in sorted(rows, key=lambda x: (isas.index(x["isa"]), modes.index(x["mode"]), ENGINES.index(x["engine"]))):
        print(f"| {x['engine']} | {x['isa']} | {x['mode']} | {x['seconds']:.2f} | {x['sent_per_s']:.1f} | "
              f"{x['tok_per_s']:.0f} | {x['bleu']:.2f} | {x['same_as_aiayn_fp32']}/{n} | {x['rss_mb']:.0f} | "
              f"{x['rss_mb'] - x['rss_import_mb']:.0f} |")
    print("\nspeed of aiayn int8 / CTranslate2 int8 (>1: aiayn faster), each round, then of the fastest rounds:")
    for isa in isas:
        for mode in modes:
            per = [c["modes"][mode]["seconds"] / a["modes"][mode]["seconds"]
                   for a, c in zip(results[("aiayn int8", isa)], results[("ct2 int8", isa)])]
            best = {x["engine"]: x["seconds"] for x in rows if x["isa"] == isa and x["mode"] == mode}
            print(f"  {isa:<6} {mode:<7} " + " ".join(f"{v:.2f}x" for v in per)
                  + f"  fastest: {best['ct2 int8'] / best['aiayn int8']:.2f}x")
    return {"rows": rows, "n": n, "threads": threads, "repeat": repeat}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        sys.exit(worker(sys.argv[2]))
    sys.exit("usage: python bench/decode.py --isolated ... (this file's `worker` mode is for its subprocesses)")
