#!/usr/bin/env bash
# The GPU checks of issue 31 (Part B) on one card, in two parts that fit one device call each:
#   bash bench/gpu.sh OUTDIR 1    CUDA tests (pytest -m cuda), a profile of the base training step, training
#                                 throughput (bench/gpu_train.py)
#   bash bench/gpu.sh OUTDIR 2    Multi30k de->en: 4 minutes of training, averaged, beam-4 test BLEU;
#                                 then beam-4 decoding against transformers' generate
#   bash bench/gpu.sh OUTDIR      both parts
#   GPU_SH_DRY=1 bash bench/gpu.sh OUTDIR [PART]   (or --cpu-smoke): every step tiny on the CPU, to show
#                                 the wiring works; it measures nothing
# Run from the checkout's root with aiayn's sources in src/ (no install needed) and Multi30k in
# $AIAYN_DATA/multi30k (default: .data/multi30k in the checkout); docs/gpu.md says how.
# Every step runs under `timeout` (GPU_SH_T_<STEP> seconds overrides its limit); a failed step makes
# the exit status 1, and the other steps still run. The limits add up to 13.3 minutes (6 for part 1,
# 7.3 for part 2), 14.1 with a machine's start (47 s on the first run); a step that overruns its
# limit gets 15 s more before it is killed, so even three overruns stay inside a session's 15
# minutes. OUTDIR gets flat files only
# (a device call brings back at most 8; part 1 writes 8): summary.md (card, versions, one line per
# step), gpu.log (every step's output), and each step's tables.
set -uo pipefail

usage="usage: bash bench/gpu.sh OUTDIR [1|2|all] [--cpu-smoke]"
dry=${GPU_SH_DRY:-0}
args=()
for a in "$@"; do
  case $a in
    --cpu-smoke) dry=1 ;;
    -h|--help) echo "$usage"; exit 0 ;;
    *) args+=("$a") ;;
  esac
done
out=${args[0]:-}
part=${args[1]:-all}
[ -n "$out" ] || { echo "$usage" >&2; exit 2; }
case $part in 1|2|all) ;; *) echo "bench/gpu.sh: part must be 1, 2 or all, got '$part'; $usage" >&2; exit 2 ;; esac

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 2
mkdir -p "$out" && out=$(cd "$out" && pwd) || { echo "bench/gpu.sh: cannot write to OUTDIR '$out'" >&2; exit 2; }
PY=${PYTHON:-python3}
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export AIAYN_DATA=${AIAYN_DATA:-$root/.data}
AIAYN="$PY -m aiayn"
if [ "$dry" = 1 ]; then device=cpu; else device=cuda; fi
summary=$out/summary.md
log=$out/gpu.log
failed=0

# ------------------------------------------------------------------------------------------ steps

step() {  # step NAME LIMIT_SECONDS NOTE CMD...: CMD under timeout, its output appended to gpu.log
  local name=$1 limit=$2 note=$3 rc=0 t0=$SECONDS status
  shift 3
  local var="GPU_SH_T_${name^^}"
  [ "$dry" = 1 ] && limit=$((3 * limit))  # the CPU stand-in is slower than the card, more so on a busy CPU
  limit=${!var:-$limit}
  echo "== $name (at most ${limit} s): $*" | tee -a "$log"
  # a step is a function of this script: bash runs it under timeout (it sees the exported functions)
  local margin=${GPU_SH_KILL_AFTER:-15} tpid
  timeout --kill-after="$margin" "$limit" bash -c '"$@"' "$name" "$@" >> "$log" 2>&1 &
  tpid=$!
  wait "$tpid" || rc=$?
  # At the limit timeout's TERM reaches its whole process group (timeout leads it); bash dies at
  # once and timeout returns, but a step that catches TERM (`aiayn train` does, to save) lives on:
  # it gets the margin, then the KILL, so that it does not run beside the next step.
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    for _ in $(seq "$margin"); do kill -0 -- "-$tpid" 2> /dev/null || break; sleep 1; done
    kill -KILL -- "-$tpid" 2> /dev/null
  fi
  case $rc in
    0) status=ok ;;
    124|137) status="TIMED OUT after ${limit} s" ;;
    *) status="FAILED (exit $rc)" ;;
  esac
  [ "$rc" = 0 ] || failed=1
  echo "| $name | $status | $((SECONDS - t0)) | $limit | $note |" >> "$summary"
  echo "   $name: $status in $((SECONDS - t0)) s" | tee -a "$log"
}

