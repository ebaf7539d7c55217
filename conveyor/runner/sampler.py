"""Sampling: per-request parameters turned into tensors once per step, then one batched pass.

Order of operations (as in vLLM): custom logits processors on the raw logits (the engine's,
then the request's own: conveyor/logits_process.py), then penalties, then logit_bias, then the
mask (structured outputs, allowed_token_ids, bad_words, min_tokens' held-back ends, Whisper's
rules), then Whisper's choice of a timestamp over text, then temperature, then top-k / top-p /
min-p filtering, then a draw. Greedy rows take the argmax of the penalised, biased and masked
logits. A draw is `argmax(probs / E)` with `E ~ Exponential(1)` per vocabulary entry, which
samples exactly from `probs`; each seeded request draws its `E` from its own generator, so the
same seed gives the same tokens whatever else shares the batch.
Logprobs are those of the model's raw distribution (before penalties and temperature), but a
Whisper request's (`WhisperRules`): of the distribution after the mask and the rules, before
temperature, as OpenAI's whisper scores its decodes. The engine's `logprobs_mode` (vLLM's) may
ask instead for the raw logits, or for the processed distribution a row was drawn from (after
every processor, penalty, bias, mask, temperature and top-k / top-p / min-p filter; a greedy
row's before temperature and filters, which it does not use) as log-probabilities or logits.
A row whose request says `raw_logprobs` (a beam search's rounds) keeps the raw
log-probabilities whatever the mode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from conveyor.logits_process import LogitsProcessor, LogitsRow, apply_processors
from conveyor.models.attention import host_longs, to_device
from conveyor.sampling_params import SamplingParams

TopLogprobs = list[tuple[int, float]]


@dataclass(slots=True)
class SamplingBatch:
    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    history: list[list[int]]  # prompt + output tokens so far, per row (penalties)
    prompt_lens: list[int]
    all_greedy: bool
    any_penalty: bool
    max_logprobs: int | None  # None: no row wants logprobs
    # [rows, vocab] bool, the tokens each row may draw (None: any): structured outputs,
    # allowed_token_ids, bad_words, min_tokens
    allowed: torch.Tensor | None = None
    # logit_bias: [rows, vocab] float, added to the logits (None: no row has any)
    bias: torch.Tensor | None = None
    # A seeded row i takes the noise row noise_from[i] drew (< i; a token tree's row: the first
    # row at its depth's), not a draw of its own (None: every row draws).
    noise_from: list[int] | None = None
    # Whisper's timestamps (`WhisperRules`): the first timestamp token (one model, one id) and
    # the rows that have them (`[rows]` bool); None: no row has any.
    timestamps: tuple[int, torch.Tensor] | None = None
    # Rows whose logprobs are of the distribution they were drawn from after the mask and
    # Whisper's rules, before temperature (`[rows]` bool: Whisper's requests, OpenAI's
    # whisper's logprobs); None: every row's are the raw distribution's.
    processed: torch.Tensor | None = None
    # Custom logits processors (conveyor/logits_process.py): each row's request and tokens, and
    # the engine's processors (None: no row is processed).
    rows: list[LogitsRow] | None = None
    processors: Sequence[LogitsProcessor] = ()
    # What the logprobs hold (the engine's logprobs_mode): raw_logprobs, raw_logits,
    # processed_logprobs or processed_logits.
    logprobs_mode: str = "raw_logprobs"


def prepare(
    params: list[SamplingParams],
    prompt_lens: list[int],
    generators: list[torch.Generator | None] | None = None,
    history: list[list[int]] | None = None,
) -> SamplingBatch:
    """A step's rows; no generators means none seeded, no history means no penalties (the
    runner builds them only for a batch that needs them)."""
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingBatch(
        params=params,
        generators=generators if generators is not None else [None] * len(params),
        history=history if history is not None else [[]] * len(params),  # read only where penalised
        prompt_lens=prompt_lens,
        all_greedy=all(p.greedy for p in params),
        any_penalty=any(p.needs_penalties for p in params),
        max_logprobs=max(wanted) if wanted else None,
    )


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._argmax: Callable[[torch.Tensor], torch.Tensor] | None = None
        if device.type == "cpu":
            from conveyor.kernels import argmax

            self._argmax = argmax()  # torch's argmax over [64, 32000] takes ~2 ms here, the kernel ~0.2
        self._cuda_argmax: Callable[..., torch.Tensor] | None = None
        if device.type == "cuda":
            from conveyor.kernels import triton_fused

            if triton_fused.enabled():  # CONVEYOR_TRITON_FUSED=1
                self._cuda_argmax = triton_fused.argmax

    def greedy(self, logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's argmax (the first index of a tie), into `out` if given: what a greedy
        step samples. Launches only device work, so a CUDA graph can capture it."""
        if self._argmax is not None and logits.dtype == torch.float32 and logits.device.type == "cpu":
            tokens = self._argmax(logits)
            return tokens if out is None else out.copy_(tokens)
        if self._cuda_argmax is not None and logits.is_cuda:
            return self._cuda_argmax(logits, out=out)
        if out is None:
            return logits.argmax(dim=-1)
        return torch.argmax(logits, dim=-1, out=out)

    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch
    ) -> tuple[list[int], list[tuple[float, TopLogprobs | None]] | None]:
        """`logits` is `[rows, vocab]` in the model's dtype. Returns token ids and, if asked, logprobs."""
        tokens, logprobs = self.sample(logits, batch)
        return tokens.tolist(), logprobs

    def sample(
        self, logits: torch.Tensor, batch: SamplingBatch
    ) -> tuple[torch.Tensor, list[tuple[float, TopLogprobs | None]] | None]:
        """The sampled ids as a tensor on the logits' device, and the logprobs if asked.

        Without logprobs nothing here waits for the device: the caller copies the ids to the
        host when it needs them (the one sync of a step). A step that only takes an argmax
        reads the logits in the model's dtype (the same index); anything else in float32."""
        tokens, logprobs, _ = self.sample_with_probs(logits, batch)
        return tokens, logprobs

    def sample_with_probs(
        self, logits: torch.Tensor, batch: SamplingBatch
    ) -> tuple[torch.Tensor, list[tuple[float, TopLogprobs | None]] | None, torch.Tensor | None]:
        """`sample`, and the distributions the rows were drawn from (`[rows, vocab]` float32,
        after penalties, bias, mask, temperature and top-k / top-p / min-p; None for an
        all-greedy batch): speculative sampling's target rows (`ModelRunner._verify`)."""
        if not (batch.all_greedy and not batch.any_penalty and batch.max_logprobs is None and batch.bias is None
                and batch.timestamps is None and batch.rows is None):
            logits = logits.float()
        raw = logits
        if batch.rows is not None:
            logits = apply_processors(logits.clone(), batch.rows, batch.processors)
        if batch.any_penalty:
            logits = self._apply_penalties(logits if batch.rows is not None else logits.clone(), batch)
        if batch.bias is not None:
            logits = logits + batch.bias
        if batch.allowed is not None:
            logits = logits.masked_fill(~batch.allowed, float("-inf"))
        if batch.timestamps is not None:
            logits = self._timestamp_or_text(logits if batch.allowed is not None else logits.clone(), *batch.timestamps)
        final = None  # the sampled rows' logits after temperature and filters
        if batch.all_greedy:
            tokens, probs = self.greedy(logits), None
        else:
            tokens, probs, final = self._sample(logits, batch)
        if batch.max_logprobs is None:
            return tokens, None, probs
        mode = batch.logprobs_mode
        if mode == "raw_logprobs":
            if batch.processed is not None:
                raw = torch.where(batch.processed[:, None], logits, raw)
            return tokens, self._logprobs(torch.log_softmax(raw.float(), dim=-1), tokens, batch), probs
        processed = logits
        if final is not None:
            greedy = to_device(torch.tensor([p.greedy for p in batch.params]), logits.device)
            processed = torch.where(greedy[:, None], logits, final)
        values = {"raw_logits": raw.float(), "processed_logits": processed,
                  "processed_logprobs": torch.log_softmax(processed, dim=-1)}[mode]
        if any(p.raw_logprobs for p in batch.params):
            keep = to_device(torch.tensor([p.raw_logprobs for p in batch.params]), logits.device)
            values = torch.where(keep[:, None], torch.log_softmax(raw.float(), dim=-1), values)
        return tokens, self._logprobs(values, tokens, batch), probs

    # -- steps ---------------------------------------------------------------------------
    @staticmethod
    def _timestamp_or_text(logits: torch.Tensor, begin: int, rows: torch.Tensor) -> torch.Tensor:
        """Whisper's last rule, in place: each of `rows` whose timestamp tokens (ids from `begin`
        on) are together likelier than its likeliest text token draws a timestamp (its text
        masked)."""
        force = (logits[:, begin:].logsumexp(dim=-1) > logits[:, :begin].amax(dim=-1)) & rows
        logits[:, :begin].masked_fill_(force[:, None], float("-inf"))
        return logits

    def _apply_penalties(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        vocab = logits.shape[1]
        for row, p in enumerate(batch.params):
            if not p.needs_penalties:
                continue
            hist = batch.history[row]
            if p.repetition_penalty != 1.0 and hist:
                ids = torch.tensor(sorted(set(hist)), dtype=torch.long, device=logits.device)
                ids = ids[ids < vocab]
                vals = logits[row, ids]
                logits[row, ids] = torch.where(
                    vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
                )
            out = hist[batch.prompt_lens[row] :]
            if out and (p.presence_penalty or p.frequency_penalty):
                counts = torch.bincount(
                    torch.tensor(out, dtype=torch.long, device=logits.device), minlength=vocab
                )[:vocab].to(logits.dtype)
                logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(
                    logits.dtype
                )
        return logits

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _rows, vocab = logits.shape
        dev = logits.device
        params = batch.params
        greedy = to_device(torch.tensor([p.greedy for p in params]), dev)
        temps = to_device(torch.tensor([p.temperature if not p.greedy else 1.0 for p in params]), dev)
        scaled = logits / temps[:, None]

        top_k = [p.top_k for p in params if not p.greedy]
        top_p = [p.top_p for p in params if not p.greedy]
        if any(k > 0 for k in top_k) or any(tp < 1.0 for tp in top_p):
            scaled = self._top_k_top_p(scaled, params)
        probs = torch.softmax(scaled, dim=-1)
        if any(p.min_p > 0 for p in params):  # decided on the host: no sync
            min_ps = to_device(torch.tensor([p.min_p for p in params]), dev)
            floor = probs.max(dim=-1, keepdim=True).values * min_ps[:, None]
            dropped = probs < floor
            probs = torch.where(dropped, torch.zeros_like(probs), probs)
            if batch.max_logprobs is not None and batch.logprobs_mode.startswith("processed"):
                scaled = scaled.masked_fill(dropped, float("-inf"))

        noise = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(batch.generators) if g is None]
        if unseeded:
            block = torch.empty((len(unseeded), vocab), device=dev).exponential_(generator=self.generator)
            if len(unseeded) == len(params):
                noise = block.to(noise.dtype)
            else:  # rows by an index on the device: a list index would copy it there and wait
                noise[to_device(host_longs(unseeded), dev)] = block.to(noise.dtype)
        shared = batch.noise_from
        for i, g in enumerate(batch.generators):
            if g is not None:
                if shared is not None and shared[i] != i:
                    noise[i] = noise[shared[i]]
                else:
                    noise[i] = torch.empty(vocab, device=dev).exponential_(generator=g).to(noise.dtype)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, self.greedy(logits), sampled), probs, scaled

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        dev = logits.device
        vocab = logits.shape[1]
        ks = to_device(torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params]), dev)
        ps = to_device(torch.tensor([p.top_p for p in params], dtype=logits.dtype), dev)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=dev)[None, :]
        drop = ranks >= ks[:, None]
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each entry
        drop |= before >= ps[:, None]
        drop[:, 0] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)

    @staticmethod
    def _logprobs(
        logp: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch
    ) -> list[tuple[float, TopLogprobs | None]]:
        """Each row's sampled token's value and its top k, from `logp` (log-probabilities, or
        logits under a `*_logits` mode)."""
        chosen = logp.gather(1, tokens[:, None]).squeeze(1).tolist()
        k = batch.max_logprobs or 0
        top_vals, top_ids = (logp.topk(k, dim=-1) if k > 0 else (None, None))
        result: list[tuple[float, TopLogprobs | None]] = []
        for row, p in enumerate(batch.params):
            if p.logprobs is None:
                result.append((chosen[row], None))
                continue
            top: TopLogprobs | None = None
            if p.logprobs > 0 and top_ids is not None and top_vals is not None:
                top = list(
                    zip(top_ids[row, : p.logprobs].tolist(), top_vals[row, : p.logprobs].tolist(), strict=True)
                )
            result.append((chosen[row], top))
        return result
