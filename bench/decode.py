"""Decoding speed: aiayn's cached search against (a) the same search without the key/value cache,
(b) Hugging Face `MarianMTModel.generate` and (c) CTranslate2 (float32 and int8) carrying the very
same weights, in one run. (bench/engines.py compares the exports too, with BLEU and agreement.)

    python bench/decode.py [--checkpoint DIR] [--quick] [--src de --tgt en]

On Multi30k test_2016_flickr (1000 sentences), for greedy and beam 4: sentences/s and target
tokens/s (tokens generated, EOS excluded). Every system gets the same length-sorted batches (by
default those of `aiayn translate`: at most 256 sentences and 4096 source tokens, padding counted),
the same beam and the same length limits (at most source length + 50 tokens); timings cover search
only (tokenization excluded), after one small warm-up batch per system. With --repeat N the systems
take turns N times and each one's fastest round counts (timings on a shared machine vary by about
10% from run to run). aiayn runs as `Translator.translate` does on the whole list, several batches
at once (--workers, default one per thread, each batch on its share of the threads;
`aiayn.translator.map_batches`; `aiayn translate` does the same within each --chunk-lines chunk), and
also one batch at a time for comparison; its uncached search gets the same workers. HF Marian and
CTranslate2 run one batch at a time on all threads. The copy into Marian is checked twice: the
logits of one batch, and the greedy translations of every sentence (printed as an agreement count).

aiayn runs as `Translator` runs it: weights frozen (so linear layers use oneDNN-packed weights, see
`aiayn.kernels.inference_linear`), bf16 as a bfloat16 copy of the model (skipped on a CPU for which
oneDNN has no bf16 kernels, where it runs ~100x slower than fp32). Comparisons are like for
like: aiayn bf16 is compared with a bfloat16 copy of the Marian model and with its own bf16 search
without the cache (the fp32 peers are printed beside them). The last lines give the speed-ups of
aiayn over HF, over its own uncached search and over CTranslate2 float32, mode by mode, and then
the work behind them: the multiply-adds in linear layers (most of a step's time) of aiayn's beam
search with and without the cache and of HF's, counted in one more, untimed pass (`--skip work`
leaves it out).

Without --checkpoint, a random-weight `small` model is built with a joint tokenizer trained on the
Multi30k training text (cached). A random model rarely emits EOS, so nearly every sentence runs to
its length limit: a worst case for pruning finished sentences.

Marian's conventions: decoder_start_token_id = our BOS, pad 0, eos 3, final_logits_bias zero; the copy
(`aiayn.export.to_marian`) permutes the hidden features so that Marian's own positional table (cosines
in the second half) fits our weights. Marian's
beam search divides by len**alpha instead of ((5+len)/6)**alpha; beams can therefore rank finished
hypotheses differently, which does not change the work done per step.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import platform
import sys
import time
from pathlib import Path

import torch

from aiayn.config import preset
from aiayn.data.text import multi30k_paths
from aiayn.export import HF_EARLY_STOPPING, to_marian  # `aiayn export --to hf`: its stop rule, weight mapping
from aiayn.files import read_lines
from aiayn.kernels import SLOW_BF16, cpu_has_fast_bf16
from aiayn.model import Transformer
from aiayn.search import beam_search, greedy_search
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_tokenizers
from aiayn.translator import Settings, length_batches, map_batches, worker_count

SKIPPABLE = ("bf16", "ct2", "hf", "uncached", "work")  # the parts --skip names


def skip_parts(ap: argparse.ArgumentParser, text: str, parts: tuple[str, ...]) -> set[str]:
    """--skip's comma-separated parts, each one of `parts`: a misspelt part would run what it was
    meant to leave out, so it is a usage error before anything is loaded or timed."""
    skip = set(filter(None, text.split(",")))
    if unknown := sorted(skip - set(parts)):
        ap.error(f"--skip {','.join(unknown)}: not a part; give any of {','.join(parts)}")
    return skip


def build(args):
    if args.checkpoint:
        from aiayn.checkpoint import load_checkpoint

        ck = load_checkpoint(args.checkpoint)
        return ck.model, ck.tokenizers, f"checkpoint {args.checkpoint}"
    tr_src, tr_tgt = multi30k_paths("train", args.src, args.tgt, args.data_dir)
    toks = build_tokenizers(tr_src, tr_tgt, args.vocab_size, joint=True)
    torch.manual_seed(0)
    cfg = preset(args.preset, src_vocab_size=toks.src.vocab_size, tgt_vocab_size=toks.tgt.vocab_size)
    return Transformer(cfg).eval(), toks, f"random-weight '{args.preset}' model"


def batches(encoded: list[list[int]], max_tokens: int, batch_size: int) -> list[list[int]]:
    """Length-sorted batches (longest first) under a source-token budget, the same for every system:
    those `aiayn translate` makes."""
    return list(length_batches(encoded, max_tokens, batch_size))


def padded(encoded: list[list[int]], idx: list[int]) -> torch.Tensor:
    src = torch.full((len(idx), max(len(encoded[i]) for i in idx)), PAD_ID, dtype=torch.long)  # (B, S)
    for r, i in enumerate(idx):
        src[r, : len(encoded[i])] = torch.tensor(encoded[i])
    return src


def strip(ids: list[int]) -> list[int]:
    out = []
    for t in ids:
        if t == EOS_ID:
            break
        if t not in (PAD_ID, BOS_ID):
            out.append(t)
    return out


def run_system(name: str, fn, encoded, groups, workers: int = 1) -> tuple[dict, list[list[int]]]:
    """Times `fn` over all batches; `workers` batches at once as `aiayn translate` runs them
    (`translator.map_batches`), 1 for the peers, which run one batch at a time on all threads."""
    outputs: list[list[int]] = [[] for _ in encoded]
    fn(padded(encoded, groups[-1][:4]))  # warm-up: lazy initialisation (packed weights, kernels) is not timed
    t0 = time.perf_counter()
    results = map_batches(lambda idx: fn(padded(encoded, idx)), groups, workers)
    for idx, res in zip(groups, results):
        for i, ids in zip(idx, res):
            outputs[i] = ids
    dt = time.perf_counter() - t0
    n_tok = sum(len(o) for o in outputs)
    row = {"system": name, "seconds": dt, "sent_per_s": len(encoded) / dt, "tok_per_s": n_tok / dt, "tokens": n_tok}
    print(f"  {name:<28} {dt:8.2f} s  {row['sent_per_s']:8.1f} sent/s  {row['tok_per_s']:9.1f} tok/s", flush=True)
    return row, outputs


@contextlib.contextmanager
def counting_linear_macs():
    """Counts the multiply-adds of every linear layer run inside the block, aiayn's
    (`aiayn.kernels.inference_linear`) and torch's (`F.linear`, which HF Marian's layers call); a call
    that one of them makes to the other counts once. Yields a one-element list holding the count.
    Not thread-safe: run the counted systems one batch at a time."""
    from aiayn import kernels

    total, depth = [0], [0]

    def counted(f):
        def linear(x, weight, *args, **kwargs):
            if depth[0] == 0:
                total[0] += x.numel() // x.size(-1) * weight.size(0) * weight.size(1)
            depth[0] += 1
            try:
                return f(x, weight, *args, **kwargs)
            finally:
                depth[0] -= 1
        return linear

    saved = kernels.inference_linear, torch.nn.functional.linear
    kernels.inference_linear, torch.nn.functional.linear = counted(saved[0]), counted(saved[1])
    try:
        yield total
    finally:
        kernels.inference_linear, torch.nn.functional.linear = saved


def linear_work(systems: dict, names: list[str], encoded, groups) -> dict[str, int]:
    """Multiply-adds in linear layers of each named system over all batches (one untimed pass each)."""
    work = {}
    for name in names:
        if name in systems:
            with counting_linear_macs() as total:
                for idx in groups:
                    systems[name](padded(encoded, idx))
            work[name] = total[0]
    return work


def best_of(rounds: list[list[dict]]) -> list[dict]:
    """Per system, the fastest of its rounds (a shared machine only ever adds time)."""
    return [min(rs, key=lambda r: r["seconds"]) for rs in zip(*rounds)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", help="a trained checkpoint (default: a random-weight model)")
    ap.add_argument("--src", default="de")
    ap.add_argument("--tgt", default="en")
    ap.add_argument("--data-dir", help="data root holding multi30k/ (default $AIAYN_DATA)")
    ap.add_argument("--preset", default="small", help="model size without --checkpoint")
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--quick", action="store_true", help="first 48 sentences only (a smoke run)")
    ap.add_argument("--n", type=int, help="first N sentences")
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=0.6)
    ap.add_argument("--max-tokens", type=int, default=Settings.max_tokens,
                    help="source tokens per batch (default: aiayn translate's)")
    ap.add_argument("--batch-size", type=int, default=Settings.batch_size,
                    help="sentences per batch (default: aiayn translate's)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for every system (1: intra-op threads on a shared, busy CPU slow all down)")
    ap.add_argument("--workers", type=int, default=Settings.workers,
                    help="aiayn's batches searched at once (default: aiayn translate's, one per thread)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: hf,uncached,bf16,ct2,work "
                    "(work: the untimed count of linear-layer multiply-adds)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds over all systems; each system's fastest round is reported (default 1)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--isolated", action="store_true",
                    help="instead: aiayn fp32/int8 and CTranslate2 fp32/int8, each engine in its own process, with "
                         "BLEU and peak RSS, under each --isa (bench/isolated.py); needs --checkpoint")
    ap.add_argument("--isa", default="native,avx2", help="with --isolated: native and/or avx2 (all libraries restricted)")
    ap.add_argument("--int8-output", choices=("int8", "fp32"), default="int8",
                    help="with --isolated: aiayn int8's projection to the vocabulary in int8 or fp32")
    args = ap.parse_args(argv)
    if args.repeat < 1 or (args.n is not None and args.n < 1):  # else an empty table, or a KeyError after the runs
        ap.error("--repeat and --n take a number above 0")
    if args.isolated:
        return isolated(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    skip = skip_parts(ap, args.skip, SKIPPABLE)
    if "bf16" not in skip and not cpu_has_fast_bf16():  # bf16 runs ~100x slower than fp32 there
        skip.add("bf16")
        print(f"note: {SLOW_BF16}; skipping bf16 (as --skip bf16)", file=sys.stderr)
    model, toks, what = build(args)
    model.requires_grad_(False)  # as `Translator` does: frozen weights take the packed inference GEMMs
    src_path, _ = multi30k_paths("test_2016_flickr", args.src, args.tgt, args.data_dir)
    lines = read_lines(src_path)
    n = 48 if args.quick else (args.n or len(lines))
    lines = lines[:n]
    eos = [EOS_ID] if model.cfg.source_eos else []  # the source as the model was trained on it
    encoded = [(toks.src.encode(line) or toks.src.encode("."))[: model.cfg.max_positions - len(eos)] + eos
               for line in lines]
    groups = batches(encoded, args.max_tokens, args.batch_size)
    K, a, b = args.beam, 1.0, 50
    workers = worker_count(args.workers, len(groups))  # as map_batches will run aiayn
    print(f"{what}; {n} sentences of {src_path.name}, {len(groups)} batches; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}; aiayn runs "
          f"{workers} batch(es) at once (--workers), the peers one at a time", flush=True)

    systems = {
        "aiayn greedy": lambda s: greedy_search(model, s, BOS_ID, EOS_ID, a, b),
        f"aiayn beam {K}": lambda s: [h[0][0] for h in beam_search(model, s, BOS_ID, EOS_ID, K, args.alpha, a, b)],
    }
    if workers > 1:  # what the workers add: the same search, one batch at a time on all threads
        systems[f"aiayn beam {K}, 1 worker"] = systems[f"aiayn beam {K}"]
    if "bf16" not in skip:  # as `Translator(precision="bf16")`: a bfloat16 copy of the model
        mb = copy.deepcopy(model).to(torch.bfloat16)
        systems["aiayn greedy bf16"] = lambda s: greedy_search(mb, s, BOS_ID, EOS_ID, a, b)
        systems[f"aiayn beam {K} bf16"] = lambda s: [
            h[0][0] for h in beam_search(mb, s, BOS_ID, EOS_ID, K, args.alpha, a, b)]
        if workers > 1:
            systems[f"aiayn beam {K} bf16, 1 worker"] = systems[f"aiayn beam {K} bf16"]
    if "uncached" not in skip:
        systems["aiayn greedy, no cache"] = lambda s: greedy_search(model, s, BOS_ID, EOS_ID, a, b, use_cache=False)
        systems[f"aiayn beam {K}, no cache"] = lambda s: [
            h[0][0] for h in beam_search(model, s, BOS_ID, EOS_ID, K, args.alpha, a, b, use_cache=False)]
        if "bf16" not in skip:
            systems[f"aiayn beam {K} bf16, no cache"] = lambda s: [
                h[0][0] for h in beam_search(mb, s, BOS_ID, EOS_ID, K, args.alpha, a, b, use_cache=False)]
    hf = None
    if "hf" not in skip:
        import transformers

        hf = to_marian(model)
        probe = padded(encoded, groups[0][:8])
        tgt_in = torch.full((probe.size(0), 5), BOS_ID)
        tgt_in[:, 1:] = torch.randint(4, model.cfg.tgt_vocab_size, (probe.size(0), 4))
        with torch.no_grad():
            diff = (hf(input_ids=probe, attention_mask=probe.ne(PAD_ID), decoder_input_ids=tgt_in).logits
                    - model(probe, tgt_in)).abs().max().item()
        print(f"transformers {transformers.__version__}: max |logit difference| Marian vs aiayn = {diff:.2e}", flush=True)

        def hf_gen(beam, m):
            def go(s):
                limit = int((s.ne(PAD_ID).sum(1).max().item()) * a + b) + 1  # the longest sentence's limit + EOS
                extra = dict(length_penalty=args.alpha, early_stopping=HF_EARLY_STOPPING) if beam > 1 else {}
                with torch.no_grad():
                    out = m.generate(input_ids=s, attention_mask=s.ne(PAD_ID), num_beams=beam, do_sample=False,
                                      max_new_tokens=limit, bad_words_ids=[[PAD_ID], [BOS_ID]],
                                      num_return_sequences=1, **extra)
                return [strip(row[1:]) for row in out.tolist()]
            return go

        systems["HF Marian greedy"] = hf_gen(1, hf)
        systems[f"HF Marian beam {K}"] = hf_gen(K, hf)
        if "bf16" not in skip:  # like for like with aiayn's bf16 mode: a bfloat16 copy of the Marian model
            hfb = copy.deepcopy(hf).to(torch.bfloat16)
            systems["HF Marian greedy bf16"] = hf_gen(1, hfb)
            systems[f"HF Marian beam {K} bf16"] = hf_gen(K, hfb)
    if "ct2" not in skip:  # CTranslate2 on `aiayn export --to ctranslate2` of the same weights, fp32 and int8
        import tempfile

        from aiayn.export import to_ctranslate2
        from aiayn.translator import CT2Translator

        exports = tempfile.TemporaryDirectory(prefix="aiayn-decode-")  # removed when the run ends
        for q in ("float32", "int8"):
            ct2 = CT2Translator(to_ctranslate2(model, toks, Path(exports.name) / q, None if q == "float32" else q),
                                threads=torch.get_num_threads())

            def ct2_gen(beam, ct2=ct2):
                def go(s):
                    ids = [row[row.ne(PAD_ID)].tolist() for row in s]
                    return [nb[0][0] for nb in ct2.translate_ids(ids, beam, args.alpha, 1, a, b, max_tokens=10**9)]
                return go

            systems[f"CTranslate2 {q} greedy"] = ct2_gen(1)
            systems[f"CTranslate2 {q} beam {K}"] = ct2_gen(K)

    rounds, outs = [], {}
    for r in range(args.repeat):  # systems take turns, so a slow spell of the machine hits them all
        if args.repeat > 1:
            print(f"round {r + 1} of {args.repeat}", flush=True)
        rounds.append([])
        for name, fn in systems.items():
            w = workers if name.startswith("aiayn") and not name.endswith("1 worker") else 1
            row, outs[name] = run_system(name, fn, encoded, groups, w)
            rounds[-1].append(row)
    rows = best_of(rounds)
    by = {r["system"]: r for r in rows}

    limits = [int(len(e) * a + b) for e in encoded]
    if hf is not None:  # Marian runs every sentence to its batch's limit; compare within each sentence's own
        agree = sum(o == h[:lim] for o, h, lim in zip(outs["aiayn greedy"], outs["HF Marian greedy"], limits))
        print(f"greedy translations identical, aiayn vs HF Marian: {agree}/{n}")
    if "ct2" not in skip:
        agree = sum(o == h for o, h in zip(outs["aiayn greedy"], outs["CTranslate2 float32 greedy"]))
        print(f"greedy translations identical, aiayn vs CTranslate2 float32: {agree}/{n}")
    for prec in ("", " bf16"):
        if f"aiayn beam {K}{prec}, 1 worker" in outs:
            same = sum(x == y for x, y in zip(outs[f"aiayn beam {K}{prec}"], outs[f"aiayn beam {K}{prec}, 1 worker"]))
            print(f"beam {K}{prec} translations identical, {workers} workers vs 1: {same}/{n}")
    if "uncached" not in skip:
        same = sum(x == y for x, y in zip(outs[f"aiayn beam {K}"], outs[f"aiayn beam {K}, no cache"]))
        print(f"beam {K} translations identical, cached vs uncached: {same}/{n}")

    print("\n| system | seconds | sentences/s | target tokens/s | speed-up of aiayn (same mode) |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        mode = ("greedy" if "greedy" in r["system"] else f"beam {K}") + (" bf16" if "bf16" in r["system"] else "")
        ours = by[f"aiayn {mode}"]["seconds"]  # a bf16 peer exists only beside aiayn's bf16 run
        print(f"| {r['system']} | {r['seconds']:.2f} | {r['sent_per_s']:.1f} | {r['tok_per_s']:.0f} | "
              f"{r['seconds'] / ours:.2f}x |")

    def ratio(slow: str, fast: str) -> str:
        return f"{by[slow]['seconds'] / by[fast]['seconds']:.2f}x" if slow in by and fast in by else "n/a"

    print("\nspeed-ups (time of the other system / time of aiayn):")
    for prec in ("", " bf16"):
        for mode in ("greedy", f"beam {K}"):
            ours = f"aiayn {mode}{prec}"
            if ours not in by:
                continue
            print(f"  {ours}: vs HF Marian{prec} {ratio(f'HF Marian {mode}{prec}', ours)}"
                  + (f" (fp32 {ratio(f'HF Marian {mode}', ours)})" if prec else "")
                  + f", vs no cache{prec} {ratio(f'aiayn {mode}{prec}, no cache', ours)}"
                  + (f" (fp32 {ratio(f'aiayn {mode}, no cache', ours)})" if prec else "")
                  + f", vs CTranslate2 float32 {ratio(f'CTranslate2 float32 {mode}', ours)}")
    work = {}
    if "work" not in skip:  # the arithmetic behind the ratios: linear layers are most of a step
        names = [f"aiayn beam {K}", f"aiayn beam {K}, no cache", f"HF Marian beam {K}"]
        work = linear_work(systems, names, encoded, groups)
        ours = work[f"aiayn beam {K}"]
        print(f"\nlinear-layer work, beam {K} (fp32 models, multiply-adds counted in one untimed pass):")
        for name, macs in work.items():
            print(f"  {name}: {macs / 1e9:.1f} G" + ("" if name == f"aiayn beam {K}" else f", {macs / ours:.2f}x aiayn's"))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "rounds": rounds, "n": n, "model": what,
                                               "linear_macs": work}, indent=2))
    return 0


def isolated(args: argparse.Namespace) -> int:
    """`--isolated`: the four-engine table of bench/isolated.py on the test set with its references."""
    from isolated import ISA_ENV, compare

    from aiayn.checkpoint import load_checkpoint
    from aiayn.errors import AiaynError

    if not args.checkpoint:
        sys.exit("--isolated needs --checkpoint (a trained model: BLEU is part of the table)")
    isas = [x for x in args.isa.split(",") if x]
    if not isas or any(x not in ISA_ENV for x in isas):
        sys.exit(f"--isa: a comma-separated list of {', '.join(ISA_ENV)}")
    if args.beam < 1 or args.threads < 0:  # else every worker process dies with a traceback
        sys.exit(f"--isolated takes --beam above 0 and --threads of 0 or more, got {args.beam} and {args.threads}")
    try:
        ck = load_checkpoint(args.checkpoint)
    except AiaynError as e:
        sys.exit(f"--checkpoint: {e}")
    src_path, ref_path = multi30k_paths("test_2016_flickr", args.src, args.tgt, args.data_dir)
    lines, refs = read_lines(src_path), read_lines(ref_path)
    n = 48 if args.quick else (args.n or len(lines))
    eos = [EOS_ID] if ck.model.cfg.source_eos else []
    encoded = [(ck.tokenizers.src.encode(line) or ck.tokenizers.src.encode("."))[: ck.model.cfg.max_positions - len(eos)]
               + eos for line in lines[:n]]
    n = len(encoded)  # --n past the end of the file: the sentences there are
    groups = batches(encoded, args.max_tokens, args.batch_size)
    print(f"checkpoint {ck.path}; {n} sentences of {src_path.name}, {len(groups)} batches; {args.threads or 1} "
          f"thread(s) per engine; {platform.processor() or platform.machine()}; rounds: {args.repeat}", flush=True)
    del ck
    out = compare(args.checkpoint, encoded, groups, refs[:n], args.beam, args.alpha, args.threads or 1, args.repeat,
                  isas, args.int8_output == "int8")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
