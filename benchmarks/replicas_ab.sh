#!/bin/bash
# Served throughput of one engine against two replicas behind a router, alternating:
# one, round_robin, cache_aware, one, round_robin, cache_aware, ...
#   bash benchmarks/replicas_ab.sh [ROUNDS=2] [OUT=results/replicas-ab] [MODES="one round_robin cache_aware"]
# MODES also takes `ray`: one engine in a Ray actor (--data-parallel-backend ray), the cost of
# the Ray hop against `one`, the engine in a child process; and POLICY_xN: N routers taking
# turns (--router-instances N), e.g. cache_aware_x2 kv_events_x2.
# PREFIX_GROUPS (default 8) sets the number of shared prefixes.
# Each run: SmolLM2 served with default options (`one`), or with --data-parallel-size 2 and the
# router policy; `conveyor bench serve` at 32 concurrent streams, 96 requests whose prompts
# start with one of 8 shared 256-token prefixes (then uniform 32-256 tokens), outputs uniform
# 16-128. On CPU the cores are split between the replicas (one torch thread each on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
out=${2:-results/replicas-ab}
modes=${3:-one round_robin cache_aware}
mkdir -p "$out"
conveyor=(python -m conveyor.cli)
n=0
for round in $(seq 1 "$rounds"); do
  for mode in $modes; do
    case "$mode" in
      one) flags=() ;;
      ray) flags=(--data-parallel-backend ray) ;;
      *_x[0-9]*) flags=(--data-parallel-size 2 --router-policy "${mode%_x*}" --router-instances "${mode##*_x}") ;;
      *) flags=(--data-parallel-size 2 --router-policy "$mode") ;;
    esac
    port=$((18200 + n)); n=$((n + 1))
    "${conveyor[@]}" serve --port "$port" "${flags[@]}" > "$out/server-$mode-$round.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 240); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
    "${conveyor[@]}" bench serve --base-url "http://127.0.0.1:$port" --label "$mode-$round" \
      --input-len uniform:32,256 --output-len uniform:16,128 --num-requests 96 --concurrency 32 \
      --shared-prefix-len 256 --prefix-groups "${PREFIX_GROUPS:-8}" \
      --seed 0 --no-plots --no-progress --out "$out/$mode-$round" | grep "^| $mode"
    curl -s "http://127.0.0.1:$port/metrics" | grep "^conveyor:router_requests_total" > "$out/routed-$mode-$round.txt" || true
    kill -TERM "$pid"
    wait "$pid" || true
  done
done
