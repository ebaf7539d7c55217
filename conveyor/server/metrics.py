"""Prometheus metrics of one server, named like vLLM's with a `conveyor:` prefix.

Everything lives in the server's own `CollectorRegistry` (no process-global state, so two
servers or two tests never share counters). One thread per engine replica writes: the engine
thread, or with an engine process the thread that reads its messages. It calls `on_step` after each step,
`on_output` for each output it routes and `on_queues` whenever the queues may have changed
(after a step, after an abort). prometheus_client is thread-safe, so `/metrics` reads
concurrently from the event loop.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from conveyor.core.block_manager import BlockManager
    from conveyor.engine import StepRecord
    from conveyor.outputs import RequestOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Buckets from vLLM's, so the same dashboards read both.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort")


class RequestProgress(Protocol):
    """What the engine thread remembers of one request between its outputs."""

    saw_first_token: bool
    token_times_seen: int


class SchedulerQueues(Protocol):
    waiting: list[Any]
    running: list[Any]
    block_manager: BlockManager


class QueueCounts(NamedTuple):
    """The queues' sizes after a step: what an engine process sends instead of its scheduler."""

    running: int
    waiting: int
    swapped: int
    kv_usage: float


def queue_counts(scheduler: SchedulerQueues) -> QueueCounts:
    bm = scheduler.block_manager
    return QueueCounts(
        len(scheduler.running),
        len(scheduler.waiting),
        # A scheduler without swap preemption has no swapped queue: report 0.
        len(getattr(scheduler, "swapped", ())),
        bm.num_used_blocks / bm.num_blocks if bm.num_blocks else 0.0,
    )


