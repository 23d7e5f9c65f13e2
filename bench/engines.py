"""aiayn's own search against the engines it exports to, on the same weights, in one run.

    python bench/engines.py [--checkpoint DIR] [--n N | --quick] [--threads T] [--src de --tgt en] [--device cuda]

Systems, each with greedy search and beam 4 on Multi30k test_2016_flickr: aiayn (fp32 and a bf16
copy), Hugging Face `MarianMTModel.generate` on `aiayn export --to hf`, and CTranslate2 on
`aiayn export --to ctranslate2` (float32 and int8). Every system gets the same length-sorted
batches and the same threads; timings cover search only, after one warm-up batch per system.

Printed per system: seconds, sentences/s, target tokens/s, time relative to aiayn fp32 in the same
mode, BLEU (sacreBLEU, against the references), and how many translations are identical to aiayn
fp32's. Greedy search is expected to be identical for HF and CTranslate2 fp32. Beam search: HF and
CTranslate2 divide by len**alpha, aiayn by ((5 + len) / 6)**alpha, so with alpha > 0 finished
hypotheses can rank differently; `--identity` adds HF beam 4 with alpha = 0 against aiayn with
alpha = 0, where the two searches are the same algorithm, and HF greedy on sources with the EOS
that `MarianTokenizer` appends by default (aiayn feeds the source without it).

aiayn runs as `Translator` runs it: weights frozen (linear layers on oneDNN-packed weights), bf16
as a bfloat16 copy of the model (skipped on a CPU for which oneDNN has no bf16 kernels); after the
table, aiayn's speed-up over HF and CTranslate2 float32 per mode (and over HF bf16, where it ran).

`--device cuda` runs aiayn and HF on the GPU (without CTranslate2, whose CPU engine has no place in
that table), adds HF on a bfloat16 copy of the Marian model beside aiayn's bf16 (like for like),
runs HF's attention on aiayn's backends there (not cuDNN's), and waits for the GPU before each clock
reading. On any device aiayn fp32 and bf16 also run with their decoder step in Python ("aiayn
fp32, Python step"), where it would run compiled (`aiayn.step`), to show what that saves (each such
row's identical count is against its compiled row). A peer that is not installed is left out.
On a GPU, pass `--max-tokens 4096 --batch-size 256`, the batches of `aiayn translate`: small
batches leave it idle. `--quick` takes the first 48 sentences (a smoke run).

Without --checkpoint, a random-weight `small` model (d_model 256, 3+3 layers) is used with a joint
tokenizer trained on the Multi30k training text; it seldom emits EOS, so sentences run to their
length limit (source length + 50), and BLEU is meaningless.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import platform
import sys
import tempfile
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import sdpa_kernel

from aiayn import step
from aiayn.checkpoint import load_checkpoint, save_checkpoint
from aiayn.config import preset
from aiayn.data.text import multi30k_paths
from aiayn.errors import AiaynError
from aiayn.evaluate import corpus_scores
from aiayn.export import HF_EARLY_STOPPING, export_ctranslate2, export_hf
from aiayn.files import read_lines
from aiayn.kernels import GPU_ATTENTION_BACKENDS, SLOW_BF16, cpu_has_fast_bf16
from aiayn.model import Transformer
from aiayn.search import beam_search, greedy_search
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_tokenizers
from aiayn.translator import CT2Translator
from decode import batches, padded, skip_parts  # bench/decode.py: the same batches for every engine, --skip
from profiling import profiler, summary  # bench/profiling.py
from train_step import positive  # bench/train_step.py: counts above 0 as argparse types

A, B = 1.0, 50  # aiayn's length limit: floor(A * source length + B)
SKIP_PARTS = ("bf16", "hf", "ct2", "int8", "python-step")


def attention_backends(dev: torch.device) -> AbstractContextManager:
    """HF's attention off the CPU on the backends aiayn's takes there (not cuDNN's, which builds a
    graph for each new shape: on an H200 its bf16 searches ran 5-12x slower than fp32, aiayn's
    13-23x), so that the two compare like for like."""
    return nullcontext() if dev.type == "cpu" else sdpa_kernel(GPU_ATTENTION_BACKENDS)


def hf_strip(row: list[int]) -> list[int]:
    row = row[1:]  # the decoder start token
    return row[: row.index(EOS_ID)] if EOS_ID in row else row


def python_step(search: Any) -> Any:
    """`search` with search's decoder step in Python where it would run compiled (`aiayn.step`:
    float32 and bf16 on the CPU, float on a GPU): the row that says what the compiled step saves."""
    def run(idx: list[int]) -> Any:
        saved, step.COMPILED_STEPS = step.COMPILED_STEPS, False
        try:
            return search(idx)
        finally:
            step.COMPILED_STEPS = saved
    return run


def reference_row(name: str) -> str:
    """The row whose translations `name`'s are counted against: a Python step row's compiled row, HF
    with alpha 0 against aiayn with alpha 0, everything else (aiayn's alpha 0 included) aiayn fp32."""
    if name.endswith(", Python step"):
        return name.removesuffix(", Python step")
    return "aiayn fp32, alpha 0" if "alpha 0" in name and not name.startswith("aiayn") else "aiayn fp32"


def check(ap: argparse.ArgumentParser, args: argparse.Namespace) -> set[str]:
    """Bad values as one-line usage errors before anything is loaded or timed; the --skip parts."""
    skip = skip_parts(ap, args.skip, SKIP_PARTS)
    if args.threads < 0:
        ap.error(f"--threads must be 0 (torch's default) or more, got {args.threads}")
    try:
        torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device: cpu or cuda[:N], got {args.device!r}")
    return skip


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except AiaynError as e:  # a bad checkpoint or data file, named by the library: one line, no traceback
        sys.exit(f"engines.py: error: {e}")


def run(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", help="a trained checkpoint or run directory (default: a random-weight model)")
    ap.add_argument("--src", default="de")
    ap.add_argument("--tgt", default="en")
    ap.add_argument("--data-dir", help="data root holding multi30k/ (default $AIAYN_DATA)")
    ap.add_argument("--n", type=positive(), help="first N test sentences (default: all 1000)")
    ap.add_argument("--quick", action="store_true", help="first 48 sentences only (a smoke run)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where aiayn and HF run")
    ap.add_argument("--preset", default="small", help="model size without --checkpoint")
    ap.add_argument("--vocab-size", type=positive(), default=8000, help="joint vocabulary without --checkpoint")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--beam", type=positive(), default=4)
    ap.add_argument("--alpha", type=float, default=0.6)
    ap.add_argument("--max-tokens", type=positive(), default=2048, help="source tokens per batch")
    ap.add_argument("--batch-size", type=positive(), default=32)
    ap.add_argument("--threads", type=int, default=0, help="threads for torch and CTranslate2 (0: torch's default)")
    ap.add_argument("--skip", default="", help=f"comma-separated: {','.join(SKIP_PARTS)}")
    ap.add_argument("--profile", metavar="FILE",
                    help="after the timings, profile aiayn's and HF's searches on the widest batch into FILE (markdown)")
    ap.add_argument("--identity", action="store_true", help="also run aiayn and HF beam search with alpha = 0")
    args = ap.parse_args(argv)
    skip = check(ap, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device is available")
    if "bf16" not in skip and dev.type == "cpu" and not cpu_has_fast_bf16():  # bf16 runs ~100x slower there
        skip.add("bf16")
        print(f"note: {SLOW_BF16}; skipping bf16 (as --skip bf16)", file=sys.stderr)
    if dev.type == "cuda":
        skip.add("ct2")
    for name, module in (("hf", "transformers"), ("ct2", "ctranslate2")):
        if name not in skip and importlib.util.find_spec(module) is None:
            skip.add(name)
            print(f"note: {module} is not installed; skipping it (as --skip {name})", file=sys.stderr)
    work_dir = tempfile.TemporaryDirectory(prefix="aiayn-engines-")  # removed when the run ends
    work = Path(work_dir.name)
    if args.checkpoint:
        ck = load_checkpoint(args.checkpoint)
        model, toks, what, ckpt = ck.model, ck.tokenizers, f"checkpoint {ck.path}", ck.path
    else:
        tr_src, tr_tgt = multi30k_paths("train", args.src, args.tgt, args.data_dir)
        toks = build_tokenizers(tr_src, tr_tgt, args.vocab_size, joint=True)
        torch.manual_seed(0)
        model = Transformer(preset(args.preset, src_vocab_size=toks.src.vocab_size, tgt_vocab_size=toks.tgt.vocab_size))
        model.eval()
        ckpt = work / "ckpt"
        save_checkpoint(ckpt, model, toks, {"train": {}, "step": 0})
        what = f"random-weight '{args.preset}' model"
    model.requires_grad_(False)  # as `Translator` does: frozen weights take the packed inference GEMMs
    model.to(dev)
    src_path, ref_path = multi30k_paths("test_2016_flickr", args.src, args.tgt, args.data_dir)
    lines, refs = read_lines(src_path), read_lines(ref_path)
    n = 48 if args.quick else (args.n or len(lines))
    lines, refs = lines[:n], refs[:n]
    n = len(lines)  # --n past the end of the file: the sentences there are, not N (sentences/s counts them)
    eos = [EOS_ID] if model.cfg.source_eos else []  # the source as the model was trained on it
    encoded = [toks.src.encode(line)[: model.cfg.max_positions - len(eos)] + eos for line in lines]
    limits = [max(1, math.floor(len(e) * A + B)) for e in encoded]
    groups = batches(encoded, args.max_tokens, args.batch_size)
    K, alpha = args.beam, args.alpha
    card = f", {torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else ""
    print(f"{what}; {n} sentences of {src_path.name}, {len(groups)} batches of at most {args.batch_size}; "
          f"{threads} threads; {platform.processor() or platform.machine()}; device {dev}{card}; "
          f"torch {torch.__version__}", flush=True)

    model_bf16 = None if "bf16" in skip else copy.deepcopy(model).to(torch.bfloat16)  # as Translator's bf16

    def aiayn(beam: int, a: float, bf16: bool = False):  # type: ignore[no-untyped-def]
        m = model_bf16 if bf16 else model

        def go(idx: list[int]) -> list[list[int]]:
            s = padded(encoded, idx).to(dev)
            if beam == 1:
                return greedy_search(m, s, BOS_ID, EOS_ID, A, B)
            return [h[0][0] for h in beam_search(m, s, BOS_ID, EOS_ID, beam, a, A, B)]
        return go

    systems = {("aiayn fp32", "greedy"): aiayn(1, 0.0), ("aiayn fp32", f"beam {K}"): aiayn(K, alpha)}
    if "python-step" not in skip:  # what the compiled step saves
        systems[("aiayn fp32, Python step", "greedy")] = python_step(aiayn(1, 0.0))
        systems[("aiayn fp32, Python step", f"beam {K}")] = python_step(aiayn(K, alpha))
    if "bf16" not in skip:
        systems[("aiayn bf16", "greedy")] = aiayn(1, 0.0, True)
        systems[("aiayn bf16", f"beam {K}")] = aiayn(K, alpha, True)
        if "python-step" not in skip:
            systems[("aiayn bf16, Python step", "greedy")] = python_step(aiayn(1, 0.0, True))
            systems[("aiayn bf16, Python step", f"beam {K}")] = python_step(aiayn(K, alpha, True))
    if "hf" not in skip:
        import transformers
        from transformers import MarianMTModel

        transformers.logging.set_verbosity_error()  # per-batch max_new_tokens overrides the export's max_length
        export_hf(ckpt, work / "hf")
        hf = MarianMTModel.from_pretrained(work / "hf").eval().to(dev)
        hf_bf16 = None if "bf16" in skip or dev.type == "cpu" else copy.deepcopy(hf).to(torch.bfloat16)

        def hf_gen(beam: int, a: float, m=hf):  # type: ignore[no-untyped-def]
            def go(idx: list[int]) -> list[list[int]]:
                s = padded(encoded, idx).to(dev)
                with torch.no_grad(), attention_backends(dev):
                    out = m.generate(input_ids=s, attention_mask=s.ne(PAD_ID), num_beams=beam, do_sample=False,
                                     length_penalty=a, early_stopping=HF_EARLY_STOPPING,
                                     max_new_tokens=max(limits[i] for i in idx) + 1)
                return [hf_strip(r)[: limits[i]] for i, r in zip(idx, out.tolist())]
            return go

        systems[(f"HF generate ({transformers.__version__})", "greedy")] = hf_gen(1, 0.0)
        systems[(f"HF generate ({transformers.__version__})", f"beam {K}")] = hf_gen(K, alpha)
        if hf_bf16 is not None:  # like for like with aiayn bf16 on a GPU: a bfloat16 copy of the Marian model
            systems[("HF generate bf16", "greedy")] = hf_gen(1, 0.0, hf_bf16)
            systems[("HF generate bf16", f"beam {K}")] = hf_gen(K, alpha, hf_bf16)
        if args.identity:
            systems[("aiayn fp32, alpha 0", f"beam {K}")] = aiayn(K, 0.0)
            systems[("HF generate, alpha 0", f"beam {K}")] = hf_gen(K, 0.0)

            def hf_eos(idx: list[int]) -> list[list[int]]:  # MarianTokenizer's default: EOS after the source
                s = padded([e + [EOS_ID] for e in encoded], idx).to(dev)
                with torch.no_grad():
                    out = hf.generate(input_ids=s, attention_mask=s.ne(PAD_ID), num_beams=1, do_sample=False,
                                      max_new_tokens=max(limits[i] for i in idx) + 1)
                return [hf_strip(r)[: limits[i]] for i, r in zip(idx, out.tolist())]

            if not model.cfg.source_eos:  # a model trained on bare sources, fed as MarianTokenizer would
                systems[("HF generate, source + EOS", "greedy")] = hf_eos
    if "ct2" not in skip:
        import ctranslate2

        kinds = [("float32", None)] + ([] if "int8" in skip else [("int8", "int8")])
        for label, q in kinds:
            export_ctranslate2(ckpt, work / f"ct2-{label}", quantization=q)
            tr = CT2Translator(work / f"ct2-{label}", threads=threads)

            def ct2_gen(beam: int, a: float, tr=tr):  # type: ignore[no-untyped-def]
                def go(idx: list[int]) -> list[list[int]]:
                    nb = tr.translate_ids([encoded[i] for i in idx], beam, a, 1, A, B, max_tokens=10**9)
                    return [h[0][0] for h in nb]
                return go

            systems[(f"CTranslate2 {label} ({ctranslate2.__version__})", "greedy")] = ct2_gen(1, 0.0)
            systems[(f"CTranslate2 {label} ({ctranslate2.__version__})", f"beam {K}")] = ct2_gen(K, alpha)

    def wait() -> None:  # the GPU's queued work belongs to the timing it was launched in
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    rows, outs = [], {}
    for (name, mode), fn in systems.items():
        fn(groups[-1][:4])  # warm-up
        fn(groups[0])  # and the widest batch: GPU libraries choose and cache kernels per shape
        res: list[list[int]] = [[] for _ in encoded]
        wait()
        t0 = time.perf_counter()
        for idx in groups:
            for i, ids in zip(idx, fn(idx)):
                res[i] = ids
        wait()
        dt = time.perf_counter() - t0
        outs[(name, mode)] = res
        hyps = [toks.tgt.decode(h) for h in res]
        bleu = corpus_scores(hyps, refs)["bleu"]
        ref_key = (reference_row(name), mode)
        same = sum(x == y for x, y in zip(res, outs[ref_key])) if ref_key in outs else n
        tok = sum(map(len, res))
        rows.append((name, mode, dt, n / dt, tok / dt, bleu, same))
        print(f"  {name:<34} {mode:<7} {dt:8.2f} s {n / dt:8.1f} sent/s  BLEU {bleu:5.2f}  identical {same}/{n}",
              flush=True)

    base = {mode: dt for name, mode, dt, *_ in rows if name == "aiayn fp32"}
    ct2 = {mode: dt for name, mode, dt, *_ in rows if name.startswith("CTranslate2 float32")}
    hfs = {mode: dt for name, mode, dt, *_ in rows if name.startswith("HF generate (")}
    hfb = {mode: dt for name, mode, dt, *_ in rows if name == "HF generate bf16"}
    for name, mode, dt, *_ in rows:
        if name in ("aiayn fp32", "aiayn bf16"):
            peers = (("HF", hfs), ("HF bf16", hfb if name == "aiayn bf16" else {}), ("CTranslate2 float32", ct2))
            vs = [f"{other} {peer[mode] / dt:.2f}x" for other, peer in peers if mode in peer]
            print(f"{name} {mode}: faster than " + ", ".join(vs) if vs else f"{name} {mode}")
    print(f"\n| system | search | seconds | sentences/s | target tokens/s | time / aiayn fp32 | BLEU | "
          f"identical to aiayn fp32 (a Python step row: to its compiled row; HF alpha 0: to aiayn alpha 0) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, mode, dt, sps, tps, bleu, same in rows:
        print(f"| {name} | {mode} | {dt:.2f} | {sps:.1f} | {tps:.0f} | {dt / base[mode]:.2f}x | {bleu:.2f} | "
              f"{same}/{n} |")
    if args.json:
        keys = ("system", "search", "seconds", "sentences_per_s", "tokens_per_s", "bleu", "identical")
        Path(args.json).write_text(json.dumps({"device": str(dev) + card, "model": what, "n": n,
                                               "rows": [dict(zip(keys, r)) for r in rows]}, indent=2) + "\n")
    if args.profile:  # after the rows are safe: a profile that overruns a time limit costs only itself
        profile_systems(systems, groups[0], outs, wait, dev, Path(args.profile))
    return 0


def profile_systems(systems: dict, idx: list[int], outs: dict, wait: Any, dev: torch.device, path: Path) -> None:
    """`--profile FILE`: aiayn's and HF's fp32 and bf16 searches on the widest batch under
    torch.profiler (bench/profiling.py), after the timed runs; markdown to FILE."""
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    parts = [f"# Profile: search on the widest batch ({len(idx)} sentences)\n\n{card}, torch {torch.__version__}\n"]
    for (name, mode), fn in systems.items():
        if (not (name.startswith("aiayn") or name.startswith("HF generate")) or "alpha 0" in name or "EOS" in name
                or name == "aiayn bf16, Python step"):  # (fp32's Python step says what the profile needs)
            continue
        steps = 1 + max(len(outs[(name, mode)][i]) for i in idx)  # the batch's last sentence ends the search
        wait()
        t0 = time.perf_counter()
        fn(idx)
        wait()
        plain = time.perf_counter() - t0
        with profiler(dev) as prof:
            t0 = time.perf_counter()
            fn(idx)
            wait()
            wall = time.perf_counter() - t0
        parts.append(summary(prof, wall, f"{name}, {mode}: {steps} steps", per=steps, plain_s=plain))
        print(f"  profiled {name} {mode}", flush=True)
    path.write_text("\n".join(parts), encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
