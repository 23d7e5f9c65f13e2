"""Shared helpers found wrong by a cold review: a checkpoint's config.json missing a field that
shapes the model, and a blank reference read from a stream taken for text."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from aiayn import checkpoint as ckpt
from aiayn.config import ConfigError, ModelConfig, preset
from aiayn.errors import AiaynError
from aiayn.files import read_lines, read_stream_lines_upto
from aiayn.model import Transformer
from aiayn.tokenizer import Tokenizer, TokenizerPair

WORDS = "the a cat dog sees runs big small red house tree man woman child ball blue green eats".split()


@pytest.fixture(scope="module")
def two_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of a 2-head model: 8 heads (the default) have weights of the same shapes."""
    lines = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(5)) for i in range(200)]
    t = Tokenizer.train(lines, 300)
    torch.manual_seed(0)
    model = Transformer(preset("tiny", src_vocab_size=t.vocab_size, tgt_vocab_size=t.vocab_size, n_heads=2))
    path = tmp_path_factory.mktemp("ckpt") / "c"
    ckpt.save_checkpoint(path, model, TokenizerPair(t, t, joint=True), {"train": {}, "step": 1})
    return path


@pytest.mark.parametrize("field", ["n_heads", "activation", "norm_first", "layer_norm_eps", "tie_output"])
def test_checkpoint_config_missing_a_shape_field_is_refused(two_heads: Path, tmp_path: Path, field: str) -> None:
    import shutil

    damaged = tmp_path / "c"
    shutil.copytree(two_heads, damaged)
    cfg = json.loads((damaged / ckpt.CONFIG).read_text())
    del cfg["model"][field]
    (damaged / ckpt.CONFIG).write_text(json.dumps(cfg))
    with pytest.raises(AiaynError, match=rf"config\.json: invalid model config .*{field} not recorded"):
        ckpt.load_checkpoint(damaged)


def test_fields_newer_than_the_format_still_default() -> None:
    """source_eos, scale_embedding and output_bias came later: a checkpoint without them still loads, as
    the model it was (bare sources, scaled embeddings, no output bias)."""
    data = ModelConfig().to_dict()
    for name in ("source_eos", "scale_embedding", "output_bias"):
        del data[name]
    got = ModelConfig.from_dict(data)
    assert (got.source_eos, got.scale_embedding, got.output_bias) == (False, True, False)
    with pytest.raises(ConfigError, match="colour"):  # an unknown field is still named first
        ModelConfig.from_dict({"colour": 1})


@pytest.mark.parametrize("data", [b"\n", b"\xef\xbb\xbf\r\n", b" \t\n"])
def test_one_blank_reference_line_from_a_stream_is_empty_as_from_a_file(tmp_path: Path, data: bytes) -> None:
    """`evaluate --ref-file -` scored BLEU 0 against one blank line that the same file was refused for."""
    (tmp_path / "ref").write_bytes(data)
    with pytest.raises(AiaynError, match="file is empty"):
        read_lines(tmp_path / "ref")
    with pytest.raises(AiaynError, match="standard input: file is empty"):
        read_stream_lines_upto(io.BytesIO(data), "standard input", 5)
    assert read_stream_lines_upto(io.BytesIO(b"\nx\n"), "s", 1) == ([""], True)  # (more follows: not empty)


def test_output_link_to_nothing_is_checked_where_it_points(tmp_path: Path) -> None:
    """`plot -o d.png` with d.png a link into a missing folder (or a loop of links) passed the check made
    before any work, and failed once the picture was drawn."""
    from aiayn.files import check_output_path, write_output_bytes

    (tmp_path / "d.png").symlink_to("nowhere/x.png")
    with pytest.raises(AiaynError, match=r"^-o .*d\.png -> .*nowhere/x\.png: no folder .*nowhere; make it first"):
        check_output_path(tmp_path / "d.png", "-o")
    (tmp_path / "loop.png").symlink_to("loop.png")
    with pytest.raises(AiaynError, match="loop.png: a loop of symbolic links"):
        check_output_path(tmp_path / "loop.png", "-o")
    (tmp_path / "real").mkdir()
    (tmp_path / "ok.png").symlink_to("real/ok.png")  # a link to a file not yet made, in a folder that is there
    check_output_path(tmp_path / "ok.png", "-o")
    write_output_bytes(tmp_path / "ok.png", b"x")
    assert (tmp_path / "real" / "ok.png").read_bytes() == b"x" and (tmp_path / "ok.png").is_symlink()


@pytest.mark.parametrize("name", ["a" * 246 + ".png", "ä" * 120 + ".txt", "\U0001f600" * 63])
def test_a_new_file_with_a_long_legal_name_is_written(tmp_path: Path, name: str) -> None:
    """A name of up to 255 bytes is legal; its temporary's longer name was "File name too long"."""
    from aiayn.files import atomic_write_bytes, write_output_bytes

    write_output_bytes(tmp_path / name, b"x")
    atomic_write_bytes(tmp_path / name, b"y")
    assert [p.name for p in tmp_path.iterdir()] == [name] and (tmp_path / name).read_bytes() == b"y"
    atomic_write_bytes(tmp_path / "train.json", b"{}")  # (a short name's temporary is as before: rundir knows it)
