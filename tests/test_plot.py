"""Pictures: each command writes an image of the expected size, and each picture shows the model's
own numbers (the positional table, attention rows that sum to 1 with nothing above the decoder's
diagonal, the trainer's learning rate, the records of metrics.jsonl)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import torch

from aiayn import checkpoint, plot
from aiayn.cli import main
from aiayn.config import TrainConfig, learning_rate, preset
from aiayn.errors import AiaynError
from aiayn.model import Transformer, sinusoidal_table
from aiayn.search import greedy_search
from aiayn.tokenizer import BOS_ID, EOS_ID, Tokenizer, TokenizerPair

SENTENCES = [
    "Ein Mann fährt Fahrrad.", "A man rides a bike.", "Zwei Hunde spielen im Schnee.", "Two dogs play in the snow.",
    "Eine Frau liest ein Buch.", "A woman reads a book.", "Kinder laufen am Strand.", "Children run on the beach.",
    "Ein Junge springt ins Wasser.", "A boy jumps into the water.", "Die Katze schläft auf dem Sofa.",
    "The cat sleeps on the sofa.", "Ein Mann spielt Gitarre auf der Straße.", "A man plays guitar on the street.",
]
SRC, TGT = "Ein Mann fährt Fahrrad.", "A man rides a bike."


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG, after checking it is not blank."""
    img = matplotlib.image.imread(path)  # (H, W, 4)
    assert img.ndim == 3 and float(img[..., :3].std()) > 0.01, "the image is blank"
    return img.shape[1], img.shape[0]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """A tiny model gains nothing from threads, and on a shared machine they only contend."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizers():
    tok = Tokenizer.train(SENTENCES * 5, 400)
    return TokenizerPair(tok, tok, joint=True)


@pytest.fixture(scope="module")
def model(tokenizers):
    torch.manual_seed(0)
    v = tokenizers.src.vocab_size
    return Transformer(preset("tiny", src_vocab_size=v, tgt_vocab_size=v, dropout=0.1)).eval()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, model, tokenizers):
    """A run directory as `aiayn train --out` leaves it: best/, a step checkpoint and metrics.jsonl."""
    run = tmp_path_factory.mktemp("run")
    cfg = {"train": TrainConfig(warmup=300, lr_factor=2.0).to_dict(), "step": 40}
    checkpoint.save_checkpoint(run / "best", model, tokenizers, cfg)
    checkpoint.save_checkpoint(run / "step_40", model, tokenizers, cfg)
    with open(run / "metrics.jsonl", "w") as f:
        for step in range(10, 41, 10):
            f.write(json.dumps({"kind": "train", "step": step, "epoch": 0, "loss": 9.0 - step / 10,
                                "lr": learning_rate(step, 32, 300, 2.0), "tokens_per_s": 1e3, "elapsed_s": step}) + "\n")
        for step, bleu in ((20, 1.5), (40, 3.25)):
            f.write(json.dumps({"kind": "valid", "step": step, "epoch": step // 20 - 1, "loss": 8.0 - step / 20,
                                "nll": 7.5 - step / 20, "bleu": bleu, "chrf": 10 * bleu, "elapsed_s": step}) + "\n")
    return run


# ------------------------------------------------------------------------------ positional encoding


def test_positional_encoding_picture_is_the_models_table():
    fig, table = plot.positional_encoding_figure(64, 50, dims=[4, 5, 20])
    model = Transformer(preset("tiny", d_model=64, n_heads=4))
    with torch.no_grad():  # what the model adds to an all-zero embedding
        added = model.pos(torch.zeros(1, 50, 64))[0].numpy()
    np.testing.assert_array_equal(table, added)
    np.testing.assert_allclose(table, sinusoidal_table(50, 64).numpy(), atol=0)
    heat, lines = fig.axes[0], fig.axes[1]
    np.testing.assert_array_equal(heat.images[0].get_array(), table)  # rows: positions, columns: dimensions
    assert [tuple(line.get_ydata()) for line in lines.lines] == [tuple(table[:, d]) for d in (4, 5, 20)]
    assert "dim 4 (sin" in lines.lines[0].get_label() and "dim 5 (cos" in lines.lines[1].get_label()
    assert math.isclose(plot.wavelength(20, 64), 2 * math.pi * 10000 ** (20 / 64))
    assert heat.get_xlabel() and heat.get_ylabel() and lines.get_xlabel() and fig.get_suptitle()


def test_positional_encoding_cli_writes_png_of_the_figure_size(tmp_path):
    out = tmp_path / "pe.png"
    assert main(["plot", "positional-encoding", "--d-model", "64", "--max-len", "30", "--dpi", "40", "-o", str(out)]) == 0
    assert png_size(out) == (13 * 40, 5 * 40)


def test_positional_encoding_takes_d_model_from_a_checkpoint(tmp_path, run_dir, monkeypatch):
    seen = []
    real = plot.positional_encoding_figure
    monkeypatch.setattr(plot, "positional_encoding_figure", lambda d, n, dims=None: seen.append(d) or real(d, n, dims))
    out = tmp_path / "pe.svg"
    assert main(["plot", "positional-encoding", "--checkpoint", str(run_dir), "--max-len", "20", "-o", str(out)]) == 0
    assert seen == [32]  # the tiny preset's width, read from best/config.json
    svg = out.read_text(encoding="utf-8")
    assert svg.lstrip().startswith("<?xml") and 'width="936pt"' in svg and 'height="360pt"' in svg  # 13 x 5 in
    # a width beside the checkpoint's was ignored without a word (lr-schedule refuses the same mix)
    assert main(["plot", "positional-encoding", "--checkpoint", str(run_dir), "--d-model", "64", "-o", str(out)]) == 2
    assert seen == [32] and out.read_text(encoding="utf-8") == svg
    assert main(["plot", "positional-encoding", "--max-len", "20", "-o", str(out)]) == 0 and seen == [32, 512]


def test_positional_encoding_rejects_bad_settings():
    with pytest.raises(AiaynError, match="even"):
        plot.positional_encoding_figure(63, 10)
    with pytest.raises(AiaynError, match="--dims"):
        plot.positional_encoding_figure(64, 10, dims=[64])


# ----------------------------------------------------------------------------------------- attention


def test_attention_rows_sum_to_one_and_decoder_sees_no_future(model, tokenizers):
    maps = plot.attention_maps(model, tokenizers, SRC, TGT)
    S, T = len(tokenizers.src.encode(SRC)) + 1, len(tokenizers.tgt.encode(TGT)) + 1  # source + EOS; BOS + target
    assert maps.encoder.shape == (2, 4, S, S)
    assert maps.decoder_self.shape == (2, 4, T, T)
    assert maps.cross.shape == (2, 4, T, S)
    for arr in (maps.encoder, maps.decoder_self, maps.cross):
        np.testing.assert_allclose(arr.sum(-1), 1.0, atol=1e-5)
        assert (arr >= 0).all()
    above = np.triu(np.ones((T, T), dtype=bool), k=1)
    assert (maps.decoder_self[..., above] == 0).all()
    assert (maps.decoder_self[..., ~above] > 0).all()
    assert not model.training  # the eval mode it came in with is kept


def test_attention_figure_draws_those_weights_with_subword_labels(model, tokenizers):
    maps = plot.attention_maps(model, tokenizers, SRC, TGT)
    pieces_src = [tokenizers.src.id_to_piece(i) for i in tokenizers.src.encode(SRC)]
    pieces_tgt = [tokenizers.tgt.id_to_piece(i) for i in tokenizers.tgt.encode(TGT)]
    assert maps.src_labels == pieces_src + ["</s>"]  # the source as the model reads it
    assert maps.tgt_in_labels == ["<s>"] + pieces_tgt  # what each decoder position reads
    assert maps.tgt_out_labels == pieces_tgt + ["</s>"]  # what it predicts
    fig, drawn = plot.attention_figure(maps)
    sections = {"encoder": maps.encoder, "decoder": maps.decoder_self, "cross": maps.cross}
    for sub, (kind, arr) in zip(fig.subfigs, sections.items()):
        np.testing.assert_array_equal(drawn[kind], arr)
        axes = sub.axes[:-1]  # the last one is the colorbar
        assert len(axes) == 2 * 4
        for i, ax in enumerate(axes):  # row-major: layer, then head
            shown = ax.images[0].get_array()
            np.testing.assert_array_equal(np.ma.getdata(shown), arr[i // 4, i % 4])
            if kind == "decoder":  # the masked future is drawn as 'masked' (grey), not as weight 0
                assert np.array_equal(np.ma.getmaskarray(shown), np.triu(np.ones(shown.shape, dtype=bool), 1))
        xl, yl = [t.get_text() for t in axes[-1].get_xticklabels()], [t.get_text() for t in axes[0].get_yticklabels()]
        want_x = maps.tgt_in_labels if kind == "decoder" else maps.src_labels
        want_y = maps.src_labels if kind == "encoder" else maps.tgt_out_labels
        assert (xl, yl) == (want_x, want_y)
        assert sub._suptitle.get_text() and sub._supxlabel.get_text() and sub._supylabel.get_text()


def test_attention_default_is_the_models_greedy_translation(model, tokenizers):
    maps = plot.attention_maps(model, tokenizers, SRC)
    src = torch.tensor([tokenizers.src.encode(SRC) + [EOS_ID]])
    ids = greedy_search(model, src, BOS_ID, EOS_ID)[0]
    assert maps.tgt_text == tokenizers.tgt.decode(ids)
    ended = len(ids) < src.size(1) + 50  # (this untrained model runs to the length limit: no EOS predicted)
    assert maps.tgt_out_labels == [tokenizers.tgt.id_to_piece(i) for i in ids] + ["</s>"] * ended
    np.testing.assert_allclose(maps.decoder_self.sum(-1), 1.0, atol=1e-5)


def test_attention_png_has_the_figure_size_and_kind_layers_select(tmp_path, model, tokenizers):
    maps = plot.attention_maps(model, tokenizers, SRC, TGT)
    fig, drawn = plot.attention_figure(maps, kinds=["cross"], layers=[2])
    assert list(drawn) == ["cross"] and len(fig.subfigs) == 1
    np.testing.assert_array_equal(drawn["cross"], maps.cross[1:2])
    out = plot.save_figure(fig, tmp_path / "a.png", dpi=30)
    w, h = fig.get_size_inches()
    assert png_size(out) == (math.floor(w * 30), math.floor(h * 30))  # quarter inches: exact products
    with pytest.raises(AiaynError, match="--layers: layer 3"):
        plot.attention_figure(maps, layers=[3])


def test_attention_cli_through_a_checkpoint(tmp_path, run_dir):
    out = tmp_path / "att.svg"
    assert main(["plot", "attention", "--checkpoint", str(run_dir), "--src", SRC, "--tgt", TGT, "--kind", "decoder",
                 "-o", str(out)]) == 0
    svg = out.read_text(encoding="utf-8")
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    out = tmp_path / "att.png"
    # An untrained model's greedy translation runs to the length limit; keep it short.
    assert main(["plot", "attention", "--checkpoint", str(run_dir / "step_40"), "--src", SRC, "--max-len-a", "0",
                 "--max-len-b", "4", "--layers", "1", "--dpi", "20", "-o", str(out)]) == 0
    png_size(out)


# -------------------------------------------------------------------------------------------- curves


def test_curves_draw_the_metrics_records(tmp_path, run_dir):
    path = plot.find_metrics(run_dir / "best")  # next to a checkpoint: the run's file
    assert path == run_dir / "metrics.jsonl" and plot.find_metrics(run_dir) == path
    fig, drawn = plot.curves_figure(plot.read_metrics(path))
    np.testing.assert_array_equal(drawn["train_loss"], [[10, 20, 30, 40], [8, 7, 6, 5]])
    np.testing.assert_array_equal(drawn["bleu"], [[20, 40], [1.5, 3.25]])
    np.testing.assert_array_equal(drawn["lr"][1], [learning_rate(s, 32, 300, 2.0) for s in (10, 20, 30, 40)])
    ax_loss, ax_bleu, ax_lr = fig.axes
    assert [tuple(ln.get_ydata()) for ln in ax_loss.lines] == [(8, 7, 6, 5), (7, 6), (6.5, 5.5)]
    assert "best BLEU 3.25 at step 40" in [ln.get_label() for ln in ax_bleu.lines]
    assert all(ax.get_xlabel() == "training step" and ax.get_ylabel() and ax.get_title() for ax in fig.axes)


def test_curves_cli_png_size(tmp_path, run_dir):
    out = tmp_path / "c.png"
    assert main(["plot", "curves", "--checkpoint", str(run_dir), "--dpi", "40", "-o", str(out)]) == 0
    assert png_size(out) == (15 * 40, round(4.6 * 40))


def test_metrics_reader_resume_duplicates_torn_line_and_errors(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"kind": "train", "step": 1, "loss": 5.0}\n{"kind": "train", "step": 2, "loss": 4.0}\n'
                 '{"kind": "train", "step": 2, "loss": 3.5}\n{"kind": "train", "st')
    _, drawn = plot.curves_figure(plot.read_metrics(f))  # a resumed run's re-logged step: the later one counts
    np.testing.assert_array_equal(drawn["train_loss"], [[1, 2], [5.0, 3.5]])
    f.write_text('{"kind": "train", "step": 1, "loss": 5.0}\nnot json\n{"kind": "train", "step": 2, "loss": 4.0}\n')
    with pytest.raises(AiaynError, match=r"metrics.jsonl:2: not a JSON object"):
        plot.read_metrics(f)
    f.write_text('{"kind": "other", "step": 1}\n')
    with pytest.raises(AiaynError, match=r":1: expected"):
        plot.read_metrics(f)
    f.write_text("")
    with pytest.raises(AiaynError, match="no train or valid records"):
        plot.curves_figure(plot.read_metrics(f))
    (tmp_path / "run" / "best").mkdir(parents=True)
    with pytest.raises(AiaynError, match="no metrics.jsonl"):
        plot.find_metrics(tmp_path / "run" / "best")


# --------------------------------------------------------------------------------------- lr schedule


def test_lr_schedule_is_the_trainers_and_the_papers():
    fig, drawn = plot.lr_schedule_figure([256, 512], [100, 400], steps=2000)
    assert list(drawn) == [f"d_model = {d}, warmup = {w}" for d in (256, 512) for w in (100, 400)]
    curve = drawn["d_model = 512, warmup = 400"]
    steps = np.arange(1, 2001)
    np.testing.assert_allclose(curve, 512**-0.5 * np.minimum(steps**-0.5, steps * 400**-1.5), rtol=1e-12)
    assert curve.argmax() + 1 == 400  # peak at the end of warm-up
    assert math.isclose(curve[399], (512 * 400) ** -0.5)
    np.testing.assert_allclose(curve[:400], curve[0] * steps[:400])  # linear rise
    np.testing.assert_allclose(curve[1999] / curve[499], (500 / 2000) ** 0.5)  # inverse square root decay
    ax = fig.axes[0]
    assert len([ln for ln in ax.lines if len(ln.get_xdata()) == 2000]) == 4
    assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title() and ax.get_legend() is not None


def test_lr_schedule_cli_png_svg_and_from_a_checkpoint(tmp_path, run_dir):
    out = tmp_path / "lr.png"
    assert main(["plot", "lr-schedule", "--d-model", "256", "512", "--warmup", "4000", "--dpi", "40", "-o", str(out)]) == 0
    assert png_size(out) == (10 * 40, round(5.2 * 40))
    out = tmp_path / "lr.svg"
    assert main(["plot", "lr-schedule", "--steps", "600", "-o", str(out)]) == 0
    svg = out.read_text(encoding="utf-8")
    assert 'width="720pt"' in svg and 'height="374.4pt"' in svg  # 10 x 5.2 inches at 72 pt


def test_lr_schedule_of_a_run(tmp_path, run_dir, monkeypatch):
    seen = []
    real = plot.lr_schedule_figure
    monkeypatch.setattr(plot, "lr_schedule_figure", lambda *a: seen.append(a) or real(*a))
    assert main(["plot", "lr-schedule", "--checkpoint", str(run_dir), "--steps", "600", "-o", str(tmp_path / "lr.png")]) == 0
    assert seen == [([32], [300], 600, 2.0, 0, 0)]  # d_model, warmup and lr_factor of the run; no ramp


def test_lr_schedule_of_a_run_refuses_the_flags_it_would_override(tmp_path, run_dir, capsys):
    for flags in (["--d-model", "256"], ["--warmup", "100"], ["--factor", "2"]):
        assert main(["plot", "lr-schedule", "--checkpoint", str(run_dir), *flags, "-o", str(tmp_path / "lr.png")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and flags[0] in err[0] and "--checkpoint" in err[0]
    assert not list(tmp_path.iterdir())


def test_lr_schedule_of_a_run_with_a_cooldown(tmp_path, model, tokenizers, monkeypatch):
    cfg = {"train": TrainConfig(warmup=100, max_steps=500, cooldown=200).to_dict(), "step": 500}
    checkpoint.save_checkpoint(tmp_path / "best", model, tokenizers, cfg)
    figure = plot.lr_schedule_figure([32], [100], None, 1.0, 200, 500)
    curve = figure[1]["d_model = 32, warmup = 100"]
    assert len(curve) == 500 and curve[-1] == learning_rate(500, 32, 100) / 200  # the whole run, ramp included
    seen = []
    monkeypatch.setattr(plot, "lr_schedule_figure", lambda *a: seen.append(a) or figure)
    assert main(["plot", "lr-schedule", "--checkpoint", str(tmp_path / "best"), "-o", str(tmp_path / "lr.png")]) == 0
    assert seen == [([32], [100], None, 1.0, 200, 500)]  # the run's ramp


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["plot", "lr-schedule", "-o", str(tmp_path / "lr.jpg")]) == 2
    assert main(["plot", "curves", "--checkpoint", str(tmp_path / "missing"), "-o", str(tmp_path / "c.png")]) == 2
    assert main(["plot", "lr-schedule", "--warmup", "0", "-o", str(tmp_path / "lr.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("aiayn plot: error: ") for line in err)
    assert ".png, .svg or .pdf" in err[0] and "missing" in err[1] and "--warmup" in err[2]
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_runs_without_a_display_or_pyplot(tmp_path):
    """An interactive backend in the environment and no display: still draws, never imports pyplot."""
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    env["MPLBACKEND"] = "TkAgg"
    code = ("import sys; from aiayn.cli import main; rc = main(sys.argv[1:]); "
            "assert 'matplotlib.pyplot' not in sys.modules; sys.exit(rc)")
    out = tmp_path / "lr.png"
    r = subprocess.run([sys.executable, "-c", code, "plot", "lr-schedule", "--steps", "100", "--dpi", "20", "-o", str(out)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert png_size(out) == (200, 104)


def test_more_bad_settings_are_one_line_errors_before_any_work(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep")
    (tmp_path / "d.png").mkdir()
    cases = [
        (["plot", "positional-encoding", "--dpi", "100000", "-o", str(tmp_path / "pe.png")], "--dpi must be between 1"),
        (["plot", "lr-schedule", "--factor", "nan", "-o", str(tmp_path / "lr.png")], "--factor must be a positive finite"),
        (["plot", "lr-schedule", "--factor", "inf", "-o", str(tmp_path / "lr.png")], "--factor must be a positive finite"),
        (["plot", "positional-encoding", "-o", str(afile / "pe.png")], f"-o {afile / 'pe.png'}: {afile} is a file, not"),
        (["plot", "positional-encoding", "-o", str(tmp_path / "d.png")], f"-o {tmp_path / 'd.png'}: is a folder;"),
        # sizes past any plot (tracebacks out of memory, once): refused before a table is made
        (["plot", "positional-encoding", "--max-len", "10000000", "-o", str(tmp_path / "pe.png")],
         "--max-len 10000000 x --d-model 512 is more than the 33554432 values a plot draws"),
        (["plot", "positional-encoding", "--d-model", "200000000", "-o", str(tmp_path / "pe.png")],
         "--d-model 200000000 is more than the 33554432 values"),
        (["plot", "lr-schedule", "--steps", "1000000000000", "-o", str(tmp_path / "lr.png")],
         "--steps 1000000000000 is more than the 10000000 steps a curve draws; give --steps 10000000 or fewer"),
        (["plot", "lr-schedule", "--warmup", "1000000000", "-o", str(tmp_path / "lr.png")],
         "--steps 10000000000 (the default: 10 x --warmup) is more than"),
    ]
    for argv, words in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "d.png"]  # nothing half-written


def test_a_picture_too_large_to_draw_is_refused(model, tokenizers, tmp_path, monkeypatch):
    with pytest.raises(AiaynError, match="readable up to 200 a side: use a shorter --src"):
        plot.attention_figure(plot.attention_maps(model, tokenizers, "a man " * 150, "a"), ("encoder",))
    fig, _ = plot.positional_encoding_figure(64, 10)  # 13 x 5 inches
    monkeypatch.setattr(plot, "MAX_PIXELS", 1000)
    with pytest.raises(AiaynError, match="would be 1300 x 500 pixels, more than 1000 a side; lower --dpi"):
        plot.save_figure(fig, tmp_path / "pe.png", dpi=100)
    assert not (tmp_path / "pe.png").exists()


def test_attention_of_a_model_trained_on_bare_sources_reads_no_eos(model, tokenizers):
    """A checkpoint from before `source_eos` is drawn as it translates: the source without EOS."""
    old = Transformer(model.cfg.replace(source_eos=False)).eval()
    old.load_state_dict(model.state_dict())
    maps = plot.attention_maps(old, tokenizers, SRC, TGT)
    assert maps.src_labels == [tokenizers.src.id_to_piece(i) for i in tokenizers.src.encode(SRC)]
    assert maps.encoder.shape[-1] == len(tokenizers.src.encode(SRC))


def test_attention_titles_and_labels_show_dollar_signs_as_text(tmp_path, model, tokenizers):
    """A "$" in the sentence is a dollar sign, not TeX: "$x^$" was a parse error (a traceback), and
    text between two of them was set as a formula."""
    for text in ("Er tippt $x^$ ein.", "Es kostet $5 und $10."):
        maps = plot.attention_maps(model, tokenizers, text, text)
        fig, _ = plot.attention_figure(maps, ("cross",), None, text)
        plot.save_figure(fig, tmp_path / "dollar.png", 30)  # drawn: TeX would fail on "$x^$"
        assert fig.get_suptitle() == text


def test_attention_refuses_a_long_source_before_any_work(model, tokenizers, monkeypatch):
    """Too long a --src to draw is refused as soon as it is tokenized, not after a greedy decode and
    an attention pass that grow with its square (20,000 tokens: minutes and ~19 GB)."""
    monkeypatch.setattr(plot, "greedy_ids", lambda *a, **k: pytest.fail("decoded a source too long to draw"))
    monkeypatch.setattr(plot, "attention_arrays", lambda *a, **k: pytest.fail("computed attention first"))
    with pytest.raises(AiaynError, match=r"--src: the source is \d+ tokens; attention maps are readable up to 200"):
        plot.attention_maps(model, tokenizers, " ".join(["Mann"] * 400))
    with pytest.raises(AiaynError, match=r"--tgt: the target is \d+ tokens"):
        plot.attention_maps(model, tokenizers, SRC, " ".join(["man"] * 400))


def test_plot_writes_through_a_link(tmp_path):
    """-o names the user's file: a link is written through and stays a link, as `translate --output`."""
    target, link = tmp_path / "target.png", tmp_path / "link.png"
    target.write_bytes(b"old")
    link.symlink_to(target)
    assert main(["plot", "positional-encoding", "--dpi", "20", "-o", str(link)]) == 0
    assert link.is_symlink() and target.read_bytes().startswith(b"\x89PNG")


