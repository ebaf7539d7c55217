#!/bin/bash
# Served throughput with the engine in a thread of the server (--no-engine-process) and in its
# own process (the default), alternating: thread, process, thread, process, ...
#   bash benchmarks/engine_process_ab.sh [ROUNDS=2] [OUT=results/engine-process-ab]
# Each run: SmolLM2 served with default options, `conveyor bench serve` at 32 concurrent streams,
# prompts uniform 32-256, outputs uniform 16-128, 96 requests (about 40 s a run on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
out=${2:-results/engine-process-ab}
mkdir -p "$out"
conveyor=(python -m conveyor.cli)
for round in $(seq 1 "$rounds"); do
  for mode in thread process; do
    flag=--engine-process
    [ "$mode" = thread ] && flag=--no-engine-process
    port=$((18100 + round * 2 + ${#mode} % 2))
    "${conveyor[@]}" serve --port "$port" "$flag" > "$out/server-$mode-$round.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 180); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
    "${conveyor[@]}" bench serve --base-url "http://127.0.0.1:$port" --label "$mode-$round" \
      --input-len uniform:32,256 --output-len uniform:16,128 --num-requests 96 --concurrency 32 \
      --seed 0 --no-plots --no-progress --out "$out/$mode-$round" | grep "^| $mode"
    kill -TERM "$pid"
    wait "$pid" || true
  done
done
