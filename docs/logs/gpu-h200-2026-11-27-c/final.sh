#!/usr/bin/env bash
# session call 2: CUDA tests (with CUDA-graph search), decoding vs generate, training throughput, aiayn+compile probe
set -u
O=$1; T0=$SECONDS; END=${FINAL_T:-385}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 AIAYN_DATA=$PWD/.data
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit --format=csv,noheader; python3 -c 'import torch; print(torch.__version__)'; } > $O/run.log 2>&1
AIAYN_CUDA_REPORT=$O timeout -k 5 120 python3 -m pytest -m cuda tests/test_cuda.py -p no:cacheprovider -q -rA >> $O/run.log 2>&1
echo "== cuda tests rc=$? at $((SECONDS-T0)) s" >> $O/run.log
timeout -k 5 110 python3 bench/engines.py --checkpoint .data/ck/m30k --device cuda --max-tokens 4096 --batch-size 256 \
  --json $O/decode.json --profile $O/decode_profile.md >> $O/run.log 2>&1
echo "== decode rc=$? at $((SECONDS-T0)) s" >> $O/run.log
left=$((END - (SECONDS - T0)))
timeout -k 5 $left python3 bench/gpu_train.py --compile aiayn --budget-s $((left - 45)) --out /tmp/tr > $O/train.log 2>&1
echo "== train rc=$? at $((SECONDS-T0)) s (limit $left)" >> $O/run.log
cp /tmp/tr/gpu_train.md /tmp/tr/gpu_train.json $O/ 2>/dev/null
grep -E "^== |passed|failed|^\s+(aiayn|HF)|faster than" $O/run.log; grep -E "tok/s|target|projection" $O/train.log | tail -16
