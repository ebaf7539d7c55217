#!/usr/bin/env bash
# What a session with a lent GPU runs, as a few calls of the device tool (each under its
# 10-minute limit, inside the session's 30 minutes of device time, machine starts included).
# Each stage runs its steps in order; a step that would not finish inside the stage's budget
# is skipped and named, and a step that fails is logged and the stage goes on. Everything
# lands in $OUT (the device tool brings it back): one session.log and a folder per step.
#
#   bash benchmarks/gpu_session.sh 1   # the CUDA tests; the GEMV sweep; batch-1 decode and the host share
#   bash benchmarks/gpu_session.sh 2   # throughput against HF continuous and static batching; parity
#   bash benchmarks/gpu_session.sh 3   # the profile of a batch-1 step, the host's phases at 256 sequences
#   STAGE_BUDGET_S=450 bash benchmarks/gpu_session.sh quick
#                                      # a 15-minute loan's first call: parity, batch-1 (the opt-in kernels
#                                      # and the default), the host share at 256, throughput against HF
#                                      # (each HF baseline stopped HF_TIME_LIMIT_S seconds in)
#   STAGE_BUDGET_S=240 bash benchmarks/gpu_session.sh tests
#                                      # its second, on the machine still warm: a batch-1 step's device
#                                      # timeline (at most 80 s), then the CUDA tests, each
#                                      # at most 60 s, none stopping the others (they took 150 s for
#                                      # the first 21 of tests/kernels on an H100: fewer fit)
#
# Stage 1 writes $OUT/gemv/gemv_configs.json. Stages after it read the configs from
# .gpu/gemv_configs.json if it is there: copy the file there (`echo /.gpu/ >> .git/info/exclude`
# once) and name `.gpu` in the call's `carry`. Without it, the GEMVs take the heuristic's configs.
# STAGE_BUDGET_S (default 560) is the stage's time; HF_NUM_REQUESTS (default 64; the quick
# stage's, 0: all) the requests HF's baselines and conveyor run in the throughput steps.
#
# GPU_SESSION_SMOKE=1 rehearses a stage on a CPU: the same steps, each script with --smoke
# (tiny shapes), the tests collected rather than run, the host's phases at 8 sequences.
# tests/bench/test_gpu_session_script.py runs every stage so in a copy of the checkout where
# only what the device's image holds can be imported.
set -u
stage=${1:?"usage: gpu_session.sh 1|2|3"}
out=${OUT:-results/gpu-session}
mkdir -p "$out"
log="$out/session.log"
export PYTHONUNBUFFERED=1
# The checkout's conveyor, not installed there: the scripts import it from the working tree.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
start=$(date +%s)
budget=${STAGE_BUDGET_S:-560}
hf_requests=${HF_NUM_REQUESTS:-64}
models=${MODELS_DIR:-/tmp/gpu-session-models}
configs=.gpu/gemv_configs.json
smoke=() collect=() host_seqs=256
if [[ -n ${GPU_SESSION_SMOKE:-} ]]; then  # a rehearsal on a CPU: the scripts' own check
    smoke=(--smoke) collect=(--collect-only) host_seqs=8
fi

# step NAME LIMIT_S COMMAND...: run COMMAND for at most LIMIT_S seconds (less if the stage's
# budget has less left), its output into the log; skipped if under 30 s would be left.
step() {
    local name=$1 limit=$2
    shift 2
    local left=$((budget - ($(date +%s) - start)))
    if ((left < 30)); then
        echo "== $name: skipped, ${left}s of the stage left" | tee -a "$log"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (at most ${limit}s) $(date -u +%FT%TZ): $*" | tee -a "$log"
    local t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc after $(($(date +%s) - t0))s" | tee -a "$log"
}

# The GEMV configs for a step's environment (`env "$(gemv_configs)" COMMAND`): the file if it is
# there, else empty (the heuristic's configs). `timeout` runs programs, not shell functions.
gemv_configs() {
    if [[ -f $configs ]]; then
        echo "CONVEYOR_GEMV_CONFIGS=$configs"
    else
        echo "(no $configs: the GEMVs take the heuristic's configs)" >>"$log"
        echo "CONVEYOR_GEMV_CONFIGS="
    fi
}

{
    echo "== stage $stage at $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1
    python3 -c "import torch, triton, transformers, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" 2>&1
} >>"$log"