def test_greedy_translation_stops_where_no_map_could_show_it(model, tokenizers, monkeypatch):
    """Without --tgt, the model's own translation is decoded no further than a map can show: an
    untrained model runs to --max-len-b (5,000 took minutes, then was refused after the fact)."""
    monkeypatch.setattr(plot, "MAX_ATTENTION_TOKENS", 20)
    maps = plot.attention_maps(model, tokenizers, SRC, max_len_b=300)
    assert len(maps.tgt_in_labels) == 20  # BOS + 19 tokens, not the 300 + |SRC| asked for (the 20th
    plot.attention_figure(maps, ("decoder",))  # predicted at the last row: cut, no row predicts EOS)
    for a, b in ((float("inf"), 50), (-1.0, 1000)):  # the search still checks the flags
        with pytest.raises(AiaynError, match="maximum length"):
            plot.attention_maps(model, tokenizers, SRC, max_len_a=a, max_len_b=b)
    for a, b in ((0.0, 10 ** 400), (1e308, 50)):  # past float's range, or a limit that overflows: capped all the same
        assert plot.attention_maps(model, tokenizers, SRC, max_len_a=a, max_len_b=b).tgt_in_labels == maps.tgt_in_labels


def test_a_translation_cut_at_the_length_limit_has_no_row_predicting_eos(model, tokenizers):
    """Cut at --max-len-b, the model's own translation never predicted </s>: each row is labelled by
    the token it did predict, the last one included, and the rows are those of the full pass."""
    maps = plot.attention_maps(model, tokenizers, SRC, max_len_a=0.0, max_len_b=5)  # (it runs on: untrained)
    ids, ended = plot.greedy_ids(model, torch.tensor([maps_src(tokenizers, model)]), 0.0, 5)
    assert not ended and len(ids) == 5
    assert maps.tgt_out_labels == [tokenizers.tgt.id_to_piece(i) for i in ids] and "</s>" not in maps.tgt_out_labels
    assert maps.decoder_self.shape[-2:] == (5, 5) and maps.cross.shape[-2] == 5
    full = plot.attention_maps(model, tokenizers, SRC, tokenizers.tgt.decode(ids))  # the same tokens as --tgt
    if tokenizers.tgt.encode(full.tgt_text) == ids:  # (decoding and encoding again may re-segment)
        assert np.array_equal(full.cross[:, :, :5], maps.cross) and full.tgt_out_labels[-1] == "</s>"


