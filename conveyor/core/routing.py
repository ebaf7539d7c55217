"""Routing policies: which engine replica serves a request (data parallelism).

Several replicas of the engine, each with its own scheduler and KV cache, serve one stream of
requests. The router sees, per request, its prompt and each replica's load (the requests routed
to it and not yet finished), and picks a replica. Policies:

- `round_robin`: in turn; blind to load and to caches.
- `random`: uniformly at random (seeded).
- `least_requests`: the replica with the fewest requests in flight.
- `power_of_two`: two replicas drawn at random, the less loaded of them (Mitzenmacher's "power
  of two choices": almost the balance of `least_requests` without comparing every replica).
- `cache_aware`: SGLang's cache-aware router (its model gateway's default). Each replica has
  an approximate index of the prompts sent to it; a request goes where the longest prefix of
  its prompt was sent before, so that replica's prefix cache holds it; when loads drift apart,
  the least loaded replica wins instead. Defaults are the gateway's (cache threshold 0.3,
  balance thresholds 64 requests and 1.5x).
- `kv_events`: NVIDIA Dynamo's KV router, llm-d's precise prefix-cache scorer: the same rules,
  on what each replica's prefix cache holds as its KV events say (conveyor/core/kv_events.py),
  evictions and resets included, with the engine's own block hashes (so a LoRA adapter's,
  a cache salt's or an image's blocks never match another prompt's); `cache_aware`'s own rules
  where no replica holds the prompt.

Every policy is one class behind `RoutingPolicy` and `@register_router`; `make_router` builds
one by name. Nothing here imports torch: the server and the simulator route with the same code.
"""

from __future__ import annotations

import dataclasses
import random
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, NamedTuple

from conveyor.config import ConfigError
from conveyor.core.registry import Registry

if TYPE_CHECKING:
    from conveyor.core.kv_events import KVEvent

