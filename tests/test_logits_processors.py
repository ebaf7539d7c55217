"""Custom logits processors (conveyor/logits_process.py) on a real model.

The reference is HF transformers' greedy `generate` on the same weights (float64) with an HF
`LogitsProcessor` applying the same rule, one that reads the prompt and every token generated
so far: the greedy tokens must be equal under every scheduling that changes how a sequence's
rows reach the sampler (chunked prompts, preemption, async scheduling, speculative steps),
for a request's own callables (both signatures), for an engine-wide processor class that
reads the request's `extra_args`, beside requests it leaves alone, and for the same rule as a
vLLM v1 processor (`update_state` / `apply(logits)`), whose slots the engine's persistent batch
keeps (over random schedules, hypothesis: the updates put each step's rows in their slots).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor import (
    LLM,
    ConfigError,
    InvalidRequestError,
    LogitsProcessor,
    LogitsRow,
    SamplingParams,
)
from conveyor.logits_process import AdapterLogitsProcessor, process_dict_updates
from tests.schedulings import SCHEDULINGS

EOS = 2
VOCAB = 384


def steer(prompt: Sequence[int], out: Sequence[int], row: torch.Tensor, strength: float = 4.0) -> torch.Tensor:
    """The rule: away from the prompt's last token and from every token written, towards one
    that moves with what was written."""
    row = row.clone()
    row[prompt[-1]] -= 5.0
    for t in out:
        row[t] -= 2.0
    row[(sum(out) + len(prompt)) % VOCAB] += strength
    return row


def hf_reference(model_dir: str, prompt: list[int], max_tokens: int, strength: float | None) -> list[int]:
    from transformers import AutoModelForCausalLM
    from transformers import LogitsProcessor as HFProcessor

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    n = len(prompt)

    class Reference(HFProcessor):
        def __call__(self, input_ids, scores):
            if strength is None:
                return scores
            ids = input_ids[0].tolist()
            return steer(ids[:n], ids[n:], scores[0], strength)[None]

    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                         eos_token_id=EOS, pad_token_id=0, logits_processor=[Reference()])
    return out[0, n:].tolist()


class Steer(LogitsProcessor):
    """The rule as an engine-wide processor: for the rows whose request asks it
    (`extra_args={"steer": strength}`)."""

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
        for i, row in enumerate(rows):
            strength = (row.params.extra_args or {}).get("steer")
            if strength is not None:
                logits[i] = steer(row.prompt_token_ids, row.output_token_ids, logits[i], float(strength))
        return logits


class Force(LogitsProcessor):
    """Every row whose request asks (`extra_args={"force": token}`) draws that token."""

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
        for i, row in enumerate(rows):
            token = (row.params.extra_args or {}).get("force")
            if token is not None:
                logits[i] = float("-inf")
                logits[i, int(token)] = 0.0
        return logits


class SteerV1:
    """The rule as vLLM v1 writes processors: per-slot state kept by `update_state` (removed,
    then added, then moved), applied to the whole batch by `apply(logits)`, reading the live
    output lists handed over when each request was added."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        strength = (params.extra_args or {}).get("steer")
        if strength is not None and not isinstance(strength, (int, float)):
            raise ValueError(f"steer must be a number, not {strength!r}")

    def __init__(self, vllm_config, device, is_pin_memory) -> None:
        assert vllm_config.scheduler_config.max_num_seqs > 0 and not is_pin_memory
        self.slots: dict[int, tuple[list[int], list[int], float]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:
        def entry(params, prompt, out):
            strength = (params.extra_args or {}).get("steer")
            return None if strength is None else (prompt, out, float(strength))

        process_dict_updates(self.slots, batch_update, entry)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for i, (prompt, out, strength) in self.slots.items():
            logits[i] = steer(prompt, out, logits[i], strength)
        return logits


class SteerAdapter(AdapterLogitsProcessor):
    """The rule as vLLM's AdapterLogitsProcessor writes it: a per-request callable a request
    (the three-argument form), the base keeping one a slot."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        SteerV1.validate_params(params)

    def new_req_logits_processor(self, params: SamplingParams):
        strength = (params.extra_args or {}).get("steer")
        if strength is None:
            return None
        return lambda prompt, out, row: steer(prompt, out, row, float(strength))


@pytest.fixture(scope="module")
def cases(tiny_models):
    model_dir = str(tiny_models["llama"])
    rng = random.Random(1)
    out = []
    for k in range(8):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 20))]
        max_tokens = rng.randint(6, 14)
        strength = None if k % 4 == 3 else rng.choice([3.0, 4.0, 6.0])
        out.append((prompt, max_tokens, strength, hf_reference(model_dir, prompt, max_tokens, strength)))
    steered = [c for c in out if c[2] is not None]
    differ = sum(want != hf_reference(model_dir, p, m, None) for p, m, _, want in steered)
    assert differ >= len(steered) // 2, "the rule changes too few outputs to test anything"
    return out


@SCHEDULINGS
def test_a_requests_own_processors_give_hfs_tokens(tiny_models, cases, options):
    llm = LLM(str(tiny_models["llama"]), dtype="float64", **{"num_kv_blocks": 128, **options})
    params = []
    for k, (_, max_tokens, strength, _) in enumerate(cases):
        procs: list = []
        if strength is not None:
            if k % 2:  # the three-argument form
                procs = [lambda p, o, row, s=strength: steer(p, o, row, s)]
            else:  # the two-argument form (the prompt closed over)
                prompt = cases[k][0]
                procs = [lambda o, row, p=prompt, s=strength: steer(p, o, row, s)]
        params.append(SamplingParams(max_tokens=max_tokens, temperature=0.0, logits_processors=procs))
    outs = llm.generate([p for p, *_ in cases], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want for *_, want in cases]
    if options.get("num_kv_blocks") == 10:
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("options", [{}, {"async_scheduling": True}], ids=["default", "async"])
def test_an_engine_processor_steers_the_rows_that_ask_and_leaves_the_rest(tiny_models, cases, options):
    llm = LLM(str(tiny_models["llama"]), dtype="float64", num_kv_blocks=128,
              logits_processors=["tests.test_logits_processors:Steer"], **options)
    params = [SamplingParams(max_tokens=m, temperature=0.0, extra_args=None if s is None else {"steer": s})
              for _, m, s, _ in cases]
    outs = llm.generate([p for p, *_ in cases], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want for *_, want in cases]


@pytest.mark.parametrize("options", [
    {}, {"max_num_batched_tokens": 16, "block_size": 4}, {"num_kv_blocks": 10, "block_size": 4},
    {"async_scheduling": True}, {"max_num_seqs": 3},
], ids=["default", "chunked-16", "preempt", "async", "three-seats"])
@pytest.mark.parametrize("kind", ["SteerV1", "SteerAdapter"])
def test_a_vllm_v1_processor_steers_as_vllms_persistent_batch_drives_it(tiny_models, cases, options, kind):
    llm = LLM(str(tiny_models["llama"]), dtype="float64", **{"num_kv_blocks": 128, **options},
              logits_processors=[f"tests.test_logits_processors:{kind}"])
    params = [SamplingParams(max_tokens=m, temperature=0.0, extra_args=None if s is None else {"steer": s})
              for _, m, s, _ in cases]
    outs = llm.generate([p for p, *_ in cases], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want for *_, want in cases]
    if options.get("num_kv_blocks") == 10:
        assert llm.engine.scheduler.num_preemptions > 0
    with pytest.raises(InvalidRequestError, match="steer must be a number"):  # validate_params
        llm.generate([[5, 6]], SamplingParams(max_tokens=2, extra_args={"steer": "strong"}), use_tqdm=False)
    with pytest.raises(ConfigError, match="speculative"):
        LLM(str(tiny_models["llama"]), num_kv_blocks=16, speculative_method="ngram",
            logits_processors=["tests.test_logits_processors:SteerV1"])


class Invariant:
    """Says it cannot change a greedy token; counts its calls (class-wide: the engine builds it)."""

    updates = 0
    applies = 0

    def __init__(self, vllm_config, device, is_pin_memory) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        Invariant.updates += batch_update is not None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        Invariant.applies += 1
        return logits


def test_an_argmax_invariant_processor_is_not_run_for_a_greedy_batch(tiny_models):
    llm = LLM(str(tiny_models["llama"]), num_kv_blocks=64, logits_processors=["tests.test_logits_processors:Invariant"])
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert Invariant.updates > 0 and Invariant.applies == 0
    llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(max_tokens=4, temperature=0.0),
                                       SamplingParams(max_tokens=4, temperature=0.8, seed=1)], use_tqdm=False)
    assert Invariant.applies > 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 9), max_size=7, unique=True), min_size=1, max_size=12))
def test_a_persistent_batchs_updates_put_each_steps_rows_in_their_slots(steps):
    """Applied as vLLM's processors apply them (removed, added, then each move in order: a
    swap, or a one-way move that empties its source), the updates leave slot i holding row i's
    sequence, and hand each sequence's output list over once while it stays in the batch."""
    from conveyor.config import EngineConfig
    from conveyor.logits_process import PersistentBatch

    batch = PersistentBatch(Invariant(None, None, False), EngineConfig(), torch.device("cpu"))
    slots: dict[int, int] = {}
    for keys in steps:
        rows = [LogitsRow(SamplingParams(), [1], [k], k) for k in keys]
        update = batch.update(rows)
        if update is None:
            assert {i: k for i, k in enumerate(keys)} == slots
            continue
        for i in update.removed:
            assert i in slots
            del slots[i]
        for i, _, _, out in update.added:
            assert i not in slots and out == [keys[[r.seq_id for r in rows].index(out[0])]]
            slots[i] = out[0]
        for a, b, how in update.moved:
            first, second = slots.pop(a, None), slots.pop(b, None)
            assert first is not None and (how.name == "SWAP") == (second is not None)
            slots[b] = first
            if second is not None:
                slots[a] = second
        assert slots == dict(enumerate(keys)) and update.batch_size == len(keys)


