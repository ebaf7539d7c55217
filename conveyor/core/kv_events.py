"""KV cache events: what the prefix cache gained and lost, step by step (vLLM's KV events).

A router that knows which blocks each replica holds can send a request where its prefix is
cached, exactly, instead of guessing from what it sent where (`cache_aware`'s index, which
never sees an eviction). vLLM publishes these events for that (NVIDIA Dynamo's KV router and
llm-d's precise prefix-cache scorer read them); conveyor records the same three kinds:

- `BlockStored`: blocks registered in the prefix cache under their hashes, a chain of one
  sequence's consecutive full blocks, with the hash of the block before the first (None at the
  prompt's start), their token ids and the LoRA adapter's id;
- `BlockRemoved`: blocks whose hashes left the cache (evicted);
- `AllBlocksCleared`: the cache was reset.

`medium` says which tier: "GPU" for the device's pool (vLLM's name, whatever the device: a CPU
engine's pool is its "GPU" tier) and "CPU" for KV offloading's host tier, whose stored blocks
carry hashes only (no token ids: their tokens were announced when the device cached them). The
disk tier sends none: its directory outlives the engine and may be shared, no one engine's to
announce. A block's hash here is the first 8 bytes of its SHA-256 prefix hash (`chain_hashes`),
as an unsigned big-endian integer.

On the wire (`KVEventPublisher`, ZeroMQ, as vLLM's `ZmqEventPublisher` sends them): a PUB
socket's multipart messages `[topic, sequence number (8 bytes, big-endian), payload]`, the
payload a msgpack array `[ts, [event, ...], data_parallel_rank]` (the rank left out when None)
and each event an array whose first element is its kind's name, then its fields in the order
above: the layout of vLLM's msgspec structs (`array_like=True, tag=True`), so a subscriber
written for vLLM reads conveyor's. A replay socket (ROUTER) answers a request holding a
sequence number (8 bytes) with each kept batch from it on, one message each
`[sequence number, payload]`, then `[-1 as 8 signed bytes, b""]`.

No torch; zmq and msgpack (`pip install conveyor[kv-events]`) only where events are published
or subscribed to over sockets.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

DEVICE = "GPU"  # the device's pool (vLLM's medium name)
HOST = "CPU"  # KV offloading's host tier
END_OF_REPLAY = -1
HIGH_WATER_MARK = 100_000  # batches a socket queues before it drops them (vLLM's default hwm)


def external_hash(block_hash: bytes) -> int:
    """A block's hash as events carry it: the first 8 bytes of its SHA-256 prefix hash."""
    return int.from_bytes(block_hash[:8], "big")


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str = DEVICE

    def wire(self) -> list[Any]:
        return ["BlockStored", self.block_hashes, self.parent_block_hash, self.token_ids, self.block_size,
                self.lora_id, self.medium]


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str = DEVICE

    def wire(self) -> list[Any]:
        return ["BlockRemoved", self.block_hashes, self.medium]


@dataclass(slots=True)
class AllBlocksCleared:
    def wire(self) -> list[Any]:
        return ["AllBlocksCleared"]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    """One step's events (`ts`: wall-clock seconds)."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None

    def wire(self) -> list[Any]:
        out: list[Any] = [self.ts, [e.wire() for e in self.events]]
        if self.data_parallel_rank is not None:
            out.append(self.data_parallel_rank)
        return out

    @classmethod
    def from_wire(cls, obj: Sequence[Any]) -> KVEventBatch:
        """A batch from its msgpack-decoded arrays; an event of an unknown kind is an error."""
        events: list[KVEvent] = []
        for e in obj[1]:
            kind, *fields = e
            if kind == "BlockStored":
                events.append(BlockStored(list(fields[0]), fields[1], list(fields[2]), *fields[3:6]))
            elif kind == "BlockRemoved":
                events.append(BlockRemoved(list(fields[0]), *fields[1:2]))
            elif kind == "AllBlocksCleared":
                events.append(AllBlocksCleared())
            else:
                raise ValueError(f"unknown KV event kind {kind!r}")
        return cls(float(obj[0]), events, obj[2] if len(obj) > 2 else None)


def encode(batch: KVEventBatch) -> bytes:
    import msgpack

    return bytes(msgpack.packb(batch.wire(), use_bin_type=True))


def decode(payload: bytes) -> KVEventBatch:
    import msgpack

    return KVEventBatch.from_wire(msgpack.unpackb(payload, raw=False))


@dataclass
class KVEventsConfig:
    """Where an engine's events go: kept for `Engine.take_kv_events` (publisher "null"), or
    published over ZeroMQ ("zmq"). vLLM's `KVEventsConfig` keys, read by `kv_events_config`."""

    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    data_parallel_rank: int | None = None