Prompt = str | Sequence[int]


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class RouterConfig:
    """How requests are spread over `data_parallel_size` engine replicas."""

    data_parallel_size: int = field(
        default=1, metadata=_help("Engine replicas, each with its own scheduler and KV cache; a router spreads requests over them.")
    )
    data_parallel_backend: str = field(
        default="mp",
        metadata=_help("Where replicas run: mp (processes of this machine) or ray (actors of a Ray cluster, "
                       "on as many machines as it has; needs `pip install ray`)."),
    )
    ray_address: str | None = field(
        default=None,
        metadata=_help("With --data-parallel-backend ray: the cluster to join (auto: this machine's); "
                       "default: start a local Ray instance."),
    )
    router_policy: str = field(
        default="cache_aware",
        metadata=_help("With several replicas: round_robin, random, least_requests, power_of_two, cache_aware "
                       "or kv_events (cache_aware's rules on the replicas' KV events: what their caches hold)."),
    )
    router_cache_threshold: float = field(
        default=0.3,
        metadata=_help("cache_aware, kv_events: the share of a prompt a replica must have seen before (holds) "
                   "to get it for its cache."),
    )
    router_balance_abs_threshold: int = field(
        default=64,
        metadata=_help("cache_aware: loads count as imbalanced (the least loaded replica wins) when the largest "
                       "exceeds the smallest by more than this many requests ..."),
    )
    router_balance_rel_threshold: float = field(
        default=1.5, metadata=_help("cache_aware: ... and is more than this many times the smallest.")
    )
    router_block_size: int = field(
        default=16, metadata=_help("cache_aware: prompts are matched in blocks of this many tokens (or characters).")
    )
    router_max_blocks: int = field(
        default=1 << 20,
        metadata=_help("cache_aware: blocks remembered per replica; the least recently routed go first."),
    )
    router_seed: int = field(default=0, metadata=_help("random and power_of_two: the seed of their draws."))
    replica_migration: bool = field(
        default=False,
        metadata=_help("Llumnix's live migration between replicas (simulated only; the server refuses it): when a "
                       "replica has requests waiting and another has more free KV blocks and none waiting, its "
                       "smallest running request moves there, its K/V over the link (into the other's "
                       "kv_receive_space; without it the tokens are computed again there)."),
    )
    router_instances: int = field(
        default=1,
        metadata=_help("Routers taking turns (several gateways or API servers in front of the replicas, as "
                       "SGLang's router replicas or vLLM's --api-server-count): each routes every n-th request "
                       "with state of its own (cache_aware's history), the loads are common, and kv_events "
                       "routers all read every replica's events."),
    )
    prefill_replicas: int = field(
        default=0,
        metadata=_help("Prefill/decode disaggregation (with --decode-replicas): replicas that run prompts and "
                       "first tokens only, each request's K/V then handed to a decode replica; 0: every replica "
                       "does both."),
    )
    decode_replicas: int = field(
        default=0, metadata=_help("Prefill/decode disaggregation: replicas that take requests over from the "
                                  "prefill replicas and decode them (least loaded first).")
    )

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ConfigError(f"data_parallel_size={self.data_parallel_size} must be at least 1")
        if self.data_parallel_backend not in ("mp", "ray"):
            raise ConfigError(f"data_parallel_backend={self.data_parallel_backend!r}: use 'mp' or 'ray'")
        if self.ray_address is not None and self.data_parallel_backend != "ray":
            raise ConfigError("ray_address needs data_parallel_backend='ray'")
        if self.router_policy not in _ROUTERS:
            raise ConfigError(f"router_policy={self.router_policy!r} is not one of {available_routers()}")
        if not 0.0 <= self.router_cache_threshold <= 1.0:
            raise ConfigError(f"router_cache_threshold={self.router_cache_threshold} must be in [0, 1]")
        if self.router_balance_abs_threshold < 0:
            raise ConfigError(f"router_balance_abs_threshold={self.router_balance_abs_threshold} must be >= 0")
        if self.router_balance_rel_threshold < 1.0:
            raise ConfigError(f"router_balance_rel_threshold={self.router_balance_rel_threshold} must be >= 1")
        if self.router_block_size < 1:
            raise ConfigError(f"router_block_size={self.router_block_size} must be at least 1")
        if self.router_instances < 1:
            raise ConfigError(f"router_instances={self.router_instances} must be at least 1")
        if self.router_max_blocks < 1:
            raise ConfigError(f"router_max_blocks={self.router_max_blocks} must be at least 1")
        if min(self.prefill_replicas, self.decode_replicas) < 0 or (self.prefill_replicas > 0) != (
            self.decode_replicas > 0
        ):
            raise ConfigError(
                f"prefill_replicas={self.prefill_replicas} and decode_replicas={self.decode_replicas}: "
                "disaggregation needs at least one of each (both 0: every replica does both)"
            )
        if self.disaggregated and self.data_parallel_size > 1:
            raise ConfigError("with prefill_replicas and decode_replicas, data_parallel_size is their sum: leave it at 1")

    @property
    def disaggregated(self) -> bool:
        return self.prefill_replicas > 0

    def pool(self, role: str) -> RouterConfig:
        """The router of one pool of a disaggregated set: the configured policy over the prefill
        replicas (their prefix caches hold the prompts), least loaded over the decode ones."""
        if role == "prefill":
            return dataclasses.replace(self, data_parallel_size=self.prefill_replicas, prefill_replicas=0,
                                       decode_replicas=0)
        return dataclasses.replace(self, data_parallel_size=self.decode_replicas, prefill_replicas=0,
                                   decode_replicas=0, router_policy="least_requests")


class Decision(NamedTuple):
    """A routing decision: the replica, and why (a metric label)."""

    replica: int
    reason: str


_ROUTERS: Registry[RoutingPolicy] = Registry("routing policy")


def register_router(name: str) -> Callable[[type[RoutingPolicy]], type[RoutingPolicy]]:
    return _ROUTERS.register(name)


def available_routers() -> list[str]:
    return _ROUTERS.names()


def make_router(config: RouterConfig) -> RoutingPolicy:
    if config.router_instances > 1:
        return RouterGroup(config)
    return _ROUTERS[config.router_policy](config)


