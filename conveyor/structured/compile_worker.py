"""Grammars compiled in a process of their own, so that a compile never holds the GIL of
the process that steps the engine.

A compile is pure Python and numpy (about a second for a 5-property schema). In a thread
of the engine's process it shares the GIL with the loop: the loop's steps go on, but many
times slower (on this project's CPU box, 3 steps of SmolLM2 at batch 4 ran during a 1.1 s
compile, where a step takes about 41 ms; BENCHMARKS.md, twenty-third session). The worker is a torch-free Python (`python -m conveyor.structured.compile_worker`, about 0.2 s
to start), fed `StructuredOutputParams` and answering automata (`ByteDFA`, `Pushdown`), pickled over its stdin
and stdout; it exits when its stdin closes (the engine's process ended, however it ended).
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

from conveyor.structured import GrammarError, compile_automaton
from conveyor.structured.cfg import Pushdown
from conveyor.structured.regex import ByteDFA


class DFACompiler:
    """The client side: one worker process, started on first use; one compile at a time.
    If the worker dies, the compile runs here instead and the next one starts a new worker."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def compile(self, spec: Any, specials: frozenset[str] | None = None) -> ByteDFA | Pushdown:
        """The automaton of a `StructuredOutputParams`; raises GrammarError as
        `compile_automaton` does."""
        with self._lock:
            try:
                proc = self._worker()
                assert proc.stdin is not None and proc.stdout is not None
                pickle.dump((spec, specials), proc.stdin)
                proc.stdin.flush()
                kind, value = pickle.load(proc.stdout)
            except (EOFError, OSError, pickle.UnpicklingError):
                self.close()
                return compile_automaton(spec, specials)
        if kind == "error":
            raise GrammarError(value)
        return value

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()

    def _worker(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            root = str(Path(__file__).resolve().parents[2])  # where `conveyor` imports from
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "conveyor.structured.compile_worker"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
            )
        return self._proc


def serve(requests: IO[bytes], answers: IO[bytes]) -> None:
    """The worker's loop: (a spec, the special tokens' texts) in, ("ok", dfa) or ("error",
    message) out, until EOF."""
    while True:
        try:
            spec, specials = pickle.load(requests)
        except EOFError:
            return
        try:
            answer: tuple[str, object] = ("ok", compile_automaton(spec, specials))
        except GrammarError as e:
            answer = ("error", str(e))
        pickle.dump(answer, answers)
        answers.flush()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's to act on; we end with our stdin
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, not into the answers
    serve(sys.stdin.buffer, answers)


if __name__ == "__main__":
    main()
