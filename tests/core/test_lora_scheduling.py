"""LoRA adapters in the scheduler: a step never runs more than `max_loras` adapters, a request
of an adapter with no place waits without holding up the others, everyone finishes with what
it generates alone, and the prefix cache never shares a block across adapters (the fake
runner tags each KV slot with its adapter: a block read under another adapter fails).

Random streams (hypothesis) over adapters, prompts that share prefixes across adapters, small
caches that preempt (recompute or swap) and every queue policy.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.config import ConfigError, EngineConfig
from conveyor.lora import LoRARequest
from conveyor.sampling_params import InvalidRequestError
from tests.core.helpers import Driver, make_prompt

ADAPTERS = [LoRARequest(f"a{i}", i + 1, f"/adapters/a{i}") for i in range(4)]


@st.composite
def streams(draw: st.DrawFn) -> dict:
    block_size = draw(st.sampled_from([2, 4]))
    requests = []
    for i in range(draw(st.integers(2, 14))):
        lora = draw(st.sampled_from([None, *ADAPTERS]))
        # Prompts drawn from a few shapes, so that several requests share prefixes
        # under one adapter and under different ones.
        base = make_prompt(draw(st.integers(0, 2)), 12)
        prompt = base[: draw(st.integers(1, 12))] + make_prompt(i, draw(st.integers(0, 4)))
        requests.append((prompt, lora, draw(st.integers(1, 8)), draw(st.integers(0, 6))))
    return dict(
        block_size=block_size,
        num_blocks=draw(st.integers(12, 40)) if block_size == 2 else draw(st.integers(6, 20)),
        max_loras=draw(st.integers(1, 3)),
        policy=draw(st.sampled_from(["fcfs", "priority", "sjf", "lpm"])),
        preemption_mode=draw(st.sampled_from(["recompute", "swap"])),
        requests=requests,
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_random_streams_keep_to_max_loras_and_generate_what_they_generate_alone(sc: dict) -> None:
    d = Driver(
        sc["num_blocks"], sc["block_size"], num_swap_blocks=64, prefix_caching=True, max_num_seqs=6,
        max_num_batched_tokens=16, max_loras=sc["max_loras"], policy=sc["policy"],
        preemption_mode=sc["preemption_mode"],
    )
    max_len = d.max_model_len
    added = 0
    pending = list(enumerate(sc["requests"]))
    for _ in range(5_000):
        while pending and pending[0][1][3] <= len(d.log):  # arrivals by step
            i, (prompt, lora, max_tokens, _) = pending.pop(0)
            if len(prompt) + max_tokens <= max_len:
                d.add(i, len(prompt), max_tokens, prompt=prompt, lora=lora, priority=i % 3)
                added += 1
        if not pending and not d.sched.has_unfinished():
            break
        out = d.step()
        adapters = {it.lora_request.lora_name for it in out.scheduled if it.lora_request is not None}
        assert len(adapters) <= sc["max_loras"], adapters
    else:
        raise AssertionError("not finished after 5,000 steps")
    assert all(s.is_finished for s in d.seqs.values()) and len(d.seqs) == added
    d.check_outputs()


def test_a_request_of_an_adapter_without_a_place_waits_and_the_others_go_ahead() -> None:
    d = Driver(64, 4, max_num_seqs=8, max_loras=1, max_num_batched_tokens=64)
    d.add(0, 4, 6, lora=ADAPTERS[0])
    d.add(1, 4, 6, lora=ADAPTERS[1])  # waits: a0 holds the one place
    d.add(2, 4, 6)  # the base model: never counts
    d.add(3, 4, 6, lora=ADAPTERS[0])  # a0 runs already: joins
    first = d.step()
    assert sorted(it.seq_id for it in first.scheduled) == [0, 2, 3]
    d.run()
    assert d.first_step_of(1) >= 6  # once a0's requests have finished
    d.check_outputs()


def test_the_same_prompt_under_two_adapters_shares_no_cached_block() -> None:
    d = Driver(64, 4, prefix_caching=True, max_loras=2)
    prompt = make_prompt(0, 16)
    d.add(0, 16, 2, prompt=prompt, lora=ADAPTERS[0])
    d.run()
    d.add(1, 16, 2, prompt=prompt, lora=ADAPTERS[1])
    d.add(2, 16, 2, prompt=prompt, lora=ADAPTERS[0])
    d.add(3, 16, 2, prompt=prompt)
    d.run()
    hits = {s.seq_id: s.metrics.num_cached_tokens for s in d.seqs.values()}
    assert hits == {0: 0, 1: 0, 2: 12, 3: 0}
    d.check_outputs()


def test_lora_options_are_refused_without_enable_lora() -> None:
    with pytest.raises(ConfigError, match="max_loras applies only with enable_lora"):
        EngineConfig.from_kwargs(max_loras=2)
    with pytest.raises(ConfigError, match="max_lora_rank and max_cpu_loras apply only"):
        EngineConfig.from_kwargs(max_lora_rank=8)
    with pytest.raises(ConfigError, match="max_cpu_loras=1 must be at least max_loras=2"):
        EngineConfig.from_kwargs(enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ConfigError, match="max_loras=0 must be at least 1"):
        EngineConfig.from_kwargs(enable_lora=True, max_loras=0)


def test_a_lora_request_needs_a_name_and_a_positive_id() -> None:
    with pytest.raises(InvalidRequestError, match="needs a name"):
        LoRARequest("", 1, "/x")
    with pytest.raises(InvalidRequestError, match="0 is the base model"):
        LoRARequest("a", 0, "/x")
