"""Handed-over requests (prefill/decode disaggregation) in the scheduler, over random streams.

Some requests arrive as a prefill engine hands them over: their first output token already
generated, the K/V of a prefix of their tokens written into swap blocks (`Scheduler.receive`),
the fake runner's tags for those tokens put where a real runner's `receive_kv` writes K/V. They
wait, as the engine keeps them, until the scheduler has a seat and swap space. Every request,
handed over or not, must generate what it generates alone, reading only K/V of its own tokens,
under random block counts, swap space, seats, budgets, preemption modes and prefill modes; every
step keeps the scheduler's and block manager's invariants, and the handed-over ones never
compute the tokens they brought.
"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from conveyor.core.block_manager import HybridLayout
from conveyor.sequence import Sequence
from tests.core.helpers import Driver, make_prompt, next_token


def write_tags(driver: Driver, seq: Sequence, num_tokens: int) -> None:
    """What `ModelRunner.receive_kv` does, in the fake runner's terms: the tags of the first
    `num_tokens` tokens (a prefix's, as any engine computes them) into the swap slots; a
    hybrid cache's sliding tables from their first block held on (`window_start`)."""
    runner, key, bm = driver.runner, 0, driver.bm
    first = seq.window_start * bm.block_size
    for pos, token in enumerate(seq.token_ids[:num_tokens]):
        key = hash((key, token))
        if pos >= first or not bm.sliding_global:
            runner.swap_slots[runner._slot(seq.block_table, pos)] = (key, pos)
        if pos >= first:
            for g, table in enumerate(seq.window_tables, 1):
                runner.swap_slots[runner._slot(table, pos)] = (key, pos, g)


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    num_blocks=st.integers(6, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    num_swap_blocks=st.integers(0, 40),
    max_num_seqs=st.integers(1, 8),
    budget=st.integers(8, 64),
    preemption_mode=st.sampled_from(["recompute", "swap"]),
    prefill_mode=st.sampled_from(["chunked", "mixed", "prefill_first"]),
    layout=st.one_of(st.none(), st.builds(lambda w, g: HybridLayout(w, 1, g, all_sliding=not g),
                                          st.integers(1, 24), st.integers(0, 2))),
)
def test_handed_over_requests_generate_what_they_would_alone(
    data, num_blocks, block_size, num_swap_blocks, max_num_seqs, budget, preemption_mode, prefill_mode, layout
):
    """With a hybrid cache too (one or two sliding groups, or a sliding block table): the
    blocks a handed-over request brings start, in each sliding table, at its next query's
    window."""
    capacity = num_blocks * block_size
    if layout is not None:  # as many tables' blocks
        num_blocks *= 1 + layout.num_window_groups
        num_swap_blocks *= 1 + layout.num_window_groups
    driver = Driver(num_blocks, block_size, num_swap_blocks=num_swap_blocks, prefix_caching=True,
                    max_num_seqs=max_num_seqs, max_num_batched_tokens=max(budget, capacity),
                    preemption_mode=preemption_mode, prefill_mode=prefill_mode, layout=layout)
    incoming: list[tuple[Sequence, int]] = []
    computed: dict[int, int] = {}  # handed-over seq -> tokens it brought
    n = data.draw(st.integers(1, 10))
    for i in range(n):
        prompt_len = data.draw(st.integers(1, max(1, capacity // 3)))
        max_tokens = data.draw(st.integers(2, max(2, capacity // 3)))
        seq = driver.add(i, prompt_len, max_tokens)
        if data.draw(st.booleans()):  # handed over: out of the waiting queue, first token known
            driver.sched.waiting.remove(seq)
            seq.token_ids.append(next_token(seq.token_ids))
            brought = data.draw(st.integers(1, prompt_len))  # the K/V of a prefix
            if driver.bm.pages_to_receive(brought) > num_swap_blocks:  # could never fit: the engine computes it again
                seq.token_ids.pop()
                driver.sched.add(seq)
                continue
            incoming.append((seq, brought))
            computed[i] = brought
    for _ in range(20_000):
        while incoming and driver.sched.can_receive(incoming[0][0], incoming[0][1]):
            seq, brought = incoming.pop(0)
            driver.sched.receive(seq, brought)
            write_tags(driver, seq, brought)
            if seq.window_start:
                event("a hand-over past the window: its sliding tables start later")
        if not driver.sched.has_unfinished() and not incoming:
            break
        out = driver.step()
        for item in out.scheduled:  # a handed-over sequence never computes what it brought
            if item.seq_id in computed and driver.seqs[item.seq_id].num_preemptions == 0:
                assert item.start_pos >= computed[item.seq_id], item
    else:
        raise AssertionError("not finished")
    driver.check_outputs()
    assert all(s.is_finished for s in driver.seqs.values())
    bm = driver.bm
    assert bm.num_free_swap_blocks == bm.num_swap_blocks and bm.num_free_blocks == bm.num_blocks


def test_receive_needs_a_seat_and_swap_space():
    driver = Driver(8, 4, num_swap_blocks=3, max_num_seqs=2)
    a = Sequence(0, "a", [*make_prompt(0, 8), 1], driver.add(9, 1, 2).sampling_params, 0.0)
    a.prompt_len = 8
    assert not driver.sched.can_receive(a, 16)  # 4 swap blocks needed, 3 there
    assert driver.sched.can_receive(a, 8)
    driver.sched.receive(a, 8)
    assert a.num_computed_tokens == 8 and len(a.block_table) == 2 and driver.bm.num_free_swap_blocks == 1
    b = Sequence(1, "b", [*make_prompt(1, 3), 1], a.sampling_params, 0.0)
    b.prompt_len = 3
    assert driver.sched.can_receive(b, 3)  # the waiting request holds no seat
    driver.sched.receive(b, 3)
    c = Sequence(2, "c", [*make_prompt(2, 2), 1], a.sampling_params, 0.0)
    assert not driver.sched.can_receive(c, 1)  # two seats taken by the received ones
    driver.sched.check_integrity()
