#!/usr/bin/env bash
# eval/gpu_check.sh OUTDIR: issue 31's GPU check in one command (about 8 minutes on one H200).
#
#   1. install     specdraft into the machine's Python (editable, no deps, no network): `specdraft.kernels`
#                  is the folder kernels/, which only an install maps
#   2. selftest    `specdraft selftest --device cuda --quick`: environment, compiled kernels vs the reference, every
#                  family trained in bf16 with an exact resume and its exports, greedy decoding identical to
#                  generate() with CUDA graphs, and the GPU's verify-cost curve                 (about 3 min)
#   3. kernels     `python eval/bench_kernels.py --out OUTDIR/kernels`                (12 s on an H200)
#      probe       `python eval/probe_gpu_decode.py`: where a decode step's time goes (eager, CUDA graphs, bf16
#                  prompts of new lengths with cuDNN attention on and off, through evaluate())   (about 40 s)
#   4. train       toy EAGLE-3 training throughput in bf16 (eval/bench_train.py): tokens/s, step / target
#                  forward (a second run with CUDA_LAUNCH_BLOCKING=1 splits the step honestly), peak memory
#   5. launcher    `accelerate launch --config_file recipes/accelerate/fsdp.yaml --num_processes 1`, toy
#                  EAGLE-3, saved at half its steps, and a copy resumed there ends with the same weights
#                  (eval/fsdp_resume.py; it also prints what accelerate made of the config)
#   6. decode      the toy drafters' decode speedups, eager and with compile_target="reduce-overhead"
#                  (CUDA graphs): EAGLE-3 and Medusa-1 trained briefly on the toy's own answers, prompt lookup
#                  (eval/bench_train_and_decode.py)
# Each step's output goes to OUTDIR/gpu_check.log and its tables to OUTDIR (summary.md lists every step's
# result and seconds); a failing step does not stop the others, and the script exits 1 at the end if any failed.
#
# With the device tool: the GPU machine has torch, transformers, triton, accelerate, peft and safetensors; it
# lacks datasets, wandb, deepspeed and gguf, which this check does not use (local data reads without datasets,
# specdraft/data/records.py; wandb and deepspeed are imported only when asked for). Its transformers (5.17 on
# 2026-11-27) is older than compiled decoding needs (5.23: StaticCache.crop), so carry a newer one, which the
# install step puts first on PYTHONPATH (13 MiB; download it here once, into the ignored .whl/):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl transformers==5.24.0
# At most 8 files come back from $OUT, so the folder travels as one archive, with the summary beside it:
#   run(command="bash eval/gpu_check.sh /tmp/gpu-check; rc=$?; cp /tmp/gpu-check/summary.md $OUT/;
#       tar czf $OUT/gpu-check.tgz -C /tmp gpu-check; exit $rc", carry=[".whl"], timeout_s=540)
# Measured on an H200 (2026-11-27, eval/gpu/h200-2026-11-27.md): install 3 s, environment 6 s, the full selftest
# 168 s with its compiled decodes refused (transformers 5.17) and --quick 111 s for three families with them,
# kernels 12 s, train 42 s, launcher 66 s, decode 144 s with its compiled half refused. With compiled decoding
# working the full sizes would pass 10 minutes, so on a GPU the selftest runs --quick and the decode eval is
# smaller (expected about 8 minutes in all; timeout_s=540). Over that: drop a step by commenting it out, and say which.
#
# Some steps only (a device call shared with other work): SPECDRAFT_GPU_CHECK_STEPS="install environment probe".
#
# A CPU dry run of every step at small sizes (so the next GPU holder finds no silly bug; about 12 minutes on
# 2 busy cores; step 3 needs eval/bench_kernels.py from the kernels change of issue 31):
#   SPECDRAFT_GPU_CHECK_DEVICE=cpu bash eval/gpu_check.sh /tmp/gpu-check-dry
set -u -o pipefail
OUT=${1:?usage: bash eval/gpu_check.sh OUTDIR}
DEVICE=${SPECDRAFT_GPU_CHECK_DEVICE:-cuda}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu_check.log"
SUMMARY="$OUT/summary.md"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
: > "$LOG"
printf '# eval/gpu_check.sh on %s (%s)\n\n| step | result | seconds |\n|---|---|---:|\n' "$DEVICE" "$(date -u +%FT%TZ)" > "$SUMMARY"
FAILED=()

STEPS=${SPECDRAFT_GPU_CHECK_STEPS:-install environment selftest kernels probe train launcher decode}

