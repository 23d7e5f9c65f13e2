"""Greedy and beam search: exact tokens and scores on a stub model with hand-set distributions,
then equivalences on a real random-weight Transformer (beam 1 = greedy, cached = uncached,
batch invariance) and the length rules."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from aiayn import kernels, search
from aiayn.config import preset
from aiayn.errors import AiaynError
from aiayn.model import Transformer
from aiayn.search import beam_search, greedy_search, length_penalty

PAD, UNK, BOS, EOS, A, B_ = 0, 1, 2, 3, 4, 5
V = 6


def dist(eos=0.0, a=0.0, b=0.0):
    """Next-token log-probabilities over the stub's 6-word vocabulary."""
    p = torch.zeros(V)
    p[EOS], p[A], p[B_] = eos, a, b
    return p.log()


# (sentence id, generated prefix) -> next-token distribution; anything else ends the sentence.
TABLE = {
    # sentence 0: [b] finishes early with .95*.3 = .285; [a b] with .6*.45 = .27 is longer.
    (0, ()): dist(eos=0.1, a=0.6, b=0.3),
    (0, (A,)): dist(eos=0.4, a=0.15, b=0.45),
    (0, (B_,)): dist(eos=0.95, a=0.025, b=0.025),
    # sentence 1: EOS straight away (.7), else [a] (.2).
    (1, ()): dist(eos=0.7, a=0.2, b=0.1),
    # sentence 2: never wants to stop (for the length rules).
    (2, ()): dist(eos=0.01, a=0.6, b=0.39),
}
END = dist(eos=1.0)


def table_lookup(sid, prefix):
    if sid == 2:
        return TABLE[(2, ())]
    return TABLE.get((sid, prefix), END)


class StubCache:
    """A `search.SearchCache`: one row per hypothesis (so `beam` changes nothing here)."""

    def __init__(self, sid: torch.Tensor) -> None:
        self.sid = sid  # (b,)
        self.hist = torch.zeros(sid.numel(), 0, dtype=torch.long)  # (b, t) tokens fed so far

    def reorder(self, indices: torch.Tensor, beam: int | None = None, same_sentences: bool = False) -> None:
        self.sid, self.hist = self.sid.index_select(0, indices), self.hist.index_select(0, indices)


class StubModel:
    """A `search.SearchModel`: encode/new_cache/decode/project like Transformer's; the source's first
    token is the sentence id. Its "hidden states" are already the logits: `project` is the identity."""

    cfg = SimpleNamespace(pad_id=PAD)

    def __init__(self) -> None:
        self.rows_per_step: list[int] = []

    def encode(self, src: torch.Tensor, src_keep: torch.Tensor | None = None) -> torch.Tensor:
        return (src[:, :1] - 10).float().unsqueeze(-1)  # (B, 1, 1): the sentence id

    def new_cache(self, memory: torch.Tensor, src_keep: torch.Tensor) -> StubCache:
        return StubCache(memory[:, 0, 0].long())

    def _logits(self, sid: torch.Tensor, prefixes: list[list[int]], T: int) -> torch.Tensor:
        rows = [table_lookup(s, tuple(p[1:])) for s, p in zip(sid.tolist(), prefixes)]
        return torch.stack(rows).unsqueeze(1).expand(-1, T, -1).clone()  # (b, T, V)

    def decode(self, tgt: torch.Tensor, memory: torch.Tensor | None, src_keep: torch.Tensor | None = None, *,
               cache: StubCache | None = None, project: bool = True) -> torch.Tensor:
        self.rows_per_step.append(tgt.size(0))
        if cache is not None:
            cache.hist = torch.cat([cache.hist, tgt], dim=1)
            return self._logits(cache.sid, cache.hist.tolist(), tgt.size(1))
        assert memory is not None
        return self._logits(memory[:, 0, 0].long(), tgt.tolist(), tgt.size(1))

    def project(self, h: torch.Tensor) -> torch.Tensor:
        return h


