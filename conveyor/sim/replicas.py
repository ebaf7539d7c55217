"""Several simulated replicas behind one router: data parallelism at GPU scale.

Each replica is a whole simulated engine (the real scheduler, block manager and prefix cache on
its own virtual clock, one device of the simulated hardware each); the router is the server's
(`conveyor.core.routing`). A discrete-event loop keeps the replicas in step with the arrivals:
it always advances whichever comes first, the next arrival or the replica whose clock is
furthest behind. So when a request is routed at time t, every busy replica has run up to t, and
its load (requests routed to it, less those finished by t) is what a live router would see.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from conveyor.core.routing import RoutingPolicy

if TYPE_CHECKING:
    from conveyor.engine import Engine
    from conveyor.outputs import RequestOutput
    from conveyor.replay import TimedRequest


@dataclass(slots=True)
class ReplicaReplay:
    """What a replay over replicas gives back besides the outputs."""

    outputs: list[RequestOutput]
    routed: list[int]  # the replica of each request, in the given order (where it ended)
    reasons: Counter[str] = field(default_factory=Counter)
    migrations: int = 0  # requests moved between replicas (`migration`)
    migrated_bytes: int = 0  # ... and the K/V they took over the link


class _Replica:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.routed = 0
        self.finish_times: list[float] = []  # non-decreasing: the replica's clock only moves on

    def load_at(self, t: float) -> int:
        return self.routed - bisect.bisect_right(self.finish_times, t)


def _first_events(
    requests: Sequence[TimedRequest], start: float, concurrency: int | None
) -> tuple[list[tuple[float, int, int, Any]], Iterator[int]]:
    """The heap of (time, order, request index, payload) events sent at once, and the requests
    still to send: all at their arrival times (open loop), or `concurrency` at `start` and the
    rest one per finish (closed loop)."""
    pending = iter(sorted(range(len(requests)), key=lambda i: requests[i].arrival_s))
    events: list[tuple[float, int, int, Any]] = []
    if concurrency is None:
        for n, i in enumerate(pending):
            heapq.heappush(events, (start + requests[i].arrival_s, n, i, None))
    else:
        for n, i in zip(range(concurrency), pending, strict=False):
            heapq.heappush(events, (start, n, i, None))
    return events, pending


def replay_on_replicas(
    engines: Sequence[Engine],
    router: RoutingPolicy,
    requests: Sequence[TimedRequest],
    concurrency: int | None = None,
    on_finished: Callable[[int], Any] | None = None,
    migration: bool = False,
    link_bandwidth: float = 50e9,
) -> ReplicaReplay:
    """Serve `requests` on `engines` (simulated: their clocks are virtual) as `router` spreads
    them. Open loop at each request's `arrival_s`; with `concurrency`, a closed loop instead:
    that many requests at t=0, and each finish sends the next at its finish time.

    `migration` (Llumnix's live migration, stop-and-copy): after each step of a replica with
    requests waiting, its smallest running request that has generated a token moves to the
    replica with the most free KV blocks, if that one has none waiting, a seat, and more free
    blocks than the first even after taking it; the request is out of both while its K/V cross
    the link (`link_bandwidth` bytes/s), then lands as a handed-over request does. At most one
    request leaves a replica a step, and a replica takes one at a time."""
    replicas = [_Replica(e) for e in engines]
    events = router.wants_kv_events  # (the router reads what each step did to the caches)
    if events:
        for e in engines:
            e.enable_kv_events()
    start = max(e.clock() for e in engines)
    for e in engines:
        e.wait_until(start)
    ids = [r.request_id or f"replay-{i}" for i, r in enumerate(requests)]
    index_of = {rid: i for i, rid in enumerate(ids)}
    arrivals, pending = _first_events(requests, start, concurrency)  # sent and not yet routed
    sent = len(arrivals)
    outputs: dict[int, RequestOutput] = {}
    routed = [-1] * len(requests)
    reasons: Counter[str] = Counter()
    candidates = list(range(len(replicas)))
    moves, moved_bytes = 0, 0
    landing: set[int] = set()  # replicas a migrated request is on its way to
    while arrivals or any(r.engine.has_unfinished_requests() for r in replicas):
        busy = [r for r in replicas if r.engine.has_unfinished_requests()]
        behind = min(busy, key=lambda r: r.engine.clock()) if busy else None
        if arrivals and (behind is None or arrivals[0][0] <= behind.engine.clock()):
            t, _, i, moving = heapq.heappop(arrivals)
            req = requests[i]
            if moving is not None:  # a migrated request lands
                k, m = moving
                replica = replicas[k]
                if not replica.engine.has_unfinished_requests():
                    replica.engine.wait_until(t)
                replica.engine.migrate_in(m)
                replica.routed += 1
                routed[i] = k
                landing.discard(k)
                continue
            decision = router.route(req.prompt, [r.load_at(t) for r in replicas], candidates)
            replica = replicas[decision.replica]
            if not replica.engine.has_unfinished_requests():
                replica.engine.wait_until(t)
            replica.engine.add_request(ids[i], req.prompt, req.params, arrival_time=t)
            replica.routed += 1
            routed[i] = decision.replica
            reasons[decision.reason] += 1
            continue
        assert behind is not None
        stepped = behind.engine.step()
        if events:
            router.on_kv_events(replicas.index(behind), behind.engine.take_kv_events())
        if migration and (move := _migration(replicas, replicas.index(behind), landing)) is not None:
            k, m = move
            t = behind.engine.clock() + m.num_bytes / link_bandwidth
            behind.routed -= 1
            landing.add(k)
            heapq.heappush(arrivals, (t, sent, index_of[m.request_id], (k, m)))
            sent += 1
            moves, moved_bytes = moves + 1, moved_bytes + m.num_bytes
        for out in stepped:
            if not out.finished:
                continue
            i = index_of[out.request_id]
            outputs[i] = out
            end = out.metrics.finished_time if out.metrics.finished_time is not None else behind.engine.clock()
            behind.finish_times.append(end)
            if on_finished is not None:
                on_finished(1)
            if concurrency is not None:
                nxt = next(pending, None)
                if nxt is not None:
                    heapq.heappush(arrivals, (end, sent, nxt, None))
                    sent += 1
    return ReplicaReplay([outputs[i] for i in range(len(requests))], routed, reasons, moves, moved_bytes)


def _migration(replicas: list[_Replica], src: int, landing: set[int]) -> tuple[int, Any] | None:
    """Llumnix's rule, simply: the move `replay_on_replicas` makes after a step of `src`, as
    (destination, `Migration`), or None."""
    a = replicas[src].engine.scheduler
    if not (a.waiting or a.swapped) or len(replicas) < 2:
        return None  # nothing waits there
    others = [j for j in range(len(replicas)) if j != src and j not in landing]
    if not others:
        return None
    dst = max(others, key=lambda j: (replicas[j].engine.scheduler.block_manager.num_free_blocks, -j))
    b = replicas[dst].engine.scheduler
    if b.waiting or b.swapped or len(b.running) >= b.config.max_num_seqs:
        return None
    free_a, free_b = a.block_manager.num_free_blocks, b.block_manager.num_free_blocks
    movable = sorted((s for s in a.running if s.num_output_tokens and not s.num_pending),
                     key=lambda s: (len(s.block_table), s.seq_id))
    for seq in movable:
        need = len(seq.block_table)
        if free_b - need <= free_a + need:
            break  # (larger ones even less)
        m = replicas[src].engine.migrate_out(seq.request_id)
        if m is not None:
            return dst, m
    return None


@dataclass(slots=True)
class DisaggregatedReplay:
    """What a disaggregated replay gives back besides the outputs."""

    outputs: list[RequestOutput]
    prefill_routed: list[int]  # the prefill replica of each request
    decode_routed: list[int]  # its decode replica (-1: it ended with its first token)
    transfer_s: list[float]  # each handoff's time on the link
    transfer_bytes: int = 0


def replay_disaggregated(
    prefill: Sequence[Engine],
    decode: Sequence[Engine],
    prefill_router: RoutingPolicy,
    decode_router: RoutingPolicy,
    requests: Sequence[TimedRequest],
    link_bandwidth: float,
    concurrency: int | None = None,
    on_finished: Callable[[int], Any] | None = None,
) -> DisaggregatedReplay:
    """Serve `requests` with prefill/decode disaggregation (DistServe, Splitwise): each goes to
    a prefill replica, which computes its prompt and first token (`export_kv`, `max_tokens=1`);
    its K/V then cross a link of `link_bandwidth` bytes/s, and a decode replica takes it over
    (`kv_handoff`), generating the rest. A request that ends with its first token never leaves
    its prefill replica. The same discrete-event loop as `replay_on_replicas`, with handoffs as a
    second kind of arrival: whatever comes first, an arrival, a handoff or the replica furthest
    behind, happens next."""
    from conveyor.engine import Resume

    pool = [_Replica(e) for e in (*prefill, *decode)]
    first_decode = len(prefill)
    kv_events = prefill_router.wants_kv_events  # (the prefill replicas' caches hold the prompts)
    if kv_events:
        for e in prefill:
            e.enable_kv_events()
    start = max(e.clock() for e in (*prefill, *decode))
    for r in pool:
        r.engine.wait_until(start)
    ids = [r.request_id or f"replay-{i}" for i, r in enumerate(requests)]
    index_of = {rid: i for i, rid in enumerate(ids)}
    # payload: the prefill's output for a handoff (its K/V arrived), None for an arrival
    events, pending = _first_events(requests, start, concurrency)
    order = len(events)
    outputs: dict[int, RequestOutput] = {}
    prefill_routed, decode_routed = [-1] * len(requests), [-1] * len(requests)
    transfer_s: list[float] = []
    transfer_bytes = 0
    prefill_ids, decode_ids = list(range(first_decode)), list(range(len(pool) - first_decode))

    def done(i: int, out: RequestOutput, end: float) -> None:
        nonlocal order
        outputs[i] = out
        if on_finished is not None:
            on_finished(1)
        if concurrency is not None and (nxt := next(pending, None)) is not None:
            heapq.heappush(events, (end, order, nxt, None))
            order += 1

    while events or any(r.engine.has_unfinished_requests() for r in pool):
        busy = [r for r in pool if r.engine.has_unfinished_requests()]
        behind = min(busy, key=lambda r: r.engine.clock()) if busy else None
        if events and (behind is None or events[0][0] <= behind.engine.clock()):
            t, _, i, first = heapq.heappop(events)
            req = requests[i]
            if first is None:  # a new request: to a prefill replica
                k = prefill_router.route(req.prompt, [r.load_at(t) for r in pool[:first_decode]], prefill_ids).replica
                replica = pool[k]
                prefill_routed[i] = k
                kwargs: dict[str, Any] = {"export_kv": True, "arrival_time": t}
                params = dataclasses.replace(req.params, max_tokens=1)
            else:  # its K/V arrived: to a decode replica
                k = decode_router.route(req.prompt, [r.load_at(t) for r in pool[first_decode:]], decode_ids).replica
                replica = pool[first_decode + k]
                decode_routed[i] = k
                got = first.outputs[0]
                kwargs = {"resume": Resume(got.token_ids, len(got.text), first.metrics), "kv_handoff": first.kv_handoff}
                params = req.params
            if not replica.engine.has_unfinished_requests():
                replica.engine.wait_until(t)
            replica.engine.add_request(ids[i], req.prompt, params, **kwargs)
            replica.routed += 1
            continue
        assert behind is not None
        k = pool.index(behind)
        is_prefill = k < first_decode
        stepped = behind.engine.step()
        if kv_events and is_prefill:
            prefill_router.on_kv_events(k, behind.engine.take_kv_events())
        for out in stepped:
            if not out.finished:
                continue
            i = index_of[out.request_id]
            end = out.metrics.finished_time if out.metrics.finished_time is not None else behind.engine.clock()
            behind.finish_times.append(end)
            handoff = out.kv_handoff
            if not is_prefill or handoff is None or out.outputs[0].finish_reason != "length" or (
                requests[i].params.max_tokens == 1
            ):
                done(i, out, end)
                continue
            seconds = handoff.num_bytes / link_bandwidth
            transfer_s.append(seconds)
            transfer_bytes += handoff.num_bytes
            heapq.heappush(events, (end + seconds, order, i, out))
            order += 1
    return DisaggregatedReplay([outputs[i] for i in range(len(requests))], prefill_routed, decode_routed,
                               transfer_s, transfer_bytes)
