"""Routing policies over engine replicas: every policy picks an accepting replica; each one's
own rule holds over random loads and prompts (hypothesis)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.config import ConfigError
from conveyor.core.routing import (
    CacheAwareRouter,
    PrefixIndex,
    RouterConfig,
    available_routers,
    block_hashes,
    make_router,
)


def router(policy: str, n: int = 4, **kw: object) -> object:
    return make_router(RouterConfig(data_parallel_size=n, router_policy=policy, **kw))  # type: ignore[arg-type]


loads_and_candidates = st.integers(1, 6).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 200), min_size=n, max_size=n),
        st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True).map(sorted),
    )
)
prompts = st.one_of(st.lists(st.integers(0, 50), max_size=80), st.text(max_size=80))


@settings(max_examples=200, deadline=None)
@given(policy=st.sampled_from(available_routers()), calls=st.lists(st.tuples(loads_and_candidates, prompts), min_size=1, max_size=20))
def test_every_policy_picks_an_accepting_replica(policy: str, calls: list[tuple[tuple[list[int], list[int]], object]]) -> None:
    n = len(calls[0][0][0])
    r = make_router(RouterConfig(data_parallel_size=n, router_policy=policy))
    for (loads, candidates), prompt in calls:
        if len(loads) != n:
            continue
        d = r.route(prompt, loads, candidates)  # type: ignore[arg-type]
        assert d.replica in candidates and d.reason


@settings(max_examples=200, deadline=None)
@given(lc=loads_and_candidates)
def test_least_requests_picks_a_least_loaded_candidate(lc: tuple[list[int], list[int]]) -> None:
    loads, candidates = lc
    d = make_router(RouterConfig(data_parallel_size=len(loads), router_policy="least_requests")).route([1], loads, candidates)
    assert loads[d.replica] == min(loads[i] for i in candidates)


@settings(max_examples=200, deadline=None)
@given(lc=loads_and_candidates, seed=st.integers(0, 100))
def test_power_of_two_never_picks_the_one_most_loaded_replica(lc: tuple[list[int], list[int]], seed: int) -> None:
    loads, candidates = lc
    r = make_router(RouterConfig(data_parallel_size=len(loads), router_policy="power_of_two", router_seed=seed))
    d = r.route([1], loads, candidates)
    top = max(loads[i] for i in candidates)
    if len(candidates) > 1 and sum(loads[i] == top for i in candidates) == 1:
        assert loads[d.replica] < top


def test_round_robin_takes_turns_and_skips_replicas_that_refuse() -> None:
    r = make_router(RouterConfig(data_parallel_size=3, router_policy="round_robin"))
    assert [r.route([1], [0, 0, 0], [0, 1, 2]).replica for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [r.route([1], [0, 0, 0], [0, 2]).replica for _ in range(4)] == [0, 2, 0, 2]


def test_random_policies_are_reproducible_from_their_seed() -> None:
    for policy in ("random", "power_of_two"):
        picks = [
            [make_router(RouterConfig(data_parallel_size=5, router_policy=policy, router_seed=s)).route([1], [3, 1, 4, 1, 5], range(5)).replica  # type: ignore[arg-type]
             for s in range(20)]
            for _ in range(2)
        ]
        assert picks[0] == picks[1] and len(set(picks[0])) > 1


def test_block_hashes_name_whole_prefixes() -> None:
    a = block_hashes(list(range(40)), 16)
    b = block_hashes([*range(32), 99, 99, 99, 99, 99, 99, 99, 99], 16)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]  # a partial last block is hashed too
    assert block_hashes(list(range(32)), 16) == a[:2]
    assert block_hashes([7, *range(1, 40)], 16)[1] != a[1]  # a block's hash depends on what precedes it
    assert block_hashes("hello world, hello router", 4)[:2] == block_hashes("hello world", 4)[:2]


def test_prefix_index_matches_leading_blocks_and_forgets_the_least_recent() -> None:
    index = PrefixIndex(max_blocks=4)
    first, second = block_hashes(list(range(48)), 16), block_hashes(list(range(100, 132)), 16)
    index.insert(first)
    assert index.match(first) == 3 and index.match(second) == 0
    index.insert(second)  # 5 blocks: the oldest (first's block 0) goes
    assert len(index) == 4 and index.match(first) == 0 and index.match(second) == 2


def test_cache_aware_keeps_a_prefix_on_one_replica_and_spreads_new_ones() -> None:
    r = make_router(RouterConfig(data_parallel_size=3, router_policy="cache_aware"))
    docs = [list(range(k * 1000, k * 1000 + 256)) for k in range(3)]
    home = {}
    for k, doc in enumerate(docs):  # each new document goes where the index is smallest
        d = r.route([*doc, 1, 2, 3], [0, 0, 0], [0, 1, 2])
        assert d.reason == "room"
        home[k] = d.replica
    assert sorted(home.values()) == [0, 1, 2]
    for q in range(30):  # follow-ups stay home while loads are level
        k = q % 3
        d = r.route(docs[k] + [q, q + 1], [q % 5, 2, 1], [0, 1, 2])
        assert d == (home[k], "cache")


def test_cache_aware_gives_way_to_balance_when_loads_drift_apart() -> None:
    cfg = RouterConfig(data_parallel_size=2, router_policy="cache_aware", router_balance_abs_threshold=8, router_balance_rel_threshold=1.5)
    doc = list(range(300))
    # (load at the prefix's home, load elsewhere) -> where the request goes
    for (at_home, elsewhere), expected in {
        (20, 10): "balance",  # 10 apart (> 8) and 2x (> 1.5x): imbalanced
        (20, 15): "cache",  # 5 apart: level enough, the cache wins
        (100, 80): "cache",  # 20 apart but 1.25x: level enough
    }.items():
        r = make_router(cfg)
        home = r.route(doc, [0, 0], [0, 1]).replica
        loads = [0, 0]
        loads[home], loads[1 - home] = at_home, elsewhere
        d = r.route(doc, loads, [0, 1])
        assert d == ((1 - home, "balance") if expected == "balance" else (home, "cache"))
        if expected == "balance":  # the prompt is now known at both: the less loaded wins
            level = [5, 5]
            level[1 - home] = 4
            assert r.route(doc, level, [0, 1]) == (1 - home, "cache")


def test_cache_aware_below_the_threshold_and_after_a_reset() -> None:
    r = make_router(RouterConfig(data_parallel_size=2, router_policy="cache_aware", router_cache_threshold=0.5))
    assert isinstance(r, CacheAwareRouter)
    doc = list(range(64))
    home = r.route(doc, [0, 0], [0, 1]).replica
    assert r.route(doc[:32] + list(range(500, 600)), [0, 0], [0, 1]).reason == "room"  # 32/132 seen
    assert r.route([*doc, 1], [0, 0], [0, 1]) == (home, "cache")
    r.on_replica_reset(home)
    assert r.route([*doc, 1], [0, 0], [0, 1]).reason == "room"


def test_a_refusing_replica_is_never_chosen_even_if_it_holds_the_prefix() -> None:
    r = make_router(RouterConfig(data_parallel_size=2, router_policy="cache_aware"))
    doc = list(range(300))
    home = r.route(doc, [0, 0], [0, 1]).replica
    assert r.route(doc, [0, 0], [1 - home]).replica == 1 - home


def test_spread_of_unrelated_prompts_is_even_under_cache_aware() -> None:
    r = make_router(RouterConfig(data_parallel_size=4, router_policy="cache_aware"))
    picks = Counter(r.route(list(range(k * 100, k * 100 + 64)), [0] * 4, range(4)).replica for k in range(40))  # type: ignore[arg-type]
    assert sorted(picks.values()) == [10, 10, 10, 10]


@pytest.mark.parametrize(
    ("field", "value"),
    [("data_parallel_size", 0), ("router_policy", "fastest"), ("router_cache_threshold", 1.5),
     ("router_balance_abs_threshold", -1), ("router_balance_rel_threshold", 0.5), ("router_block_size", 0),
     ("router_max_blocks", 0), ("router_instances", 0)],
)
def test_bad_router_options_are_refused_with_their_name(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        RouterConfig(**{field: value})  # type: ignore[arg-type]


def test_cache_aware_spreads_short_prompts_and_keeps_a_repeated_one_home() -> None:
    r = make_router(RouterConfig(data_parallel_size=2, router_policy="cache_aware"))
    picks = [r.route([k, k + 1, k + 2], [0, 0], [0, 1]) for k in range(0, 40, 4)]  # 3 tokens each
    assert [d.replica for d in picks] == [0, 1] * 5 and {d.reason for d in picks} == {"room"}
    assert r.route([0, 1, 2], [0, 0], [0, 1]) == (0, "cache")  # the same short prompt again


# -- kv_events: the replicas' own account of their caches ------------------------------------
def device_events(tokens: list[int], block_size: int = 4) -> list[object]:
    """The BlockStored a replica's engine sends when it caches `tokens`' full blocks."""
    from conveyor.core.block_manager import chain_hashes
    from conveyor.core.kv_events import BlockStored, external_hash

    n = len(tokens) // block_size
    return [BlockStored([external_hash(h) for h in chain_hashes(tokens, block_size, [], n)], None,
                        tokens[: n * block_size], block_size)]


DOC = list(range(100, 132))  # 8 blocks of 4


def test_kv_events_routes_where_the_events_say_the_prefix_is_held() -> None:
    from conveyor.core.kv_events import AllBlocksCleared, BlockRemoved

    r = router("kv_events", 3)
    assert r.wants_kv_events  # type: ignore[attr-defined]
    r.on_kv_events(2, device_events(DOC))  # type: ignore[attr-defined]
    # Held on replica 2 (as the events say, not as anything was sent there): there, even busier.
    d = r.route([*DOC, 1, 2], [0, 0, 5], [0, 1, 2])  # type: ignore[attr-defined]
    assert d == (2, "cache")
    # Replica 2 evicts the document's blocks; replica 0 caches it (the balance rule sent it there).
    hashes = device_events(DOC)[0].block_hashes  # type: ignore[attr-defined]
    r.on_kv_events(2, [BlockRemoved(hashes)])  # type: ignore[attr-defined]
    r.on_kv_events(0, device_events(DOC))  # type: ignore[attr-defined]
    assert r.route([*DOC, 3], [0, 0, 0], [0, 1, 2]) == (0, "cache")  # type: ignore[attr-defined]
    # Cleared everywhere: where it was sent before (cache_aware's history), not a stranger.
    for i in range(3):
        r.on_kv_events(i, [AllBlocksCleared()])  # type: ignore[attr-defined]
    d = r.route([*DOC, 4], [0, 0, 1], [0, 1, 2])  # type: ignore[attr-defined]
    assert d.reason == "history" and d.replica != 1


def test_kv_events_matches_the_engines_block_size_and_text_through_the_tokenizer() -> None:
    r = router("kv_events", 2)
    r.on_kv_events(1, device_events(DOC, block_size=8))  # type: ignore[attr-defined]
    assert r.prompt_hashes(DOC) == device_events(DOC, 8)[0].block_hashes  # type: ignore[attr-defined]
    text = "".join(chr(t) for t in DOC)
    assert r.prompt_hashes(text) == []  # type: ignore[attr-defined]  # no tokenizer: no ids to hash
    r.use_tokenizer(lambda s: [ord(c) for c in s])  # type: ignore[attr-defined]
    assert r.route(text, [3, 0], [0, 1]) == (1, "cache")  # type: ignore[attr-defined]


def test_kv_events_sends_a_burst_with_one_new_prefix_to_one_replica() -> None:
    r = router("kv_events", 4)
    # No replica has announced anything yet (the first request's prefill has not run).
    picks = {r.route([*DOC, i], [i % 2, 0, 0, 0], range(4)).replica for i in range(6)}  # type: ignore[attr-defined]
    assert len(picks) == 1


def test_routers_taking_turns_keep_histories_of_their_own_and_share_the_events() -> None:
    one, two = router("cache_aware", 4), router("cache_aware", 4, router_instances=2)
    for r in (one, two):
        assert r.route(DOC, [0, 0, 0, 0], range(4)) == (0, "room")  # type: ignore[attr-defined]
    assert one.route([*DOC, 1], [1, 0, 0, 0], range(4)) == (0, "cache")  # type: ignore[attr-defined]
    assert two.route([*DOC, 1], [1, 0, 0, 0], range(4)) == (1, "room")  # type: ignore[attr-defined]  # (never saw it)
    events = router("kv_events", 4, router_instances=2)
    assert events.wants_kv_events  # type: ignore[attr-defined]
    d = events.route(DOC, [0, 0, 0, 0], range(4))  # type: ignore[attr-defined]
    events.on_kv_events(d.replica, device_events(DOC))  # type: ignore[attr-defined]
    assert events.route([*DOC, 1], [0, 0, 0, 0], range(4)) == (d.replica, "cache")  # type: ignore[attr-defined]