def maps_src(tokenizers, model) -> list[int]:  # type: ignore[no-untyped-def]
    ids = tokenizers.src.encode(SRC)
    return ids + [3] if model.cfg.source_eos else ids


def test_a_layer_the_model_lacks_is_refused_before_it_runs(tmp_path, run_dir, monkeypatch, capsys):
    monkeypatch.setattr(plot, "attention_maps", lambda *a, **k: pytest.fail("ran the model for a bad --layers"))
    assert main(["plot", "attention", "--checkpoint", str(run_dir), "--src", SRC, "--layers", "9",
                 "-o", str(tmp_path / "a.png")]) == 2
    assert "--layers: layer 9 does not exist; the model has" in capsys.readouterr().err


def test_curves_title_shows_dollar_signs_as_text(tmp_path):
    """A run directory named with "$" is text in the title, as in attention titles: "$x^$" was a
    TeX parse error (a traceback)."""
    run = tmp_path / "lr $x^$"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 5.0, "lr": 0.001}\n')
    assert main(["plot", "curves", "--checkpoint", str(run), "--dpi", "20", "-o", str(tmp_path / "c.png")]) == 0


def test_attention_title_names_a_checkpoint_given_as_dot(tmp_path, run_dir, monkeypatch):
    """`--checkpoint .` inside a checkpoint is named by its folders, not as "/"."""
    titles = []
    real = plot.attention_figure
    monkeypatch.setattr(plot, "attention_figure", lambda m, k, n, t: titles.append(t) or real(m, k, n, t))
    monkeypatch.chdir(run_dir / "best")
    assert main(["plot", "attention", "--checkpoint", ".", "--src", SRC, "--tgt", TGT, "--kind", "cross",
                 "--dpi", "20", "-o", str(tmp_path / "a.png")]) == 0
    assert titles[0].startswith(f"Attention weights of {run_dir.name}/best\n")


