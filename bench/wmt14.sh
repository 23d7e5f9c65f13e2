#!/usr/bin/env bash
# The paper's WMT14 English-German experiment, end to end (Section 5 and 6.1):
#   download (sha256-checked) -> prepare (shared 37k BPE) -> torchrun on N machines x G GPUs
#   -> average the last checkpoints -> beam 4, alpha 0.6 on newstest2014 -> sacreBLEU and the
#   paper's tokenized, compound-split BLEU side by side.
#
#   bench/wmt14.sh [base|big]
#
# One machine: NPROC GPUs (default: all). N machines: run it on each with the same MASTER and
#   NNODES=N NODE_RANK=i MASTER=host0:29500 bench/wmt14.sh base
# Every machine downloads and prepares its own copy (byte-identical, so the manifests agree); DATA
# may also be one folder shared by all: the machines take turns on it (a lock with a heartbeat that
# needs no common process table), and each finds done work done. RUN need not be shared: rank 0
# decides what to resume from and sends it to the others. Checkpoints, averaging and scoring happen
# on NODE_RANK 0. Re-running the script resumes: download and prepare skip what is done (no second
# unpacking) and training continues from the newest checkpoint.
set -euo pipefail

MODEL=${1:-base}
case "$MODEL" in base) AVG=5 ;; big) AVG=20 ;; *) echo "usage: $0 [base|big]" >&2; exit 2 ;; esac
AIAYN=${AIAYN:-python -m aiayn}
DATA=${DATA:-$PWD/data}
BIN=${BIN:-$DATA/wmt14-en-de-37k}
RUN=${RUN:-$PWD/runs/wmt14-en-de-$MODEL}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER=${MASTER:-127.0.0.1:29500}
NPROC=${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}
[ "$NPROC" -ge 1 ] || { echo "no GPU found; set NPROC" >&2; exit 2; }
# The configs hold tokens_per_update = 28,000 (~25k tokens a side per step, as in the paper): train
# derives --update-freq from it for NNODES x NPROC GPUs. MAX_TOKENS: padded positions per batch per GPU.
MAX_TOKENS=${MAX_TOKENS:-3500}
CONFIG=$(cd "$(dirname "$0")/.." && pwd)/configs/wmt14-en-de-$MODEL.toml  # the repo's, from any directory

echo "== 1. download WMT14 en-de into $DATA/wmt14"
$AIAYN download --data wmt14 --src en --tgt de --data-dir "$DATA"

echo "== 2. prepare $BIN"
$AIAYN prepare --data wmt14 --src en --tgt de --data-dir "$DATA" --vocab-size 37000 --max-len 256 --out "$BIN"

echo "== 3. train $MODEL on $NNODES x $NPROC GPUs, --max-tokens $MAX_TOKENS per GPU"
python -m torch.distributed.run --nnodes "$NNODES" --nproc_per_node "$NPROC" --node_rank "$NODE_RANK" \
  --rdzv_backend c10d --rdzv_endpoint "$MASTER" --rdzv_id "aiayn-wmt14-$MODEL" \
  -m aiayn train --config "$CONFIG" --data-bin "$BIN" --out "$RUN" \
  --max-tokens "$MAX_TOKENS" --resume

[ "$NODE_RANK" = 0 ] || exit 0

echo "== 4. average the last $AVG checkpoints"
AVG_DIR="$RUN/avg$AVG"
$AIAYN average --checkpoint "$RUN" -n "$AVG" -o "$AVG_DIR"

echo "== 5. translate newstest2014 (beam 4, alpha 0.6, up to input + 50 tokens)"
TEST_SRC="$DATA/wmt14/newstest2014.en-de.en"
TEST_REF="$DATA/wmt14/newstest2014.en-de.de"
$AIAYN translate --checkpoint "$AVG_DIR" --input "$TEST_SRC" --output "$RUN/newstest2014.hyp.de" \
  --beam 4 --alpha 0.6 --max-len-a 1 --max-len-b 50

echo "== 6. score (the paper: 27.3 base, 28.4 big, tokenized)"
python "$(dirname "$0")/paper_bleu.py" "$RUN/newstest2014.hyp.de" "$TEST_REF" | tee "$RUN/newstest2014.bleu.txt"
