"""Per-request generation parameters, validated at construction (before any work starts)."""

from __future__ import annotations

import dataclasses
import json as _json
from dataclasses import dataclass, field
from typing import Any


class InvalidRequestError(ValueError):
    """A request can never be served as asked; the message says which parameter and why.

    `param` names the offending field so an HTTP layer can report it (OpenAI's `param`).
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


OUTPUT_KINDS = ("cumulative", "delta", "final_only")


@dataclass(frozen=True)
class StructuredOutputParams:
    """What the output must match (vLLM's structured outputs): exactly one of a JSON Schema
    (`json`, a dict or its text), any JSON object (`json_object`), a regular expression
    (`regex`, matched whole, as `re.fullmatch`), one of several strings (`choice`) or a
    context-free grammar in GBNF (`grammar`, starting at its `root` rule), or a structural tag
    (`structural_tag`, xgrammar's as vLLM takes it: `{"structures": [{"begin", "schema",
    "end"}], "triggers": [...]}`; free text, but where a trigger is written the output goes on
    as one of the structures it begins, a JSON value of its schema between `begin` and `end`;
    or xgrammar's format tree, `{"format": {...}}`: conveyor/structured/structural_tag.py).

    `reasoning=(opening tag, closing tag)`: a thinking model's output may think first, and the
    grammar holds only its answer, as vLLM holds it under a reasoning parser. Any text up to
    the first closing tag is the thinking, when the output opens with the opening tag (after
    whitespace) or, with an empty opening tag, always (the template opened the block in the
    prompt); the newlines after the closing tag are dropped, and the rest must match. An output
    that does not open the block is all answer. The end of the output is allowed only where the
    answer matches, so an output cannot stop inside its thinking. `conveyor serve
    --reasoning-parser` sets it from the parser's tags (`("", "</think>")` for deepseek_r1,
    `("<think>", "</think>")` for qwen3), so that the parser returns the answer as `content`.

    Checked here (the pattern parsed, the schema converted), so a bad one fails before the
    request is queued; the engine compiles it against its vocabulary (`conveyor/structured`).
    """

    json: str | dict[str, object] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    json_object: bool = False
    grammar: str | None = None
    structural_tag: str | dict[str, object] | None = None
    reasoning: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        from conveyor.structured import GrammarError, check

        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.reasoning is not None:
            tags = self.reasoning
            if not isinstance(tags, tuple | list) or len(tags) != 2 or not all(isinstance(t, str) for t in tags) \
                    or not tags[1]:
                raise InvalidRequestError("reasoning must be (opening tag, closing tag): two strings, the closing "
                                          "one not empty", param="structured_outputs.reasoning")
            object.__setattr__(self, "reasoning", tuple(tags))
        for name in ("json", "structural_tag"):  # kept as text: frozen and hashable, the compile cache's key
            if isinstance(getattr(self, name), dict):
                object.__setattr__(self, name, _json.dumps(getattr(self, name)))
        given = [k for k in ("json", "regex", "choice", "grammar", "structural_tag") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidRequestError(
                "structured outputs need exactly one of json, json_object, regex, choice, grammar, structural_tag"
                + (f" (got {', '.join(given)})" if given else ""),
                param="structured_outputs",
            )
        try:
            check(self)
        except GrammarError as e:
            raise InvalidRequestError(f"structured outputs: {e}", param=f"structured_outputs.{given[0]}") from None

    @property
    def key(self) -> tuple[object, ...]:
        """What the compiled grammar is cached under."""
        after = () if self.reasoning is None else (("reasoning", *self.reasoning),)
        if self.json is not None:
            return ("json", self.json, *after)
        if self.regex is not None:
            return ("regex", self.regex, *after)
        if self.choice is not None:
            return ("choice", self.choice, *after)
        if self.grammar is not None:
            return ("grammar", self.grammar, *after)
        if self.structural_tag is not None:
            return ("structural_tag", self.structural_tag, *after)
        return ("json_object", True, *after)


POOLING_TYPES = ("last", "mean", "max", "cls", "all", "step")
POOLING_TASKS = ("embed", "classify")


@dataclass(frozen=True)
class PoolingParams:
    """An embedding instead of a completion (vLLM's pooling): the prompt's final hidden states
    (after the model's last norm) pooled into one vector.

    `pooling_type`: "last", the last prompt token's state (what a causal model's prompt ends
    in); "mean", the mean over every prompt token; "max", each value's maximum over every
    prompt token (sentence-transformers' max pooling); "cls", the first token's; "all", every
    prompt token's, one vector each (a token classifier's default); "step", the vectors of the
    prompt tokens equal to `step_tag_id` only, in order (vLLM's step pooling: a process reward
    model's scores at the end of each reasoning step); None (the
    default): the model's own (`ArchConfig.default_pooling`: sentence-transformers' pooling
    config where the model has one, else "last" for a decoder and "cls" for an encoder, as
    vLLM's defaults), filled in by the engine. `dimensions` keeps the first that many values
    (Matryoshka truncation, OpenAI's `dimensions`), before `normalize` scales the vector to
    unit L2 norm.

    `task="classify"` (a sequence classifier's model only): the pooled state goes through the
    model's classification head; the output is its classes' probabilities (softmax, or a
    sigmoid where there is one class: a cross-encoder's relevance), or the raw logits with
    `activation=False`. `normalize` and `dimensions` are the embeddings'.
    """

    pooling_type: str | None = None
    normalize: bool = True
    dimensions: int | None = None
    task: str = "embed"
    activation: bool = True
    step_tag_id: int | None = None  # pooling_type "step": the token that ends a step

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise InvalidRequestError(
                f"pooling_type={self.pooling_type!r}: must be one of {', '.join(POOLING_TYPES)}", param="pooling_type"
            )
        tag = self.step_tag_id
        if (self.pooling_type == "step") != (tag is not None) or (
                tag is not None and (isinstance(tag, bool) or not isinstance(tag, int) or tag < 0)):
            raise InvalidRequestError(f"step_tag_id={tag!r}: pooling_type 'step' needs a token id, and only it takes one",
                                      param="step_tag_id")
        if self.task not in POOLING_TASKS:
            raise InvalidRequestError(f"task={self.task!r}: must be one of {', '.join(POOLING_TASKS)}", param="task")
        if self.task == "classify" and self.dimensions is not None:
            raise InvalidRequestError("dimensions cuts an embedding; a classification has one value a class",
                                      param="dimensions")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise InvalidRequestError(f"dimensions={d!r}: must be an integer >= 1", param="dimensions")

    @property
    def whole_prompt(self) -> bool:
        """Whether every prompt position must be computed here (no prefix-cache hits)."""
        return self.pooling_type != "last"  # (None, not yet the model's: assume so)


@dataclass(frozen=True)
class WhisperRules:
    """Whisper's decoding rules (the logit filters of OpenAI's whisper and HF's Whisper
    `generate`), which `conveyor.transcribe` sets on its requests from the checkpoint's
    generation_config.json. `suppress`: never drawn; `begin_suppress`: not drawn first (the
    blank and the end). With `timestamp_begin` (the id of `<|0.00|>`; None: no timestamps), the
    output is segments between timestamp tokens: `<|notimestamps|>` (the id before it) is
    never drawn; the first token is a timestamp of at most `max_initial_timestamp` steps of
    20 ms; timestamps come in pairs (after a pair, text; after a lone one, another timestamp
    or the `end`) and never go back (a pair's second may equal its first, no later one);
    and where the timestamps together are likelier than the likeliest text token, a
    timestamp is drawn. Such a request's logprobs are those of the distribution after these
    rules (and any other mask), before temperature: OpenAI's whisper's, where others get the
    raw distribution's."""

    suppress: tuple[int, ...] = ()
    begin_suppress: tuple[int, ...] = ()
    timestamp_begin: int | None = None
    end: int = 0
    max_initial_timestamp: int | None = 50

    def bans(self, output: list[int], vocab: int) -> tuple[list[int], list[tuple[int, int]]]:
        """The tokens (ids, and [lo, hi) ranges) not drawn after `output`, the request's tokens
        so far."""
        ids = [*self.suppress, *(self.begin_suppress if not output else ())]
        begin = self.timestamp_begin
        if begin is None:
            return ids, []
        ids.append(begin - 1)
        if not output:
            last = begin + self.max_initial_timestamp + 1 if self.max_initial_timestamp is not None else vocab
            return ids, [(0, begin), (last, vocab)]
        ranges: list[tuple[int, int]] = []
        last_ts = output[-1] >= begin
        pair = len(output) < 2 or output[-2] >= begin
        if last_ts:
            ranges.append((begin, vocab) if pair else (0, self.end))
        stamps = [t for t in output if t >= begin]
        if stamps:
            ranges.append((begin, stamps[-1] + (0 if last_ts and not pair else 1)))
        return ids, ranges


@dataclass(frozen=True)
class SamplingParams:
    # Outputs per prompt (vLLM's n): the engine runs n sequences over the prompt (its K/V
    # computed once through the prefix cache) and gives one RequestOutput with n outputs;
    # choice i of a seeded request uses seed + i.
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's; k: plus the top k
    # The prompt's tokens' logprobs (vLLM's prompt_logprobs): None: none; 0: each prompt
    # token's own (and its rank); k: plus the top k at its position. The first token has none.
    # A request asking them computes its whole prompt (no prefix cache hit).
    prompt_logprobs: int | None = None
    # Keep only the prompt's last k tokens (vLLM's truncate_prompt_tokens); -1: as many as fit
    # (max_model_len - 1, room for one generated token; an embedding's may fill the context).
    truncate_prompt_tokens: int | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # What a streamed request's outputs hold (vLLM's RequestOutputKind): "cumulative", the
    # text, token ids and logprobs so far in each; "delta", only what is new since the
    # previous output (a stream of n tokens then costs O(n), not O(n^2)); "final_only", one
    # output, when the request ends (as a request that does not stream).
    output_kind: str = "cumulative"
    # scheduling hints (used by the queue policies)
    priority: int = 0
    expected_output_tokens: int | None = None
    tenant: str | None = None  # whose share the request counts against (policy "vtc"); the server's `user`
    # vLLM's cache_salt: the prefix cache chains the request's first block onto it, so only
    # requests given the same salt share cached K/V (a tenant's prompts cannot be probed by
    # another's timing). It should be secret and long enough to guess at no better than chance.
    cache_salt: str | None = None
    slo_ttft_ms: float | None = None  # this request's objectives (policy "slo"; default: the engine's)
    slo_tpot_ms: float | None = None
    # Constrained decoding: each token is drawn only from those that keep the output a
    # prefix of something the grammar accepts, and the end only where it accepts.
    structured_outputs: StructuredOutputParams | None = None
    # Added to the logits before the draw (OpenAI's logit_bias): token id -> bias in
    # [-100, 100]; -100 all but bans a token, 100 all but forces it.
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    # Only these tokens may be drawn (vLLM's allowed_token_ids); the end too only if listed.
    allowed_token_ids: tuple[int, ...] | None = None
    # Words never to write (vLLM's bad_words): each word's tokens, with and without a leading
    # space; the last token of one is masked wherever the output ends with the ones before it.
    bad_words: tuple[str, ...] = ()
    # An embedding request (`LLM.embed`, the server's /v1/embeddings): the engine pools the
    # prompt's hidden states and gives them as `RequestOutput.embedding`; no text is generated
    # (the one token its step samples is dropped). Made by `SamplingParams.for_pooling`.
    pooling: PoolingParams | None = None
    # Whisper's decoding rules (`WhisperRules`): set by conveyor.transcribe's requests.
    whisper: WhisperRules | None = None
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)
    # Custom logits processors of this request (conveyor/logits_process.py): callables
    # `fn(output_ids, logits)` or `fn(prompt_ids, output_ids, logits)` -> the row's logits.
    logits_processors: tuple[Any, ...] = field(default=(), compare=False, hash=False)
    # Arguments for the engine's own logits processors (vLLM's extra_args; the server's vllm_xargs).
    extra_args: dict[str, Any] | None = field(default=None, compare=False, hash=False)
    # The raw distribution's logprobs whatever the engine's logprobs_mode (a beam search's
    # rounds: its scores are log-probabilities).
    raw_logprobs: bool = False

    def __post_init__(self) -> None:
        # Accept lists / a single string for convenience; store tuples (frozen, hashable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.logit_bias is not None:  # a copy: the caller's dict may change after
            try:
                object.__setattr__(self, "logit_bias", dict(self.logit_bias))
            except (TypeError, ValueError):
                raise InvalidRequestError(
                    f"logit_bias={self.logit_bias!r}: must map token ids to biases", param="logit_bias"
                ) from None
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        elif not isinstance(self.bad_words, tuple):
            object.__setattr__(self, "bad_words", tuple(self.bad_words))
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, tuple):
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if callable(self.logits_processors):
            object.__setattr__(self, "logits_processors", (self.logits_processors,))
        elif not isinstance(self.logits_processors, tuple):
            object.__setattr__(self, "logits_processors", tuple(self.logits_processors))
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param}={getattr(self, param)!r}: {why}", param=param)

        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.logits_processors:
            from conveyor.logits_process import check_request_processor

            for fn in self.logits_processors:
                try:
                    check_request_processor(fn)
                except ValueError as e:
                    raise InvalidRequestError(f"logits_processors: {e}", param="logits_processors") from None
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise bad("extra_args", "must be a dict of the engine's logits processors' arguments")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise bad("cache_salt", "must be a non-empty string (or left out)")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < 0:
            raise bad("top_k", "must be >= 0 (0 or -1 turn it off)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0 (1 turns it off)")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.output_kind not in OUTPUT_KINDS:
            raise bad("output_kind", f"must be one of {', '.join(OUTPUT_KINDS)}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", "must be in [0, 20]")
        if self.prompt_logprobs is not None and (
            isinstance(self.prompt_logprobs, bool) or not isinstance(self.prompt_logprobs, int)
            or not 0 <= self.prompt_logprobs <= 20
        ):
            raise bad("prompt_logprobs", "must be an integer in [0, 20]")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or not (t == -1 or t >= 1)):
            raise bad("truncate_prompt_tokens", "must be -1 (as many as fit) or an integer >= 1")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be in [0, max_tokens={self.max_tokens}]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64
        ):
            raise bad("seed", "must be an integer in [-2**63, 2**64)")
        if self.expected_output_tokens is not None and self.expected_output_tokens < 0:
            raise bad("expected_output_tokens", "must be >= 0")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputParams):
                raise bad("structured_outputs", "must be a StructuredOutputParams")
            if self.ignore_eos:
                raise bad("ignore_eos", "cannot be combined with structured_outputs: the grammar ends the output with EOS")
        if self.logit_bias is not None:
            for token, bias in self.logit_bias.items():
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    raise bad("logit_bias", f"key {token!r} is not a token id (an integer >= 0)")
                if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
                    raise bad("logit_bias", f"the bias of token {token} must be a number in [-100, 100]")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids
            or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)
        ):
            raise bad("allowed_token_ids", "must be a non-empty list of token ids (integers >= 0)")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise bad("bad_words", "must be words: non-empty strings")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float) and value > 0):
                raise bad(name, "must be > 0 (milliseconds)")
        if self.whisper is not None and not isinstance(self.whisper, WhisperRules):
            raise bad("whisper", "must be a WhisperRules")
        if self.pooling is not None:
            if not isinstance(self.pooling, PoolingParams):
                raise bad("pooling", "must be a PoolingParams")
            clash = [name for name, ok in (
                ("n", self.n == 1), ("max_tokens", self.max_tokens == 1), ("logprobs", self.logprobs is None),
                ("prompt_logprobs", self.prompt_logprobs is None), ("structured_outputs", self.structured_outputs is None),
            ) if not ok]
            if clash:
                raise bad(clash[0], "an embedding request generates nothing: use SamplingParams.for_pooling")

    @classmethod
    def for_pooling(cls, pooling: PoolingParams | None = None, priority: int = 0,
                    tenant: str | None = None) -> SamplingParams:
        """The parameters of an embedding request: the prompt's pooled hidden states, no text."""
        return cls(max_tokens=1, temperature=0.0, output_kind="final_only", priority=priority, tenant=tenant,
                   pooling=pooling or PoolingParams())

    def choices(self) -> list[SamplingParams]:
        """The parameters of each of n choices, run as requests of one choice (vLLM's parallel
        sampling): choice i of a seeded request uses seed + i; the first alone computes the
        prompt's logprobs."""
        return [
            dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + i,
                                prompt_logprobs=self.prompt_logprobs if i == 0 else None)
            for i in range(self.n)
        ]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def shapes_logits(self) -> bool:
        """Whether the runner masks or biases this request's logits (structured outputs,
        logit_bias, allowed_token_ids, min_tokens' ban on the end, bad_words)."""
        return (
            self.structured_outputs is not None
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or self.min_tokens > 0
            or bool(self.bad_words)
            or self.whisper is not None
        )

    @property
    def needs_history(self) -> bool:
        """Whether the runner gives this request's rows their tokens (penalties, its own logits
        processors)."""
        return self.needs_penalties or bool(self.logits_processors)

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