def test_logprobs_stay_the_raw_distributions(tiny_models):
    prompt = [5, 6, 7]
    plain = LLM(str(tiny_models["llama"]), num_kv_blocks=64)
    want = plain.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=3), use_tqdm=False)
    first = want[0].outputs[0].token_ids[0]

    def ban(out, row):
        row[first] = float("-inf")
        return row

    got = plain.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=3, logits_processors=[ban]),
                         use_tqdm=False)
    lp_want, lp_got = want[0].outputs[0].logprobs[0], got[0].outputs[0].logprobs[0]
    assert lp_got.token_id != first  # banned ...
    # ... and the top 3 reported as the model gave them, the banned token first
    assert [t for t, _ in lp_got.top] == [t for t, _ in lp_want.top] and lp_got.top[0][0] == first
    assert [v for _, v in lp_got.top] == pytest.approx([v for _, v in lp_want.top])


def test_bad_processors_are_refused_by_name(tiny_models):
    with pytest.raises(InvalidRequestError, match="logits_processors"):
        SamplingParams(logits_processors=[lambda row: row])
    with pytest.raises(InvalidRequestError, match="logits_processors"):
        SamplingParams(logits_processors=["not callable"])
    model = str(tiny_models["llama"])
    with pytest.raises(ConfigError, match="cannot be loaded"):
        LLM(model, num_kv_blocks=16, logits_processors=["tests.test_logits_processors:Nowhere"])
    with pytest.raises(ConfigError, match="not a subclass"):
        LLM(model, num_kv_blocks=16, logits_processors=["tests.test_logits_processors:steer"])
    with pytest.raises(ConfigError, match="module:Class"):
        LLM(model, num_kv_blocks=16, logits_processors=["Steer"])
