"""`conveyor` command line: generate, chat, serve, bench (and later simulate).

Engine options are generated from the config dataclasses' fields and help text, so every knob
of `LLM(...)` is a flag here with the same name (underscores become dashes).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, TypeVar

from conveyor.config import ConfigError, EngineConfig
from conveyor.core.routing import RouterConfig  # light: no torch
from conveyor.sampling_params import SamplingParams
from conveyor.server.config import ServerConfig  # light: no FastAPI until `serve` runs

T = TypeVar("T")


def _arg_type(annotation: Any) -> tuple[Any, bool]:
    """(python type for argparse, is_bool) from a field annotation string or type."""
    text = str(annotation)
    if "bool" in text:
        return bool, True
    if "int" in text:
        return int, False
    if "float" in text:
        return float, False
    return str, False


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    from conveyor.config import PRESETS

    group = parser.add_argument_group("engine")
    group.add_argument(
        "--preset", choices=sorted(PRESETS), default=None,
        help="A named combination of scheduler options (explicit options override it): "
        + "; ".join(f"{k}: {v}" for k, v in PRESETS.items()),
    )
    group.add_argument(
        "--speculative-config", default=None, metavar="JSON",
        help='vLLM\'s form of the speculative options, e.g. \'{"method": "eagle3", "model": "PATH", '
             '"num_speculative_tokens": 3}\' (keys: method, model, num_speculative_tokens, prompt_lookup_min, '
             'prompt_lookup_max, disable_by_batch_size, quantization, speculative_token_tree; and SGLang\'s '
             'speculative_eagle_topk, speculative_num_steps)',
    )
    group.add_argument(
        "--kv-events-config", default=None, metavar="JSON",
        help='vLLM\'s form of the KV events options, e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", '
             '"endpoint": "tcp://*:5557"}\' (keys: enable_kv_cache_events, publisher, endpoint, replay_endpoint, '
             'topic, buffer_steps)',
    )
    for section in EngineConfig.section_types().values():
        _add_field_args(group, section)


def _add_field_args(group: argparse._ArgumentGroup, config_type: type) -> None:
    """One flag per dataclass field (`max_num_seqs` -> `--max-num-seqs`), help from metadata.

    Every default is None, so only the flags a user gives reach the config."""
    for f in dataclasses.fields(config_type):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        if "tuple" in str(f.type):
            group.add_argument(flag, dest=f.name, nargs="+", default=None, help=help_text)
            continue
        typ, is_bool = _arg_type(f.type)
        if is_bool:
            group.add_argument(
                flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                help=f"{help_text} (default: {f.default})",
            )
        else:
            group.add_argument(
                flag, dest=f.name, type=typ, default=None, help=f"{help_text} (default: {f.default})"
            )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = {
        f.name for sec in EngineConfig.section_types().values() for f in dataclasses.fields(sec)
    }
    names.update(("preset", "speculative_config", "kv_events_config"))
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--stop", action="append", default=[])


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        stop=tuple(args.stop),
    )


def _stream(engine: Any, prompt_ids: list[int], params: Any, request_id: str) -> str:
    """Run one request on the engine, printing text as it is produced."""
    engine.add_request(request_id, prompt_ids, params, stream=True)
    text = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            delta = out.outputs[0].delta_text
            if delta:
                sys.stdout.write(delta)
                sys.stdout.flush()
                text.append(delta)
    sys.stdout.write("\n")
    return "".join(text)


def cmd_generate(args: argparse.Namespace) -> int:
    from conveyor.llm import LLM

    llm = LLM(**engine_kwargs(args))
    params = sampling_params(args)
    if args.stream:
        assert llm.tokenizer is not None
        ids = llm.tokenizer.encode(args.prompt)
        _stream(llm.engine, ids, params, "cli-0")
        return 0
    out = llm.generate([args.prompt], params, use_tqdm=False)[0]
    print(out.outputs[0].text)
    return 0


def cmd_transcribe(args: argparse.Namespace) -> int:
    """Whisper's transcripts (or English translations) of audio files, all batched, printed in
    order in `--format` (text: each after its file's name where there are several; the others
    each after a `==> file <==` line where there are several); draws seeded by `--seed`."""
    import json
    from pathlib import Path

    from conveyor.llm import LLM
    from conveyor.transcribe import srt, verbose_json, vtt

    llm = LLM(**engine_kwargs(args))
    clips = [Path(f).read_bytes() for f in args.files]
    task = "translate" if args.translate else "transcribe"
    outs = llm.transcribe(clips, language=args.language, task=task, prompt=args.prompt, temperature=args.temperature,
                          timestamps=args.format in ("verbose_json", "srt", "vtt"), seed=args.seed,
                          words=args.words)
    for name, out in zip(args.files, outs, strict=True):
        if args.format == "text":
            print(f"{name}: {out.text}" if len(args.files) > 1 else out.text)
            continue
        if len(args.files) > 1:
            print(f"==> {name} <==")
        if args.format == "json":
            print(json.dumps({"text": out.text, "language": out.language}, ensure_ascii=False))
        elif args.format == "verbose_json":
            print(json.dumps(verbose_json(out, task, words=args.words), ensure_ascii=False, indent=2))
        else:
            print((srt if args.format == "srt" else vtt)(out.segments), end="")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from conveyor.llm import LLM

    llm = LLM(**engine_kwargs(args))
    if llm.tokenizer is None:
        print("this model has no tokenizer; chat needs one", file=sys.stderr)
        return 2
    params = sampling_params(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    turn = 0
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            break
        if line.strip() in ("/exit", "/quit"):
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        ids = llm.tokenizer.apply_chat_template(messages)
        if interactive:
            sys.stdout.write("assistant> ")
        reply = _stream(llm.engine, ids, params, f"chat-{turn}")
        messages.append({"role": "assistant", "content": reply})
        turn += 1
    return 0


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Flags generated from `ServerConfig`'s fields, like the engine's."""
    _add_field_args(parser.add_argument_group("server"), ServerConfig)


