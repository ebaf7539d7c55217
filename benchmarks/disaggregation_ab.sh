#!/bin/bash
# Served prefill/decode disaggregation against two replicas that do both, alternating:
# dp2, pd, dp2, pd, ...
#   bash benchmarks/disaggregation_ab.sh [ROUNDS=2] [OUT=results/disaggregation-ab] [MODES="dp2 pd"]
# Each run: SmolLM2 served with --data-parallel-size 2 --router-policy least_requests (`dp2`: each
# replica prefills and decodes, chunked prefill) or --prefill-replicas 1 --decode-replicas 1
# (`pd`); `conveyor bench serve` at 8 concurrent streams, 48 requests with long prompts (uniform
# 512-1024 tokens) and short answers (uniform 32-128). On CPU the 2 cores are split between the
# two engine processes (one torch thread each); the prompts' K/V go through their pipes.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
out=${2:-results/disaggregation-ab}
modes=${3:-dp2 pd}
mkdir -p "$out"
conveyor=(python -m conveyor.cli)
n=0
for round in $(seq 1 "$rounds"); do
  for mode in $modes; do
    case "$mode" in
      dp2) flags=(--data-parallel-size 2 --router-policy least_requests) ;;
      pd) flags=(--prefill-replicas 1 --decode-replicas 1) ;;
      *) echo "unknown mode $mode" >&2; exit 2 ;;
    esac
    port=$((18300 + n)); n=$((n + 1))
    "${conveyor[@]}" serve --port "$port" --max-model-len 2048 "${flags[@]}" > "$out/server-$mode-$round.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 240); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
    "${conveyor[@]}" bench serve --base-url "http://127.0.0.1:$port" --label "$mode-$round" \
      --input-len uniform:512,1024 --output-len uniform:32,128 --num-requests 48 --concurrency 8 \
      --seed 0 --no-plots --no-progress --out "$out/$mode-$round" | grep "^| $mode"
    kill -TERM "$pid"
    wait "$pid" || true
  done
done
