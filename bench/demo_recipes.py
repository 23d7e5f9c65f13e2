"""The candidates for `make demo`'s recipe: validation BLEU against minutes, one line per run.

Each candidate is a real run of `aiayn train ... --max-minutes 4.5` whose run directory (or a copy
of its metrics.jsonl, train.json and log under docs/logs/demo-*) is given here; the run validates at
each epoch end and when time is up. Draws docs/demo-recipes.png and prints the table of docs/demo.md
(settings from train.json; precision and steps from the log's `device ...` and `stopped: ...` lines).

    python bench/demo_recipes.py docs/logs/demo-*            # the picture and the table
    python bench/demo_recipes.py runs/demo-a runs/demo-b -o /tmp/recipes.png   # logs: runs/demo-a.log, ...
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

from aiayn.errors import AiaynError
from aiayn.plot import read_metrics, save_figure

PICTURE = Path(__file__).resolve().parents[1] / "docs" / "demo-recipes.png"  # the repo's, from any directory


@dataclass(frozen=True)
class Candidate:
    name: str
    settings: str
    minutes: list[float]  # at each validation
    bleu: list[float]
    steps: int
    precision: str


def _settings(train_json: Path) -> str:
    """The knobs the candidates vary, in one short line."""
    try:
        cfg = json.loads(train_json.read_text(encoding="utf-8"))
        m, t = cfg["model"], cfg["train"]
        return (f"d{m['d_model']} {m['encoder_layers']}+{m['decoder_layers']} ff{m['d_ff']} drop {m['dropout']}, "
                f"vocab {t['vocab_size']}, {t['max_tokens']} tok, warmup {t['warmup']}, lr x{t['lr_factor']}")
    except OSError as e:
        raise AiaynError(f"{train_json}: cannot read it ({e.strerror or e}); pass a run directory of `aiayn train`") \
            from None
    except (ValueError, KeyError, TypeError) as e:  # not JSON, or not a run's settings
        raise AiaynError(f"{train_json}: not the train.json of an `aiayn train` run ({type(e).__name__}: {e})") \
            from None


def read_candidate(run: Path) -> Candidate:
    """A run directory (or its copy under docs/logs): metrics.jsonl, train.json and the run's log,
    `*.log` in it or RUN.log beside it."""
    valid = [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "valid" and "bleu" in r]
    if not valid:
        raise SystemExit(f"{run}/metrics.jsonl: no validation BLEU yet")
    logs = sorted(run.glob("*.log")) + [run.parent / f"{run.name}.log"]  # a copy's, or the one beside the run
    logs = [f for f in logs if f.is_file()]
    text = logs[0].read_text(encoding="utf-8", errors="replace") if logs else ""
    precision = re.search(r"precision (\w+)", text)
    stopped = re.search(r"stopped: .*?; step (\d+)", text)
    return Candidate(run.name.removeprefix("demo-"), _settings(run / "train.json"),
                     [r["elapsed_s"] / 60 for r in valid], [r["bleu"] for r in valid],
                     int(stopped.group(1)) if stopped else valid[-1]["step"],
                     precision.group(1) if precision else "?")


def figure(cands: list[Candidate], goal: float) -> Figure:
    fig = Figure(figsize=(9, 7.5), layout="constrained")
    ax = fig.subplots()
    for c in cands:
        ax.plot(c.minutes, c.bleu, marker="o", ms=4, lw=1.6, ls="--" if c.precision == "fp32" else "-",
                label=f"{c.name}: {c.settings}, {c.precision} ({c.bleu[-1]:.1f})")
    ax.axhline(goal, color="grey", ls=":", lw=1)
    ax.set_xlabel("minutes of training (validation included)")
    ax.set_ylabel("validation BLEU (Multi30k val, de->en, greedy)")
    ax.set_title("Recipes for `make demo`: one run each, validated at each epoch end and at the stop")
    ax.grid(alpha=0.3)
    fig.legend(fontsize=8, loc="outside lower center")  # below the axes: the lines cross every corner
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories (or their copies under docs/logs)")
    p.add_argument("-o", "--output", default=PICTURE, help="the picture (default: docs/demo-recipes.png of this repo)")
    p.add_argument("--goal", type=float, default=30.0, help="the BLEU line drawn")
    args = p.parse_args(argv)
    try:  # a missing or broken run file, an unwritable picture: one line naming it
        cands = [read_candidate(r) for r in args.runs]
        print(save_figure(figure(cands, args.goal), args.output))
    except AiaynError as e:
        raise SystemExit(f"demo_recipes.py: error: {e}") from None
    print("| candidate | settings | precision | steps | val BLEU at the end (minutes) | best val BLEU |")
    print("|---|---|---|---|---|---|")
    for c in cands:
        print(f"| {c.name} | {c.settings} | {c.precision} | {c.steps} | {c.bleu[-1]:.2f} ({c.minutes[-1]:.2f}) "
              f"| {max(c.bleu):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
