"""The encoder's budget a step (`max_num_encoder_input_tokens`, vLLM's): a step computes the
embeddings of at most that many media tokens; a prefill chunk stops before an item the budget
cannot pay for, and the item waits for a later step. Property tests over random prompts with
images (some sharing a digest, some in the encoder cache), chunked and whole prompts, and a KV
cache small enough to preempt: each step's new encodings stay within the budget, and every
request finishes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.config import ConfigError, SchedulerConfig
from conveyor.core.block_manager import BlockManager
from conveyor.core.scheduler import Scheduler
from conveyor.multimodal import ImageSpan, Pixels
from conveyor.sampling_params import SamplingParams
from conveyor.sequence import Sequence
from tests.core.helpers import EOS, FakeRunner, make_prompt


@dataclass(frozen=True)
class Request:
    prompt_len: int
    spans: tuple[tuple[int, int, int], ...]  # (offset, length, digest id)
    max_tokens: int


def span(offset: int, length: int, digest: int) -> ImageSpan:
    return ImageSpan(offset, length, Pixels(None, b"d%d" % digest))  # type: ignore[arg-type]


def build(requests: list[Request], budget: int, tokens: int, chunked: bool, num_blocks: int,
          cached: frozenset[int] = frozenset()) -> tuple[Scheduler, dict[int, Sequence]]:
    config = SchedulerConfig(8, tokens, prefill_mode="chunked" if chunked else "mixed",
                             max_num_encoder_input_tokens=budget)
    sched = Scheduler(config, BlockManager(num_blocks, 4), num_blocks * 4, frozenset({EOS}))
    held = {b"d%d" % d for d in cached}
    sched.encoder_cached = held.__contains__
    seqs = {}
    for i, r in enumerate(requests):
        params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
        seq = Sequence(i, f"r{i}", make_prompt(i, r.prompt_len), params, 0.0,
                       images=tuple(span(*s) for s in r.spans))
        sched.add(seq)
        seqs[i] = seq
    return sched, seqs


def run(sched: Scheduler, seqs: dict[int, Sequence], budget: int, cached: frozenset[int] = frozenset()
        ) -> list[list[tuple[int, int]]]:
    """Every step until all finish: each step's new encodings (sequence, item) checked against
    the budget, an item new where a chunk first reaches its first token since the sequence
    (re)started computing."""
    runner = FakeRunner(sched.block_manager.num_blocks, 4)
    steps: list[list[tuple[int, int]]] = []
    for _ in range(5000):
        if not sched.has_unfinished():
            return steps
        out = sched.schedule(0.0)
        sched.check_integrity()
        new: list[tuple[int, int]] = []
        paid: set[bytes] = set()
        spent = 0
        for it in out.scheduled:
            end = it.start_pos + len(it.token_ids)
            for k, s in enumerate(it.images):
                if it.start_pos <= s.offset < end:
                    new.append((it.seq_id, k))
                    digest = s.pixels.digest
                    if digest not in paid and int(digest[1:]) not in cached:
                        paid.add(digest)
                        spent += s.length
        assert spent <= budget, (spent, budget)
        steps.append(new)
        sched.update(out, runner(out), 0.0)
        sched.check_integrity()
    raise AssertionError("the requests did not finish")


@st.composite
def requests(draw: st.DrawFn, budget: int, chunked: bool) -> list[Request]:
    out = []
    for _ in range(draw(st.integers(1, 6))):
        n = draw(st.integers(2, 90))
        spans: list[tuple[int, int, int]] = []
        at = draw(st.integers(0, 10))
        while at < n - 1 and len(spans) < 4:
            length = draw(st.integers(1, min(budget, n - 1 - at)))
            spans.append((at, length, draw(st.integers(0, 5))))
            at += length + draw(st.integers(0, 12))
        if not chunked:  # (a whole prompt's items must fit one step's budget: the engine refuses others)
            while sum(s[1] for s in spans) > budget:
                spans.pop()
        out.append(Request(n, tuple(spans), draw(st.integers(1, 6))))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), budget=st.integers(1, 60), chunked=st.booleans(), small_cache=st.booleans())
def test_steps_encode_within_the_budget_and_all_finish(data, budget, chunked, small_cache):
    reqs = data.draw(requests(budget, chunked))
    tokens = data.draw(st.integers(8, 128)) if chunked else 128
    num_blocks = 40 if small_cache else 400  # (40: four-token blocks for 160 tokens, preemptions)
    cached = frozenset(data.draw(st.sets(st.integers(0, 5), max_size=2)))
    sched, seqs = build(reqs, budget, tokens, chunked, num_blocks, cached)
    run(sched, seqs, budget, cached)
    assert all(s.is_finished for s in seqs.values())


def test_a_chunk_stops_before_an_image_the_budget_cannot_pay_for():
    """Four prompts of 10 words and a 30-token image: a budget of 60 encodes two a step, the
    others computing their words up to their image and waiting there."""
    reqs = [Request(50, ((10, 30, i),), 2) for i in range(4)]
    sched, _ = build(reqs, 60, 512, True, 400)
    first = sched.schedule(0.0)
    assert [(it.seq_id, len(it.token_ids)) for it in first.scheduled] == [(0, 50), (1, 50), (2, 10), (3, 10)]
    sched.update(first, FakeRunner(400, 4)(first), 0.0)
    second = sched.schedule(0.0)
    assert [(it.seq_id, it.start_pos, len(it.token_ids)) for it in second.scheduled if it.seq_id >= 2] == \
        [(2, 10, 40), (3, 10, 40)]


def test_one_encoding_serves_every_sequence_with_the_item_and_the_cache_costs_nothing():
    same = [Request(40, ((0, 30, 7),), 1) for _ in range(3)]
    sched, _ = build(same, 30, 512, True, 400)
    assert len(sched.schedule(0.0).scheduled) == 3  # (one digest: encoded once)
    other = [Request(40, ((0, 30, i),), 1) for i in range(3)]
    sched, _ = build(other, 30, 512, True, 400, cached=frozenset({0, 1}))
    assert len(sched.schedule(0.0).scheduled) == 3  # (two in the encoder cache)
    sched, _ = build(other, 30, 512, True, 400)
    assert len(sched.schedule(0.0).scheduled) == 1


def test_whole_prompts_wait_for_a_step_with_the_room():
    reqs = [Request(40, ((5, 30, 0),), 1), Request(40, ((5, 30, 1),), 1)]
    sched, _ = build(reqs, 40, 512, False, 400)
    first = sched.schedule(0.0)
    assert [it.seq_id for it in first.scheduled] == [0]  # (the second's image would pass the budget)


def test_budget_is_checked():
    with pytest.raises(ConfigError, match="max_num_encoder_input_tokens"):
        SchedulerConfig(max_num_encoder_input_tokens=0)
