#!/usr/bin/env bash
# Train on Multi30k and score test_2016_flickr: bench/multi30k.sh SRC TGT [MINUTES] [THREADS] [TRAIN FLAGS...]
# Writes runs/multi30k-SRC-TGT/ (checkpoints, metrics.jsonl, averaged-5/, averaged-10/ and, where
# the run kept 20 epoch checkpoints (--keep-last 20), averaged-20/: the last 5, 10 and 20 epochs),
# the choices made on the validation set (val.jsonl: which average, then beam and alpha) and the
# test scores (scores.jsonl). The test set is translated only with settings fixed in
# advance or chosen on val: best/ greedy and beam 4, and the val-chosen average with the paper's
# beam 4 / alpha 0.6 and with the val-tuned beam and alpha, in fp32 and, where the CPU has oneDNN
# bf16 kernels, in bf16.
set -euo pipefail
src=${1:?source language}; tgt=${2:?target language}; minutes=${3:-60}; threads=${4:-0}
shift $(( $# < 4 ? $# : 4 ))  # the rest go to `aiayn train` (e.g. --dropout 0.3), after the recipe
aiayn=${AIAYN:-aiayn}
run=${RUN:-runs/multi30k-$src-$tgt}  # RUN=DIR scores (or trains) another run directory
recipe=$(cd "$(dirname "$0")/.." && pwd)/configs/multi30k.toml  # the repo's, from whatever directory it runs
if [ ! -e "$run/averaged-10" ]; then
  $aiayn train --config "$recipe" --src "$src" --tgt "$tgt" --max-minutes "$minutes" \
    --threads "$threads" --out "$run" --resume "$@"  # a re-run after an interruption continues the run
  $aiayn average --checkpoint "$run" -n 5 -o "$run/averaged-5"
  $aiayn average --checkpoint "$run" -n 10 -o "$run/averaged-10"
fi
kept=$(find "$run" -mindepth 2 -maxdepth 2 -path "$run/step_*/config.json" | grep -cE '/step_[0-9]+/config.json$' || true)
if [ ! -e "$run/averaged-20" ] && [ "$kept" -ge 20 ]; then  # complete step_<N>/ checkpoints, as average counts
  $aiayn average --checkpoint "$run" -n 20 -o "$run/averaged-20"
fi
score() {  # score SPLIT CHECKPOINT BEAM ALPHA PRECISION -> one JSON line
  $aiayn evaluate --checkpoint "$run/$2" --data multi30k --src "$src" --tgt "$tgt" --split "$1" \
    --beam "$3" --alpha "$4" --precision "$5" --json \
    | python3 -c "import json,sys; d=json.load(sys.stdin); d.update(split='$1', checkpoint='$2', beam=$3, alpha=$4, precision='$5'); print(json.dumps(d))"
}
: > "$run/val.jsonl"
best_on_val() {  # the row of val.jsonl with the highest BLEU among those whose checkpoint is $1 (or any)
  python3 -c "
import json, sys; rows = [json.loads(l) for l in open(sys.argv[2])]
rows = [r for r in rows if sys.argv[1] in ('', r['checkpoint'])]
r = max(rows, key=lambda r: r['bleu']); print(r['checkpoint'], r['beam'], r['alpha'])" "${1:-}" "$run/val.jsonl"
}
for avg in averaged-5 averaged-10 averaged-20; do  # how many epochs to average, at beam 4 / alpha 0.6
  [ -e "$run/$avg" ] || continue
  echo "== val $avg beam 4 alpha 0.6" >&2
  score val "$avg" 4 0.6 fp32 >> "$run/val.jsonl"
done
read -r avg _ < <(best_on_val)
for beam in 4 6; do
  for alpha in 0.6 1.0 1.4 1.8 2.2 2.6 3.0; do
    [ "$beam $alpha" = "4 0.6" ] && continue  # scored above
    echo "== val $avg beam $beam alpha $alpha" >&2
    score val "$avg" "$beam" "$alpha" fp32 >> "$run/val.jsonl"
  done
done
read -r _ vbeam valpha < <(best_on_val "$avg")
echo "== chosen on val: $avg, beam $vbeam alpha $valpha" >&2
: > "$run/scores.jsonl"
has_fast_bf16() {  # 1 if oneDNN has bf16 kernels for this CPU, asked of the Python that runs aiayn
  local exe py
  exe=$(command -v "${aiayn%% *}" || true)  # aiayn's script (its #! names the Python), or a python itself
  case "${exe##*/}" in python*) py=$exe ;; *) py=$(sed -n '1s/^#![[:space:]]*//p' "$exe" 2>/dev/null || true) ;; esac
  $py -c 'import aiayn.kernels as k; print(int(k.cpu_has_fast_bf16()))' 2>/dev/null \
    || { echo "note: could not ask aiayn's Python whether this CPU has bf16 kernels; scoring bf16 too" >&2; echo 1; }
}
fast_bf16=$(has_fast_bf16)
for spec in "best 1 0.6 fp32" "best 4 0.6 fp32" "$avg 4 0.6 fp32" "$avg 4 0.6 bf16" \
            "$avg $vbeam $valpha fp32" "$avg $vbeam $valpha bf16"; do
  [ "$fast_bf16" = 0 ] && [ "${spec##* }" = bf16 ] && continue  # bf16 is 10-100x slower than fp32 there
  echo "== test $spec" >&2
  score test_2016_flickr $spec >> "$run/scores.jsonl"
done
cat "$run/scores.jsonl"