step() {  # step NAME COMMAND...: run it (when STEPS names it), log everything, record ok/FAILED and its seconds
    local name=$1 start result
    shift
    [[ " $STEPS " == *" $name "* ]] || return 0
    echo "== $name: $*" | tee -a "$LOG"
    start=$(date +%s)
    if "$@" >> "$LOG" 2>&1; then result=ok; else result=FAILED; FAILED+=("$name"); fi
    echo "== $name: $result in $(( $(date +%s) - start )) s" | tee -a "$LOG"
    echo "| $name | $result | $(( $(date +%s) - start )) |" >> "$SUMMARY"
}

if [ "$DEVICE" = cpu ]; then  # the dry run: every step, at sizes a CPU finishes
    QUICK=(--quick)
    KERNELS=(--quick)
    PROBE=(--tokens 12)
    TRAIN=(--steps 6 --micro-batch 2 --max-length 64)
    FSDP=(--cpu)
    DECODE=(--device cpu --num-train-prompts 24 --heldout-answers 8 --answer-tokens 32 --answer-batch 8
            --train-steps 4 --per-category 1 --max-new-tokens 16 --compile-modes off)
    PRECISION=()
else
    QUICK=(--quick)  # the full selftest and decode sizes passed 10 minutes of device time with compiled decoding
    KERNELS=()
    PROBE=()
    TRAIN=()
    FSDP=()
    DECODE=(--device cuda --num-train-prompts 300 --heldout-answers 32 --answer-tokens 128 --answer-batch 128
            --train-minutes 0.4 --per-category 1 --max-new-tokens 64 --compile-modes off reduce-overhead)
    PRECISION=(--set training.mixed_precision=bf16 --set target.dtype=bfloat16)
fi

install() {  # an editable install maps kernels/ to specdraft.kernels; failing that, a link does, in this copy
    # Compiled decoding (CUDA graphs) needs transformers >= 5.23; a carried wheel replaces an older one.
    local wheel
    wheel=$(ls .whl/transformers-*.whl 2>/dev/null | head -1)
    if [ -n "$wheel" ] && ! "$PY" -c "import sys; from transformers.cache_utils import StaticLayer as S
sys.exit('cumulative_length' not in getattr(S, '__annotations__', {}))"; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/specdraft-site "$wheel" && export PYTHONPATH="/tmp/specdraft-site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    "$PY" -c "import specdraft.kernels" 2>/dev/null && return 0
    "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . && "$PY" -c "import specdraft.kernels" \
        && return 0
    ln -sfn ../kernels specdraft/kernels && export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" \
        && "$PY" -c "import specdraft.kernels"
}

environment() {
    { nvidia-smi || echo "(no nvidia-smi)"; "$PY" -c "import torch; print('torch', torch.__version__, 'cuda',
torch.version.cuda, 'available', torch.cuda.is_available())"; } | tee "$OUT/environment.txt"
}

train_throughput() {
    "$PY" eval/bench_train.py --target toy --families eagle3 --modes online "${TRAIN[@]}" "${PRECISION[@]}" \
        | tee "$OUT/train_throughput.md"
    # Host timers split a step only when every kernel finishes before the clock is read.
    CUDA_LAUNCH_BLOCKING=1 "$PY" eval/bench_train.py --target toy --families eagle3 --modes online "${TRAIN[@]}" \
        "${PRECISION[@]}" | tee "$OUT/train_throughput_blocking.md"
}

step install install  # a function runs in this shell: a PYTHONPATH it exports reaches the later steps
step environment environment
step selftest "$PY" -m specdraft selftest --device "$DEVICE" "${QUICK[@]}" --out "$OUT/selftest"
step kernels "$PY" eval/bench_kernels.py --out "$OUT/kernels" "${KERNELS[@]}"
step probe bash -c "set -o pipefail; \"$PY\" eval/probe_gpu_decode.py --device $DEVICE ${PROBE[*]} | tee \"$OUT/probe.md\""
step train train_throughput
step launcher bash -c "cd eval && \"$PY\" fsdp_resume.py --work \"$OUT/fsdp-work\" ${FSDP[*]} | tee \"$OUT/launcher.md\""
step decode bash -c "cd eval && \"$PY\" bench_train_and_decode.py --target toy --work \"$OUT/decode-work\" \
    --families eagle3 medusa1 -k 5 --temperatures 0 ${DECODE[*]} && cp \"$OUT/decode-work/report.md\" \"$OUT/decode.md\""
rm -rf "$OUT/fsdp-work" "$OUT/decode-work/runs" "$OUT"/selftest/work-*  # checkpoints (655 MB once): not worth bringing back

if [ ${#FAILED[@]} -gt 0 ]; then
    echo "FAILED: ${FAILED[*]} (see $LOG)" | tee -a "$SUMMARY"
    exit 1
fi
echo "all steps passed" | tee -a "$SUMMARY"
