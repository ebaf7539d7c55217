"""`LLM`: offline generation over the engine, in the shape vLLM users know."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from conveyor.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, candidates
from conveyor.config import EngineConfig
from conveyor.core.kv_events import KVEvent
from conveyor.engine import Engine
from conveyor.lora import LoRARequest
from conveyor.multimodal import ImagePrompt, ImageSpan, ImageToken, as_image_prompt, chat_images
from conveyor.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from conveyor.sampling_params import InvalidRequestError, PoolingParams, SamplingParams
from conveyor.scoring import (
    ModelHead,
    cosine,
    cross_encoder_inputs,
    cross_encoder_score,
    score_pairs,
    top_label,
)
from conveyor.tokenizer import Tokenizer

Prompt = str | list[int] | ImagePrompt | dict[str, Any]  # (the dict: vLLM's, with "multi_modal_data")
Message = dict[str, Any]


class LLM:
    """Load a model once; generate for many prompts at once with continuous batching.

    >>> llm = LLM()  # SmolLM2-135M-Instruct, embedded
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        self.engine = Engine.from_config(self.config)
        self._counter = 0

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix: the next prompts are computed whole."""
        return self.engine.reset_prefix_cache()

    def reset_mm_cache(self) -> bool:
        """Forget every image's or clip's encoder output the encoder cache keeps."""
        return self.engine.reset_mm_cache()

    def sleep(self, level: int = 1) -> bool:
        """Give memory back while idle (vLLM's sleep mode; `Engine.sleep`): level 1 frees the KV
        cache, level 2 the weights too (built again from the model's path by `wake_up`)."""
        return self.engine.sleep(level)

    def wake_up(self) -> bool:
        return self.engine.wake_up()

    def update_weights_from_disk(self, model_path: str) -> bool:
        """New weights of the same architecture from `model_path` (an RL trainer's checkpoint;
        `Engine.update_weights_from_disk`); the prefix cache is forgotten."""
        return self.engine.update_weights_from_disk(model_path)

    def update_weights_from_tensor(self, named_tensors: Any, flush_cache: bool = True,
                                   weight_version: str | None = None) -> bool:
        """New values of some or all of the model's tensors by their HF names (a trainer's
        parameters; `Engine.update_weights_from_tensor`)."""
        return self.engine.update_weights_from_tensor(named_tensors, flush_cache, weight_version)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str | None = None) -> bool:
        """Join a trainer's weight-update group (conveyor/weight_sync.py; blocks until all join)."""
        return self.engine.init_weights_update_group(master_address, master_port, rank_offset, world_size,
                                                     group_name, backend)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        weight_version: str | None = None, bucket_bytes: int = 0) -> bool:
        """Receive and load the tensors the trainer broadcasts over the group (`bucket_bytes`:
        as its `send` packs them)."""
        return self.engine.update_weights_from_distributed(names, dtypes, shapes, group_name, flush_cache,
                                                           weight_version, bucket_bytes)

    def get_weight_version(self) -> str:
        """The `weight_version` the last update named ("default" before any)."""
        return self.engine.get_weight_version()

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> bool:
        return self.engine.destroy_weights_update_group(group_name)

    def take_kv_events(self) -> list[KVEvent]:
        """The prefix cache's KV events since the last call (with `enable_kv_cache_events=True`):
        BlockStored, BlockRemoved, AllBlocksCleared (conveyor/core/kv_events.py)."""
        return self.engine.take_kv_events()

    # vLLM's LLM.llm_engine calls, here on the LLM itself (`Engine`'s, documented there).
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter before any request names it (a bad one raises here)."""
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop the adapter of that id from memory (and its pin)."""
        return self.engine.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters in memory."""
        return self.engine.list_loras()

    def pin_lora(self, lora_int_id: int) -> bool:
        """Keep a loaded adapter in memory whatever else runs, until `remove_lora`."""
        return self.engine.pin_lora(lora_int_id)

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order.

        `lora_request`: one adapter for every prompt, or one (or None: the base model) per
        prompt; the engine needs `enable_lora=True`. Every prompt is validated, and every
        adapter loaded, before any work starts: one bad prompt raises and nothing runs.
        """
        batch = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(batch))
        loras = _as_lora_list(lora_request, len(batch))
        checked = [self._checked(i, prompt, p, lora)
                   for i, (prompt, p, lora) in enumerate(zip(batch, params, loras, strict=True))]
        return self._run(checked, params, use_tqdm, loras)

    def _checked(self, i: int, prompt: Prompt, params: SamplingParams, lora: LoRARequest | None,
                 room: int = 0) -> tuple[str | None, list[int], tuple[ImageSpan, ...]]:
        """Prompt `i`'s text, token ids and images, validated (with `room` more tokens after
        it, if asked); its error names it."""
        try:
            text, ids, images = self.engine.prepare_prompt(prompt, params)
            self.engine.validate(ids, params)
            if room and len(ids) + room > self.engine.max_model_len:
                raise InvalidRequestError(
                    f"the prompt has {len(ids)} tokens: with max_tokens={room}, a beam would "
                    f"outgrow the {self.engine.max_model_len} tokens a sequence may have", param="max_tokens",
                )
            if lora is not None:
                self.engine.check_lora(lora)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"prompt {i}: {e}", e.param) from None
        return text, ids, images

    def embed(
        self,
        prompts: Prompt | Seq[Prompt],
        pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        priority: int = 0,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (vLLM's `LLM.embed`): the prompt's final hidden states
        pooled (`PoolingParams`: the model's own pooling by default, normalized), batched with
        continuous batching beside any other requests. `out.outputs.embedding` is a list of
        floats. Every prompt is validated before any work starts."""
        outs = self._pooled(prompts, pooling_params, use_tqdm, lora_request, priority)
        return [
            EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(o.embedding or []), o.finished)
            for o in outs
        ]

    def encode(
        self,
        prompts: Prompt | Seq[Prompt],
        pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        priority: int = 0,
    ) -> list[PoolingRequestOutput]:
        """Each prompt's pooled output as its `PoolingParams` ask (vLLM's `LLM.encode`):
        `out.outputs.data` is a vector, or with `pooling_type="all"` one vector a prompt token
        (the hidden states; with `task="classify"` a token classifier's probabilities, what a
        token classifier gives by default)."""
        if pooling_params is None:
            pooling_params = default_pooling(self.engine.head)
        outs = self._pooled(prompts, pooling_params, use_tqdm, lora_request, priority)
        return [pooling_output(o) for o in outs]

    def _pooled(
        self,
        prompts: Prompt | Seq[Prompt],
        pooling_params: PoolingParams | Seq[PoolingParams] | None,
        use_tqdm: bool,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None,
        priority: int,
    ) -> list[RequestOutput]:
        batch = _as_prompt_list(prompts)
        pooling: list[PoolingParams]
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling = [pooling_params or PoolingParams()] * len(batch)
        else:
            pooling = list(pooling_params)
            if len(pooling) != len(batch):
                raise InvalidRequestError(
                    f"{len(pooling)} pooling params for {len(batch)} prompts", param="pooling_params"
                )
        params = [SamplingParams.for_pooling(p, priority) for p in pooling]
        return self.generate(batch, params, use_tqdm, lora_request)

    def classify(
        self,
        prompts: Prompt | Seq[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        priority: int = 0,
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities (vLLM's `LLM.classify`), from a sequence
        classifier (`*ForSequenceClassification`): its head over the last token's hidden
        state, softmax over the classes (a sigmoid for a one-class model; the logits with
        `PoolingParams(activation=False)`). `out.outputs.probs`, `out.label` the most probable
        class's name. Batched with continuous batching beside any other requests. A token
        classifier classifies each token: `encode` gives its rows."""
        pooling = classify_pooling(self.engine.head, pooling_params)
        outs = self._pooled(prompts, pooling, use_tqdm, lora_request, priority)
        return [classification_output(o, self.engine.head) for o in outs]

    def score(
        self,
        text_1: str | Seq[str],
        text_2: str | Seq[str],
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[float]:
        """vLLM's `LLM.score`: one `text_1` against each `text_2`, or pairwise. A cross-encoder
        (a one-class sequence classifier, a reranker) reads each pair as one input (the
        tokenizer's pair template) and scores it by its sigmoid; an embedding model gives the
        cosine similarity of the two texts' embeddings (last token, normalized), each distinct
        text embedded once."""
        pairs = score_pairs(text_1, text_2)
        if self.engine.labels:
            return self._cross_encode(pairs, use_tqdm, lora_request)
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        outs = self.embed(texts, use_tqdm=use_tqdm, lora_request=lora_request)
        vectors = {t: o.outputs.embedding for t, o in zip(texts, outs, strict=True)}
        return [cosine(vectors[a], vectors[b]) for a, b in pairs]

    def _cross_encode(self, pairs: list[tuple[str, str]], use_tqdm: bool,
                      lora_request: LoRARequest | None) -> list[float]:
        head = self.engine.head
        inputs = cross_encoder_inputs(pairs, head, self.engine.tokenizer)
        outs = self.classify(inputs, PoolingParams(task="classify", activation=False), use_tqdm, lora_request)
        return [cross_encoder_score(o.outputs.probs[0], head) for o in outs]

    def beam_search(
        self,
        prompts: Prompt | Seq[Prompt],
        params: BeamSearchParams,
        lora_request: LoRARequest | None = None,
    ) -> list[BeamSearchOutput]:
        """The `params.beam_width` best continuations of each prompt by beam search
        (conveyor/beam_search.py): each round runs every live beam of every prompt as one batch
        of one-token requests, the prefix cache giving back the K/V they share. Every prompt is
        validated (with room for `max_tokens`) before any work starts."""
        batch = _as_prompt_list(prompts)
        whole = SamplingParams(max_tokens=params.max_tokens)
        eos = self.engine.scheduler.eos_token_ids
        checked = [self._checked(i, prompt, whole, lora_request, params.max_tokens) for i, prompt in enumerate(batch)]
        searches = [BeamSearch(ids, params, eos) for _, ids, _ in checked]
        images = {id(s): spans for s, (_, _, spans) in zip(searches, checked, strict=True)}
        one = params.round_params()
        while live := [s for s in searches if not s.done]:
            beams = [(s, b) for s in live for b in s.beams]
            outs = self._run([(None, b.tokens, images[id(s)]) for s, b in beams], [one] * len(beams), False,
                             [lora_request] * len(beams))
            at = 0
            for s in live:
                n = len(s.beams)
                s.advance([candidates(o) for o in outs[at : at + n]])
                at += n
        results = [s.result() for s in searches]
        tokenizer = self.engine.tokenizer
        if tokenizer is not None:
            for r in results:
                for seq in r.sequences:
                    seq.text = tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        return results

    def transcribe(self, audio: Any, language: str | None = None, task: str = "transcribe",
                   prompt: str | None = None, temperature: float | tuple[float, ...] = 0.0,
                   timestamps: bool = False, seed: int | None = None, words: bool = False, **sampling: Any) -> Any:
        """Whisper's transcript of a clip (samples with their rate, a file's bytes, a URL or a
        path: `conveyor.audio`), or its translation into English (`task="translate"`): its
        windows of at most 30 seconds decoded in one batch and joined; `language` (ISO-639-1)
        where given, else Whisper's own guess on the first window; with `timestamps`, its
        segments too (`Transcription.segments`); with `words`, each word's times
        (`Transcription.words`, `conveyor.alignment`). A temperature of 0 decodes greedily with
        OpenAI's fallback to 0.2, 0.4 ... 1.0 for a window whose decode looks wrong; a tuple of
        temperatures falls back through those (`(0.0,)`: greedy alone); any other number samples
        at it (`seed`: the draws' seed). `sampling`: `top_p`, `top_k`, `min_p`,
        `repetition_penalty`, `frequency_penalty`, `presence_penalty`, and `max_tokens` (at most
        the decoder's room), for each window's request. A list of clips gives a list of `Transcription`s, every
        clip's windows (and language guesses) in one batch; one clip, one `Transcription`
        (`conveyor.transcribe`)."""
        from conveyor.transcribe import Transcriber

        whisper = Transcriber.of(self.tokenizer, self.engine.image_processor, self.engine.max_model_len)
        before = whisper.before(prompt)
        given = None if language is None else whisper.language_id(language)
        temperatures = whisper.check(before, task, temperature, timestamps, words, sampling)
        clips = audio if isinstance(audio, list) else [audio]
        job = whisper.job([whisper.windows(clip) for clip in clips], given, before, task, temperatures, timestamps,
                          seed, words, sampling)

        def run(batch: list[tuple[ImagePrompt, SamplingParams]]) -> list[RequestOutput]:
            return self.generate([prompt for prompt, _ in batch], [params for _, params in batch], use_tqdm=False)

        detect = job.detect()
        if detect:
            job.detected(run(detect))
        while batch := job.requests():
            job.took(run(batch))
        if words:
            job.aligned(self.engine.cross_weights(*job.alignment()))
        results = job.results()
        return results if isinstance(audio, list) else results[0]

    def chat(
        self,
        messages: list[Message] | Seq[list[Message]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations; `mm_processor_kwargs`:
        their images' and videos' processing options (`ImageProcessor.overridden`);
        `chat_template`: a template (its text or a file's path) for these instead of the model's."""
        convs: list[list[Message]]
        if messages and isinstance(messages[0], dict):
            convs = [list(messages)]  # type: ignore[arg-type]
        else:
            convs = [list(c) for c in messages]  # type: ignore[arg-type]
        prompts: list[Prompt] = [chat_prompt(self.engine.tokenizer, c, add_generation_prompt, chat_template_kwargs,
                                             self.engine.image_token, mm_processor_kwargs, chat_template)
                                 for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _run(
        self,
        prompts: list[tuple[str | None, list[int], tuple[ImageSpan, ...]]],
        params: list[SamplingParams],
        use_tqdm: bool,
        loras: list[LoRARequest | None],
    ) -> list[RequestOutput]:
        engine = self.engine
        ids: list[str] = []
        for (text, token_ids, images), p, lora in zip(prompts, params, loras, strict=True):
            rid = f"gen-{self._counter}"
            self._counter += 1
            engine.add_request(rid, token_ids, p, prompt_text=text, lora_request=lora, images=images)
            ids.append(rid)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req", dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in results:
                    engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in ids]


def chat_prompt(tokenizer: Tokenizer | None, messages: list[Message], add_generation_prompt: bool = True,
                chat_template_kwargs: dict[str, Any] | None = None, image_token: ImageToken | None = None,
                mm_processor_kwargs: dict[str, Any] | None = None,
                chat_template: str | None = None) -> list[int] | ImagePrompt:
    """One conversation put through the model's chat template, or `chat_template` (its text or a
    file's path; `LLM.chat`, `AsyncLLM.chat`); with images among its content parts, the prompt
    and its images (`chat_images`)."""
    if tokenizer is None:
        raise InvalidRequestError("this engine has no tokenizer", param="messages")
    kwargs = dict(chat_template_kwargs or {})
    if chat_template is not None:
        from conveyor.tokenizer import load_chat_template

        try:
            kwargs["chat_template"] = load_chat_template(chat_template)
        except ValueError as e:
            raise InvalidRequestError(str(e), param="chat_template") from None
    messages, images = chat_images(messages, kwargs.get("chat_template") or tokenizer.chat_template or "", image_token)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    return ImagePrompt(ids, tuple(images), mm_processor_kwargs) if images else ids


def default_pooling(head: ModelHead) -> PoolingParams:
    """What `encode` pools without `PoolingParams`: a token classifier's probabilities, else the
    model's own pooling."""
    return PoolingParams(task="classify") if head.token_classifier else PoolingParams()


def classify_pooling(head: ModelHead, pooling_params: PoolingParams | None) -> PoolingParams:
    """What `classify` pools with (`LLM.classify`, `AsyncLLM.classify`): the head over the hidden
    state `pooling_params` pick; refused for a token classifier (its output is a row a token)."""
    if head.token_classifier:
        raise InvalidRequestError("this model classifies each token: encode gives one row of "
                                  "probabilities a prompt token", param="model")
    if head.lexical and not head.labels:
        raise InvalidRequestError("this model's sparse head weighs each token: encode with "
                                  "PoolingParams(task='classify') gives its lexical weights", param="model")
    base = pooling_params or PoolingParams()
    return PoolingParams(base.pooling_type, task="classify", activation=base.activation)


def classification_output(out: RequestOutput, head: ModelHead) -> ClassificationRequestOutput:
    """A finished classification as `classify` gives it: the probabilities and the likeliest class."""
    probs = out.embedding or []
    return ClassificationRequestOutput(out.request_id, out.prompt_token_ids, ClassificationOutput(probs),
                                       top_label(probs, head.labels), out.finished)


def pooling_output(out: RequestOutput) -> PoolingRequestOutput:
    """A finished pooled request as `encode` gives it: a vector, or one a prompt token."""
    data = out.token_embeddings if out.token_embeddings is not None else out.embedding or []
    return PoolingRequestOutput(out.request_id, out.prompt_token_ids, PoolingOutput(data), out.finished)


def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | ImagePrompt | dict):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [[int(t) for t in items]]
    out: list[Prompt] = []
    for p in items:
        if isinstance(p, dict):
            p = as_image_prompt(p)
        if isinstance(p, str | ImagePrompt) or (isinstance(p, dict) and "prompt_embeds" in p):
            out.append(p)
        elif isinstance(p, list | tuple):
            out.append([int(t) for t in p])
        else:
            raise InvalidRequestError(f"a prompt must be a string, a list of token ids or a dict with images, "
                                      f"not {type(p).__name__}", "prompt")
    return out


def _as_params_list(
    params: SamplingParams | Seq[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    items = list(params)
    if len(items) != n:
        raise InvalidRequestError(f"{len(items)} sampling params for {n} prompts", "sampling_params")
    return items


def _as_lora_list(loras: LoRARequest | Seq[LoRARequest | None] | None, n: int) -> list[LoRARequest | None]:
    if loras is None or isinstance(loras, LoRARequest):
        return [loras] * n
    items = list(loras)
    if len(items) != n:
        raise InvalidRequestError(f"{len(items)} LoRA requests for {n} prompts", "lora_request")
    return items
