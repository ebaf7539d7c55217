"""The host side of a step's inputs: int tensors built through an array, and the input ids of a
step whose decodes read the previous step's sampled tokens (async scheduling)."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.models.attention import HostBlockTables, host_longs, host_table
from conveyor.runner.model_runner import ModelRunner

longs = st.integers(min_value=-(2**63), max_value=2**63 - 1)


@given(st.lists(longs, max_size=300))
def test_host_longs_is_torch_tensor_of_the_list(values):
    got = host_longs(values)
    assert got.dtype == torch.long and got.shape == (len(values),)
    assert torch.equal(got, torch.tensor(values, dtype=torch.long))


@given(st.lists(st.lists(st.integers(0, 10**6), max_size=9), max_size=12), st.integers(0, 9), st.integers(-1, 10**6))
def test_host_table_cuts_and_pads_each_row(tables, width, fill):
    want = [t[:width] + [fill] * (width - len(t[:width])) for t in tables]
    for rows in (tables, [array("q", t) for t in tables]):  # lists, or HostBlockTables' arrays
        got = host_table(rows, width, fill)
        assert got.dtype == torch.long and got.shape == (len(tables), width)
        assert got.tolist() == want


@given(st.lists(st.tuples(st.sampled_from(["append", "replace", "drop", "read"]), st.integers(0, 3),
                          st.lists(st.integers(0, 10**6), max_size=4)), max_size=60))
def test_host_block_tables_follow_lists_that_grow_in_place_or_are_replaced(ops):
    """The block manager's contract (appends in place, a new list for anything else) with
    reads between: every read gives each sequence's table as it is now."""
    tables: dict[int, list[int]] = {}
    host = HostBlockTables()
    for op, seq, blocks in ops:
        if op == "append":
            tables.setdefault(seq, []).extend(blocks)
        elif op == "replace":
            tables[seq] = list(blocks)
        elif op == "drop":
            tables.pop(seq, None)
            host.drop(seq)
        ids = sorted(tables)
        rows = host.rows(ids, [tables[i] for i in ids])
        assert [r.tolist() for r in rows] == [tables[i] for i in ids]
    assert len(host) <= len(tables)  # a dropped sequence leaves nothing behind


@st.composite
def steps(draw):
    """A previous step's sampled ids, and a step of which some rows take one of them."""
    last = draw(st.lists(st.integers(0, 999), min_size=1, max_size=12))
    n = draw(st.integers(1, 12))
    token_ids = draw(st.lists(st.integers(0, 999), min_size=n, max_size=n))
    rows = sorted(draw(st.sets(st.integers(0, n - 1), max_size=min(n, len(last)))))
    sources = draw(st.permutations(range(len(last))))[: len(rows)]
    return last, token_ids, rows, list(sources)


@settings(max_examples=200)
@given(steps())
def test_input_ids_take_pending_rows_from_the_previous_step(step):
    last, token_ids, rows, sources = step
    runner = SimpleNamespace(_last_tokens=torch.tensor(last), device=torch.device("cpu"))
    got = ModelRunner._input_ids(runner, list(token_ids), rows, sources)  # type: ignore[arg-type]
    want = list(token_ids)
    for r, s in zip(rows, sources, strict=True):
        want[r] = last[s]
    assert got.tolist() == want


def test_the_same_decodes_in_the_same_order_reuse_the_sampled_ids():
    last = torch.tensor([5, 6, 7])
    runner = SimpleNamespace(_last_tokens=last, device=torch.device("cpu"))
    assert ModelRunner._input_ids(runner, [0, 0, 0], [0, 1, 2], [0, 1, 2]) is last  # type: ignore[arg-type]
    # One sequence fewer (it finished): a gather, not the same tensor.
    got = ModelRunner._input_ids(runner, [0, 0], [0, 1], [0, 2])  # type: ignore[arg-type]
    assert got is not last and got.tolist() == [5, 7]


def test_a_one_token_prompt_chunk_is_not_sampled(tiny_models):
    """A step of one-token items may hold a prompt chunk that ends short of the prompt (a
    budget of one token): it takes the decode path, but only the decodes are sampled."""
    from conveyor import LLM, SamplingParams
    from conveyor.core.scheduler import ScheduledSequence, SchedulerOutput

    llm = LLM(str(tiny_models["llama"]), dtype="float32", num_kv_blocks=16, block_size=4)
    runner = llm.engine.runner
    greedy = SamplingParams(temperature=0.0)
    decode = ScheduledSequence(1, [5], 2, [0], True, greedy, [3, 4, 5], 2)
    chunk = ScheduledSequence(2, [9], 1, [1], False, greedy, [8, 9, 10, 11], 4)
    out = runner.execute(SchedulerOutput(step_id=1, scheduled=[decode, chunk]))
    assert set(out.sampled) == {1}
