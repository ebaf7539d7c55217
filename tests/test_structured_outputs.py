"""Structured outputs on real models.

The reference is HF transformers' greedy `generate` on the same weights (float64) with a
logits processor written independently of conveyor's automata: a token is allowed when the
`regex` module says the text with the token's decoded text appended can still match the
pattern (`partial=True`), the end when the text matches whole. Greedy tokens must be equal,
under every scheduling that changes how a sequence's tokens reach the sampler.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import regex
import torch

from conveyor import LLM, InvalidRequestError, SamplingParams, StructuredOutputParams
from tests.schedulings import SCHEDULINGS
from tests.structured.tiny_tokenizer import with_tokenizer

# Patterns of ASCII characters the tokenizer spells in whole tokens (a negated class would
# also take a lone byte of a multi-byte character, which the reference decodes as U+FFFD).
PATTERNS = [
    r"(cat|dog|bird)s? [0-9]{1,3}",
    r"\{\"name\": \"[a-z]{1,8}\", \"age\": [1-9][0-9]?\}",
    r"(yes|no|maybe)",
    r"[a-z ]{4,30}!",
    r"-?(0|[1-9][0-9]*)(\.[0-9]+)?",
]
PROMPTS = ["the cat", "hello world", '{"name": ', "12 345", "yes no", "abc xyz dogs", "0.5", "the"]


@pytest.fixture(scope="module")
def model_dir(tiny_models, tmp_path_factory):
    return str(with_tokenizer(tiny_models["llama"], tmp_path_factory.mktemp("structured") / "llama"))


def hf_reference(model_dir: str, prompt_ids: list[int], allows: Any, ends: Any, max_new_tokens: int) -> list[int]:
    """HF's greedy tokens (float64) under a reference logits processor: a token is allowed when
    `allows(text, piece)` says so of the output's decoded text and the token's, the end when
    `ends(text)` does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    vocab = model.config.vocab_size
    pieces = [tok.decode([i]) if i < len(tok) and i not in tok.all_special_ids else None for i in range(vocab)]
    n = len(prompt_ids)

    class Reference(LogitsProcessor):
        def __call__(self, input_ids, scores):
            text = tok.decode(input_ids[0, n:].tolist())
            allowed = torch.tensor([bool(piece) and allows(text, piece) for piece in pieces])
            allowed[tok.eos_token_id] = ends(text)
            return scores.masked_fill(~allowed, float("-inf"))

    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=tok.eos_token_id, pad_token_id=0, logits_processor=[Reference()],
    )
    return out[0, n:].tolist()


def hf_constrained(model_dir: str, prompt_ids: list[int], pattern: str, max_new_tokens: int) -> list[int]:
    return hf_reference(model_dir, prompt_ids, lambda text, piece: regex.fullmatch(pattern, text + piece, partial=True) is not None,
                        lambda text: regex.fullmatch(pattern, text) is not None, max_new_tokens)