def test_the_stub_and_the_transformer_are_what_search_needs():
    """Both implement the protocols search is typed with (mypy checks the signatures of the real ones)."""
    model = Transformer(preset("tiny", src_vocab_size=V, tgt_vocab_size=V))
    for m, src in ((StubModel(), src_for(0, 1)), (model, torch.tensor([[A, B_, EOS], [B_, EOS, PAD]]))):
        assert isinstance(m, search.SearchModel)
        memory = m.encode(src)
        assert isinstance(m.new_cache(memory, torch.ones(2, memory.size(1), dtype=torch.bool)), search.SearchCache)
    assert not isinstance(SimpleNamespace(encode=None), search.SearchModel)


def src_for(*sids, length=3):
    return torch.tensor([[10 + s] + [7] * (length - 1) for s in sids])


L = math.log


@pytest.mark.parametrize("use_cache", [True, False])
def test_beam_exact_tokens_scores_and_nbest_order(use_cache):
    model = StubModel()
    out = beam_search(model, src_for(0, 1), BOS, EOS, beam=2, alpha=0.0, nbest=2, use_cache=use_cache)
    (h0, h1) = out
    assert [t for t, _ in h0] == [[B_], [A, B_]]
    assert h0[0][1] == pytest.approx(L(0.3) + L(0.95))
    assert h0[1][1] == pytest.approx(L(0.6) + L(0.45) + L(1.0))
    assert [t for t, _ in h1] == [[], [A]]
    assert h1[0][1] == pytest.approx(L(0.7))
    assert h1[1][1] == pytest.approx(L(0.2))
    # the first step runs one row per sentence (its beams are still identical), then 2 sentences x
    # 2 beams; sentence 1 is done after step 1 and leaves the batch: 1 x 2
    assert model.rows_per_step == [2, 4, 2]


def test_length_penalty_flips_the_order_and_len_counts_eos():
    out = beam_search(StubModel(), src_for(0), BOS, EOS, beam=2, alpha=1.0, nbest=2)[0]
    assert [t for t, _ in out] == [[A, B_], [B_]]
    # len counts generated tokens including EOS: [a b]+EOS is 3, [b]+EOS is 2.
    assert out[0][1] == pytest.approx((L(0.6) + L(0.45)) / ((5 + 3) / 6))
    assert out[1][1] == pytest.approx((L(0.3) + L(0.95)) / ((5 + 2) / 6))
    assert length_penalty(3, 0.6) == pytest.approx((8 / 6) ** 0.6)
    # the default alpha, 0.6, already prefers the longer one: -1.309/1.189 > -1.255/1.097
    best = beam_search(StubModel(), src_for(0), BOS, EOS, beam=2)[0]
    assert best == [([A, B_], pytest.approx((L(0.6) + L(0.45)) / (8 / 6) ** 0.6))]


def test_min_len_forbids_early_eos():
    out = beam_search(StubModel(), src_for(1), BOS, EOS, beam=2, alpha=0.0, nbest=2, min_len=1)[0]
    assert all(len(t) >= 1 for t, _ in out)
    assert out[0] == ([A], pytest.approx(L(0.2)))
    assert greedy_search(StubModel(), src_for(1), BOS, EOS, min_len=1) == [[A]]
    assert greedy_search(StubModel(), src_for(1), BOS, EOS) == [[]]


@pytest.mark.parametrize("use_cache", [True, False])
def test_max_length_forces_eos_and_is_a_times_len_plus_b(use_cache):
    src = src_for(2, length=4)  # 4 source tokens
    # a=0.5, b=1 -> floor(0.5 * 4 + 1) = 3 tokens at most, then a forced EOS that is scored
    out = beam_search(StubModel(), src, BOS, EOS, beam=2, alpha=0.0, max_len_a=0.5, max_len_b=1, use_cache=use_cache)
    assert out[0][0][0] == [A, A, A]
    assert out[0][0][1] == pytest.approx(3 * L(0.6) + L(0.01))
    assert greedy_search(StubModel(), src, BOS, EOS, max_len_a=0.5, max_len_b=1, use_cache=use_cache) == [[A, A, A]]
    # default a=1, b=50: source length + 50
    assert greedy_search(StubModel(), src, BOS, EOS) == [[A] * 54]


