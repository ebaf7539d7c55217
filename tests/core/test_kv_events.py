"""KV events (conveyor/core/kv_events.py): what the prefix cache reports of itself.

The property test runs random workloads of shared prefixes through the scheduler on a small
cache (evictions, a host tier under each write policy, LRU and LFU, resets) and replays the
events into a mirror after every step: the mirror must hold exactly the hashes the device cache
and the host tier hold, and every device BlockStored must let a consumer that knows only the
events recompute its hashes from its token ids and its parent (as Dynamo's router does).
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.config import ConfigError, EngineConfig
from conveyor.core.block_manager import BlockManager, chain_hashes
from conveyor.core.kv_events import (
    DEVICE,
    END_OF_REPLAY,
    HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventIndex,
    KVEventPublisher,
    KVEventsConfig,
    KVEventSubscriber,
    decode,
    encode,
    external_hash,
    offset_endpoint,
)
from tests.core.helpers import Driver
from tests.core.test_prefix_cache import SHARED, admit, seq_of


class Mirror:
    """What a consumer of the events knows: each medium's hashes, each hash's token prefix."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.held = {DEVICE: set(), HOST: set()}
        self.prefix_of: dict[int, tuple[int, ...]] = {}

    def apply(self, events: list) -> None:
        for e in events:
            if isinstance(e, AllBlocksCleared):
                for held in self.held.values():
                    held.clear()
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    assert h in self.held[e.medium], f"removed {h} that {e.medium} does not hold"
                    self.held[e.medium].remove(h)
            else:
                assert isinstance(e, BlockStored)
                for h in e.block_hashes:
                    assert h not in self.held[e.medium], f"stored {h} that {e.medium} holds already"
                    self.held[e.medium].add(h)
                if e.medium == DEVICE:
                    self.check_chain(e)

    def check_chain(self, e: BlockStored) -> None:
        size = self.block_size
        assert e.block_size == size and len(e.token_ids) == size * len(e.block_hashes)
        base = () if e.parent_block_hash is None else self.prefix_of[e.parent_block_hash]
        for k, h in enumerate(e.block_hashes):
            base = base + tuple(e.token_ids[k * size:(k + 1) * size])
            want = chain_hashes(list(base), size, [], len(base) // size)[-1]
            assert h == external_hash(want), "a block's hash is not its tokens' under its parent"
            self.prefix_of[h] = base


def cache_state(bm: BlockManager) -> dict[str, set[int]]:
    return {DEVICE: {external_hash(h) for h in bm._cached}, HOST: {external_hash(h) for h in bm._host_cached}}


@settings(max_examples=40, deadline=None)
@given(
    num_blocks=st.integers(6, 24),
    block_size=st.sampled_from([2, 4]),
    num_offload=st.sampled_from([0, 3, 8]),
    policy=st.sampled_from(["write_back", "write_through", "write_through_selective"]),
    lfu=st.booleans(),
    requests=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 12), st.integers(1, 6)), min_size=1, max_size=10),
    reset_at=st.integers(0, 40),
)
def test_the_events_replay_the_cache_exactly(num_blocks, block_size, num_offload, policy, lfu, requests,
                                             reset_at) -> None:
    d = Driver(num_blocks, block_size, prefix_caching=True, num_offload_blocks=num_offload,
               max_num_seqs=4, max_num_batched_tokens=32, max_model_len=num_blocks * block_size)
    d.bm.offloading_policy, d.bm.lfu = policy, lfu
    d.bm.kv_events = []
    mirror = Mirror(block_size)
    prefixes = [SHARED[:8], SHARED[4:16], [7] * 12, SHARED[:16]]
    for i, (p, tail, out) in enumerate(requests):
        prompt = (prefixes[p] + [1 + (i + k) % 9 for k in range(tail)])[: d.max_model_len - out]
        if prompt:
            d.add(i, len(prompt), out, prompt=prompt, at=float(i))
    for step in range(400):
        if not d.sched.has_unfinished():
            break
        d.step()
        if step == reset_at:
            d.bm.reset_prefix_cache()
        mirror.apply(d.bm.take_events())
        assert mirror.held == cache_state(d.bm)
    assert not d.sched.has_unfinished()


