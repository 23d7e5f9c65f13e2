"""The WMT14 recipe's pieces that run here: the paper's tokenized BLEU (compound splitting), the two
configs hold Table 3's settings and load as `train --config`, bench/wmt14.sh is valid shell, and
bench/scale.py runs end to end on a tiny corpus."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sacrebleu

from aiayn import train_options as TO
from aiayn.cli import build_parser
from aiayn.config import TrainConfig, learning_rate
from aiayn.errors import AiaynError

import benches

ROOT = Path(__file__).resolve().parents[1]
DATA = os.environ.get("AIAYN_DATA")


def _load(name: str):  # type: ignore[no-untyped-def]
    return benches.load(f"{name}.py")


def test_compound_splitting_and_tokenized_bleu():
    pb = _load("paper_bleu")
    # what perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g' prints, the quirk with one-letter parts included
    assert pb.split_compounds("Ost-West-Konflikt , 5-10 A-B-C") == \
        "Ost ##AT##-##AT## West ##AT##-##AT## Konflikt , 5 ##AT##-##AT## 10 A ##AT##-##AT## B-C"
    refs = ["Der Ost-West-Konflikt ist vorbei.", "Ein Hund läuft."]
    assert pb.tokenized_bleu(refs, refs) == pytest.approx(100.0)
    # a hypothesis that gets the compound's parts right but not the hyphenation scores higher once split
    hyps = ["Der Ost-West Konflikt ist vorbei.", "Ein Hund läuft."]
    assert pb.tokenized_bleu(hyps, refs) > pb.sacre_bleu(hyps, refs).score


def test_the_papers_bleu_tokenizes_as_moses_does():
    """tokenizer.perl -l de splits German quotes, the ellipsis and the dash off the words and escapes
    apostrophes; 13a (the stand-in before) left „…“ and ’s attached, so those words never matched."""
    pb = _load("paper_bleu")
    lines = ["„Das ist gut“, sagte er.", "Er sagte: “Nein” … und ging.", "Berlin – die Stadt.",
             "Geht’s dir gut? Ich hab's.", "Die Ost-West-Beziehung kostet 5,5 Mio. Euro & mehr."]
    assert pb.moses_tokenize(lines) == [
        "„ Das ist gut “ , sagte er .", "Er sagte : “ Nein ” … und ging .", "Berlin – die Stadt .",
        "Geht ’ s dir gut ? Ich hab &apos; s.", "Die Ost-West-Beziehung kostet 5,5 Mio. Euro &amp; mehr ."]
    # the score is multi-bleu's over those tokens (13a saw „Das and Haus“ as words of their own)
    refs, hyps = ["„Das Haus“ ist gut, sagte er."], ["Das Ost-Haus ist gut, sagte er."]
    by_hand = ["„ Das Haus “ ist gut , sagte er ."], ["Das Ost ##AT##-##AT## Haus ist gut , sagte er ."]
    want = sacrebleu.corpus_bleu(by_hand[1], [by_hand[0]], tokenize="none", force=True).score
    assert pb.tokenized_bleu(hyps, refs) == pytest.approx(want)
    assert want != pytest.approx(pb.sacre_bleu(hyps, refs).score)
    out = pb.report(lines, lines).splitlines()
    assert out[0].startswith("sacreBLEU (detokenized, 13a): 100.00  nrefs:1|case:mixed|eff:no|tok:13a|")
    assert out[1] == "tokenized BLEU, Moses -l de, compounds split (the paper's): 100.00"


@pytest.mark.parametrize("size, dropout, steps, keep", [("base", 0.1, 100_000, 5), ("big", 0.3, 300_000, 20)])
def test_wmt14_configs_hold_the_papers_settings(size, dropout, steps, keep):
    args = build_parser("train").parse_args(["train", "--config", str(ROOT / "configs" / f"wmt14-en-de-{size}.toml")])
    name, over, tc = TO.build_configs(args)
    assert name == size and over["dropout"] == dropout and over["share_embeddings"]
    assert (tc.warmup, tc.max_steps, tc.label_smoothing, tc.vocab_size, tc.keep_last) == (4000, steps, 0.1, 37000, keep)
    assert (tc.adam_beta1, tc.adam_beta2, tc.adam_eps, tc.lr_factor) == (0.9, 0.98, 1e-9, 1.0)
    assert 24_000 <= tc.tokens_per_update <= 30_000  # ~25k tokens a side per step, on any number of GPUs
    for gpus, freq in ((1, 8), (2, 4), (4, 2), (8, 1)):
        assert TO.with_update_freq(tc, gpus).update_freq == freq


def test_update_freq_follows_the_number_of_gpus_and_the_step_never_grows_past_it():
    tc = TrainConfig(max_tokens=3500, tokens_per_update=28000)
    assert [TO.with_update_freq(tc, w).update_freq for w in (1, 2, 3, 5, 8)] == [8, 4, 3, 2, 1]
    with pytest.raises(AiaynError, match=r"^--tokens-per-update 28000: 16 processes x --max-tokens 3500 already take "
                                         r"56000 per step; use --max-tokens 1750 or less"):
        TO.with_update_freq(tc, 16)  # before: 16 GPUs x 3,500 silently made a 56,000-token step
    assert TO.with_update_freq(tc.replace(max_tokens=1750), 16).update_freq == 1
    assert TO.with_update_freq(TrainConfig(update_freq=3), 16).update_freq == 3  # off: --update-freq as given


def test_the_large_batch_config_holds_ott_et_al_s_step_and_rate():
    args = build_parser("train").parse_args(["train", "--config", str(ROOT / "configs" / "wmt14-en-de-big-largebatch.toml")])
    name, over, tc = TO.build_configs(args)
    assert name == "big" and tc.tokens_per_update == 8 * 16 * 3584
    peak = learning_rate(tc.warmup, 1024, tc.warmup, tc.lr_factor)
    assert peak == pytest.approx(0.001, rel=0.02)  # twice the base config's 0.0005
    assert [TO.with_update_freq(tc, w).update_freq for w in (1, 8, 128)] == [131, 16, 1]


def test_wmt14_script_is_valid_shell():
    subprocess.run(["bash", "-n", str(ROOT / "bench" / "wmt14.sh")], check=True)


@pytest.mark.skipif(not DATA or not Path(DATA, "multi30k").is_dir(), reason="AIAYN_DATA (Multi30k) not set")
def test_scale_bench_runs_end_to_end_on_a_tiny_corpus(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "scale.py"), "--work", str(tmp_path), "--pairs", "3000",
                          "--small", "1000", "--old", "1000", "--steps", "2", "--workers", "1", "--preset", "tiny"],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    results = json.loads((tmp_path / "scale.json").read_text())
    assert {"prepare 3000", "train --data-bin 1000", "train --data-bin 3000", "train in-memory 1000"} <= set(results)
    assert all(r.get("rc", 0) == 0 for r in results.values()), results
    assert results["train --data-bin 3000"]["first_step_s"] > 0
    assert "| prepare | 3000 |" in res.stdout


def test_wmt14_script_finds_its_config_from_another_directory(tmp_path):
    """Run from elsewhere (every command faked), the training step gets the repo's config, not a path
    that only exists in the repo's root."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    (tmp_path / "run").mkdir()  # as the real training would leave it
    for name in ("python", "aiayn"):  # `python -m torch.distributed.run ...` and $AIAYN, each logging its args
        (bin_dir / name).write_text(f'#!/usr/bin/env bash\necho "{name} $*" >> "{log}"\n')
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "AIAYN": str(bin_dir / "aiayn"), "NPROC": "1",
           "DATA": str(tmp_path / "data"), "RUN": str(tmp_path / "run")}
    subprocess.run(["bash", str(ROOT / "bench" / "wmt14.sh"), "base"], cwd=tmp_path, env=env, check=True,
                   capture_output=True, timeout=60)
    train = next(line.split() for line in log.read_text().splitlines() if " train " in line)
    assert (tmp_path / train[train.index("--config") + 1]).is_file()  # a relative path counts from the cwd
