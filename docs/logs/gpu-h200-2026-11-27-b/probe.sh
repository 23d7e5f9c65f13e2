#!/usr/bin/env bash
# session probe 1: eager training profile, Multi30k 4 min + decode (part 2), aiayn+compile probe
set -u
O=$1; D=/tmp/o; rm -rf $D; mkdir -p $D
GPU_SH_T_CUDA_TESTS=1 GPU_SH_T_TRAIN_THROUGHPUT=1 GPU_SH_KILL_AFTER=2 bash bench/gpu.sh $D/p1 1 > $D/p1.out 2>&1
bash bench/gpu.sh $D/p2 2 > $D/p2.out 2>&1
PYTHONPATH=src timeout -k 5 ${PROBE_T:-90} python3 bench/gpu_train.py --compile aiayn --sizes base --tokens 25000 --rounds 1 --out $D/c > $D/c.log 2>&1
tar czf $O/all.tgz -C $D .
cp $D/p1/gpu_profile.md $D/p2/decode_profile.md $D/p2/summary.md $O/ 2>/dev/null
cat $D/p2/summary.md; cat $D/p2/multi30k.json; tail -30 $D/c.log; cat $D/p1/gpu_profile.md | head -80
