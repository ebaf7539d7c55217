"""Simulated prefill/decode disaggregation: the real schedulers of prefill and decode replicas
on the cost model, K/V crossing a link of a given bandwidth. Over random workloads and pool
sizes every request finishes once with its length, its first token from a prefill replica and
the rest from a decode replica that never computes its prompt, no earlier than the handoff's
bytes could cross; by hand, one request's end moves by exactly its transfer time."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.cli import main
from conveyor.config import ConfigError
from conveyor.core.routing import RouterConfig, make_router
from conveyor.replay import TimedRequest
from conveyor.sampling_params import SamplingParams
from conveyor.sim.replicas import replay_disaggregated
from tests.sim.test_replicas import workload
from tests.sim.test_sim import TOY, toy_engine


def pools(p: int, d: int, receive: int = 1 << 30, decode_seats: int = 8):
    prefill = [toy_engine(num_kv_blocks=60, max_num_seqs=8) for _ in range(p)]
    decode = [toy_engine(num_kv_blocks=60, max_num_seqs=decode_seats, kv_receive_space=receive) for _ in range(d)]
    rc = RouterConfig(prefill_replicas=p, decode_replicas=d, router_policy="round_robin")
    return prefill, decode, make_router(rc.pool("prefill")), make_router(rc.pool("decode"))


@settings(max_examples=25, deadline=None)
@given(p=st.integers(1, 3), d=st.integers(1, 3), n=st.integers(1, 40), seed=st.integers(0, 1000),
       gbps=st.sampled_from([0.001, 1.0, 100.0]), receive_blocks=st.sampled_from([8, 64, 4096]),
       concurrency=st.sampled_from([None, 1, 5]))
def test_every_request_finishes_once_through_both_pools(p, d, n, seed, gbps, receive_blocks, concurrency):
    reqs = workload(n, seed)
    block_bytes = TOY.kv_bytes_per_token(2) * 16
    prefill, decode, pr, dr = pools(p, d, receive=receive_blocks * block_bytes)
    done = replay_disaggregated(prefill, decode, pr, dr, reqs, gbps * 1e9, concurrency)
    decode_prompt_tokens = sum(s.num_prefill_tokens for e in decode for s in e.step_trace)
    recomputed = sum(e.num_kv_recomputed for e in decode)
    handoffs = 0
    for req, out, dk in zip(reqs, done.outputs, done.decode_routed, strict=True):
        assert out.finished and len(out.outputs[0].token_ids) == req.params.max_tokens
        assert out.metrics.first_token_time is not None and out.metrics.arrival_time <= out.metrics.first_token_time
        if req.params.max_tokens == 1:
            assert dk == -1  # ended at its prefill replica
            continue
        handoffs += 1
        assert 0 <= dk < d
        # the second token came after the K/V crossed the link
        crossing = len(req.prompt) * TOY.kv_bytes_per_token(2) / (gbps * 1e9)
        assert out.metrics.token_times[1] >= out.metrics.first_token_time + crossing * (1 - 1e-9)
    assert len(done.transfer_s) == handoffs
    assert sum(e.num_kv_received for e in decode) + recomputed == handoffs
    if recomputed == 0:  # the decode replicas computed no prompt (preemption aside)
        assert decode_prompt_tokens == 0 or any(e.scheduler.num_preemptions for e in decode)
    for e in (*prefill, *decode):
        bm = e.scheduler.block_manager
        assert not e.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks
        assert bm.num_free_swap_blocks == bm.num_swap_blocks


def test_the_transfer_time_is_the_bytes_over_the_link():
    req = TimedRequest(0.0, list(range(10, 110)), SamplingParams(max_tokens=8, ignore_eos=True), "r0")
    ends = {}
    for gbps in (1000.0, 0.001):
        done = replay_disaggregated(*pools(1, 1), [req], gbps * 1e9)
        ends[gbps] = done.outputs[0].metrics.finished_time
        assert done.transfer_bytes == 100 * TOY.kv_bytes_per_token(2)
    slow, fast = (done.transfer_bytes / (g * 1e9) for g in (0.001, 1000.0))
    assert ends[0.001] - ends[1000.0] == pytest.approx(slow - fast, rel=1e-9)


def test_router_config_for_disaggregation():
    with pytest.raises(ConfigError, match="at least one of each"):
        RouterConfig(prefill_replicas=1)
    with pytest.raises(ConfigError, match="data_parallel_size is their sum"):
        RouterConfig(prefill_replicas=1, decode_replicas=1, data_parallel_size=2)
    rc = RouterConfig(prefill_replicas=2, decode_replicas=3, router_policy="cache_aware")
    assert (rc.pool("prefill").data_parallel_size, rc.pool("prefill").router_policy) == (2, "cache_aware")
    assert (rc.pool("decode").data_parallel_size, rc.pool("decode").router_policy) == (3, "least_requests")


def test_simulate_disaggregated_end_to_end(tmp_path, capsys):
    out = tmp_path / "sim"
    rc = main(["simulate", "--hardware", "h100-sxm", "--model", "llama-3.1-8b", "--num-requests", "40",
               "--request-rate", "4", "--input-len", "512", "--output-len", "32", "--kv-transfer-gbps", "25",
               "pd:prefill_replicas=1,decode_replicas=2", "dp:data_parallel_size=3", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert text.count("40/40 done") == 2
    result = json.loads((out / "result.json").read_text())
    pd = next(s for s in result["systems"] if s["name"] == "pd")
    engine = pd["points"][0]["engine"]
    assert engine["kv_transfer"]["handoffs"] == 40 and engine["kv_transfer"]["link_gbps"] == 25
    assert [r["role"] for r in engine["replicas"]] == ["prefill", "decode", "decode"]
    assert sum(r["requests"] for r in engine["replicas"][1:]) == 40
    assert result["simulation"]["systems"]["pd"]["prefill_replicas"] == 1


def test_handoffs_wait_for_a_decode_seat():
    """Handoffs beyond a decode replica's seats wait (in arrival order) and all finish."""
    reqs = [dataclasses.replace(r, arrival_s=0.0) for r in workload(30, 5)]
    prefill, decode, pr, dr = pools(2, 1, decode_seats=2)
    done = replay_disaggregated(prefill, decode, pr, dr, reqs, 1e9)
    assert all(o.finished for o in done.outputs)
    assert max(s.num_seqs for s in decode[0].step_trace) <= 2