def test_stored_removed_and_cleared_in_order() -> None:
    bm = BlockManager(3, 4, enable_prefix_caching=True)
    bm.kv_events = []
    a = seq_of(0, SHARED[:9])
    admit(bm, a)
    (stored,) = bm.take_events()
    assert isinstance(stored, BlockStored) and stored.medium == DEVICE and stored.parent_block_hash is None
    assert stored.token_ids == SHARED[:8] and stored.block_hashes == [external_hash(h) for h in a.block_hashes[:2]]
    bm.free(a)
    admit(bm, seq_of(1, [0] * 12))  # three fresh blocks: a's two cached ones are evicted
    events = bm.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(stored.block_hashes)
    bm.reset_prefix_cache()
    assert isinstance(bm.take_events()[-1], AllBlocksCleared)
    assert bm.take_events() == []


def test_a_disk_hit_is_announced_in_the_host_tier_then_on_the_device(tmp_path) -> None:
    from conveyor.core.disk_tier import DiskTier

    disk = DiskTier(str(tmp_path), "layout", 8, 16)
    bm = BlockManager(2, 2, enable_prefix_caching=True, num_offload_blocks=1, disk=disk)
    bm.kv_events = []
    mirror = Mirror(2)
    a = seq_of(0, [1, 1, 1])
    admit(bm, a)
    bm.free(a)
    for i, filler in enumerate(([2, 2, 2, 2], [3, 3, 3, 3]), 1):  # [1, 1] to the tier, then out of it
        admit(bm, f := seq_of(i, filler))
        bm.take_copies()
        for _, h in bm.take_disk_copies()[0]:
            disk.write(h, memoryview(bytes(16)))
        bm.free(f)
    mirror.apply(bm.take_events())
    key = external_hash(a.block_hashes[0])
    assert key not in mirror.held[DEVICE] | mirror.held[HOST]  # on disk only: no tier announces it
    admit(bm, seq_of(3, [1, 1, 1]))  # a disk hit: read into a host tier block, loaded to the device
    mirror.apply(bm.take_events())
    assert key in mirror.held[DEVICE] and key in mirror.held[HOST]
    assert mirror.held == cache_state(bm)


def test_events_are_off_unless_asked_for() -> None:
    bm = BlockManager(3, 4, enable_prefix_caching=True)
    admit(bm, seq_of(0, SHARED[:9]))
    assert bm.kv_events is None and bm.take_events() == []


def test_a_lora_adapters_blocks_carry_its_id() -> None:
    from conveyor.lora import LoRARequest
    from conveyor.sampling_params import SamplingParams
    from conveyor.sequence import Sequence

    bm = BlockManager(4, 4, enable_prefix_caching=True)
    bm.kv_events = []
    seq = Sequence(0, "r0", SHARED[:9], SamplingParams(), 0.0, LoRARequest("sql", 7, "/nowhere"))
    admit(bm, seq)
    (stored,) = bm.take_events()
    assert stored.lora_id == 7
    # ... and their hashes are not the base model's (a router matching base prompts never finds them)
    assert stored.block_hashes[0] != external_hash(chain_hashes(SHARED[:4], 4, [], 1)[0])


# -- the wire --------------------------------------------------------------------------------
def test_the_wire_layout_is_vllms_tagged_arrays() -> None:
    msgpack = pytest.importorskip("msgpack")
    batch = KVEventBatch(12.5, [BlockStored([1, 2], None, [5, 6, 7, 8], 2, None, DEVICE), BlockRemoved([1], HOST),
                                AllBlocksCleared()], 3)
    raw = msgpack.unpackb(encode(batch))
    assert raw == [12.5, [["BlockStored", [1, 2], None, [5, 6, 7, 8], 2, None, "GPU"], ["BlockRemoved", [1], "CPU"],
                          ["AllBlocksCleared"]], 3]
    assert decode(encode(batch)) == batch
    no_rank = KVEventBatch(1.0, [AllBlocksCleared()])
    assert msgpack.unpackb(encode(no_rank)) == [1.0, [["AllBlocksCleared"]]]  # omitted, as msgspec's omit_defaults
    assert decode(encode(no_rank)) == no_rank
    with pytest.raises(ValueError, match="unknown KV event kind"):
        KVEventBatch.from_wire([0.0, [["Other", 1]]])


