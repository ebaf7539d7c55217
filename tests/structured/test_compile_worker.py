"""The grammar compiler process (`compile_worker`): the same DFAs and errors as compiling in
this process, a dead worker survived, and a worker that ends with its stdin."""

from __future__ import annotations

import numpy as np
import pytest

from conveyor import StructuredOutputParams
from conveyor.structured import GrammarError, compile_automaton
from conveyor.structured.cfg import Pushdown
from conveyor.structured.compile_worker import DFACompiler

SPECS = [
    StructuredOutputParams(regex=r"(cat|dog)s? [0-9]{1,3}"),
    StructuredOutputParams(choice=("yes", "no", "maybe")),
    StructuredOutputParams(json={"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
                                 "required": ["n"]}),
    StructuredOutputParams(json={"type": "array", "items": {"enum": [1, "a"]}}),
]


@pytest.fixture()
def compiler():
    c = DFACompiler()
    yield c
    c.close()


def test_the_worker_gives_the_dfa_compiled_here(compiler):
    for spec in SPECS:
        got, want = compiler.compile(spec), compile_automaton(spec)
        assert np.array_equal(got.table, want.table) and np.array_equal(got.accepting, want.accepting)


def test_the_worker_gives_a_context_free_grammar_as_compiled_here(compiler):
    for spec in (StructuredOutputParams(grammar='root ::= "[" (item ("," item)*)? "]"\nitem ::= [0-9]+ | root'),
                 StructuredOutputParams(json_object=True)):
        got, want = compiler.compile(spec), compile_automaton(spec)
        assert isinstance(got, Pushdown) and isinstance(want, Pushdown)
        assert got.names == want.names and got.calls == want.calls
        assert all(np.array_equal(a, b) for a, b in zip(got.tables, want.tables, strict=True))
        assert got.matches('{"a": [1, {"b": []}]}' if spec.json_object else "[1,[2,[]]]")
    with pytest.raises(GrammarError, match="left-recursive"):
        compiler.compile(StructuredOutputParams(grammar='root ::= "a"? root "b" | "c"'))


def test_a_grammar_error_comes_back_as_one(compiler):
    huge = StructuredOutputParams(regex="[a-z]{1,3000}x{1,3000}")
    with pytest.raises(GrammarError) as here:
        compile_automaton(huge)
    with pytest.raises(GrammarError) as there:
        compiler.compile(huge)
    assert str(there.value) == str(here.value)
    assert compiler.compile(SPECS[0]).num_states > 1  # and the worker serves on


def test_a_dead_worker_is_replaced(compiler):
    compiler.compile(SPECS[1])
    first = compiler._proc
    assert first is not None
    first.kill()
    first.wait()
    assert compiler.compile(SPECS[0]).num_states > 1
    assert compiler.compile(SPECS[2]).num_states > 1
    assert compiler._proc is not None and compiler._proc.pid != first.pid


def test_the_worker_ends_with_its_stdin(compiler):
    compiler.compile(SPECS[1])
    proc = compiler._proc
    assert proc is not None and proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0