cuda_tests() {  # the CUDA test module; its reports (cuda.md, sdpa_kernels.md) land in OUTDIR
  local on=""
  [ "$dry" = 1 ] && on=cpu  # the dry run runs the module on the CPU (its comparisons are then trivial)
  AIAYN_TEST_DEVICE=$on AIAYN_CUDA_REPORT=$out $PY -m pytest -m cuda "${GPU_SH_CUDA_TESTS:-tests/test_cuda.py}" -p no:cacheprovider \
    -q -rA --junitxml="$out/cuda_tests.xml"
}

train_throughput() {  # bench/gpu_train.py; it starts no new contender after LIMIT - 90 s
  local limit=${GPU_SH_T_TRAIN_THROUGHPUT:-$1}
  if [ "$dry" = 1 ]; then
    $PY bench/gpu_train.py --device cpu --quick --compile none --threads 1 --out "$out" ${GPU_TRAIN_FLAGS:-}
  else
    $PY bench/gpu_train.py --out "$out" --budget-s $((limit > 150 ? limit - 90 : limit / 2)) ${GPU_TRAIN_FLAGS:-}
  fi
}

train_profile() {  # bench/gpu_train.py --profile: where the time of aiayn's base step at 25k tokens goes
  # eager by default; GPU_PROFILE_FLAGS="--compile aiayn" profiles `aiayn train --compile`'s step
  # (give it GPU_SH_T_TRAIN_PROFILE=120: the layers compile in its warm-up)
  if [ "$dry" = 1 ]; then
    $PY bench/gpu_train.py --device cpu --quick --profile --threads 1 --out "$out" ${GPU_PROFILE_FLAGS:-}
  else
    $PY bench/gpu_train.py --profile --sizes base --tokens 25000 --out "$out" ${GPU_PROFILE_FLAGS:-}
  fi
}

fake_multi30k() {  # fake_multi30k DIR: a tiny de-en corpus in Multi30k's file names (for the dry run)
  $PY - "$1" <<'EOF'
import random, sys
from pathlib import Path
folder = Path(sys.argv[1]) / "multi30k"
folder.mkdir(parents=True, exist_ok=True)
de = "ein Mann eine Frau zwei Hunde ein Kind spielt läuft sitzt auf dem im Park Wasser Ball rot blau".split()
en = "a man a woman two dogs a child plays runs sits on the in park water ball red blue".split()
rng = random.Random(0)
for split, n in (("train", 300), ("val", 24), ("test_2016_flickr", 24)):
    rows = [[rng.randrange(len(de)) for _ in range(rng.randint(3, 9))] for _ in range(n)]
    for lang, words in (("de", de), ("en", en)):
        (folder / f"{split}.{lang}").write_text("".join(" ".join(words[i] for i in r) + "\n" for r in rows))
EOF
}

# Multi30k de->en with configs/multi30k-gpu.toml (60 epochs or 4 minutes of training, whichever
# comes first), the last 10 epoch checkpoints averaged, test_2016_flickr at beam 4 / alpha 0.6: all
# fixed in advance (docs/training.md). The dry run keeps the same commands and shrinks the model,
# data and steps.
MULTI30K_WIRED=1
multi30k() {  # multi30k RUN_DIR: writes OUTDIR/multi30k.json (the test BLEU line)
  local run=$1 config=${GPU_SH_MULTI30K_CONFIG:-configs/multi30k-gpu.toml} tiny=()
  [ -e "$config" ] || { echo "$config: not in this checkout (helper gpu's recipe; see MULTI30K_WIRED)"; return 3; }
  if [ "$dry" = 1 ]; then
    tiny=(--preset tiny --d-model 32 --n-heads 4 --encoder-layers 1 --decoder-layers 1 --d-ff 64
          --vocab-size 320 --max-steps 4 --max-minutes 0 --max-tokens 512 --save-every 2 --valid-bleu 8 --threads 1)
  else
    [ -d "$AIAYN_DATA/multi30k" ] || { echo "no Multi30k in $AIAYN_DATA/multi30k: copy it to .data/multi30k (docs/gpu.md)"; return 3; }
  fi
  rm -rf "$run"
  $AIAYN train --config "$config" --src de --tgt en --device "$device" --out "$run" "${tiny[@]}" || return
  $AIAYN average --checkpoint "$run" -n 10 -o "$run/averaged" || return
  $AIAYN evaluate --checkpoint "$run/averaged" --data multi30k --src de --tgt en --split test_2016_flickr \
    --beam 4 --alpha 0.6 --device "$device" --json > "$out/multi30k.json" || return
  cat "$out/multi30k.json"
}

