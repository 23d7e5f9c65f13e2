"""Pictures of the model and its training: positional encodings (Section 3.5), attention maps
(Section 3.2, the paper's Figures 3-5), learning curves, and the learning-rate schedule (Section 5.3).

Each picture is made by a function that takes plain data (arrays, or a model and its tokenizers) and
returns a matplotlib `Figure` together with the numbers it drew, so tests compare the picture's
data with the model's. `save_figure` writes PNG, or SVG/PDF when the file name ends so.

We build `matplotlib.figure.Figure` objects directly and never import pyplot: no GUI backend is
chosen, no display is needed, and no global figure registry grows; `savefig` renders PNG with Agg.

Command line: `aiayn plot positional-encoding|attention|curves|lr-schedule ... -o FILE`.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import sys
import textwrap
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from aiayn.checkpoint import is_metrics_record
from aiayn.config import learning_rate
from aiayn.errors import AiaynError
from aiayn.files import check_output_path, write_output_bytes
from aiayn.model import PositionalEncoding, Transformer
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID, PIECES

FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}
DEFAULT_DPI = 150
SPECIAL_LABELS = {i: PIECES[i] for i in (PAD_ID, BOS_ID, EOS_ID)}  # axis labels of the special ids


# ----------------------------------------------------------------------------------------- output


def image_format(path: str | os.PathLike) -> str:
    """'png', 'svg' or 'pdf' from the file name; AiaynError for anything else."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise AiaynError(f"-o {path}: the name must end in .png, .svg or .pdf (got {suffix or 'no extension'!r})")
    return FORMATS[suffix]


MAX_DPI = 1200
MAX_PIXELS = 32768  # a side of a PNG; matplotlib's own limit is 65536, and memory runs out before it
MAX_AREA = 2 ** 27  # pixels of a PNG in all (134 M; drawing takes ~9 bytes a pixel: a side's limit alone let ~9 GB through)
MAX_ATTENTION_TOKENS = 200  # a side of an attention map; longer ones are unreadable at any size


def check_dpi(dpi: int) -> None:
    if not 1 <= dpi <= MAX_DPI:
        raise AiaynError(f"--dpi must be between 1 and {MAX_DPI}, got {dpi}")


# characters XML 1.0 cannot hold, and lone surrogates (a name's invalid UTF-8, as os.fsdecode keeps it),
# which no font can draw (a TypeError from matplotlib)
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def printable(text: str) -> str:
    """`text` with the control characters XML cannot hold written as escapes ("\\x1b"): an SVG keeps
    each text of the picture in a comment, and one such character (a terminal's colour code pasted
    into --src) made the file unreadable to every viewer. Lone surrogates too ("\\udcff")."""
    return _NOT_XML.sub(lambda m: ascii(m[0])[1:-1], text)


_MISSING_GLYPH = re.compile(r"Glyph (\d+) .*missing from")  # matplotlib's warning, one per character and draw


def _report(caught: list[warnings.WarningMessage]) -> None:
    """matplotlib's warnings while drawing, passed on, except those for characters the font lacks
    (a --src in Chinese, an emoji): two lines each, naming matplotlib's source, for what is one
    thing to say: those characters are drawn as boxes."""
    missing: dict[str, None] = {}
    for w in caught:
        if (m := _MISSING_GLYPH.match(str(w.message))) and int(m[1]) < 0x110000:
            missing[chr(int(m[1]))] = None
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if missing:
        chars = " ".join(printable(c) for c in missing)
        print(f"aiayn plot: note: the font has no glyph for {chars}; drawn as boxes", file=sys.stderr, flush=True)


def save_figure(fig: Figure, path: str | os.PathLike, dpi: int = DEFAULT_DPI) -> Path:
    """Write `fig` atomically (a temporary file renamed into place); the format follows the name.

    The figure is saved at its own size (no tight bounding box), so a PNG is
    `fig.get_size_inches() * dpi` pixels (rounded down).
    """
    path = Path(path)
    fmt = image_format(path)
    check_dpi(dpi)
    w, h = (int(x * dpi) for x in fig.get_size_inches())
    if fmt == "png" and max(w, h) > MAX_PIXELS:
        raise AiaynError(f"the picture would be {w} x {h} pixels, more than {MAX_PIXELS} a side; lower --dpi "
                         "(or draw less)")
    if fmt == "png" and w * h > MAX_AREA:  # (an attention map of many layers, heads and tokens)
        raise AiaynError(f"the picture would be {w} x {h} pixels, {w * h / 1e6:.0f} million, more than "
                         f"{MAX_AREA / 1e6:.0f} million; lower --dpi, draw less (attention: --layers, --kind), "
                         "or write .svg or .pdf")
    buf = io.BytesIO()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig.savefig(buf, format=fmt, dpi=dpi, facecolor="white")
    _report(caught)
    try:
        write_output_bytes(path, buf.getvalue())
    except OSError as e:
        raise AiaynError(f"-o {path}: cannot write ({e.strerror or e}); choose another file name") from None
    return path