case $stage in
1)
    step tests 170 python3 -m pytest -q -x -p no:cacheprovider "${collect[@]}" tests/kernels tests/runner
    step gemv 170 python3 benchmarks/gpu_speed.py --parts gemv --gemv-budget-s 100 "${smoke[@]}" --out "$out/gemv"
    # The configs just written, for the steps after it in this call.
    [[ -f $out/gemv/gemv_configs.json ]] && mkdir -p .gpu && cp "$out/gemv/gemv_configs.json" "$configs"
    step batch1 240 env "$(gemv_configs)" python3 benchmarks/gpu_speed.py --parts batch1,overhead "${smoke[@]}" --out "$out/batch1"
    ;;
2)
    step hf_continuous 300 python3 benchmarks/gpu_speed.py --parts throughput --baselines hf_continuous \
        --hf-num-requests "$hf_requests" "${smoke[@]}" --out "$out/hf_continuous"
    step hf_static 170 python3 benchmarks/gpu_speed.py --parts throughput --baselines hf_static \
        --hf-num-requests "$hf_requests" "${smoke[@]}" --out "$out/hf_static"
    step parity 80 env "$(gemv_configs)" python3 benchmarks/gpu_speed.py --parts parity "${smoke[@]}" --out "$out/parity"
    ;;
3)
    step profile 200 env "$(gemv_configs)" python3 benchmarks/gpu_profile.py --fused --gemv "${smoke[@]}" --out "$out/profile"
    step host_time 120 python3 benchmarks/host_time.py --seqs "${host_seqs}" --out "$out/host_time.json"
    ;;
quick)
    # A loan of 15 device minutes, machine start included: one call for what the issue must
    # show and earlier loans left unmeasured, the paths never run on a GPU first. The models
    # are built once, in $models, for every step.
    common=(--models "$models" "${smoke[@]}")
    step parity 80 python3 benchmarks/gpu_speed.py --parts parity "${common[@]}" \
        --variants "${QUICK_PARITY:-float32,bfloat16,bfloat16+fused,bfloat16+fused+gemv+pdl}" --out "$out/parity"
    step batch1 170 env "$(gemv_configs)" python3 benchmarks/gpu_speed.py --parts batch1 "${common[@]}" \
        --variants "${QUICK_BATCH1:-graphs+async+fused+gemv+pdl,graphs+async+fused+gemv,graphs+async+fused,graphs+async,graphs+async+fused+gemv+3launch}" \
        --out "$out/batch1"
    step overhead 90 python3 benchmarks/gpu_speed.py --parts overhead "${common[@]}" --out "$out/overhead"
    # HF's baselines on the whole mix, each stopped HF_TIME_LIMIT_S (35) seconds in, its rate
    # the tokens made by then: on an H100 neither finished the mix's first 32 requests inside
    # such a step (2026-11-26). Static batching first.
    step throughput 170 python3 benchmarks/gpu_speed.py --parts throughput --hf-num-requests "${HF_NUM_REQUESTS:-0}" \
        --hf-time-limit-s "${HF_TIME_LIMIT_S:-35}" --baselines hf_static,hf_continuous "${common[@]}" \
        --out "$out/throughput"
    ;;
tests)
    # The CUDA tests, each at most 60 s, every failure reported (no -x), the slowest named. Each
    # property test takes at most CONVEYOR_GPU_EXAMPLES (4) examples: a new shape compiles its
    # kernels, and the interpreter on the CPU runs them all in CI.
    export CONVEYOR_GPU_EXAMPLES=${CONVEYOR_GPU_EXAMPLES:-4}
    per_test=()
    python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 60)  # the image has it
    # First the device timeline of a batch-1 step on the best path (fused kernels, GEMVs, PDL):
    # the time between its kernels against the time in them, which says where the 85% goal's
    # missing 0.4 ms goes. The model is the quick stage's, if this machine still holds it.
    step profile 80 python3 benchmarks/gpu_profile.py --fused --gemv --pdl --modes graphs --iters 50 \
        --models "$models" "${smoke[@]}" --out "$out/profile"
    # The graphs first (quick), then the captures that no loan has run, Whisper on the Triton
    # kernels (its cross-attention blocks, preempted too; no loan has run it), then the kernels
    # (slow: 150 s for the first 21 of tests/kernels on an H100, before the examples were capped).
    step tests 240 python3 -m pytest -q -rfE --durations=15 -p no:cacheprovider "${per_test[@]}" "${collect[@]}" tests/runner \
        tests/models/test_hybrid_kv_cache.py::test_a_hybrid_cache_captures_its_decode_on_gpu \
        tests/models/test_whisper.py::test_greedy_tokens_are_hfs \
        "tests/models/test_whisper.py::test_cross_blocks_count_in_the_cache_and_survive_preemption" tests/kernels
    ;;
*)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
echo "== stage $stage done after $(($(date +%s) - start))s" | tee -a "$log"