def offset_endpoint(endpoint: str, rank: int | None) -> str:
    """Replica `rank`'s endpoint (vLLM's rule for data parallelism): a TCP port plus the rank,
    an IPC path with `-rank` after it; rank None or 0 is the endpoint itself."""
    if not rank:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"KV events endpoint {endpoint!r} has no port to offset for replica {rank}")
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}-{rank}"


def connect_address(endpoint: str) -> str:
    """Where a subscriber connects to an endpoint a publisher binds (`*` is this machine)."""
    return endpoint.replace("tcp://*:", "tcp://127.0.0.1:").replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")


class KVEventPublisher:
    """Publishes event batches on a ZeroMQ PUB socket (and, with `replay_endpoint`, answers
    replay requests from the last `buffer_steps` batches). `publish` is called by the engine's
    step loop; the replay socket is served by a thread of its own. A subscriber that falls
    behind loses messages at ZeroMQ's high-water mark, as vLLM's: the sequence numbers show the
    gap, and the replay socket fills it."""

    def __init__(self, config: KVEventsConfig) -> None:
        try:
            import zmq
        except ImportError:
            from conveyor.config import ConfigError

            raise ConfigError("publishing KV events needs pyzmq and msgpack: pip install conveyor[kv-events]") from None
        self.topic = config.topic.encode()
        self.rank = config.data_parallel_rank
        self._ctx: Any = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
        self.endpoint = offset_endpoint(config.endpoint, config.data_parallel_rank)
        self._pub.bind(self.endpoint)
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._lock = threading.Lock()  # the buffer, between the step loop and the replay thread
        self._stop = threading.Event()
        self._replay_thread: threading.Thread | None = None
        if config.replay_endpoint is not None:
            replay = self._ctx.socket(zmq.ROUTER)
            replay.bind(offset_endpoint(config.replay_endpoint, config.data_parallel_rank))
            self._replay_thread = threading.Thread(target=self._serve_replay, args=(replay,), daemon=True,
                                                   name="kv-events-replay")
            self._replay_thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        payload = encode(KVEventBatch(time.time(), events, self.rank))
        seq = self._seq
        self._seq += 1
        with self._lock:
            self._buffer.append((seq, payload))
        self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], copy=False)

    def _serve_replay(self, socket: Any) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                client, _, start = socket.recv_multipart()
                first = int.from_bytes(start, "big")
                with self._lock:
                    kept = [(s, p) for s, p in self._buffer if s >= first]
                for s, p in kept:
                    socket.send_multipart([client, b"", s.to_bytes(8, "big"), p])
                socket.send_multipart([client, b"", END_OF_REPLAY.to_bytes(8, "big", signed=True), b""])
            except Exception:  # a malformed request: the next one is served
                logger.exception("KV events replay request failed")
        socket.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join(1.0)
        self._pub.close(linger=0)