@pytest.mark.parametrize("section, key, value", [("model", "d_model", "32x"), ("train", "warmup", None),
                                                 ("train", "lr_factor", "fast"), ("train", "cooldown", "x")])
def test_a_bad_number_in_a_checkpoint_config_is_a_one_line_error(tmp_path, model, tokenizers, capsys,
                                                                 section, key, value):
    """plot reads config.json as raw JSON (no weights loaded): a hand-edited value was a traceback."""
    cfg = {"train": TrainConfig(warmup=100).to_dict(), "step": 1}
    checkpoint.save_checkpoint(tmp_path / "best", model, tokenizers, cfg)
    file = tmp_path / "best" / "config.json"
    data = json.loads(file.read_text())
    data[section][key] = value
    file.write_text(json.dumps(data))
    for picture in ["lr-schedule"] + (["positional-encoding"] if section == "model" else []):
        assert main(["plot", picture, "--checkpoint", str(tmp_path), "-o", str(tmp_path / "x.png")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{section}.{key}" in err, err


@pytest.mark.parametrize("line, words", [
    ('{"kind": "train", "step": 100000000000000000000000, "loss": 4.0}', ":2: expected an object"),  # OverflowError
    ('{"kind": "train", "step": true, "loss": 4.0}', ":2: expected an object"),  # drawn at step 1
    ('{"kind": "train", "step": 2, "loss": ' + "1" * 5000 + "}", ":2: not a JSON object (a number of more than"),
    ("[" * 100000 + "]" * 100000, ":2: not a JSON object (nested too deeply)"),  # RecursionError
])
def test_a_hand_edited_metrics_line_is_a_one_line_error(tmp_path, capsys, line, words):
    """A metrics.jsonl line no run writes is named by file and line: these were tracebacks (or, a
    boolean step, drawn as step 1), where the trainer's own reader refuses them."""
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"kind": "train", "step": 1, "loss": 5.0}\n' + line + "\n")
    assert main(["plot", "curves", "--checkpoint", str(f), "-o", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"metrics.jsonl{words}" in err, err
    assert not (tmp_path / "c.png").exists()


def test_values_that_are_not_finite_numbers_are_left_out_of_the_curves(tmp_path):
    """A loss past float's range as an integer was an OverflowError traceback; true is no number."""
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"kind": "train", "step": 1, "loss": 5.0}\n{"kind": "train", "step": 2, "loss": 1' + "0" * 400
                 + '}\n{"kind": "train", "step": 3, "loss": true}\n{"kind": "train", "step": 4, "loss": null}\n'
                 '{"kind": "train", "step": 5, "loss": 3}\n')
    _, drawn = plot.curves_figure(plot.read_metrics(f))
    np.testing.assert_array_equal(drawn["train_loss"], [[1, 5], [5.0, 3.0]])


@pytest.mark.parametrize("picture", ["positional-encoding", "lr-schedule", "curves", "attention"])
def test_an_empty_checkpoint_name_is_refused(tmp_path, capsys, monkeypatch, picture):
    """`--checkpoint "$RUN"` with RUN unset: lr-schedule and positional-encoding drew the defaults
    (d_model 512, warmup 4000) without a word, curves read the current folder's metrics."""
    monkeypatch.chdir(tmp_path)
    extra = ["--src", SRC] if picture == "attention" else []
    assert main(["plot", picture, "--checkpoint", "", *extra, "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--checkpoint '': an empty name" in err, err
    assert not (tmp_path / "x.png").exists()


def test_an_svg_with_control_characters_in_its_text_is_well_formed_xml(tmp_path, model, tokenizers):
    """A terminal's colour code pasted into --src (or a run folder's name) went raw into the SVG's
    comments, which XML cannot hold: no viewer opened the file. It is shown as an escape."""
    import xml.dom.minidom

    text = "Ein \x1b[31mMann\x1b[0m f\x01hrt."
    maps = plot.attention_maps(model, tokenizers, text, TGT)
    fig, _ = plot.attention_figure(maps, ("cross",), None, f"\u201c{text}\u201d")
    plot.save_figure(fig, tmp_path / "a.svg")
    xml.dom.minidom.parse(str(tmp_path / "a.svg"))
    assert "\\x1b[31mMann" in fig.get_suptitle()
    run = tmp_path / "run \x1b[1m"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 5.0}\n')
    assert main(["plot", "curves", "--checkpoint", str(run), "-o", str(tmp_path / "c.svg")]) == 0
    xml.dom.minidom.parse(str(tmp_path / "c.svg"))


def test_a_run_folder_named_with_invalid_utf8_is_drawn(tmp_path):
    """A folder name with a byte that is not UTF-8 reaches Python as a lone surrogate ("\\udcff"),
    which no font can draw: `plot curves` on it was a TypeError traceback from matplotlib."""
    import xml.dom.minidom

    run = tmp_path / os.fsdecode(b"run \xff")
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 5.0}\n')
    for name in ("c.svg", "c.png"):
        assert main(["plot", "curves", "--checkpoint", str(run), "-o", str(tmp_path / name)]) == 0
    xml.dom.minidom.parse(str(tmp_path / "c.svg"))


def test_an_output_in_a_missing_folder_is_refused_before_any_work(tmp_path, run_dir, monkeypatch, capsys):
    """`-o typo/att.png` made the folder typo/ (and any above it), where translate --output and
    evaluate --save-hyps refuse a missing folder; and said so only after loading and drawing."""
    import aiayn.checkpoint

    monkeypatch.setattr(aiayn.checkpoint, "load_checkpoint", lambda *a, **k: pytest.fail("loaded for nothing"))
    for argv in (["lr-schedule"], ["attention", "--checkpoint", str(run_dir), "--src", SRC]):
        out = tmp_path / "typo" / "sub" / "a.png"
        assert main(["plot", *argv, "-o", str(out)]) == 2
        assert capsys.readouterr().err == (f"aiayn plot: error: -o {out}: no folder {out.parent}; make it first, "
                                           "or choose another path\n")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "broken").symlink_to(tmp_path / "gone")  # a link to no folder: "cannot write (File exists)"
    out = tmp_path / "broken" / "a.png"
    assert main(["plot", "lr-schedule", "-o", str(out)]) == 2
    assert capsys.readouterr().err == (f"aiayn plot: error: -o {out}: {out.parent} is a symbolic link to nothing "
                                       f"({tmp_path / 'gone'}); choose another path\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]


@pytest.mark.parametrize("flags", [["--max-len-b", "-1"], ["--max-len-a", "nan"], ["--max-len-a", "-2"]])
def test_attention_length_flags_are_checked_before_loading_and_named(tmp_path, run_dir, monkeypatch, capsys, flags):
    """They were refused by the search, after loading, in words naming no flag ("maximum length a*len+b
    needs finite a >= 0 ...")."""
    import aiayn.checkpoint

    monkeypatch.setattr(aiayn.checkpoint, "load_checkpoint", lambda *a, **k: pytest.fail("loaded for nothing"))
    assert main(["plot", "attention", "--checkpoint", str(run_dir), "--src", SRC, *flags,
                 "-o", str(tmp_path / "a.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--max-len-a and --max-len-b must be finite numbers >= 0" in err, err


def test_characters_the_font_lacks_are_one_note_not_a_warning_each(tmp_path, capsys):
    """Each character the font cannot draw (a --src in Chinese, an emoji) was a Python warning of two
    lines naming matplotlib's source; a note line says it once, and other warnings still pass."""
    import warnings

    from matplotlib.figure import Figure

    fig = Figure(figsize=(3, 2))
    fig.suptitle("漢字 🙂 漢 a", parse_math=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plot.save_figure(fig, tmp_path / "a.png", dpi=20)
        plot.save_figure(fig, tmp_path / "a.svg")
    assert [str(w.message) for w in caught] == []
    assert capsys.readouterr().err == "aiayn plot: note: the font has no glyph for 漢 字 🙂; drawn as boxes\n" * 2


def test_a_curves_run_named_in_chinese_draws_with_one_note(tmp_path, run_dir):
    """As a user runs it (Python's own warning display, not pytest's)."""
    run = tmp_path / "实验"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes((run_dir / "metrics.jsonl").read_bytes())
    r = subprocess.run([sys.executable, "-m", "aiayn", "plot", "curves", "--checkpoint", str(run), "--dpi", "20",
                        "-o", str(tmp_path / "c.png")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stderr == "aiayn plot: note: the font has no glyph for 实 验; drawn as boxes\n", r.stderr


def test_curves_read_metrics_from_a_pipe(tmp_path, run_dir):
    """`--checkpoint <(ssh host cat run/metrics.jsonl)`, a named pipe: it is read once, as a file is; it
    was "no such file or directory"."""
    import threading

    fifo = tmp_path / "metrics.fifo"
    os.mkfifo(fifo)
    data = (run_dir / "metrics.jsonl").read_bytes()

    def feed():
        with open(fifo, "wb") as f:
            f.write(data)

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    out = tmp_path / "c.png"
    assert main(["plot", "curves", "--checkpoint", str(fifo), "--dpi", "20", "-o", str(out)]) == 0
    writer.join(timeout=60)
    png_size(out)