def test_endpoints_are_offset_by_the_replicas_rank() -> None:
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv-1"
    with pytest.raises(ValueError, match="no port"):
        offset_endpoint("tcp://host", 1)


def first_batches(pub: KVEventPublisher, sub: KVEventSubscriber, n: int) -> tuple[list, int]:
    """Publish BlockRemoved([n]), [n + 1], ... until the subscriber reads some (a SUB socket joins
    a moment after it connects: what is published before is not sent to it); what it read, and
    the next n."""
    got: list = []
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        pub.publish([BlockRemoved([n])])
        n += 1
        time.sleep(0.05)
        got = sub.poll()
    return got, n


def test_a_subscriber_reads_what_is_published_and_replays_what_it_missed(tmp_path) -> None:
    zmq = pytest.importorskip("zmq")
    pytest.importorskip("msgpack")
    endpoint, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    pub = KVEventPublisher(KVEventsConfig("zmq", endpoint, replay, "kv", 2, data_parallel_rank=None))
    sub = KVEventSubscriber([endpoint], "kv")
    try:
        got, n = first_batches(pub, sub, 0)
        assert got and got[0][0] == 0 and isinstance(got[0][1].events[0], BlockRemoved)
        pub.publish([])  # nothing happened: nothing is sent
        pub.publish([AllBlocksCleared()])
        deadline, last = time.monotonic() + 10, []
        while not last and time.monotonic() < deadline:
            time.sleep(0.05)
            last = [type(b.events[0]) for _, b in sub.poll()]
        assert last[-1] is AllBlocksCleared and sub.missed == 0
        # The replay socket holds the last two batches (buffer_steps=2), in order, then its end mark.
        req = zmq.Context.instance().socket(zmq.DEALER)
        req.connect(replay)
        req.send_multipart([b"", (0).to_bytes(8, "big")])
        replies = []
        while True:
            assert req.poll(5000), "no replay"
            _, seq, payload = req.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == END_OF_REPLAY:
                break
            replies.append((int.from_bytes(seq, "big"), decode(payload)))
        req.close(linger=0)
        assert [s for s, _ in replies] == [n - 1, n]
        assert isinstance(replies[-1][1].events[0], AllBlocksCleared)
    finally:
        sub.close()
        pub.close()


def test_index_counts_blocks_held_in_any_medium() -> None:
    index = KVEventIndex()
    index.apply([BlockStored([1, 2, 3], None, [], 4, None, DEVICE), BlockStored([3], None, [], 4, None, HOST)])
    assert index.match([1, 2, 3, 9]) == 3 and index.block_size == 4
    index.apply([BlockRemoved([2], DEVICE)])
    assert index.match([1, 2, 3]) == 1 and index.holds(3, HOST)
    index.apply([BlockRemoved([3], DEVICE)])
    assert index.holds(3, HOST) and not index.holds(3, DEVICE) and len(index) == 2
    index.apply([AllBlocksCleared()])
    assert len(index) == 0


# -- config ----------------------------------------------------------------------------------
def test_vllms_kv_events_config_sets_the_options() -> None:
    cfg = EngineConfig.from_kwargs(kv_events_config='{"enable_kv_cache_events": true, "publisher": "zmq", '
                                                    '"endpoint": "tcp://*:6000", "topic": "kv"}')
    assert cfg.cache.enable_kv_cache_events and cfg.cache.kv_events_publisher == "zmq"
    assert cfg.cache.kv_events_endpoint == "tcp://*:6000" and cfg.cache.kv_events_topic == "kv"
    with pytest.raises(ConfigError, match=r"kv_events_config: \['hwm'\] not read here"):
        EngineConfig.from_kwargs(kv_events_config={"hwm": 5})
    with pytest.raises(ConfigError, match="needs enable_kv_cache_events"):
        EngineConfig.from_kwargs(kv_events_publisher="zmq")
    with pytest.raises(ConfigError, match="needs enable_prefix_caching"):
        EngineConfig.from_kwargs(enable_kv_cache_events=True, enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="is not one of null, zmq"):
        EngineConfig.from_kwargs(enable_kv_cache_events=True, kv_events_publisher="nats")