def greedy_as_hf(model_dir: str, options: dict, prompts: list[list[int]], specs: list[StructuredOutputParams],
                 max_tokens: list[int], wants: list[list[int]]) -> list[Any]:
    """conveyor's greedy outputs of `prompts` under `specs`, each equal to HF's tokens `wants`."""
    llm = LLM(model_dir, dtype="float64", **{"num_kv_blocks": 128, **options})
    params = [SamplingParams(max_tokens=m, temperature=0.0, structured_outputs=spec)
              for spec, m in zip(specs, max_tokens, strict=True)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == wants
    if options.get("num_kv_blocks") == 10:
        assert llm.engine.scheduler.num_preemptions > 0
    return outs


# Context-free grammars (GBNF) and the same languages as `regex` recursive patterns, the
# reference's independent recognizer.
GRAMMARS = [
    (
        'root ::= "[" list ( ", " item )* "]"\nlist ::= "[" ( item ( ", " item )* )? "]"\n'
        'item ::= [0-9]{1,3} | list | "\\"" [a-z]{1,6} "\\""',
        r'\[(?&l)(?:, (?&i))*\](?(DEFINE)(?P<l>\[(?:(?&i)(?:, (?&i))*)?\])(?P<i>[0-9]{1,3}|(?&l)|"[a-z]{1,6}"))',
    ),
    (
        'root ::= "{\\"a\\": " obj "}"\nobj ::= "{" ( pair ( ", " pair )* )? "}"\npair ::= "\\"" [a-z]{1,8} "\\": " val\n'
        'val ::= obj | [0-9]{1,3} | "true" | "null" | "[" ( val ( ", " val )* )? "]"',
        r'\{"a": (?&o)\}(?(DEFINE)(?P<o>\{(?:(?&p)(?:, (?&p))*)?\})(?P<p>"[a-z]{1,8}": (?&v))'
        r'(?P<v>(?&o)|[0-9]{1,3}|true|null|\[(?:(?&v)(?:, (?&v))*)?\]))',
    ),
    (
        'root ::= "(" expr ") * " term\nexpr ::= term ( ( " + " | " - " ) term )*\nterm ::= [0-9]{1,2} | "(" expr ")"',
        r'\((?&e)\) \* (?&t)(?(DEFINE)(?P<e>(?&t)(?: [+-] (?&t))*)(?P<t>[0-9]{1,2}|\((?&e)\)))',
    ),
]


@pytest.fixture(scope="module")
def grammar_cases(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(2)
    out = []
    for gbnf, pattern in GRAMMARS * 2:
        ids = tok.encode(rng.choice(PROMPTS))
        max_tokens = rng.randint(12, 28)
        out.append((ids, gbnf, pattern, max_tokens, hf_constrained(model_dir, ids, pattern, max_tokens)))
    return out


@SCHEDULINGS
def test_greedy_tokens_under_a_grammar_equal_hf_with_a_reference_processor(model_dir, grammar_cases, options):
    outs = greedy_as_hf(model_dir, options, [ids for ids, *_ in grammar_cases],
                        [StructuredOutputParams(grammar=g) for _, g, *_ in grammar_cases],
                        [m for *_, m, _ in grammar_cases], [want for *_, want in grammar_cases])
    nested = 0
    for o, (_, _, pattern, _, _) in zip(outs, grammar_cases, strict=True):
        text = o.outputs[0].text
        assert regex.fullmatch(pattern, text, partial=o.outputs[0].finish_reason != "stop"), text
        nested += max(text.count("["), text.count("{"), text.count("(")) >= 2 + (text[0] == "(")
    assert nested >= 3, "few outputs nested: the stack was barely tested"


@pytest.fixture(scope="module")
def cases(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(0)
    out = []
    for i, pattern in enumerate(PATTERNS * 2):
        ids = tok.encode(rng.choice(PROMPTS))
        max_tokens = rng.randint(8, 24)
        out.append((ids, pattern, max_tokens, hf_constrained(model_dir, ids, pattern, max_tokens)))
        assert i >= len(PATTERNS) or regex.fullmatch(pattern, tok.decode(out[-1][3], skip_special_tokens=True)) \
            or len(out[-1][3]) == max_tokens
    return out


@SCHEDULINGS
def test_greedy_tokens_equal_hf_with_a_reference_processor(model_dir, cases, options):
    outs = greedy_as_hf(model_dir, options, [ids for ids, *_ in cases], [StructuredOutputParams(regex=p) for _, p, *_ in cases],
                        [m for *_, m, _ in cases], [want for *_, want in cases])
    finished = [o for o in outs if o.outputs[0].finish_reason == "stop"]
    assert finished, "no output reached the end of its pattern: nothing was tested"
    for o, (_, pattern, _, _) in zip(outs, cases, strict=True):
        if o.outputs[0].finish_reason == "stop":
            assert regex.fullmatch(pattern, o.outputs[0].text)


def answer_allowed(text: str, pattern: str, opening: str, closing: str, whole: bool) -> bool:
    """The reference for a grammar after a thinking block, written from the reasoning parsers'
    documented reading: whether `text` is (`whole`) or can still become an output whose answer
    matches `pattern`."""
    rest = text
    if opening:
        stripped = text.lstrip(" \t\n\r")
        if stripped.startswith(opening):
            rest = stripped[len(opening):]
        elif not whole and opening.startswith(stripped):
            return True  # it may still open the block
        else:
            return regex.fullmatch(pattern, text, partial=not whole) is not None  # all answer
    end = rest.find(closing)
    if end < 0:
        return not whole  # thinking: anything may follow, but it may not end here
    return regex.fullmatch(pattern, rest[end + len(closing):].lstrip("\n"), partial=not whole) is not None


def hf_thinking(model_dir: str, prompt_ids: list[int], pattern: str | None, tags: tuple[str, str],
                max_new_tokens: int) -> list[int]:
    """HF's greedy tokens under `answer_allowed` (with no pattern: only the end is masked)."""
    return hf_reference(
        model_dir, prompt_ids,
        lambda text, piece: pattern is None or answer_allowed(text + piece, pattern, *tags, whole=False),
        lambda text: pattern is not None and answer_allowed(text, pattern, *tags, whole=True), max_new_tokens)


@pytest.fixture(scope="module")
def thinking_cases(model_dir):
    """A random model never writes `</think>`, so each case takes its tags from the model's own
    free greedy text: the closing tag is the text of two of its tokens (the free part then ends
    where the model writes them), the opening tag, where a case has one, its first token's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(3)
    out = []
    for k, prompt in enumerate(PROMPTS + [p + " " + q for p, q in zip(PROMPTS, reversed(PROMPTS), strict=True)]):
        if len(out) == 6:
            break
        ids = tok.encode(prompt)
        free = hf_thinking(model_dir, ids, None, ("", ""), 14)
        texts = [tok.decode([t]) for t in free]
        spans = [i for i in range(1, len(free) - 1)
                 if all(t.isascii() and t.strip() and t.isprintable() for t in texts[i: i + 2])]
        if not spans or not texts[0].isascii() or not texts[0].strip() or texts[0] != texts[0].lstrip():
            continue
        i = rng.choice(spans)
        closing = texts[i] + texts[i + 1]
        opening = texts[0] if k % 2 and texts[0] not in closing else ""
        pattern = PATTERNS[k % len(PATTERNS)]
        out.append((ids, pattern, (opening, closing), 26, hf_thinking(model_dir, ids, pattern, (opening, closing), 26)))
    assert len(out) >= 4 and any(c[2][0] for c in out)
    return out


@SCHEDULINGS
def test_greedy_tokens_after_a_thinking_block_equal_hf_with_a_reference_processor(model_dir, thinking_cases, options):
    """`reasoning=(opening, closing)`: free text (but no end) until the closing tag, the pattern
    after it; the same greedy tokens as HF under a reference processor."""
    outs = greedy_as_hf(model_dir, options, [ids for ids, *_ in thinking_cases],
                        [StructuredOutputParams(regex=p, reasoning=tags) for _, p, tags, *_ in thinking_cases],
                        [m for *_, m, _ in thinking_cases], [want for *_, want in thinking_cases])
    answered = 0
    for o, (_, pattern, (opening, closing), _, _) in zip(outs, thinking_cases, strict=True):
        c = o.outputs[0]
        assert answer_allowed(c.text, pattern, opening, closing, whole=c.finish_reason == "stop"), c.text
        answered += c.finish_reason == "stop"
    assert answered >= 2, "few outputs reached the end of their answer: the part after the block was barely tested"


def hf_tagged(model_dir: str, prompt_ids: list[int], spec: dict, max_new_tokens: int) -> list[int]:
    """HF's greedy tokens under a structural tag, allowed by `tag_ok`, a scanner written from
    the definition (tests/structured/test_structural_tag.py)."""
    from tests.structured.test_structural_tag import tag_ok

    return hf_reference(model_dir, prompt_ids, lambda text, piece: tag_ok(text + piece, spec, whole=False),
                        lambda text: tag_ok(text, spec), max_new_tokens)


@pytest.fixture(scope="module")
def tagged_cases(model_dir):
    """The trigger of each case is the text of two tokens the model writes unconstrained (a
    random model writes no tag of its own), its structure a choice or an integer; free text
    resumes after the structure's end, so a repetitive model triggers it again."""
    from transformers import AutoTokenizer

    from tests.structured.test_structural_tag import ENUM, INTEGER

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(4)
    out = []
    for k, prompt in enumerate(PROMPTS):
        ids = tok.encode(prompt)
        free = hf_thinking(model_dir, ids, None, ("", ""), 10)
        texts = [tok.decode([t]) for t in free]
        spans = [i for i in range(len(free) - 1) if all(t.isascii() and t.strip() and t.isprintable() for t in texts[i: i + 2])]
        if not spans:
            continue
        i = rng.choice(spans)
        trigger = texts[i] + texts[i + 1]
        schema = (ENUM, INTEGER)[k % 2][0]
        spec = {"structures": [{"begin": trigger + "=", "schema": schema, "end": ";"}], "triggers": [trigger]}
        out.append((ids, spec, 30, hf_tagged(model_dir, ids, spec, 30)))
    assert len(out) >= 4
    return out


@SCHEDULINGS
def test_greedy_tokens_under_a_structural_tag_equal_hf_with_a_reference_processor(model_dir, tagged_cases, options):
    outs = greedy_as_hf(model_dir, options, [ids for ids, *_ in tagged_cases],
                        [StructuredOutputParams(structural_tag=spec) for _, spec, *_ in tagged_cases],
                        [m for *_, m, _ in tagged_cases], [want for *_, want in tagged_cases])
    tagged = sum(o.outputs[0].text.count(spec["structures"][0]["end"]) for o, (_, spec, _, _) in zip(outs, tagged_cases, strict=True))
    assert tagged >= 3, "few structures were written: the part after a trigger was barely tested"


def test_the_format_tree_shape_runs_as_the_first_shape_does(model_dir, tagged_cases):
    """The same structural tags written as xgrammar's format tree (`triggered_tags` of `tag`s
    holding a `json_schema`): the engine's greedy tokens are HF's under the first shape's
    reference processor."""
    def tree(spec: dict) -> dict:
        tags = [{"type": "tag", "begin": s["begin"], "content": {"type": "json_schema", "json_schema": s["schema"]},
                 "end": s["end"]} for s in spec["structures"]]
        return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": spec["triggers"], "tags": tags}}

    greedy_as_hf(model_dir, {}, [ids for ids, *_ in tagged_cases],
                 [StructuredOutputParams(structural_tag=tree(spec)) for _, spec, *_ in tagged_cases],
                 [m for *_, m, _ in tagged_cases], [want for *_, want in tagged_cases])


def test_sampled_outputs_match_their_grammar_whatever_the_batch(model_dir):
    """Sampling at temperature 1.5 with mixed constrained and free requests in one batch:
    every constrained output that ends is in its language, and every one that runs out of
    tokens is a prefix of something in it."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
              "required": ["n", "ok"]}
    specs = [StructuredOutputParams(json=schema), StructuredOutputParams(choice=("cat", "dog", "bird")),
             StructuredOutputParams(regex=r"[a-z]{2,5}( [a-z]{2,5}){1,3}\."), None]
    llm = LLM(model_dir, dtype="float64", num_kv_blocks=64, block_size=4)
    rng = random.Random(1)
    chosen = [rng.choice(specs) for _ in range(40)]
    params = [SamplingParams(max_tokens=60, temperature=1.5, seed=i, structured_outputs=s)
              for i, s in enumerate(chosen)]
    outs = llm.generate([rng.choice(PROMPTS) for _ in chosen], params, use_tqdm=False)
    ended = 0
    for o, spec in zip(outs, chosen, strict=True):
        c = o.outputs[0]
        if spec is None:
            continue
        text = c.text
        if spec.json is not None:
            if c.finish_reason == "stop":
                value = json.loads(text)
                assert isinstance(value["n"], int) and isinstance(value["ok"], bool)
                assert set(value) <= {"n", "ok", "tags"} and set(value.get("tags", [])) <= {"a", "b"}
        elif spec.choice is not None:
            assert c.finish_reason != "stop" or text in spec.choice
        else:
            assert regex.fullmatch(spec.regex, text, partial=c.finish_reason != "stop")
        ended += c.finish_reason == "stop"
    assert ended >= 10


def test_bad_grammars_are_refused_and_the_engine_serves_on(model_dir):
    llm = LLM(model_dir, dtype="float64", num_kv_blocks=64)
    with pytest.raises(InvalidRequestError, match="lookaround"):
        SamplingParams(structured_outputs=StructuredOutputParams(regex="a(?=b)"))
    with pytest.raises(InvalidRequestError, match="not supported: patternProperties"):
        StructuredOutputParams(json={"type": "object", "patternProperties": {}})
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputParams(regex="a", choice=("a",))
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputParams(choice=("a",)))
    with pytest.raises(InvalidRequestError, match="too large"):
        llm.generate(["the"], SamplingParams(structured_outputs=StructuredOutputParams(regex="[a-z]{1,3000}x{1,3000}")),
                     use_tqdm=False)
    out = llm.generate(["the"], SamplingParams(max_tokens=8, temperature=0,
                                               structured_outputs=StructuredOutputParams(choice=("cat", "dog"))),
                       use_tqdm=False)
    assert out[0].outputs[0].text in ("cat", "dog")


def test_an_engine_without_a_tokenizer_refuses_structured_outputs(tiny_models):
    llm = LLM(str(tiny_models["llama"]), dtype="float64", num_kv_blocks=32)
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        llm.generate([[5, 6, 7]], SamplingParams(structured_outputs=StructuredOutputParams(choice=("a",))),
                     use_tqdm=False)


@pytest.mark.slow
def test_smollm2_answers_in_the_schema(smollm2):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0},
            "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            "employed": {"type": "boolean"},
        },
        "required": ["name", "age", "employed"],
    }
    llm = LLM(smollm2)
    questions = ["Describe a fictional software engineer as JSON.", "Invent a person and give their details in JSON.",
                 "Who are you? Reply in JSON."]
    params = SamplingParams(max_tokens=120, temperature=0.0, structured_outputs=StructuredOutputParams(json=schema))
    outs = llm.chat([[{"role": "user", "content": q}] for q in questions], params, use_tqdm=False)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        jsonschema.validate(json.loads(o.outputs[0].text), schema)
    choice = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputParams(choice=("yes", "no")))
    out = llm.chat([[{"role": "user", "content": "Is water wet? Answer yes or no."}]], choice, use_tqdm=False)
    assert out[0].outputs[0].text in ("yes", "no")
