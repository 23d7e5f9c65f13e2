#!/usr/bin/env bash
# Train on Multi30k and score test_2016_flickr: bench/multi30k.sh SRC TGT [MINUTES] [THREADS]
# Writes runs/multi30k-SRC-TGT/ (checkpoints, metrics.jsonl, averaged/) and scores.jsonl there.
set -euo pipefail
src=${1:?source language}; tgt=${2:?target language}; minutes=${3:-60}; threads=${4:-0}
aiayn=${AIAYN:-aiayn}
run=runs/multi30k-$src-$tgt
$aiayn train --config configs/multi30k.toml --src "$src" --tgt "$tgt" --max-minutes "$minutes" \
  --threads "$threads" --out "$run"
$aiayn average --checkpoint "$run" -n 5 -o "$run/averaged"
: > "$run/scores.jsonl"
for ckpt in best averaged; do
  for beam in 1 4; do
    for prec in fp32 bf16; do
      echo "== $ckpt beam $beam $prec" >&2
      $aiayn evaluate --checkpoint "$run/$ckpt" --data multi30k --src "$src" --tgt "$tgt" \
        --split test_2016_flickr --beam "$beam" --precision "$prec" --json \
        | python3 -c "import json,sys; d=json.load(sys.stdin); d.update(checkpoint='$ckpt', beam=$beam, precision='$prec'); print(json.dumps(d))" \
        >> "$run/scores.jsonl"
    done
  done
done
cat "$run/scores.jsonl"