class ServerMetrics:
    """The metric families; labelled by `model_name` like vLLM's."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        m = model_name

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, registry=r, buckets=buckets).labels(m)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(m)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(m)

        self.ttft = hist("conveyor:time_to_first_token_seconds",
                         "Time from arrival to the first generated token.", TTFT_BUCKETS)
        self.itl = hist("conveyor:inter_token_latency_seconds",
                        "Time between consecutive generated tokens of a request.", ITL_BUCKETS)
        self.tpot = hist("conveyor:request_time_per_output_token_seconds",
                         "Mean time per output token after the first, per finished request.",
                         ITL_BUCKETS)
        self.e2e = hist("conveyor:e2e_request_latency_seconds",
                        "Time from arrival to finish (any reason).", REQUEST_LATENCY_BUCKETS)
        self.queue_time = hist("conveyor:request_queue_time_seconds",
                               "Time from arrival to first being scheduled.",
                               REQUEST_LATENCY_BUCKETS)
        self.step_tokens = hist("conveyor:iteration_tokens_total",
                                "Tokens computed per engine step (prefill + decode).",
                                STEP_TOKEN_BUCKETS)
        self.running = gauge("conveyor:num_requests_running", "Sequences in the running queue.")
        self.waiting = gauge("conveyor:num_requests_waiting", "Sequences in the waiting queue.")
        self.swapped = gauge("conveyor:num_requests_swapped",
                             "Sequences swapped out to CPU memory.")
        self.kv_usage = gauge("conveyor:kv_cache_usage_perc",
                              "Share of KV-cache blocks in use (1 = full).")
        self.preemptions = counter("conveyor:num_preemptions",
                                   "Sequences preempted (their KV dropped or swapped out).")
        self.prompt_tokens = counter("conveyor:prompt_tokens",
                                     "Prompt tokens of requests that produced a first token.")
        self.generation_tokens = counter("conveyor:generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = counter(
            "conveyor:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (requests that produced a first token).")
        self.prefix_cache_hits = counter(
            "conveyor:prefix_cache_hits", "Of those, tokens whose K/V the prefix cache held.")
        self.offload_stored = counter(
            "conveyor:kv_offload_blocks_stored",
            "KV offloading: cached blocks copied to the host tier (--kv-offloading-size, --kv-offloading-policy).")
        self.offload_loaded = counter(
            "conveyor:kv_offload_blocks_loaded",
            "KV offloading: blocks copied back from the host tier for prefix-cache hits (in prefix_cache_hits).")
        self.disk_written = counter(
            "conveyor:kv_disk_blocks_written",
            "KV offloading's disk tier: host tier blocks written to files (--kv-disk-path).")
        self.disk_read = counter(
            "conveyor:kv_disk_blocks_read",
            "KV offloading's disk tier: files read back for prefix-cache hits (in kv_offload_blocks_loaded).")
        self.spec_draft_tokens = counter(
            "conveyor:spec_decode_num_draft_tokens",
            "Speculative decoding: draft tokens verified (--speculative-method).")
        self.spec_accepted_tokens = counter(
            "conveyor:spec_decode_num_accepted_tokens",
            "Speculative decoding: draft tokens the model accepted (the acceptance rate is "
            "this over the drafts).")
        self._success = Counter("conveyor:request_success",
                                "Finished requests, by finish reason (stop, length, abort).",
                                ["model_name", "finished_reason"], registry=r)
        self.success = {reason: self._success.labels(m, reason) for reason in FINISH_REASONS}
        self.engine_restarts = counter(
            "conveyor:engine_restarts",
            "Engine processes started again after one died (--engine-process).")
        self.requests_replayed = counter(
            "conveyor:requests_replayed",
            "Requests in flight when an engine process died, resumed by its successor.")
        self.requests_failed = counter(
            "conveyor:requests_failed",
            "Requests ended by an error for being in flight through more engine deaths than "
            "--engine-max-replays allows.")

        self._routed = Counter(
            "conveyor:router_requests",
            "Requests (API requests; their n choices go together) routed to each engine replica, "
            "by the reason the routing policy gave (--data-parallel-size > 1).",
            ["model_name", "replica", "reason"], registry=r)
        self._kv_event_batches = Counter(
            "conveyor:router_kv_event_batches",
            "KV event batches the router read from each replica (--router-policy kv_events).",
            ["model_name", "replica"], registry=r)
        self.model_name = m
        self._queues: dict[int, QueueCounts] = {}
        self._queues_lock = threading.Lock()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- updates (engine thread) -----------------------------------------------------------
    def on_step(self, record: StepRecord) -> None:
        self.step_tokens.observe(record.num_prefill_tokens + record.num_decode_tokens)
        if record.num_preempted:
            self.preemptions.inc(record.num_preempted)
        if record.blocks_stored or record.blocks_loaded:
            self.offload_stored.inc(record.blocks_stored)
            self.offload_loaded.inc(record.blocks_loaded)
        if record.disk_blocks_written or record.disk_blocks_read:
            self.disk_written.inc(record.disk_blocks_written)
            self.disk_read.inc(record.disk_blocks_read)
        if record.num_draft_tokens:
            self.spec_draft_tokens.inc(record.num_draft_tokens)
            self.spec_accepted_tokens.inc(record.num_accepted_tokens)

    def on_queues(self, counts: QueueCounts, replica: int = 0) -> None:
        """A replica's queues after its step; the gauges show the sum over replicas (the KV
        usage: the mean). Replicas call this from their own threads."""
        with self._queues_lock:
            self._queues[replica] = counts
            every = list(self._queues.values())
        self.running.set(sum(c.running for c in every))
        self.waiting.set(sum(c.waiting for c in every))
        self.swapped.set(sum(c.swapped for c in every))
        self.kv_usage.set(sum(c.kv_usage for c in every) / len(every))

    def on_routed(self, replica: int, reason: str) -> None:
        self._routed.labels(self.model_name, str(replica), reason).inc()

    def on_kv_events(self, replica: int) -> None:
        self._kv_event_batches.labels(self.model_name, str(replica)).inc()

    def on_output(self, out: RequestOutput, progress: RequestProgress) -> None:
        """Count what is new in `out` since this request's previous output."""
        metrics = out.metrics
        new_tokens = len(out.outputs[0].delta_token_ids)
        if new_tokens:
            self.generation_tokens.inc(new_tokens)
        if not progress.saw_first_token and metrics.first_token_time is not None:
            progress.saw_first_token = True
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.prefix_cache_queries.inc(len(out.prompt_token_ids))
            self.prefix_cache_hits.inc(out.num_cached_tokens)
            self.ttft.observe(metrics.first_token_time - metrics.arrival_time)
        times = metrics.token_times
        for i in range(max(progress.token_times_seen, 1), len(times)):
            self.itl.observe(times[i] - times[i - 1])
        progress.token_times_seen = len(times)
        if out.finished:
            self._on_finished(out)

    def _on_finished(self, out: RequestOutput) -> None:
        metrics = out.metrics
        reason = out.outputs[0].finish_reason or "abort"
        if reason in self.success:
            self.success[reason].inc()
        if metrics.first_scheduled_time is not None:
            self.queue_time.observe(metrics.first_scheduled_time - metrics.arrival_time)
        if metrics.finished_time is not None:
            self.e2e.observe(metrics.finished_time - metrics.arrival_time)
        if metrics.tpot is not None:
            self.tpot.observe(metrics.tpot)
