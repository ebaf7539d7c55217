"""Beam search over the engine (vLLM's `LLM.beam_search`, and `use_beam_search` over HTTP).

Beam search keeps, for each prompt, the `beam_width` continuations with the highest
log-probability so far. It runs on top of the engine, not inside the scheduler: each round,
every live beam of every prompt is one engine request (its prompt: the original prompt and
the beam's tokens) with `max_tokens=1` and the top `2 * beam_width` logprobs; the candidates
are each beam's extensions by those tokens, the best `beam_width` survive. A beam's K/V are
not kept between rounds: the prefix cache (on by default) gives back the full blocks every beam
shares with the prompt and with its own previous round, so a round computes the beams' last
partial block and the new token. The requests of a round are batched by the scheduler with
each other and with whatever else runs.

A beam that draws an end token is complete (with `ignore_eos` it goes on). The search ends
after `max_tokens` rounds, or when every prompt has `beam_width` complete beams that no live
beam can beat (a live beam's score only falls with length when `length_penalty` is 0; with
a length penalty, it runs to `max_tokens` or until no beam is live, as vLLM's does).
Beams are ranked by `cum_logprob / length ** length_penalty`, the length being the generated
tokens without a final end token (HF transformers' normalisation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.outputs import RequestOutput
from conveyor.sampling_params import InvalidRequestError, SamplingParams

MAX_BEAM_WIDTH = 10  # 2 * beam_width logprobs a round, and the engine gives at most 20


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        w = self.beam_width
        if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= MAX_BEAM_WIDTH:
            raise InvalidRequestError(f"beam_width={w!r}: must be an integer in [1, {MAX_BEAM_WIDTH}]",
                                      param="beam_width")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens={self.max_tokens!r}: must be an integer >= 1", param="max_tokens")

    def round_params(self) -> SamplingParams:
        """One round of one beam: its next token's top candidates."""
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * self.beam_width, ignore_eos=True,
                              output_kind="final_only", raw_logprobs=True)


@dataclass(slots=True)
class BeamSearchSequence:
    tokens: list[int]  # the prompt's, then the beam's
    logprobs: list[float]  # one per generated token
    cum_logprob: float = 0.0
    prompt_len: int = 0
    finished: bool = False  # it drew an end token
    text: str | None = None  # the generated tokens' text (set at the end, with a tokenizer)
    score: float = 0.0

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def finish_reason(self) -> str:
        return "stop" if self.finished else "length"


@dataclass(slots=True)
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def candidates(out: RequestOutput) -> list[tuple[int, float]]:
    """A beam's next tokens with their logprobs, best first (its one-token request's top k)."""
    entries = out.outputs[0].logprobs
    if not entries or entries[0].top is None:  # aborted
        raise RuntimeError(f"beam search: request {out.request_id} ended without its logprobs")
    return list(entries[0].top)


def beam_score(num_generated: int, cum_logprob: float, finished: bool, length_penalty: float) -> float:
    length = max(num_generated - (1 if finished else 0), 1)
    return cum_logprob / length**length_penalty


@dataclass
class BeamSearch:
    """One prompt's search: `beams` to extend this round, `advance` with each one's candidates."""

    prompt: list[int]
    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    beams: list[BeamSearchSequence] = field(init=False)
    completed: list[BeamSearchSequence] = field(default_factory=list)
    rounds: int = 0

    def __post_init__(self) -> None:
        self.beams = [BeamSearchSequence(list(self.prompt), [], 0.0, len(self.prompt))]

    @property
    def done(self) -> bool:
        if not self.beams or self.rounds >= self.params.max_tokens:
            return True
        p = self.params
        if p.length_penalty == 0 and len(self.completed) >= p.beam_width:
            # A live beam's score only falls: it cannot beat the beam_width-th completed one.
            worst = sorted(b.score for b in self.completed)[-p.beam_width]
            return max(b.cum_logprob for b in self.beams) <= worst
        return False

    def advance(self, candidates: list[list[tuple[int, float]]]) -> None:
        """`candidates[i]`: beam i's next tokens with their logprobs (the top 2 * beam_width)."""
        p = self.params
        live: list[BeamSearchSequence] = []
        for beam, options in zip(self.beams, candidates, strict=True):
            for token, logprob in options:
                cum = beam.cum_logprob + logprob
                ends = token in self.eos_token_ids and not p.ignore_eos
                new = BeamSearchSequence([*beam.tokens, token], [*beam.logprobs, logprob], cum, beam.prompt_len, ends)
                new.score = beam_score(len(new.logprobs), cum, ends, p.length_penalty)
                (self.completed if ends else live).append(new)
        self.rounds += 1
        # Ties keep the earlier beam's candidates first (a stable sort), as their order came.
        self.beams = sorted(live, key=lambda b: -b.score)[: p.beam_width]
        if self.rounds >= p.max_tokens:
            self.beams_final()

    def beams_final(self) -> None:
        self.completed.extend(self.beams)
        self.beams = []

    def result(self) -> BeamSearchOutput:
        if self.beams:
            self.beams_final()
        return BeamSearchOutput(sorted(self.completed, key=lambda b: -b.score)[: self.params.beam_width])