# -- an engine on a real model --------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    from tests.conftest import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def test_an_engine_reports_its_prompts_blocks_and_publishes_a_reset_at_once(tiny, tmp_path) -> None:
    from conveyor import LLM, SamplingParams

    prompt = list(range(10, 50))  # two full blocks of 16 and 8 tokens
    llm = LLM(str(tiny), enable_kv_cache_events=True, num_kv_blocks=64, block_size=16)
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))
    stored = [e for e in llm.take_kv_events() if isinstance(e, BlockStored)]
    assert stored[0].parent_block_hash is None and stored[0].token_ids[:32] == prompt[:32]
    llm.reset_prefix_cache()
    assert llm.take_kv_events() == [AllBlocksCleared()] and llm.take_kv_events() == []

    pytest.importorskip("zmq")
    endpoint = f"ipc://{tmp_path}/kv"
    llm = LLM(str(tiny), kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint},
              num_kv_blocks=64, block_size=16)
    sub = KVEventSubscriber([endpoint])
    try:
        deadline, joined = time.monotonic() + 10, False
        while not joined:  # (a SUB socket joins a moment after it connects: until then, what is sent is lost)
            assert time.monotonic() < deadline, "the subscriber never joined"
            llm.reset_prefix_cache()
            time.sleep(0.05)
            joined = any(AllBlocksCleared() in b.events for _, b in sub.poll())
        llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))
        llm.reset_prefix_cache()  # idle: published without waiting for a step
        assert llm.take_kv_events() == []  # (published instead)
        deadline, events = time.monotonic() + 10, []
        while time.monotonic() < deadline and AllBlocksCleared() not in events:
            events += [e for _, b in sub.poll() for e in b.events]
            time.sleep(0.05)
        assert any(isinstance(e, BlockStored) and e.token_ids[:32] == prompt[:32] for e in events)
        assert events[-1] == AllBlocksCleared()
    finally:
        sub.close()


def test_a_subscriber_replays_what_it_missed_before_joining_and_in_a_gap(tmp_path) -> None:
    """With the replay endpoint, the batches published before the subscriber joined come back
    at its first batch (as far as the buffer holds them), and a batch lost between two others
    is asked for and put in its place; `missed` counts what stayed lost."""
    pytest.importorskip("zmq")
    pytest.importorskip("msgpack")
    endpoint, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    pub = KVEventPublisher(KVEventsConfig("zmq", endpoint, replay, "kv", 4, data_parallel_rank=None))
    for n in range(6):  # before anyone listens: lost to the PUB socket, kept (the last 4) for replay
        pub.publish([BlockRemoved([n])])
    sub = KVEventSubscriber([endpoint], "kv", [replay])
    try:
        got, _ = first_batches(pub, sub, 6)
        removed = [b.events[0].block_hashes[0] for _, b in got]
        # (what the buffer of 4 still held before the first batch read, then that batch: no gap)
        assert sub.replayed >= 2 and removed == list(range(removed[0], removed[0] + len(removed)))
        assert len(removed) > sub.replayed
        assert sub.missed == 0
        # A batch lost between two others (read off the socket here, as a full queue would drop it).
        pub.publish([BlockRemoved([100])])
        pub.publish([BlockRemoved([101])])
        pub.publish([BlockRemoved([102])])
        time.sleep(0.2)
        sub._sockets[0].recv_multipart()  # the next one after those already read: 100 or earlier
        deadline, later = time.monotonic() + 10, []
        while 102 not in later and time.monotonic() < deadline:
            later += [b.events[0].block_hashes[0] for _, b in sub.poll()]
            time.sleep(0.05)
        assert later[-3:] == [100, 101, 102] and sub.missed == 0
    finally:
        sub.close()
        pub.close()