# ---------------------------------------------------------------------------- positional encoding


MAX_TABLE = 2**25  # positions x dimensions of an encoding table to draw (128 MB of float32)
MAX_STEPS = 10**7  # steps of a learning-rate curve (the paper trains for 100k and 300k; T5 for 2^20)


def positional_encoding_table(d_model: int, max_len: int) -> np.ndarray:
    """What the model adds to the embeddings at positions 0..max_len-1: (max_len, d_model)."""
    if d_model <= 0 or d_model % 2:
        raise AiaynError(f"--d-model must be a positive even number, got {d_model}")
    if max_len <= 0:
        raise AiaynError(f"--max-len must be positive, got {max_len}")
    if max_len * d_model > MAX_TABLE:  # (a table of billions of values once ran out of memory with a traceback)
        raise AiaynError(f"--max-len {max_len} x --d-model {d_model} is more than the {MAX_TABLE} values a plot "
                         "draws; give fewer positions or dimensions")
    with torch.no_grad():
        # Run the model's own module on zeros, so the picture is the encoding as the model applies it.
        return PositionalEncoding(d_model, max_len)(torch.zeros(1, max_len, d_model))[0].numpy()


def wavelength(dim: int, d_model: int) -> float:
    """Period in positions of encoding dimension `dim`: 2*pi * 10000^(2i/d_model), i = dim // 2."""
    return 2 * math.pi * 10000.0 ** (2 * (dim // 2) / d_model)


def positional_encoding_figure(
    d_model: int, max_len: int, dims: Sequence[int] | None = None
) -> tuple[Figure, np.ndarray]:
    """A heatmap of the encoding (position by dimension) and a few dimensions as curves.

    Returns the figure and the (max_len, d_model) table it shows.
    """
    table = positional_encoding_table(d_model, max_len)
    if dims is None:  # a sine/cosine pair, then slower wavelengths
        base = max(2, d_model // 16) // 2 * 2
        dims = sorted({base, base + 1, d_model // 8 // 2 * 2, d_model // 4 // 2 * 2} & set(range(d_model)))
    for d in dims:
        if not 0 <= d < d_model:
            raise AiaynError(f"--dims: dimension {d} is outside 0..{d_model - 1}")

    fig = Figure(figsize=(13, 5), layout="constrained")
    heat, lines = fig.subplots(1, 2, width_ratios=[1.15, 1])
    im = heat.imshow(table, aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest")
    heat.set_title("Encoding value at each position and dimension")
    heat.set_xlabel("encoding dimension (even: sine, odd: cosine; wavelength grows to the right)")
    heat.set_ylabel("position in the sentence")
    fig.colorbar(im, ax=heat, label="value added to the embedding", shrink=0.9)

    positions = np.arange(max_len)
    for d in dims:
        kind = "sin" if d % 2 == 0 else "cos"
        lines.plot(positions, table[:, d], lw=1.6, label=f"dim {d} ({kind}, wavelength {wavelength(d, d_model):.1f})")
    lines.set_title("Selected dimensions over position")
    lines.set_xlabel("position in the sentence")
    lines.set_ylabel("encoding value")
    lines.set_ylim(-1.15, 1.45)
    lines.grid(alpha=0.3)
    lines.legend(loc="upper right", fontsize=9, ncols=2 if len(dims) > 3 else 1, framealpha=0.9)
    fig.suptitle(
        f"Sinusoidal positional encoding (Section 3.5), d_model = {d_model}, positions 0-{max_len - 1}:   "
        r"$PE_{(pos,\,2i)} = \sin(pos\,/\,10000^{2i/d_{model}})$,   "
        r"$PE_{(pos,\,2i+1)} = \cos(pos\,/\,10000^{2i/d_{model}})$",
        fontsize=12,
    )
    return fig, table


# -------------------------------------------------------------------------------------- attention


@dataclass
class AttentionMaps:
    """The attention probabilities for one sentence pair, and the tokens on each axis.

    encoder: (L_enc, H, S, S); decoder_self: (L_dec, H, T, T); cross: (L_dec, H, T, S).
    Decoder rows are target positions: position t reads `tgt_in_labels[t]` and predicts
    `tgt_out_labels[t]`.
    """

    encoder: np.ndarray
    decoder_self: np.ndarray
    cross: np.ndarray
    src_labels: list[str]
    tgt_in_labels: list[str]
    tgt_out_labels: list[str]
    src_text: str = ""
    tgt_text: str = ""


def _labels(ids: list[int], tokenizer: Any) -> list[str]:
    """Axis labels: the subword piece of each id ("▁" marks a word start), special tokens by name."""
    return [SPECIAL_LABELS.get(i) or printable(tokenizer.id_to_piece(i)) for i in ids]


def attention_inputs(tokenizers: Any, src_ids: list[int], tgt_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[str], list[str], list[str]]:
    """Source and decoder-input tensors (1, S), (1, T) built as training batches are
    (`aiayn.data.text.collate`), and the labels of the source, decoder input and decoder output tokens."""
    from aiayn.data.text import collate

    if not src_ids:
        raise AiaynError("--src encodes to no tokens; give a non-empty sentence")
    batch = collate([(list(src_ids), list(tgt_ids))], [0])
    return (batch.src, batch.tgt_in, _labels(batch.src[0].tolist(), tokenizers.src),
            _labels(batch.tgt_in[0].tolist(), tokenizers.tgt), _labels(batch.tgt_out[0].tolist(), tokenizers.tgt))


@torch.no_grad()
def attention_arrays(model: Transformer, src: torch.Tensor, tgt_in: torch.Tensor) -> dict[str, np.ndarray]:
    """The model's attention probabilities for one sentence pair, through its opt-in
    `attention_weights` path, in eval mode (no dropout).

    Shape: src (1, S), tgt_in (1, T) -> {"encoder": (L, H, S, S), "decoder_self": (L, H, T, T),
    "cross": (L, H, T, S)}.
    """
    if src.dim() != 2 or tgt_in.dim() != 2 or src.size(0) != 1 or tgt_in.size(0) != 1:
        raise AiaynError(f"attention maps take one sentence pair, got src {tuple(src.shape)}, tgt_in {tuple(tgt_in.shape)}")
    was_training = model.training
    model.eval()
    try:
        weights = model.attention_weights(src, tgt_in)
    finally:
        model.train(was_training)
    return {k: torch.stack([w[0].float() for w in ws]).numpy() for k, ws in weights.items()}


@torch.no_grad()
def greedy_ids(model: Transformer, src: torch.Tensor, max_len_a: float = 1.0,
               max_len_b: int = 50) -> tuple[list[int], bool]:
    """The model's greedy translation of one source (1, S) (aiayn.search.greedy_search), in eval mode,
    at most MAX_ATTENTION_TOKENS long: a longer one cannot be drawn, and a model that never ends a
    sentence would decode to any --max-len-b (minutes, and gigabytes of attention) only to be refused.
    Also whether it ended by itself (EOS chosen) rather than at the length limit."""
    from aiayn.search import LENGTH_CAP, greedy_search

    # past LENGTH_CAP no limit either way: an int past float's range cannot be added below, a huge a
    # makes an infinite limit that would skip the cap (an infinite a itself the search refuses)
    max_len_b = min(max_len_b, LENGTH_CAP)
    if math.isfinite(max_len_a):
        max_len_a = min(max_len_a, float(LENGTH_CAP))
    limit = max_len_a * src.size(1) + max_len_b
    if max_len_a >= 0 and max_len_b >= 0 and MAX_ATTENTION_TOKENS < limit < math.inf:  # else the search refuses them
        max_len_a, max_len_b = 0.0, MAX_ATTENTION_TOKENS
    was_training = model.training
    model.eval()
    try:
        ids = greedy_search(model, src, BOS_ID, EOS_ID, max_len_a=max_len_a, max_len_b=max_len_b)[0]
        return ids, len(ids) < max(1, math.floor(max_len_a * src.size(1) + max_len_b))  # (as search's limit)
    finally:
        model.train(was_training)


def attention_maps(model: Transformer, tokenizers: Any, src_text: str, tgt_text: str | None = None,
                   max_len_a: float = 1.0, max_len_b: int = 50) -> AttentionMaps:
    """Attention of `model` reading `src_text` and producing `tgt_text`, or its own greedy
    translation (the exact tokens it chose) when `tgt_text` is None. The source ends with EOS if
    the model was trained so (`ModelConfig.source_eos`), as translation feeds it."""
    from aiayn.tokenizer import EOS_ID

    src_ids = tokenizers.src.encode(src_text)
    if src_ids and model.cfg.source_eos:
        src_ids = src_ids + [EOS_ID]
    _check_readable("source", len(src_ids), "--src")
    ended = True
    if tgt_text is None:
        src, _, _, _, _ = attention_inputs(tokenizers, src_ids, [])
        tgt_ids, ended = greedy_ids(model, src, max_len_a, max_len_b)
        tgt_text = tokenizers.tgt.decode(tgt_ids)
    else:
        tgt_ids = tokenizers.tgt.encode(tgt_text)
        _check_readable("target", len(tgt_ids) + 1, "--tgt")
    src, tgt_in, src_labels, tgt_in_labels, tgt_out_labels = attention_inputs(tokenizers, src_ids, tgt_ids)
    if not ended:  # cut at the length limit: no position predicted EOS, so the last row is not drawn
        tgt_in, tgt_in_labels, tgt_out_labels = tgt_in[:, :-1], tgt_in_labels[:-1], tgt_out_labels[:-1]
    arrays = attention_arrays(model, src, tgt_in)
    return AttentionMaps(arrays["encoder"], arrays["decoder_self"], arrays["cross"], src_labels, tgt_in_labels,
                         tgt_out_labels, src_text, tgt_text)


def _check_layers(layers: Sequence[int] | None, kind: str, n: int) -> None:
    """--layers (1-based; None: all) against the `n` layers of one attention kind."""
    bad = [x for x in layers or () if not 1 <= x <= n]
    if bad:
        raise AiaynError(f"--layers: layer {bad[0]} does not exist; the model has {n} ({kind})")


def _check_readable(side: str, tokens: int, flag: str) -> None:
    """Refuses a sentence too long to draw before any attention is computed (quadratic in its length)."""
    if tokens > MAX_ATTENTION_TOKENS:
        raise AiaynError(f"{flag}: the {side} is {tokens} tokens; attention maps are readable up to "
                         f"{MAX_ATTENTION_TOKENS} a side: use a shorter {flag}")


ATTENTION_KINDS = ("encoder", "decoder", "cross")
_SECTION = {  # kind -> (AttentionMaps field, title, x label, y label)
    "encoder": ("encoder", "Encoder self-attention: each source token (row) attends over the source (columns)",
                "source token attended to", "source token attending"),
    "decoder": ("decoder_self", "Decoder self-attention: each target position attends over itself and earlier ones "
                "(grey: masked future)",
                "target token read at that position", "target position, labelled by the token it predicts"),
    "cross": ("cross", "Encoder-decoder attention: each target position (row) attends over the source (columns)",
              "source token attended to", "target position, labelled by the token it predicts"),
}


def _section_labels(maps: AttentionMaps, kind: str) -> tuple[list[str], list[str]]:
    """(x labels, y labels) of a section."""
    if kind == "encoder":
        return maps.src_labels, maps.src_labels
    if kind == "decoder":
        return maps.tgt_in_labels, maps.tgt_out_labels
    return maps.src_labels, maps.tgt_out_labels


def attention_figure(maps: AttentionMaps, kinds: Sequence[str] = ATTENTION_KINDS, layers: Sequence[int] | None = None,
                     title: str | None = None) -> tuple[Figure, dict[str, np.ndarray]]:
    """Grids of attention maps, one section per kind (rows: layers, columns: heads), the subword
    pieces as axis labels and a shared 0-1 colour scale.

    `layers` are 1-based layer numbers (default: all). Returns the figure and, per kind, the
    (layers, H, T_q, T_k) array drawn.
    """
    for kind in kinds:
        if kind not in _SECTION:
            raise AiaynError(f"--kind: unknown attention kind {kind!r}; choose from {', '.join(ATTENTION_KINDS)}")
    drawn: dict[str, np.ndarray] = {}
    numbers: dict[str, list[int]] = {}  # 1-based layer numbers drawn, per kind
    sizes = []  # (width, height) in inches per section
    for kind in kinds:
        arr = getattr(maps, _SECTION[kind][0])
        n_layers = arr.shape[0]
        _check_layers(layers, kind, n_layers)
        chosen = list(range(1, n_layers + 1)) if not layers else list(layers)
        drawn[kind], numbers[kind] = arr[[n - 1 for n in chosen]], chosen
        xl, yl = _section_labels(maps, kind)
        L, H, Tq, Tk = drawn[kind].shape
        if max(Tq, Tk) > MAX_ATTENTION_TOKENS:
            raise AiaynError(f"the {kind} attention map would be {Tq} x {Tk} tokens; it is readable up to "
                             f"{MAX_ATTENTION_TOKENS} a side: use a shorter --src or --tgt (without --tgt, the "
                             "model's own translation: lower --max-len-a/--max-len-b)")
        cell = 0.19  # inches per token: room for a 7-point label
        pw, ph = max(1.3, cell * Tk), max(1.3, cell * Tq)
        margin_x = 0.07 * max(map(len, yl)) + 1.3  # y tick labels, layer labels, colorbar
        margin_y = 0.07 * max(map(len, xl)) + 1.1  # x tick labels, section title
        sizes.append((H * (pw + 0.12) + margin_x + 1.0, L * (ph + 0.3) + margin_y))

    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#d9d9d9")
    # Quarter inches are exact in binary, so a PNG is exactly size * dpi pixels for any integer dpi.
    width = math.ceil(4 * max(7.0, max(w for w, _ in sizes))) / 4
    sizes = [(w, math.ceil(4 * h) / 4) for w, h in sizes]
    if title:  # wrapped to the figure's width (about 10 characters of 12-point text per inch)
        title = "\n".join(textwrap.fill(part, width=max(40, int(width * 10))) for part in printable(title).split("\n"))
    title_h = 0.25 * (title.count("\n") + 1) if title else 0.0  # quarter inches keep the size exact
    fig = Figure(figsize=(width, sum(h for _, h in sizes) + 0.25 + title_h), layout="constrained")
    subfigs = fig.subfigures(len(kinds), 1, height_ratios=[h for _, h in sizes], squeeze=False)[:, 0]
    for sub, kind in zip(subfigs, kinds):
        arr = drawn[kind]
        L, H, Tq, Tk = arr.shape
        xl, yl = _section_labels(maps, kind)
        axes = sub.subplots(L, H, squeeze=False)
        future = np.triu(np.ones((Tq, Tk), dtype=bool), k=1)  # (T, T) above the diagonal
        for li in range(L):
            for h in range(H):
                ax = axes[li, h]
                # Future positions of decoder self-attention are masked, not merely unattended: grey.
                shown = np.ma.masked_where(future, arr[li, h]) if kind == "decoder" else arr[li, h]
                im = ax.imshow(shown, cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest", aspect="equal")
                ax.set_xticks(range(Tk))
                ax.set_yticks(range(Tq))
                ax.set_xticklabels(xl if li == L - 1 else [], rotation=90, fontsize=7, parse_math=False)
                ax.set_yticklabels(yl if h == 0 else [], fontsize=7, parse_math=False)
                ax.tick_params(length=0)
                if li == 0:
                    ax.set_title(f"head {h + 1}", fontsize=9)
                if h == 0:
                    ax.set_ylabel(f"layer {numbers[kind][li]}", fontsize=9, fontweight="bold")
        sub.colorbar(im, ax=axes, label="attention weight", shrink=min(1.0, 3.0 / max(L, 1) + 0.3), aspect=25)
        _, section_title, xlabel, ylabel = _SECTION[kind]
        sub.suptitle(section_title, fontsize=11, fontweight="bold")
        sub.supxlabel(xlabel, fontsize=9)
        sub.supylabel(ylabel, fontsize=9)
    if title:  # a "$" of the text is a dollar sign, not TeX
        fig.suptitle(title, fontsize=12, parse_math=False)
    return fig, drawn


# ----------------------------------------------------------------------------------------- curves


def find_metrics(path: str | os.PathLike) -> Path:
    """metrics.jsonl for a run: `path` itself if a file (or a pipe, `<(ssh host cat run/metrics.jsonl)`:
    it is read once; it was "no such file or directory"), else in `path` (a run directory), else in
    its parent (`path` is a checkpoint inside a run directory)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        return path
    if not path.is_dir():
        raise AiaynError(f"--checkpoint {path}: no such file or directory")
    for candidate in (path / "metrics.jsonl", path.parent / "metrics.jsonl"):
        if candidate.is_file():
            return candidate
    raise AiaynError(f"--checkpoint {path}: no metrics.jsonl in it or its parent; pass the --out directory of `aiayn train`")


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl; AiaynError names the file and line of a bad one."""
    path = Path(path)
    records = []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise AiaynError(f"{path}: cannot read metrics ({e})") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        # ValueError: JSONDecodeError, and an int past Python's 4,300 digits; RecursionError: nested too deep
        except (ValueError, RecursionError) as e:
            if n == len(text.splitlines()) and not text.endswith("\n"):
                continue  # a last line cut short by a run still writing it
            why = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply" if isinstance(
                e, RecursionError) else f"a number of more than {sys.get_int_max_str_digits()} digits"
            raise AiaynError(f"{path}:{n}: not a JSON object ({why})") from None
        # the trainer's own test, and a step the int64 axis can hold
        if not is_metrics_record(rec) or not -2**63 <= rec["step"] < 2**63:
            raise AiaynError(f'{path}:{n}: expected an object with "kind": "train" or "valid" and an integer "step"')
        records.append(rec)
    return records


def _number(value: Any) -> float | None:
    """A record's value as a finite float, else None (null for a diverged step, true/false, an
    integer past float's range: math.isfinite raised OverflowError on one)."""
    if type(value) not in (int, float):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def _series(records: list[dict[str, Any]], kind: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of `key` in records of `kind`, sorted by step; when a step appears more than
    once (a run resumed from an earlier checkpoint logs it again) the later record wins."""
    by_step: dict[int, float] = {}
    for rec in records:
        value = _number(rec.get(key)) if rec["kind"] == kind else None
        if value is not None:
            by_step[rec["step"]] = value
    steps = sorted(by_step)
    return np.array(steps, dtype=np.int64), np.array([by_step[s] for s in steps], dtype=np.float64)


def curves_figure(records: list[dict[str, Any]], title: str | None = None,
                  source: str = "the metrics file") -> tuple[Figure, dict[str, np.ndarray]]:
    """Training and validation loss, validation BLEU (and chrF), and the learning rate against
    step. Returns the figure and the series drawn ("train_loss", "valid_loss", "valid_nll", "bleu",
    "chrf", "lr"), each a (steps, values) pair stacked as a (2, n) array. `source` names the records'
    file in the error for none to draw."""
    series = {
        "train_loss": _series(records, "train", "loss"),
        "valid_loss": _series(records, "valid", "loss"),
        "valid_nll": _series(records, "valid", "nll"),
        "bleu": _series(records, "valid", "bleu"),
        "chrf": _series(records, "valid", "chrf"),
        "lr": _series(records, "train", "lr"),
    }
    if not any(len(s) for s, _ in series.values()):
        # (a run writes its first train line after --log-every steps: a plot made early meets this)
        raise AiaynError(f"{source} has no train or valid records with numbers to plot yet; a run writes a train "
                         "line every --log-every steps and a valid line at each validation")

    fig = Figure(figsize=(15, 4.6), layout="constrained")
    ax_loss, ax_bleu, ax_lr = fig.subplots(1, 3)
    s, v = series["train_loss"]
    if len(s):
        ax_loss.plot(s, v, color="tab:blue", lw=1.2, alpha=0.85, label="training loss")
    s, v = series["valid_loss"]
    if len(s):
        ax_loss.plot(s, v, color="tab:orange", lw=1.8, marker="o", ms=4, label="validation loss")
    s, v = series["valid_nll"]
    if len(s):
        ax_loss.plot(s, v, color="tab:red", lw=1.4, ls="--", marker="s", ms=3, label="validation NLL (no label smoothing)")
    ax_loss.set_title("Loss per target token (the training objective)")
    ax_loss.set_ylabel("loss (nats)")

    s, v = series["bleu"]
    if len(s):
        ax_bleu.plot(s, v, color="tab:green", lw=1.8, marker="o", ms=4, label="BLEU")
        best = int(np.argmax(v))
        ax_bleu.plot(s[best], v[best], marker="*", ms=14, color="tab:red", ls="none",
                     label=f"best BLEU {v[best]:.2f} at step {s[best]}")
    s, v = series["chrf"]
    if len(s):
        ax_bleu.plot(s, v, color="tab:purple", lw=1.4, ls="--", marker="s", ms=3, label="chrF")
    ax_bleu.set_title("Validation scores (sacreBLEU)")
    ax_bleu.set_ylabel("score (0-100)")

    s, v = series["lr"]
    if len(s):
        ax_lr.plot(s, v, color="tab:gray", lw=1.6, label="learning rate")
    ax_lr.set_title("Learning rate")
    ax_lr.set_ylabel("learning rate")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))

    for ax in (ax_loss, ax_bleu, ax_lr):
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
        if ax.lines:
            ax.legend(fontsize=9)
        else:
            ax.text(0.5, 0.5, "no records", transform=ax.transAxes, ha="center", va="center", color="gray")
    if title:  # a "$" of a run's name is a dollar sign, not TeX
        fig.suptitle(printable(title), fontsize=12, parse_math=False)
    return fig, {k: np.stack([s.astype(np.float64), v]) for k, (s, v) in series.items()}


# -------------------------------------------------------------------------------------- lr schedule


def schedule(steps: np.ndarray, d_model: int, warmup: int, factor: float = 1.0, cooldown: int = 0,
             max_steps: int = 0) -> np.ndarray:
    """The trainer's learning rate (`aiayn.config.learning_rate`, Section 5.3) at each step."""
    return np.array([learning_rate(int(s), d_model, warmup, factor, cooldown, max_steps) for s in steps],
                    dtype=np.float64)


def lr_schedule_figure(d_models: Sequence[int], warmups: Sequence[int], steps: int | None = None,
                       factor: float = 1.0, cooldown: int = 0,
                       max_steps: int = 0) -> tuple[Figure, dict[str, np.ndarray]]:
    """One curve per (d_model, warmup) pair (with a run's `--cooldown` ramp before `max_steps`, if
    any). Returns the figure and {legend label: lr per step 1..steps}."""
    for d in d_models:
        if d <= 0:
            raise AiaynError(f"--d-model must be positive, got {d}")
    for w in warmups:
        if w <= 0:
            raise AiaynError(f"--warmup must be positive, got {w}")
    if not 0 < factor < math.inf:  # nan fails too
        raise AiaynError(f"--factor must be a positive finite number, got {factor}")
    given = steps is not None
    steps = steps if steps is not None else (max_steps if cooldown else 10 * max(warmups))
    if steps < 1:
        raise AiaynError(f"--steps must be at least 1, got {steps}")
    if steps > MAX_STEPS:
        default = "" if given else " (the default: --max-steps)" if cooldown else " (the default: 10 x --warmup)"
        raise AiaynError(f"--steps {steps}{default} is more than the {MAX_STEPS} steps a curve draws; "
                         f"give --steps {MAX_STEPS} or fewer")
    x = np.arange(1, steps + 1)
    fig = Figure(figsize=(10, 5.2), layout="constrained")
    ax = fig.subplots()
    drawn: dict[str, np.ndarray] = {}
    styles = ["-", "--", ":", "-."]  # per warmup: same-d_model curves coincide after warmup, dashes keep both visible
    for d in d_models:
        for k, w in enumerate(warmups):
            lr = schedule(x, d, w, factor, cooldown, max_steps)
            label = f"d_model = {d}, warmup = {w}"
            (line,) = ax.plot(x, lr, lw=1.8, ls=styles[k % len(styles)], label=f"{label}  (peak {lr.max():.2e} at step {int(x[np.argmax(lr)])})")
            if w <= steps:
                ax.plot(w, lr[w - 1], marker="o", color=line.get_color(), ms=6)
            drawn[label] = lr
    ax.set_xlabel("training step")
    ax.set_ylabel("learning rate")
    ax.set_xlim(0, steps)
    ax.set_ylim(bottom=0)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
    f = "" if factor == 1.0 else f"{factor:g} · "
    ramp = f", ramped down over steps {max_steps - cooldown + 1}-{max_steps}" if cooldown else ""
    ax.set_title(
        "Learning-rate schedule (Section 5.3): "
        rf"lrate = {f}$d_{{model}}^{{-0.5}} \cdot \min(step^{{-0.5}},\ step \cdot warmup^{{-1.5}})${ramp}",
        fontsize=11,
    )
    return fig, drawn


# ------------------------------------------------------------------------------------------- CLI


def _checkpoint_config(path: str) -> dict[str, Any]:
    """config.json of a checkpoint (or of a run directory's best/newest one); no weights are loaded."""
    from aiayn.checkpoint import read_config, resolve_checkpoint

    return read_config(resolve_checkpoint(path))


def _config_value(cfg: dict[str, Any], section: str, key: str, path: str, default: float | None = None) -> float:
    """A number of config.json, or `default` where it has none (older runs); plot reads the raw
    JSON, so a hand-edited value ("32x") is refused here, not met as a traceback."""
    value = (cfg.get(section) or {}).get(key)  # read_config: each section is an object or absent
    if value is None and default is None:
        raise AiaynError(f"--checkpoint {path}: config.json has no {section}.{key}")
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AiaynError(f"--checkpoint {path}: config.json's {section}.{key} is {value!r}, not a number; "
                         "use another checkpoint")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="picture", metavar="PICTURE", required=True)
    fmt = parser.formatter_class  # `aiayn`'s: the defaults shown, none where it is None (the help says it)

    def common(p: argparse.ArgumentParser, default_name: str) -> None:
        p.add_argument("-o", "--output", default=default_name, help="image file: .png, .svg or .pdf")
        p.add_argument("--dpi", type=int, default=DEFAULT_DPI, help="pixels per inch of a PNG")

    p = sub.add_parser("positional-encoding", formatter_class=fmt,
                       help="the sinusoidal positional encoding as a heatmap and as curves")
    p.add_argument("--d-model", type=int, default=None, help="model width (default 512; not with --checkpoint, whose width it is)")
    p.add_argument("--max-len", type=int, default=100, help="number of positions drawn")
    p.add_argument("--dims", type=int, nargs="+", default=None,
                   help="dimensions drawn as curves (default: a sine/cosine pair near d_model/16, d_model/8, d_model/4)")
    p.add_argument("--checkpoint", default=None, help="take d_model from this checkpoint or run directory")
    common(p, "positional-encoding.png")

    p = sub.add_parser("attention", formatter_class=fmt,
                       help="attention maps per layer and head for one sentence")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory, or a run directory (uses its best/)")
    p.add_argument("--src", required=True, help="source sentence")
    p.add_argument("--tgt", default=None, help="target sentence (default: the model's greedy translation)")
    p.add_argument("--kind", choices=("all",) + ATTENTION_KINDS, default="all",
                   help="which attention: encoder self-, decoder self-, cross-attention, or all three in one image")
    p.add_argument("--layers", type=int, nargs="+", default=None, help="1-based layer numbers to draw (default: all)")
    p.add_argument("--max-len-a", type=float, default=1.0, help="greedy translation: at most a * source length + b tokens")
    p.add_argument("--max-len-b", type=int, default=50, help="greedy translation: at most a * source length + b tokens")
    common(p, "attention.png")

    p = sub.add_parser("curves", formatter_class=fmt,
                       help="training/validation loss, validation BLEU and learning rate from metrics.jsonl")
    p.add_argument("--checkpoint", required=True,
                   help="run directory, a checkpoint in it, or a metrics.jsonl file")
    common(p, "curves.png")

    p = sub.add_parser("lr-schedule", formatter_class=fmt, help="the paper's learning-rate schedule")
    # defaults filled in by `_schedule_flags`: with --checkpoint the run's own settings stand instead
    p.add_argument("--d-model", type=int, nargs="+", default=None, help="one or more model widths (default: 512)")
    p.add_argument("--warmup", type=int, nargs="+", default=None, help="one or more warm-up step counts (default: 4000)")
    p.add_argument("--factor", type=float, default=None,
                   help="multiplier of the whole schedule (--lr-factor of training; default: 1)")
    p.add_argument("--steps", type=int, default=None, help="last step drawn (default: 10 x the largest warmup)")
    p.add_argument("--checkpoint", default=None,
                   help="draw the schedule of this checkpoint or run (its d_model, warmup and lr_factor)")
    common(p, "lr-schedule.png")


def _schedule_flags(args: argparse.Namespace) -> tuple[list[int], list[int], float]:
    """lr-schedule's --d-model, --warmup and --factor, with their defaults; refused beside
    --checkpoint, whose run's own settings would replace them unseen."""
    given = [flag for flag, value in (("--d-model", args.d_model), ("--warmup", args.warmup), ("--factor", args.factor))
             if value is not None]
    if args.checkpoint and given:
        raise AiaynError(f"{given[0]} and --checkpoint: the checkpoint's run sets d_model, warmup and the factor; "
                         f"give one or the other")
    return args.d_model or [512], args.warmup or [4000], 1.0 if args.factor is None else args.factor


def run(args: argparse.Namespace) -> int:
    if args.checkpoint == "":  # (lr-schedule and positional-encoding drew the defaults without a word)
        raise AiaynError("--checkpoint '': an empty name (an unset shell variable?); give a run directory or a "
                         "checkpoint in it")
    image_format(args.output)  # fail on a bad name or --dpi before any work
    check_dpi(args.dpi)
    check_output_path(args.output, "-o")  # before any work; no folder is made for it
    if args.picture == "positional-encoding":
        d_model = 512 if args.d_model is None else args.d_model
        if args.checkpoint:
            if args.d_model is not None:  # (it was ignored without a word; lr-schedule refuses the same mix)
                raise AiaynError("--d-model and --checkpoint: the checkpoint sets d_model; give one of the two")
            d_model = int(_config_value(_checkpoint_config(args.checkpoint), "model", "d_model", args.checkpoint))
        fig, _ = positional_encoding_figure(d_model, args.max_len, args.dims)
    elif args.picture == "attention":
        from aiayn.checkpoint import load_checkpoint, resolve_checkpoint

        if not (0 <= args.max_len_a < math.inf and args.max_len_b >= 0):  # nan fails too
            raise AiaynError(f"--max-len-a and --max-len-b must be finite numbers >= 0, got {args.max_len_a} and "
                             f"{args.max_len_b}")
        ckpt = load_checkpoint(resolve_checkpoint(args.checkpoint))
        kinds = ATTENTION_KINDS if args.kind == "all" else (args.kind,)
        cfg = ckpt.model.cfg
        for kind in kinds:  # before the model runs, which may take a while
            _check_layers(args.layers, kind, cfg.encoder_layers if kind == "encoder" else cfg.decoder_layers)
        maps = attention_maps(ckpt.model, ckpt.tokenizers, args.src, args.tgt, args.max_len_a, args.max_len_b)
        source = "the model's greedy translation" if args.tgt is None else "the given target"
        path = ckpt.path.resolve()  # `--checkpoint .` has no name of its own
        name = f"{path.parent.name}/{path.name}"
        title = f"Attention weights of {name}\n\u201c{args.src}\u201d \u2192 \u201c{maps.tgt_text}\u201d ({source})"
        fig, _ = attention_figure(maps, kinds, args.layers, title)
    elif args.picture == "curves":
        path = find_metrics(args.checkpoint)
        fig, _ = curves_figure(read_metrics(path), title=f"Training run {path.parent.resolve().name} ({path.name})",
                               source=str(path))
    else:
        d_models, warmups, factor = _schedule_flags(args)
        ramp = (0, 0)
        if args.checkpoint:  # the schedule that run trained with
            cfg = _checkpoint_config(args.checkpoint)
            d_models = [int(_config_value(cfg, "model", "d_model", args.checkpoint))]
            warmups = [int(_config_value(cfg, "train", "warmup", args.checkpoint))]
            factor = float(_config_value(cfg, "train", "lr_factor", args.checkpoint))
            ramp = (int(_config_value(cfg, "train", "cooldown", args.checkpoint, 0)),  # older runs: none
                    int(_config_value(cfg, "train", "max_steps", args.checkpoint, 0)))
        fig, _ = lr_schedule_figure(d_models, warmups, args.steps, factor, *ramp)
    out = save_figure(fig, args.output, args.dpi)
    print(out)
    return 0