# Greedy and beam 4 on test_2016_flickr with the averaged model: aiayn (fp32, bf16) against
# transformers' generate on its `aiayn export --to hf` Marian copy (fp32, bf16) on the same card,
# in the batches of `aiayn translate`: sentences/s, BLEU, outputs identical to aiayn fp32's, speed-ups.
DECODE_WIRED=1
decode() {  # decode CHECKPOINT: writes OUTDIR/decode.json and OUTDIR/decode_profile.md
  local quick=()
  [ "$dry" = 1 ] && quick=(--quick --skip ct2)
  $PY bench/engines.py --checkpoint "$1" --device "$device" --max-tokens 4096 --batch-size 256 \
    --json "$out/decode.json" --profile "$out/decode_profile.md" "${quick[@]}"
}

# ---------------------------------------------------------------------------------------------- run

export -f cuda_tests train_profile train_throughput fake_multi30k multi30k decode
export out dry PY AIAYN device

{
  echo "# bench/gpu.sh part $part$([ "$dry" = 1 ] && echo ' (dry run on the CPU: wiring only, no measurement)')"
  echo
  echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  $PY -c 'import torch; c = torch.cuda.is_available(); print("torch", torch.__version__, "CUDA", torch.version.cuda,
"|", torch.cuda.get_device_name() if c else "no CUDA device")' 2>&1
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv,noheader 2>&1
  else
    echo "nvidia-smi: not found"
  fi
  echo
  echo "| step | status | seconds | limit | note |"
  echo "|---|---|---:|---:|---|"
} > "$summary"
: > "$log"
command -v nvidia-smi > /dev/null && nvidia-smi >> "$log" 2>&1
if [ "$dry" != 1 ] && ! $PY -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  echo "bench/gpu.sh: torch sees no CUDA device; GPU_SH_DRY=1 (or --cpu-smoke) runs the steps on the CPU" | tee -a "$summary" >&2
  exit 2
fi

if [ "$part" != 2 ]; then
  rm -f "$out"/{cuda_tests.xml,cuda.md,sdpa_kernels.md,gpu_profile.md,gpu_train.md,gpu_train.json}  # no stale tables
  step cuda_tests 100 "pytest -m cuda; cuda.md, sdpa_kernels.md, cuda_tests.xml" cuda_tests
  step train_profile 40 "gpu_profile.md: aiayn base at 25k tokens under torch.profiler" train_profile
  step train_throughput 220 "gpu_train.md, gpu_train.json" train_throughput 220
fi
if [ "$part" != 1 ]; then
  rm -f "$out"/{multi30k.json,decode.json,decode_profile.md}
  if [ "$dry" = 1 ]; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    run=$tmp/run
    fake_multi30k "$tmp"
    export AIAYN_DATA=$tmp
  else
    run=$root/runs/gpu-multi30k  # checkpoints stay out of OUTDIR (a device call brings back 8 files)
  fi
  note() { [ "$1" = 1 ] && echo "$2" || echo "$2; PLACEHOLDER, not wired yet"; }
  step multi30k 320 "$(note $MULTI30K_WIRED 'multi30k.json: test_2016_flickr BLEU, beam 4')" multi30k "$run"
  step decode 120 "$(note $DECODE_WIRED 'decode.json: sentences/s vs generate; decode_profile.md')" decode "$run/averaged"
fi

echo
cat "$summary"
for table in "$out"/gpu_train.md "$out"/cuda.md "$out"/sdpa_kernels.md "$out"/gpu_profile.md; do
  [ -e "$table" ] && { echo; cat "$table"; }
done
for f in "$out"/multi30k.json "$out"/decode.json; do
  [ -e "$f" ] && { echo; echo "${f##*/}:"; head -c 3000 "$f"; echo; }
done
exit $failed