class RoutingPolicy(ABC):
    """Picks a replica per request.

    Invariants: `route` returns one of `candidates` (the replicas that accept requests now,
    never empty); `loads[i]` is replica i's requests in flight, for every replica. The same
    calls give the same decisions (the random policies draw from their own seeded generator).
    """

    name: ClassVar[str] = ""
    # A policy that reads the replicas' KV events: they are turned on for it and handed to
    # `on_kv_events` as they come (conveyor/sim/replicas.py, conveyor/server/replicas.py).
    wants_kv_events: ClassVar[bool] = False

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.num_replicas = config.data_parallel_size
        self.rng = random.Random(config.router_seed)  # the only source of a policy's draws
        # A text prompt's token ids, for a policy that hashes them as the engine does (the
        # server sets it to the engine's tokenizer: `use_tokenizer`).
        self.tokenize: Callable[[str], list[int]] | None = None

    @abstractmethod
    def route(self, prompt: Prompt, loads: Sequence[int], candidates: Sequence[int]) -> Decision:
        """The replica for a request with this prompt."""

    def on_replica_reset(self, replica: int) -> None:  # noqa: B027 - optional hook
        """Replica `replica` lost its KV cache (its engine was started again)."""

    def on_kv_events(self, replica: int, events: Sequence[KVEvent]) -> None:  # noqa: B027 - optional hook
        """Replica `replica`'s KV events, in order (only for `wants_kv_events`)."""

    def use_tokenizer(self, tokenize: Callable[[str], list[int]] | None) -> None:
        self.tokenize = tokenize

    def imbalanced(self, loads: Sequence[int], candidates: Sequence[int]) -> bool:
        """SGLang's balance rule: largest - smallest load > the abs threshold and largest >
        the rel threshold x smallest."""
        cfg = self.config
        most, least = max(loads[i] for i in candidates), min(loads[i] for i in candidates)
        return most - least > cfg.router_balance_abs_threshold and most > least * cfg.router_balance_rel_threshold

    @staticmethod
    def least_loaded(loads: Sequence[int], candidates: Sequence[int]) -> int:
        return min(candidates, key=lambda i: (loads[i], i))


@register_router("round_robin")
class RoundRobinRouter(RoutingPolicy):
    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self._next = 0

    def route(self, prompt: Prompt, loads: Sequence[int], candidates: Sequence[int]) -> Decision:
        # The next replica in turn that accepts requests.
        for k in range(self.num_replicas):
            i = (self._next + k) % self.num_replicas
            if i in candidates:
                self._next = i + 1
                return Decision(i, "turn")
        raise AssertionError("route() needs a candidate")


@register_router("random")
class RandomRouter(RoutingPolicy):
    def route(self, prompt: Prompt, loads: Sequence[int], candidates: Sequence[int]) -> Decision:
        return Decision(candidates[self.rng.randrange(len(candidates))], "random")


@register_router("least_requests")
class LeastRequestsRouter(RoutingPolicy):
    def route(self, prompt: Prompt, loads: Sequence[int], candidates: Sequence[int]) -> Decision:
        return Decision(self.least_loaded(loads, candidates), "load")


@register_router("power_of_two")
class PowerOfTwoRouter(RoutingPolicy):
    def route(self, prompt: Prompt, loads: Sequence[int], candidates: Sequence[int]) -> Decision:
        if len(candidates) == 1:
            return Decision(candidates[0], "load")
        a, b = self.rng.sample(list(candidates), 2)
        return Decision(self.least_loaded(loads, (a, b)), "load")


def block_hashes(prompt: Prompt, block_size: int) -> list[int]:
    """Chained hashes of the prompt's blocks: hash k stands for the prompt's first
    (k+1) x block_size elements (tokens or characters), as a prefix cache's block hashes do.
    A last, partial block is hashed too: it matches only a prompt that is the same to its end
    (a short prompt sent again), and it makes every prompt count in the index's size."""
    hashes: list[int] = []
    h = 0
    for start in range(0, len(prompt), block_size):
        h = hash((h, tuple(prompt[start:start + block_size])))
        hashes.append(h)
    return hashes


class PrefixIndex:
    """The prompt blocks routed to one replica, least recently routed first.

    An approximation of that replica's prefix cache: it sees what was sent, not what the
    replica kept; the replica evicts by its own LRU, this index by its own size bound.
    """

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt were routed here."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()


@register_router("cache_aware")
class CacheAwareRouter(RoutingPolicy):
    """SGLang's cache-aware routing, with chained block hashes in place of its radix tree.

    Per request, in order:
    1. loads imbalanced (largest - smallest > abs threshold and largest > rel threshold x
       smallest): the least loaded replica ("balance");
    2. else, if the best replica has seen more than `cache_threshold` of the prompt: that
       replica, the least loaded on ties ("cache");
    3. else: the replica whose index is smallest, the one with the most room for a new prefix
       ("room"; every prompt adds to the index, so new prompts take turns at level loads).
    The prompt's blocks are then recorded for the chosen replica.
    """

    history_reason = "cache"  # (kv_events: "history", its "cache" is what the events say is held)

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self.indexes = [PrefixIndex(config.router_max_blocks) for _ in range(self.num_replicas)]

    def route(self, prompt: Prompt, loads: Sequence[int], candidates: Sequence[int]) -> Decision:
        cfg = self.config
        hashes = block_hashes(prompt, cfg.router_block_size)
        if self.imbalanced(loads, candidates):
            decision = Decision(self.least_loaded(loads, candidates), "balance")
        else:
            matched = {i: self.indexes[i].match(hashes) for i in candidates}
            best = max(candidates, key=lambda i: (matched[i], -loads[i], -i))
            rate = min(matched[best] * cfg.router_block_size, len(prompt)) / len(prompt) if len(prompt) else 0.0
            if matched[best] and rate > cfg.router_cache_threshold:
                decision = Decision(best, self.history_reason)
            else:
                decision = Decision(min(candidates, key=lambda i: (len(self.indexes[i]), loads[i], i)), "room")
        self.indexes[decision.replica].insert(hashes)
        return decision

    def on_replica_reset(self, replica: int) -> None:
        self.indexes[replica].clear()


