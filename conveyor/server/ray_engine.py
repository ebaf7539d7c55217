"""Engine replicas as Ray actors: replicas on the machines of a Ray cluster (DESIGN.md §8).

`RayAsyncEngine` is `ProcessAsyncEngine` whose engine runs in a Ray actor instead of a child
process. Everything else is shared: the wire, the front end's bookkeeping, and the recovery
(when the actor dies, a node goes away or its step fails, another actor is started and every
request in flight resumes from its last delivered token).

How the actor is reached: inside it, the engine process's own loop (`_child_main`) runs in a
thread at one end of a local pipe. In the front end, two pump threads stand at the far end of
another pipe, so the front end reads and writes a connection exactly as it would a child's:
- out: commands read from the pipe go to the actor in order, a batch per call (each call waits
  for the previous, so Ray never reorders them);
- in: a call that waits up to `poll_s` in the actor brings back what the engine sent; when
  the actor's engine has ended, or the actor is gone, the pipe is closed: the front end reads
  EOF, as at a child's death.

Ray is optional (`pip install ray`); `conveyor serve --data-parallel-backend ray` starts a local
Ray instance, or joins the cluster at `--ray-address` (`auto`: the one this machine belongs to).
The weights must be at the same path on every node.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection as mpc
import threading
from typing import Any

from conveyor.server.engine_process import Child, ProcessAsyncEngine, Wire, _child_main

logger = logging.getLogger("conveyor.server")


class EngineActor:
    """The actor's body (made a Ray actor class by `actor_class`): an engine loop behind a pipe."""

    def __init__(self, engine_kwargs: dict[str, Any], max_queued_requests: int | None, idle_poll_s: float,
                 log_level: int) -> None:
        self._conn, core = multiprocessing.Pipe()
        self._core = threading.Thread(
            target=_child_main,
            args=(engine_kwargs, core, max_queued_requests, idle_poll_s, log_level, False),
            name="conveyor-engine", daemon=True,
        )
        self._core.start()

    def put(self, messages: list[tuple[Any, ...]]) -> None:
        for m in messages:
            self._conn.send(m)

    def take(self, timeout: float) -> list[tuple[Any, ...]] | None:
        """What the engine sent, waiting up to `timeout` for something; None once it has ended."""
        out: list[tuple[Any, ...]] = []
        try:
            if self._conn.poll(timeout):
                while self._conn.poll():
                    out.append(self._conn.recv())
        except (EOFError, OSError):  # the engine's end is closed: what came before, then None
            return out or None
        if out or self._core.is_alive():
            return out
        # The engine ended; what it sent between our wait and its end (its "load_failed") is
        # in the pipe now, and must not be lost for an end of stream.
        try:
            while self._conn.poll():
                out.append(self._conn.recv())
        except (EOFError, OSError):
            pass
        return out or None


def actor_class() -> Any:
    """`EngineActor` as a Ray actor class."""
    import ray

    return ray.remote(EngineActor)


class _Duplex:
    """Two one-way pipes as one connection. One-way, so that closing the end a pump writes to
    reaches the reader as EOF even while the other pump is blocked reading its own pipe (a
    two-way pipe's socket stays open under a thread blocked in it)."""

    def __init__(self, reader: mpc.Connection, writer: mpc.Connection) -> None:
        self._reader, self._writer = reader, writer

    def send(self, obj: Any) -> None:
        self._writer.send(obj)

    def recv(self) -> Any:
        return self._reader.recv()

    def poll(self, timeout: float | None = 0.0) -> bool:
        return self._reader.poll(timeout)

    def fileno(self) -> int:
        return self._reader.fileno()

    def close(self) -> None:
        self._reader.close()
        self._writer.close()