@pytest.mark.parametrize("kwargs", [dict(beam=0), dict(beam=2, nbest=3), dict(nbest=0), dict(alpha=-1.0),
                                    dict(min_len=-1), dict(max_len_b=-5)])
def test_impossible_settings_are_user_errors(kwargs):
    with pytest.raises(AiaynError):
        beam_search(StubModel(), src_for(0), BOS, EOS, **kwargs)


# --- a real random-weight Transformer -------------------------------------------------------------

def random_model(vocab=40, seed=1):
    torch.manual_seed(seed)
    model = Transformer(preset("tiny", src_vocab_size=vocab, tgt_vocab_size=vocab)).eval()
    with torch.no_grad():  # make EOS likely enough that lengths vary
        model.tgt_embed.weight[EOS] *= 3
    return model


def random_batch(lengths, vocab=40, seed=2):
    g = torch.Generator().manual_seed(seed)
    src = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        src[i, :n] = torch.randint(4, vocab, (n,), generator=g)
    return src


def test_beam_one_equals_greedy():
    model, src = random_model(), random_batch([5, 9, 3, 7])
    greedy = greedy_search(model, src, BOS, EOS, max_len_b=10)
    beam1 = beam_search(model, src, BOS, EOS, beam=1, max_len_b=10)
    assert [h[0][0] for h in beam1] == greedy
    assert len({len(g) for g in greedy}) > 1  # the sentences really end at different steps


@pytest.mark.parametrize("beam", [1, 4])
def test_cached_equals_uncached(beam):
    model, src = random_model(), random_batch([6, 2, 8, 4, 5])
    cached = beam_search(model, src, BOS, EOS, beam=beam, nbest=beam, max_len_b=10)
    uncached = beam_search(model, src, BOS, EOS, beam=beam, nbest=beam, max_len_b=10, use_cache=False)
    assert [[t for t, _ in h] for h in cached] == [[t for t, _ in h] for h in uncached]
    for hc, hu in zip(cached, uncached):
        assert [s for _, s in hc] == pytest.approx([s for _, s in hu], abs=1e-4)
    assert greedy_search(model, src, BOS, EOS, max_len_b=10) == greedy_search(
        model, src, BOS, EOS, max_len_b=10, use_cache=False)


def test_row_blocks_do_not_change_the_search(monkeypatch):
    """The vocabulary stage runs on blocks of rows (`ROW_BLOCK`): any block size gives the same
    tokens and scores, forced EOS at the length limit and min_len across block edges included."""

    model, src = random_model(), random_batch([6, 2, 8, 4, 5, 7, 3])
    kw = dict(beam=4, nbest=4, max_len_b=6, min_len=2)
    want = beam_search(model, src, BOS, EOS, **kw)
    for block in (1, 3, 5):
        monkeypatch.setattr(search, "ROW_BLOCK", block)
        assert beam_search(model, src, BOS, EOS, **kw) == want
    bf16 = copy.deepcopy(model).to(torch.bfloat16)  # bf16 logits are upcast into a float32 buffer
    monkeypatch.setattr(search, "ROW_BLOCK", 128)
    want16 = beam_search(bf16, src, BOS, EOS, **kw)
    monkeypatch.setattr(search, "ROW_BLOCK", 3)
    assert beam_search(bf16, src, BOS, EOS, **kw) == want16