@register_router("kv_events")
class KVEventsRouter(CacheAwareRouter):
    """Dynamo's KV router, llm-d's precise prefix-cache scorer: where the prompt's prefix is
    cached, by the replicas' KV events; `cache_aware`'s rules where no replica holds it.

    Per request, in order: loads imbalanced, the least loaded ("balance"); else the replica
    holding the most leading blocks of the prompt (device or host tier), if more than
    `cache_threshold` of it ("cache"); else `cache_aware`'s choice from what was sent where
    ("history": a prefix sent to a replica before it is cached there, a step or more later,
    or evicted everywhere, goes where it went before, so each prefix keeps a home and a burst
    of requests with one new prefix does not compute it on every replica; "room" for a new
    one). A prompt's blocks are hashed as the engine hashes them (`chain_hashes`, at
    `router_block_size` until the events carry the engine's block size), from its token ids
    (a text prompt through `tokenize`, which the server sets to the engine's tokenizer).
    """

    wants_kv_events = True
    history_reason = "history"

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        from conveyor.core.kv_events import KVEventIndex

        self.held = [KVEventIndex() for _ in range(self.num_replicas)]

    def on_kv_events(self, replica: int, events: Sequence[KVEvent]) -> None:
        self.held[replica].apply(events)

    def on_replica_reset(self, replica: int) -> None:
        super().on_replica_reset(replica)
        self.held[replica].clear()

    def prompt_hashes(self, prompt: Prompt) -> list[int]:
        """The prompt's full blocks' hashes as events carry them ([] for a text prompt with no
        tokenizer)."""
        from conveyor.core.block_manager import chain_hashes
        from conveyor.core.kv_events import external_hash

        size = next((x.block_size for x in self.held if x.block_size), self.config.router_block_size)
        if isinstance(prompt, str):
            if self.tokenize is None:
                return []
            prompt = self.tokenize(prompt)
        tokens = list(prompt)
        return [external_hash(h) for h in chain_hashes(tokens, size, [], len(tokens) // size)]

    def route(self, prompt: Prompt, loads: Sequence[int], candidates: Sequence[int]) -> Decision:
        if not self.imbalanced(loads, candidates) and (hashes := self.prompt_hashes(prompt)):
            held = {i: self.held[i].match(hashes) for i in candidates}
            best = max(candidates, key=lambda i: (held[i], -loads[i], -i))
            if held[best] and held[best] / len(hashes) > self.config.router_cache_threshold:
                self.indexes[best].insert(block_hashes(prompt, self.config.router_block_size))
                return Decision(best, "cache")
        return super().route(prompt, loads, candidates)


class RouterGroup(RoutingPolicy):
    """`router_instances` routers of one policy taking turns, each with its own state (and
    seed): what several gateways in front of the same replicas decide. Each one's decision is
    counted under its own reason."""

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        one = dataclasses.replace(config, router_instances=1)
        self.members = [make_router(dataclasses.replace(one, router_seed=config.router_seed + k))
                        for k in range(config.router_instances)]
        self.wants_kv_events = self.members[0].wants_kv_events  # type: ignore[misc]
        self._turn = 0

    def route(self, prompt: Prompt, loads: Sequence[int], candidates: Sequence[int]) -> Decision:
        member = self.members[self._turn % len(self.members)]
        self._turn += 1
        return member.route(prompt, loads, candidates)

    def on_replica_reset(self, replica: int) -> None:
        for m in self.members:
            m.on_replica_reset(replica)

    def on_kv_events(self, replica: int, events: Sequence[KVEvent]) -> None:
        for m in self.members:
            m.on_kv_events(replica, events)

    def use_tokenizer(self, tokenize: Callable[[str], list[int]] | None) -> None:
        self.tokenize = tokenize
        for m in self.members:
            m.use_tokenizer(tokenize)