class RayChild:
    """An engine actor handled as a child process (`engine_process.Child`)."""

    def __init__(self, actor: Any, poll_s: float = 0.05) -> None:
        self.actor = actor
        self.poll_s = poll_s
        news_r, self._news_w = multiprocessing.Pipe(duplex=False)  # actor -> front end
        self._commands_r, commands_w = multiprocessing.Pipe(duplex=False)  # front end -> actor
        self.conn = _Duplex(news_r, commands_w)
        self._pumps = [
            threading.Thread(target=self._pump_in, name="conveyor-ray-in", daemon=True),
            threading.Thread(target=self._pump_out, name="conveyor-ray-out", daemon=True),
        ]
        for t in self._pumps:
            t.start()

    @property
    def exitcode(self) -> int | None:
        return None

    def _pump_in(self) -> None:
        import ray

        try:
            while True:
                messages = ray.get(self.actor.take.remote(self.poll_s))
                if messages is None:
                    return
                for m in messages:
                    self._news_w.send(m)
        except ray.exceptions.RayError as e:
            logger.error("the engine actor is gone: %s", str(e).splitlines()[0])
        except OSError:
            pass
        finally:
            self._news_w.close()  # the front end reads EOF: the engine is gone

    def _pump_out(self) -> None:
        import ray

        try:
            while True:
                batch = [self._commands_r.recv()]
                while self._commands_r.poll():
                    batch.append(self._commands_r.recv())
                ray.get(self.actor.put.remote(batch))
                if any(m[0] == "stop" for m in batch):
                    return
        except (EOFError, OSError, ray.exceptions.RayError):
            return

    def is_alive(self) -> bool:
        return self._pumps[0].is_alive()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the engine to end; then the actor, whose engine is over, is let go."""
        self._pumps[0].join(timeout)
        if not self._pumps[0].is_alive():
            self.kill()

    def kill(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self.actor)
        self.conn.close()  # the out pump reads EOF


class RayAsyncEngine(ProcessAsyncEngine):
    """`ProcessAsyncEngine` with its engine in a Ray actor. `actor_options` go to the actor
    (`num_gpus=1` puts it on a GPU of its own, `num_cpus` reserves cores)."""

    def __init__(self, engine_kwargs: dict[str, Any], actor_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(engine_kwargs, **kwargs)
        self.actor_options = dict(actor_options or {})

    def _start_child(self) -> tuple[Child, Wire]:
        # Threaded, so that `take` waits in the actor while `put` runs.
        actor = actor_class().options(max_concurrency=4, **self.actor_options).remote(
            self.engine_kwargs, self.max_queued_requests, self.idle_poll_s, logging.getLogger().getEffectiveLevel(),
        )
        child = RayChild(actor)
        return child, child.conn


def ray_replica_options(engine_kwargs: dict[str, Any], size: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each replica's (engine options, actor options): a GPU each where the cluster has enough
    (Ray makes it the actor's only visible device, so the engine's device is plain `cuda`);
    otherwise CPU cores, split as on one machine but over the whole cluster."""
    import ray

    from conveyor.config import ConfigError

    device = engine_kwargs.get("device", "auto")
    if device.startswith("cuda:"):
        raise ConfigError(f"device={device!r}: on Ray each replica gets a GPU of its own; give 'cuda'")
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if device != "cpu" and gpus:
        if gpus < size:
            raise ConfigError(f"data_parallel_size={size} needs {size} GPUs, one per replica; the Ray cluster has {gpus}")
        return [({**engine_kwargs, "device": "cuda"}, {"num_gpus": 1}) for _ in range(size)]
    if device == "cuda":
        raise ConfigError("device='cuda' but the Ray cluster has no GPU")
    cpus = int(ray.cluster_resources().get("CPU", 1))
    threads = engine_kwargs.get("num_threads") or max(1, cpus // size)
    return [({**engine_kwargs, "device": "cpu", "num_threads": threads}, {"num_cpus": min(threads, cpus)})
            for _ in range(size)]


def init_ray(address: str | None) -> None:
    """Join the cluster at `address` (`auto`: this machine's), or start a local Ray instance."""
    try:
        import ray
    except ImportError as e:
        from conveyor.config import ConfigError

        raise ConfigError("data_parallel_backend='ray' needs Ray: `pip install ray` (or conveyor's `ray` extra)") from e

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
    else:
        ray.init(include_dashboard=False, logging_level=logging.WARNING)