@pytest.mark.parametrize("V,k", [(8000, 8), (200, 8), (64, 2), (48, 3)])
def test_topk_rows_gives_the_values_of_topk(V, k):
    """The strided two-stage top-k returns exactly topk's values, with ties and -inf rows."""
    from aiayn.search import _topk_rows

    g = torch.Generator().manual_seed(V)
    x = torch.randn(37, V, generator=g).log_softmax(-1)
    x[0] = float("-inf")
    x[0, 5] = -1.0  # a forced row: one finite value
    x[1] = x[1].round(decimals=0)  # many ties
    x[2, : V // 2] = float("-inf")
    x[3, :] = 0.0
    v, i = _topk_rows(x, k)
    want_v, _ = x.topk(k, dim=1)
    assert torch.equal(v, want_v)
    assert torch.equal(x.gather(1, i), v)
    assert all(len(set(row)) == k for row in i.tolist())  # k distinct tokens per row


@pytest.mark.parametrize("V", [8000, 8003, 58101, 2047, 100])
def test_argmax_rows_is_argmax(V, monkeypatch):
    """Greedy's sliced arg-max is argmax exactly: the first maximum of each row, ties, -inf rows,
    NaN (argmax's largest), a maximum in the columns past the last whole slice, a strided input;
    narrow rows are sliced too (the width from which it slices lowered to 16)."""
    from aiayn.search import _argmax_rows

    monkeypatch.setattr(search, "ARGMAX_MIN_WIDTH", 16 if V < 2048 else search.ARGMAX_MIN_WIDTH)
    g = torch.Generator().manual_seed(V)
    x = torch.randn(41, V, generator=g)
    x[0] = float("-inf")
    x[1] = x[1].round(decimals=0)  # many ties: the first one wins
    x[2, :] = 0.0
    x[3, V // 3] = x[3, V - 1] = float("nan")
    x[4, V - 1] = 100.0  # the tail's maximum (past 8 * (V // 8) when 8 does not divide V)
    x[5, V - 1] = float("nan")
    x[6, 7] = x[6, V - 1] = 100.0  # equal maxima in the head and the tail: the head's is first
    x[7, -3:] = float("-inf")
    for y in (x, x[::2], torch.cat([x, x], 1)[:, :V], x[:3], x[:0]):
        assert torch.equal(_argmax_rows(y), y.argmax(1))


def test_fast_topk_does_not_change_the_search(monkeypatch):

    model, src = random_model(vocab=200), random_batch([6, 2, 8, 4, 5], vocab=200)
    kw = dict(beam=4, nbest=4, max_len_b=6)
    fast = beam_search(model, src, BOS, EOS, **kw)
    monkeypatch.setattr(search, "TOPK_GROUPS", 7)  # 200 % 7 != 0: plain topk
    assert beam_search(model, src, BOS, EOS, **kw) == fast


@pytest.mark.parametrize("beam", [1, 4])
def test_on_done_gives_each_sentence_its_result_as_soon_as_it_is_done(beam, monkeypatch):
    """What a server answers early is what the search returns, at the step each sentence ends
    (in that order), not once the batch is done."""
    model, src = random_model(), random_batch([6, 2, 8, 4, 5])
    steps, seen = [], []
    hidden = search._hidden
    monkeypatch.setattr(search, "_hidden", lambda *args: steps.append(1) or hidden(*args))
    done = lambda row, result: seen.append((row, result, len(steps)))  # noqa: E731
    if beam == 1:
        out = greedy_search(model, src, BOS, EOS, max_len_b=10, on_done=done)
    else:
        out = beam_search(model, src, BOS, EOS, beam=beam, nbest=2, max_len_b=10, on_done=done)
    assert sorted(row for row, _, _ in seen) == [0, 1, 2, 3, 4]
    assert all(result == out[row] for row, result, _ in seen)
    at = [step for _, _, step in seen]
    assert at == sorted(at) and at[0] < at[-1] == len(steps)  # the first one steps before the last


@pytest.mark.parametrize("beam", [1, 4])
def test_sentences_leaving_in_place_change_nothing(beam, monkeypatch):
    """Finished sentences' places taken by the last live ones (`_survivors`), the source side moved
    in place (`cache.moves`): results and early answers bitwise those of copying it, int8 too."""
    from aiayn import cache as cache_mod
    from aiayn.kernels import quantize_int8

    for int8 in (False, True):
        model, src = random_model(), random_batch([6, 2, 8, 4, 5, 3, 7])
        if int8:
            quantize_int8(model.requires_grad_(False))
        runs = []
        for in_place in (True, False):
            monkeypatch.setattr(cache_mod, "IN_PLACE", in_place)
            seen = []
            done = lambda row, result: seen.append((row, result))  # noqa: E731,B023
            if beam == 1:
                out = greedy_search(model, src, BOS, EOS, max_len_b=10, on_done=done)
            else:
                out = beam_search(model, src, BOS, EOS, beam=beam, nbest=2, max_len_b=10, on_done=done)
            runs.append((out, sorted(seen)))
        assert runs[0] == runs[1]


def test_a_batch_without_any_source_token_decodes_as_with_autograd_on():
    """The encoder's gathers over packed tokens have nothing to gather from: zeros, as the spread
    layout (taken with autograd on) gives."""
    model, src = random_model(), torch.zeros(2, 3, dtype=torch.long)
    with torch.no_grad():
        fast = model.encode(src)
    with torch.enable_grad():
        spread = model.encode(src)
    assert torch.equal(fast, spread.detach())
    assert greedy_search(model, src, BOS, EOS, max_len_b=3) == greedy_search(model, src[:1], BOS, EOS, max_len_b=3) * 2
    assert len(beam_search(model, src, BOS, EOS, beam=2, max_len_b=3)) == 2


def test_batch_invariance():
    model = random_model()
    batch = random_batch([4, 11, 9, 12])
    alone = batch[:1, :4]
    for search in (lambda s: beam_search(model, s, BOS, EOS, beam=4, nbest=4, max_len_b=8),
                   lambda s: greedy_search(model, s, BOS, EOS, max_len_b=8)):
        one, many = search(alone)[0], search(batch)[0]
        if isinstance(one, list) and one and isinstance(one[0], tuple):
            assert [t for t, _ in one] == [t for t, _ in many]
            assert [s for _, s in one] == pytest.approx([s for _, s in many], abs=1e-4)
        else:
            assert one == many


def test_bf16_autocast_runs():
    model, src = random_model(), random_batch([5, 3])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = beam_search(model, src, BOS, EOS, beam=3, max_len_b=5)
        greedy = greedy_search(model, src, BOS, EOS, max_len_b=5)
    assert len(out) == 2 and all(len(h[0][0]) <= 5 + 5 for h in out)
    assert len(greedy) == 2


def _general_step(decoder, x, cache, src_keep):
    """`step.decoder_step` done by the decoder's general forward on one position (the path before it)."""
    return decoder(x[:, None], None, src_keep, None, False, cache, None)[:, 0]


STEP_KINDS = ["post-norm", "pre-norm", "gelu", "swish", "int8", "int8 pre-norm", "int8 gelu", "int8 swish", "bf16",
              "fp16", "autocast", "sdpa", "dropout", "pre-norm dropout", "ff training", "int8 dropout",
              "int8 ff training", "int8 mixed eps", "int8 long self keys", "int8 long cross keys", "short rows",
              "int8 short rows", "bf16 short rows", "int8 onednn copies", "float step", "float step pre-norm", "float step gelu",
              "float step swish", "float step bf16", "float step dropout", "trainable", "python step"]
# step._StepPlan (int8, or frozen float32 or bf16 on the CPU) or _FloatStepPlan (a GPU's float step, here on
# the CPU) runs every step of these; "int8 long self keys" until the keys outgrow the explicit attention
COMPILED = {"post-norm", "pre-norm", "gelu", "swish", "short rows", "int8", "int8 pre-norm", "int8 gelu", "int8 swish",
            "int8 short rows", "float step", "float step pre-norm", "float step gelu", "float step swish",
            "float step bf16"} | ({"bf16", "bf16 short rows"} if kernels.packs(torch.ones(1), torch.bfloat16) else set())
LONG_KEYS = {"int8 long self keys": 9, "int8 long cross keys": 8}  # EXPLICIT_ATTENTION_MAX_KEYS; sources of 9
DROPOUTS = {"dropout": 0.3, "attention_dropout": 0.2, "activation_dropout": 0.25}  # apart: a mix-up shows


def _step_model(kind):
    from aiayn.kernels import quantize_int8

    overrides = {"pre-norm": {"norm_first": True}, "gelu": {"activation": "gelu"}, "swish": {"activation": "swish"},
                 "dropout": DROPOUTS, "pre-norm dropout": {"norm_first": True, **DROPOUTS}, "ff training": DROPOUTS}
    base = kind.removeprefix("int8 ").removeprefix("float step ")
    torch.manual_seed(3)
    model = Transformer(preset("tiny", src_vocab_size=40, tgt_vocab_size=40, **overrides.get(base, {}))).eval()
    model.requires_grad_(False)  # frozen: the packed (and int8) inference GEMMs, as Translator runs
    with torch.no_grad():
        model.tgt_embed.weight[EOS] *= 3
        for m in model.modules():  # norms and biases apart from 1 and 0: a mix-up between them shows
            if isinstance(m, (nn.LayerNorm, nn.Linear)):
                for t in (m.weight, m.bias) if isinstance(m, nn.LayerNorm) else (m.bias,):
                    t.add_(torch.randn_like(t) * 0.3)
    if base == "mixed eps":
        model.decoder.layers[1].norm2.eps = 1e-3
    if kind.startswith("int8"):
        quantize_int8(model)
    if kind.startswith("float step") or kind == "trainable":  # as on a GPU: F.linear, no packed weights
        model.requires_grad_(True)
    if base in ("bf16", "fp16", "bf16 short rows"):  # fp16: masked_fill rather than an additive mask
        model = model.to(torch.bfloat16 if base.startswith("bf16") else torch.float16)
    if kind.endswith("dropout"):
        model.decoder.train()  # dropout in the decoder only (the step path follows each module's flag)
    if base == "ff training":
        for layer in model.decoder.layers:
            layer.ff.train()  # activation dropout alone
    return model


@pytest.mark.parametrize("kind", STEP_KINDS)
def test_decoder_step_is_the_general_path_exactly(kind, monkeypatch):
    """Search's cached steps take `step.decoder_step`, the same operations as the decoder's forward
    with fewer calls: hidden states, greedy and beam results are bitwise those of the general path,
    through reorders, finished sentences and beam rows sharing their sentence's cross-attention keys;
    also under autocast, on SDPA, with dropout on (the same random numbers drawn), and on the
    compiled steps, int8, float32 and bf16 (whose plan is refused where it does not apply, as under dropout, and which
    leaves a step to Python from the rows where a layer's oneDNN copy runs: 6 rows here)."""
    from aiayn import step as step_module

    if kind == "int8 onednn copies":
        if kernels.WIDE_ENGINE not in torch.backends.quantized.supported_engines:
            pytest.skip("no oneDNN quantized engine in this torch")
        monkeypatch.setattr(kernels, "WIDE_RATIO", 1)  # every layer keeps one, run from 6 rows
        monkeypatch.setattr(kernels, "WIDE_MIN_ROWS", {torch.backends.cpu.get_cpu_capability(): 6})
    model = _step_model(kind)
    if kind == "int8 onednn copies":
        assert kernels._INT8[id(model.decoder.layers[0].ff.w1.weight)][2].rows == 6
    if kind == "sdpa" or kind.startswith("float step"):
        monkeypatch.setattr(kernels, "EXPLICIT_ATTENTION_MAX_KEYS", 0)
    if kind.startswith("float step"):  # the GPU's compiled float step, here on the CPU
        monkeypatch.setattr(step_module, "FLOAT_STEP_DEVICES", ("cpu",))
    if kind in LONG_KEYS:
        monkeypatch.setattr(kernels, "EXPLICIT_ATTENTION_MAX_KEYS", LONG_KEYS[kind])
    if kind == "python step":  # the frozen float32 model's Python step (a failed compile, bench's rows)
        monkeypatch.setattr(step_module, "COMPILED_STEPS", False)
    if kind.endswith("short rows"):  # every float32 attention's softmax and weighted sum spelled out
        monkeypatch.setattr(kernels, "SHORT_ROW", 10**6)  # (kernels.softmax_rows, weigh_values); bf16's never
        monkeypatch.setattr(kernels, "SHORT_ROWS_MIN", 1)
        monkeypatch.setattr(kernels, "SMALL_BMM", 10**6)
    src = random_batch([5, 9, 3, 7, 1])
    calls: list[bool] = []  # per fast step: whether a compiled step ran it (step._StepPlan.run, _FloatStepPlan.run)
    fast = step_module.decoder_step

    def spy(decoder, x, cache, src_keep):
        calls.append(False)
        return fast(decoder, x, cache, src_keep)

    def noting(run):
        def ran(*args):
            calls[-1] = True
            return run(*args)
        return ran

    monkeypatch.setattr(step_module, "decoder_step", spy)
    for plan in (step_module._StepPlan, step_module._FloatStepPlan):
        monkeypatch.setattr(plan, "run", noting(plan.run))
    runs = []
    for step in (None, _general_step):
        if step is not None:
            monkeypatch.setattr(step_module, "decoder_step", step)
        torch.manual_seed(4)
        out = []
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "autocast"):
            keep = src.ne(0)
            cache = model.new_cache(model.encode(src, keep), keep)
            tok = torch.full((5, 1), BOS)
            for t in range(12 if kind == "int8 long self keys" else 4):  # hidden states past 9 keys too
                out.append(model.decode(tok, None, cache=cache, project=False))
                tok = torch.randint(4, 40, (tok.size(0), 1), generator=torch.Generator().manual_seed(t))
                if t == 1:
                    cache.reorder(torch.tensor([0, 0, 2, 2, 3, 3]), beam=2)  # sentences 1 and 4 leave; beams of 2
                    tok = tok.new_full((6, 1), 7)
            longer = {"min_len": 11} if kind == "int8 long self keys" else {}  # past 9 keys
            out.append(greedy_search(model, src, BOS, EOS, max_len_b=12, **longer))
            out.append(beam_search(model, src, BOS, EOS, beam=3, nbest=3, max_len_b=12, **longer))
        runs.append(out)
    assert calls  # the fast path ran, compiled where it applies, and only there
    partly = ("int8 long self keys", "int8 onednn copies")
    assert all(calls) if kind in COMPILED else any(calls) if kind in partly else not any(calls)
    if kind in partly:
        assert not all(calls)  # the longest searches outgrew the limit; steps of 6 rows or more
    for got, want in zip(*runs):
        assert got == want if isinstance(got, list) else torch.equal(got, want)


@pytest.mark.parametrize("kind", ["post-norm", "float step"])
def test_a_compiled_step_leaves_steps_with_gradients_to_python(kind, monkeypatch):
    """With gradients on (a cached decode outside search), a compiled step's appends into storage
    would fail once a gradient reaches the keys (`cat(out=)` records none): Python's step runs every
    step, and search, under inference mode, takes the compiled one. The CPU step (`_StepPlan`): the
    decoder's norms trainable, its linear layers frozen (packed); the float step (`_FloatStepPlan`,
    here on the CPU): the decoder trainable. The embeddings stay frozen, so the step's input needs
    no gradient."""
    from aiayn import step

    plan = step._StepPlan if kind == "post-norm" else step._FloatStepPlan
    monkeypatch.setattr(step, "FLOAT_STEP_DEVICES", ("cpu",))
    ran: list[int] = []
    run = plan.run
    monkeypatch.setattr(plan, "run", lambda *a: (ran.append(1), run(*a))[1])
    model = _step_model(kind)
    model.tgt_embed.weight.requires_grad_(False)
    trainable = [n.weight for layer in model.decoder.layers for n in (layer.norm1, layer.norm2, layer.norm3)]
    for w in trainable if kind == "post-norm" else []:
        w.requires_grad_(True)
    src = random_batch([5, 3])
    keep = src.ne(0)
    cache = model.new_cache(model.encode(src, keep), keep)
    tok = torch.full((2, 1), BOS)
    for _ in range(3):
        out = model.decode(tok, None, cache=cache)
        tok = out[:, -1].argmax(-1, keepdim=True)
    out.sum().backward()  # the steps were recorded for autograd
    assert not ran and trainable[0].grad is not None
    with torch.inference_mode():
        greedy_search(model, src, BOS, EOS, max_len_b=3)
    assert ran


def test_a_three_dimensional_source_mask_takes_the_general_path():
    """decode accepts src_keep as (B, T, S) with a cache; the step path takes (N, S) only."""
    model = _step_model("post-norm")
    src = random_batch([5, 9])
    with torch.inference_mode():
        keep = src.ne(0)
        cache = model.new_cache(model.encode(src, keep), keep)
        h = model.decode(torch.full((2, 1), BOS), None, src_keep=keep[:, None, :], cache=cache, project=False)
    assert h.shape == (2, 1, model.cfg.d_model)


def test_forbid_sets_minus_infinity_at_the_ids_inside_the_vocabulary():
    """`_forbid` bans each id in range in every row (duplicates and ids past the vocabulary, such as
    a pad id of another vocabulary, are harmless) and leaves the other columns alone."""
    from aiayn.search import _forbid

    x = torch.randn(3, 10)
    want = x.clone()
    want[:, [1, 4]] = float("-inf")
    for _ in range(2):  # the second call reuses the index
        got = x.clone()
        _forbid(got, (4, 1, 4, 10, 99))
        assert torch.equal(got, want)
    same = x.clone()
    _forbid(same, (10, 12))
    assert torch.equal(same, x)
    with torch.inference_mode():  # the index made during a search serves autograd afterwards
        _forbid(torch.zeros(1, 7), (2, 3))
    y = torch.randn(2, 7, requires_grad=True) * 1.0
    _forbid(y, (2, 3))
    y.logsumexp(1).sum().backward()


def test_greedy_keeps_each_sentences_own_length_limit_as_rows_leave():
    """Each sentence stops at its own limit, floor(a * its length + b), while others leave before
    it (the last live rows take their places: the limits move with them); each output is what the
    sentence gets alone. (EOS made unlikely: every sentence runs to its limit, at 2 to 8 tokens.)"""
    model = _step_model("post-norm")
    with torch.no_grad():
        model.tgt_embed.weight[EOS] = 0.0  # tied: EOS's logit is its bias alone
    src = random_batch([5, 9, 3, 7, 1, 8, 12, 4])
    lengths = src.ne(0).sum(1).tolist()
    with torch.inference_mode():
        got = greedy_search(model, src, BOS, EOS, max_len_a=0.5, max_len_b=2)
        alone = [greedy_search(model, src[i:i + 1, :n], BOS, EOS, max_len_a=0.5, max_len_b=2)[0]
                 for i, n in enumerate(lengths)]
    assert got == alone
    assert [len(g) for g in got] == [int(0.5 * n + 2) for n in lengths] == [4, 6, 3, 5, 2, 6, 8, 4]


def test_collect_keeps_the_k_best_finished_and_the_score_to_beat():
    """`_collect` (beam search's finished hypotheses): the rows that `fin` marks join their original
    sentences' lists with the length penalty applied; with `worst` ("best" rule) each list keeps its
    K best and `worst` takes the K-th score where there are K, in the sentence's live row."""
    from aiayn.search import _collect

    K = R = 2
    sent = torch.tensor([5, 7])  # live row -> original sentence
    tokens = torch.tensor([[1, 10], [1, 11], [1, 12], [1, 13]])  # (b*R, 1 + t): BOS and one token
    top_beam = torch.tensor([[0, 1, 0, 1], [1, 0, 0, 1]])
    top_scores = torch.tensor([[-1.0, -2.0, -3.0, -4.0], [-0.5, -1.5, -3.0, -4.0]])
    fin = torch.tensor([[True, True, False, False], [False, True, False, False]])
    finals: list = [[] for _ in range(8)]
    finals[7] = [([9], -0.1), ([8], -2.0)]
    worst = torch.full((2,), float("-inf"))
    _collect(finals, worst, fin, sent, tokens, top_beam, top_scores, R, K, 2.0)
    assert finals[5] == [([10], -0.5), ([11], -1.0)]
    assert finals[7] == [([9], -0.1), ([12], -0.75)]  # -0.75 displaces -2.0
    assert worst.tolist() == [-1.0, -0.75]
    plain: list = [[] for _ in range(8)]
    _collect(plain, None, fin, sent, tokens, top_beam, top_scores, R, K, 2.0)  # "first": appended only
    assert plain[5] == [([10], -0.5), ([11], -1.0)] and plain[7] == [([12], -0.75)]