class KVEventSubscriber:
    """Reads the batches replicas publish (one SUB socket connected to each endpoint), without
    blocking: `poll()` returns what has arrived, as (replica, batch) pairs, in arrival order.

    With `replay_endpoints` (each replica's replay socket, `KVEventPublisher`'s), what the
    sequence numbers say was missed is asked for there and put in its place: the batches
    published before this subscriber joined (at a replica's first batch) and any a full queue
    dropped, as far as the publisher's buffer still holds them (`buffer_steps`); a replay waits
    at most `replay_timeout_s` for its answer. `missed` counts what stayed lost, `replayed` what
    came back."""

    def __init__(self, endpoints: Sequence[str], topic: str = "", replay_endpoints: Sequence[str | None] | None = None,
                 replay_timeout_s: float = 0.25) -> None:
        import zmq

        self._ctx: Any = zmq.Context.instance()
        self._sockets = []
        self._addresses = [connect_address(e) for e in endpoints]
        for address in self._addresses:
            s = self._ctx.socket(zmq.SUB)
            s.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
            s.setsockopt(zmq.RECONNECT_IVL, 10)  # (a publisher not bound yet: tried again every 10 ms)
            s.setsockopt(zmq.SUBSCRIBE, topic.encode())
            s.connect(address)
            self._sockets.append(s)
        self.missed = 0  # batches lost between sequence numbers (a slow reader's)
        self.replayed = 0  # ... and those the replay sockets gave back
        self._last = [-1] * len(endpoints)
        self._replay = list(replay_endpoints) if replay_endpoints is not None else [None] * len(endpoints)
        if len(self._replay) != len(endpoints):
            raise ValueError("one replay endpoint (or None) per endpoint")
        self.replay_timeout_s = replay_timeout_s

    def poll(self) -> list[tuple[int, KVEventBatch]]:
        import zmq

        out: list[tuple[int, KVEventBatch]] = []
        for i, s in enumerate(self._sockets):
            while True:
                try:
                    _, seq_bytes, payload = s.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                seq = int.from_bytes(seq_bytes, "big")
                if seq > self._last[i] + 1 and (self._last[i] >= 0 or self._replay[i] is not None):
                    got = self._fetch(i, self._last[i] + 1, seq)
                    self.replayed += len(got)
                    if self._last[i] >= 0:  # (before the first batch: what was never seen is not missed)
                        self.missed += seq - self._last[i] - 1 - len(got)
                    out.extend((i, batch) for _, batch in got)
                self._last[i] = seq
                out.append((i, decode(payload)))
        return out

    def _fetch(self, i: int, first: int, before: int) -> list[tuple[int, KVEventBatch]]:
        """Replica `i`'s batches `first` .. `before - 1` that its replay socket still holds."""
        import zmq

        endpoint = self._replay[i]
        if endpoint is None:
            return []
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(connect_address(endpoint))
        got: list[tuple[int, KVEventBatch]] = []
        try:
            s.send_multipart([b"", first.to_bytes(8, "big")])
            while s.poll(int(self.replay_timeout_s * 1000)):
                _, seq_bytes, payload = s.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_OF_REPLAY:
                    break
                if first <= seq < before:
                    got.append((seq, decode(payload)))
        finally:
            s.close(linger=0)
        return sorted(got, key=lambda p: p[0])

    def rejoin(self, settle_s: float = 0.05) -> None:
        """Connect again to every publisher, and give the subscriptions `settle_s` to reach them:
        what a server does once its replicas have bound their sockets, so that no batch they
        publish after it is lost to a connection still being retried (a SUB socket joins a moment
        after it connects, and what is published before is not kept for it)."""
        import time

        for s, address in zip(self._sockets, self._addresses, strict=True):
            s.disconnect(address)
            s.connect(address)
        time.sleep(settle_s)

    def close(self) -> None:
        for s in self._sockets:
            s.close(linger=0)


@dataclass
class KVEventIndex:
    """One replica's cached blocks as its events tell them: each hash and the media holding
    it. `match` counts a prompt's leading blocks held in any medium (a host tier block costs a
    copy, not a prefill)."""

    block_size: int | None = None  # from the first BlockStored
    _media: dict[int, set[str]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._media)

    def apply(self, events: Iterable[KVEvent]) -> None:
        media = self._media
        for e in events:
            if isinstance(e, BlockStored):
                self.block_size = e.block_size or self.block_size
                for h in e.block_hashes:
                    media.setdefault(h, set()).add(e.medium)
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    held = media.get(h)
                    if held is not None:
                        held.discard(e.medium)
                        if not held:
                            del media[h]
            else:
                media.clear()

    def match(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self._media:
                break
            n += 1
        return n

    def holds(self, h: int, medium: str) -> bool:
        return medium in self._media.get(h, ())

    def clear(self) -> None:
        self._media.clear()