def add_router_args(parser: argparse.ArgumentParser) -> None:
    """Flags generated from `RouterConfig`'s fields: replicas and how requests are spread."""
    _add_field_args(parser.add_argument_group("replicas (data parallelism)"), RouterConfig)


def _config_of(config_type: type[T], args: argparse.Namespace) -> T:
    names = {f.name for f in dataclasses.fields(config_type)}  # type: ignore[arg-type]
    return config_type(**{k: v for k, v in vars(args).items() if k in names and v is not None})


def server_config(args: argparse.Namespace) -> ServerConfig:
    return _config_of(ServerConfig, args)


def router_config(args: argparse.Namespace) -> RouterConfig:
    return _config_of(RouterConfig, args)


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from conveyor.server.launch import run_server

    config = server_config(args)
    level = "DEBUG" if config.log_level == "trace" else config.log_level.upper()
    logging.getLogger("conveyor").setLevel(level)
    return run_server(engine_kwargs(args), config, router_config(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    add_sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat with the model's chat template")
    chat.add_argument("--system", default=None, help="a system message")
    add_sampling_args(chat)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    asr = sub.add_parser("transcribe", help="a Whisper model's transcripts of audio files")
    asr.add_argument("files", nargs="+", help="audio files (WAV; MP3, FLAC, OGG with soundfile), batched")
    asr.add_argument("--language", default=None, help="the clip's language (ISO-639-1); default: Whisper's guess")
    asr.add_argument("--translate", action="store_true", help="translate into English")
    asr.add_argument("--prompt", default=None, help="text the transcript continues from")
    asr.add_argument("--words", action="store_true", help="verbose_json: each word's times too")
    asr.add_argument("--temperature", type=float, default=0.0,
                     help="0 (default): greedy, falling back to 0.2 ... 1.0 for a window that loops or is unsure "
                          "(the draws seeded by --seed)")
    asr.add_argument("--format", choices=("text", "json", "verbose_json", "srt", "vtt"), default="text",
                     help="what is printed: the text, OpenAI's json or verbose_json (segments with their "
                          "times), SubRip or WebVTT subtitles")
    add_engine_args(asr)
    asr.set_defaults(func=cmd_transcribe)

    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/responses, "
             "/v1/embeddings, /score, /rerank, /tokenize, /metrics)",
    )
    add_server_args(serve)
    add_router_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    from conveyor.bench.commands import add_bench_parser

    add_bench_parser(sub, add_engine_args)

    from conveyor.sim.commands import add_sim_parsers

    add_sim_parsers(sub, add_engine_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded by `bench` in its results
    try:
        return int(args.func(args))
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

