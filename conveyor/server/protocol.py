"""Request bodies of the OpenAI-compatible API (pydantic), with vLLM's extensions.

Unknown fields are accepted and ignored, as OpenAI's and vLLM's servers do, so clients that
send newer fields keep working. NaN and infinity are refused (JSON allows them as extensions;
no sampling parameter means anything with them). Ranges that `SamplingParams` checks are left to
it, so each rule lives in one place; only what pydantic must know to parse (types, `n`, the
int64 seed) is checked here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 128


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    # vLLM's: the request's own id (else the X-Request-Id header's, else a random one); the
    # response's `id` is "<cmpl|chatcmpl>-<it>", and POST /abort_request {"rid": it} ends it
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share prefix-cache blocks
    # vLLM's: arguments for the engine's own logits processors (--logits-processors), as SamplingParams.extra_args
    vllm_xargs: dict[str, str | int | float | bool | list[str | int | float | bool]] | None = None
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens `token_id:N` (None: the server's)
    # vLLM's: the prompt's and the answer's token ids beside the text (`prompt_token_ids`, `token_ids`;
    # streamed, the prompt's in a choice's first chunk and each chunk's new ids)
    return_token_ids: bool | None = None
    # vLLM's beam search: `n` beams, the best n sequences as the choices (not streamed)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs
    # ({"json" | "regex" | "choice" | "json_object" | "grammar": ...}), its older guided_*
    # fields, and SGLang's ebnf (a GBNF grammar, as structured_outputs.grammar)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    ebnf: str | None = None
    # conveyor's: a hint for the shortest-predicted-output queue policies
    expected_output_tokens: int | None = None
    # conveyor's: this request's objectives for policy "slo" (default: the server's)
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    # vLLM's: prompts as embeddings, each a base64 `torch.save` of a `[tokens, hidden]` tensor
    # (with --enable-prompt-embeds); answered before the `prompt`'s, if both are given
    prompt_embeds: str | list[str] | None = None
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ImageURL(OpenAIBaseModel):
    url: str  # a data:image/...;base64 URL, an http(s) URL, or (--allowed-local-media-path) a file
    detail: str | None = None  # (OpenAI's; conveyor reads every image at the tower's size)


class ImagePart(OpenAIBaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(OpenAIBaseModel):
    url: str  # a data:video/...;base64 URL, an http(s) URL, or (--allowed-local-media-path) a file


class VideoPart(OpenAIBaseModel):  # (vLLM's: Qwen2-VL's and Qwen2.5-VL's videos)
    type: Literal["video_url"]
    video_url: VideoURL


class InputAudio(OpenAIBaseModel):
    data: str  # the file's bytes, base64 (not a data URL)
    format: str = "wav"  # (OpenAI's "wav" or "mp3"; conveyor reads the file's own header)


class InputAudioPart(OpenAIBaseModel):  # (OpenAI's: Qwen2-Audio's clips)
    type: Literal["input_audio"]
    input_audio: InputAudio


class AudioURL(OpenAIBaseModel):
    url: str  # a data:audio/...;base64 URL, an http(s) URL, or (--allowed-local-media-path) a file


class AudioPart(OpenAIBaseModel):  # (vLLM's)
    type: Literal["audio_url"]
    audio_url: AudioURL


MEDIA_PARTS = (ImagePart, VideoPart, InputAudioPart, AudioPart)


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[TextPart | ImagePart | VideoPart | InputAudioPart | AudioPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # (the images' and videos' processing options)
    # OpenAI's; handed to the chat template as `reasoning_effort` (gpt-oss's reads it, as vLLM does)
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None

    def message_dicts(self) -> list[dict[str, Any]]:
        """Messages as the chat template expects them (text parts joined; a message with images,
        videos or audio keeps its parts, for `conveyor.multimodal.chat_images`)."""
        out: list[dict[str, Any]] = []
        for m in self.messages:
            content: Any = m.content
            if isinstance(content, list):
                images = any(isinstance(p, MEDIA_PARTS) for p in content)
                content = ([p.model_dump(exclude_none=True) for p in content] if images
                           else "".join(p.text for p in content if isinstance(p, TextPart)))
            d: dict[str, Any] = {"role": m.role, "content": content or ""}
            if m.name is not None:
                d["name"] = m.name
            if m.tool_calls:
                d["tool_calls"] = m.tool_calls
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            out.append(d)
        return out


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """POST /v1/load_lora_adapter (vLLM's): serve a PEFT folder under a model name;
    `load_inplace` replaces the adapter a name already serves (vLLM's flag)."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False
    # SGLang's: loaded on every engine now, and kept loaded however many others are used
    pinned: bool = False


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """POST /v1/unload_lora_adapter (vLLM's): stop serving a model name's adapter."""

    lora_name: str
    lora_int_id: int | None = None


class PoolingInputs(OpenAIBaseModel):
    """The inputs of a request that pools instead of generating: `input` (texts or token ids),
    or vLLM's chat form, `messages` rendered by the chat template into one input."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = False  # (messages)
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # (the messages' images' and videos' processing)
    user: str | None = None
    # vLLM's extensions
    truncate_prompt_tokens: int | None = None  # keep the last k tokens (-1: the context length)
    add_special_tokens: bool = True
    priority: int = 0
    # conveyor's: how the hidden states are pooled ("last", the default; "mean"; "max"; "cls")
    pooling_type: str | None = None


class EmbeddingRequest(PoolingInputs):
    """POST /v1/embeddings (OpenAI's, with vLLM's extensions and conveyor's `pooling_type`)."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None  # default: true


class PoolingRequest(PoolingInputs):
    """POST /pooling (vLLM's): each input's pooled output for `task`: "embed" (a vector),
    "classify" (class probabilities), "token_embed" (a vector a token), "token_classify" (a
    token classifier's probabilities a token); default: the model's (token_classify for a token
    classifier, classify for a sequence classifier, else embed)."""

    task: Literal["embed", "classify", "token_embed", "token_classify"] | None = None
    step_tag_id: int | None = None  # pooling_type "step": the token that ends a reasoning step
    normalize: bool | None = None  # (embeddings) default: true
    dimensions: int | None = None
    activation: bool | None = None  # (classifications) default: true


class ClassifyRequest(PoolingInputs):
    """POST /classify and /v1/classify (vLLM's, for a sequence classifier): each input's class
    probabilities; `activation=false` gives the logits."""

    activation: bool | None = None  # default: true


class ScoreRequest(OpenAIBaseModel):
    """POST /score and /v1/score (vLLM's): `text_1` scored against each of `text_2`, or
    pairwise: by a cross-encoder (a one-class classifier) reading each pair as one input, or
    by the cosine similarity of an embedding model's embeddings."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    user: str | None = None


class RerankRequest(OpenAIBaseModel):
    """POST /rerank, /v1/rerank and /v2/rerank (vLLM's, Jina's and Cohere's shape): the
    documents ordered by their score against the query (as /score gives it)."""

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None  # None or 0: every document
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    user: str | None = None


class TokenizeRequest(OpenAIBaseModel):
    """POST /tokenize (vLLM's): a `prompt`, or chat `messages` rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIBaseModel):
    """POST /detokenize (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[int]


class ResponsesRequest(OpenAIBaseModel):
    """POST /v1/responses (OpenAI's Responses API, as vLLM serves it): `input` (text, or items:
    messages, function calls and their outputs), `instructions`, `previous_response_id` to go on
    from a stored response, function `tools`, `text.format` for structured outputs."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    user: str | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None  # OpenAI's {"effort": ...}: the chat template's reasoning_effort
    # vLLM's sampling extensions
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    priority: int = 0
    mm_processor_kwargs: dict[str, Any] | None = None  # (its input images' processing)
