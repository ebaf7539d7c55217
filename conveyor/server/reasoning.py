"""Reasoning outputs (`conveyor serve --reasoning-parser`): a thinking model's thoughts,
written between `<think>` and `</think>`, come back apart from its answer, as
`message.reasoning_content` (and `delta.reasoning_content` streamed), the way vLLM's parsers
of the same names return them.

- `deepseek_r1`: the chat template opens `<think>` in the prompt, so the output starts inside
  it (an opening tag written anyway is dropped); everything before `</think>` is reasoning,
  and an output cut off before it is all reasoning.
- `qwen3`: the output thinks only if it opens with `<think>` (Qwen3 thinks unless told not to
  by `enable_thinking=false`, then the template closes the block in the prompt); otherwise it
  is all answer. `glm45` (GLM-4.5 / 4.6) reads the same way.
- `mistral` (Magistral): as `qwen3`, between `[THINK]` and `[/THINK]`.
- `seed_oss` (ByteDance Seed-OSS): as `deepseek_r1`, between `<seed:think>` and `</seed:think>`;
  `step3` (StepFun Step-3): as `deepseek_r1` (everything before `</think>` is reasoning).
- `ernie45` (ERNIE 4.5 thinking models): as `deepseek_r1`, and an answer wrapped in
  `<response>` ... `</response>` comes back without the wrapper (the newlines before it and
  after it too); an answer without one is itself.
- `hunyuan_a13b` (Tencent Hunyuan-A13B): as `qwen3`, between `<think>\n` and `\n</think>`, and
  the answer without its `<answer>\n` ... `\n</answer>` wrapper.
- `minimax_m2` (MiniMax-M2): as `deepseek_r1`; `minimax_m2_append_think` gives the whole output
  as content with the `<think>` the template opened put back in front of it (the client keeps
  the thinking inline, as MiniMax asks of multi-turn use).
- `granite` (IBM Granite 3.2 with `thinking=True`): the output thinks only if it opens with
  "Here is my thought process:" (or "Here's ..."), and the answer follows "Here is my
  response:" (or "Here's ..."); an output cut off before it is all reasoning.
- `openai_gptoss` (gpt-oss's harmony format): the output is messages, each a header (its
  `<|channel|>`, maybe a recipient `to=...`) then `<|message|>`, its text, and `<|end|>` (or the
  stop tokens `<|return|>`, `<|call|>`); the `analysis` channel is reasoning, `final` (and
  `commentary` to no one) is content, and a message to a function (`to=functions.NAME`) is a
  tool call, passed on to the content in one canonical form that the `openai` tool parser
  reads. Its markers are special tokens, so requests keep special tokens in their text
  (`keeps_special_tokens`) and the parser leaves none of them in what it returns. An output
  with no header at all is content. A grammar (structured outputs) holds the final message's
  text, the messages before `HARMONY_FINAL` free (conveyor/structured `thinking`).

Tool calls and everything else about the answer are read from the content alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.server.tool_parsers import (
    CALL,
    CHANNEL,
    CONSTRAIN,
    END,
    MESSAGE,
    RETURN,
    START,
    harmony_call,
    partial_suffix,
)

OPEN, CLOSE = "<think>", "</think>"
# Each parser's (opening tag, closing tag, whether an output that does not open the block is
# inside it already: the template opened it in the prompt).
TAGS = {
    "deepseek_r1": (OPEN, CLOSE, True),
    "ernie45": (OPEN, CLOSE, True),
    "glm45": (OPEN, CLOSE, False),
    "granite": ("Here is my thought process:", "Here is my response:", False),
    "hunyuan_a13b": ("<think>\n", "\n</think>", False),
    "minimax_m2": (OPEN, CLOSE, True),
    "minimax_m2_append_think": (OPEN, CLOSE, True),
    "mistral": ("[THINK]", "[/THINK]", False),
    "qwen3": (OPEN, CLOSE, False),
    "seed_oss": ("<seed:think>", "</seed:think>", True),
    "step3": (OPEN, CLOSE, True),
}
# Other spellings of a parser's tags that it reads too (a structured output's grammar holds the
# model to the first).
SPELLINGS = {"granite": (("Here is my thought process:", "Here's my thought process:"),
                         ("Here is my response:", "Here's my response:"))}
# Parsers that give the whole output as content, the opening tag the template wrote in front.
INLINE = {"minimax_m2_append_think"}
# A parser's wrapper around the answer, dropped from the content (ERNIE's).
WRAPPERS = {"ernie45": ("<response>", "</response>"), "hunyuan_a13b": ("<answer>\n", "\n</answer>")}
HARMONY = "openai_gptoss"
HARMONY_FINAL = f"{CHANNEL}final{MESSAGE}"  # what opens gpt-oss's answer: a grammar holds what follows
PARSERS = tuple(sorted((*TAGS, HARMONY)))


def keeps_special_tokens(parser: str | None) -> bool:
    """Whether this parser reads markers that are special tokens (the text must keep them)."""
    return parser == HARMONY


def split_reasoning(text: str, parser: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output; None where there is none."""
    reasoning, content = reasoning_stream(parser).feed(text, final=True)
    return reasoning or None, content or None


def reasoning_stream(parser: str) -> ReasoningStream:
    return HarmonyStream() if parser == HARMONY else TagStream(parser)


@dataclass
class TagStream:
    """One streamed choice's text, split as it grows into reasoning and content deltas. A tail
    that could be the start of a tag is held back until the next piece tells."""

    parser: str
    text: str = ""
    sent: int = 0  # characters of `text` passed on
    state: str = "start"  # start (before the first non-space), reasoning, content
    opened: bool = False  # (a wrapper's opening tag, if any, is behind)

    def feed(self, piece: str, final: bool) -> tuple[str, str]:
        """(new reasoning, new content)."""
        self.text += piece
        if self.parser in INLINE:
            opened, self.sent = self.sent == 0, 1
            return "", (TAGS[self.parser][0] if opened else "") + piece
        opening, closing, inside = TAGS[self.parser]
        openings, closings = SPELLINGS.get(self.parser, ((opening,), (closing,)))
        reasoning, content = "", ""
        while True:
            rest = self.text[self.sent :]
            if self.state == "start":
                stripped = rest.lstrip()
                if not final and (not stripped or any(o.startswith(stripped) and stripped != o for o in openings)):
                    return reasoning, content  # nothing yet, or `<thi`: wait
                tag = next((o for o in openings if stripped.startswith(o)), None)
                if tag is not None:
                    self.sent += len(rest) - len(stripped) + len(tag)
                    self.state = "reasoning"
                else:
                    self.state = "reasoning" if inside else "content"
            elif self.state == "reasoning":
                found = [(i, c) for c in closings if (i := rest.find(c)) >= 0]
                if found:
                    end, tag = min(found)
                    reasoning += rest[:end]
                    self.sent += end + len(tag)
                    self.state = "after"
                    continue
                keep = 0 if final else max(partial_suffix(rest, c) for c in closings)
                reasoning += rest[: len(rest) - keep]
                self.sent += len(rest) - keep
                return reasoning, content
            elif self.state == "after":  # the newlines after </think> are not the answer's
                stripped = rest.lstrip("\n")
                self.sent += len(rest) - len(stripped)
                if not stripped and not final:
                    return reasoning, content
                self.state = "content"
            elif self.parser in WRAPPERS:
                return reasoning, content + self._unwrapped(rest, final)
            else:
                content += rest
                self.sent += len(rest)
                return reasoning, content

    def _unwrapped(self, rest: str, final: bool) -> str:
        """The answer's new text less its wrapper: an opening tag first (after newlines) is
        dropped, and so is a last closing tag that only newlines follow, with them, once the
        output ends; a tail that may be either waits."""
        opening, closing = WRAPPERS[self.parser]
        if not self.opened:
            head = rest.lstrip("\n")
            if not final and opening.startswith(head) and head != opening:
                return ""  # nothing yet, or `<resp`: wait
            self.opened = True
            if head.startswith(opening):
                skip = len(rest) - len(head) + len(opening)
                self.sent += skip
                rest = rest[skip:]
        at = rest.rfind(closing)
        ends = at >= 0 and not rest[at + len(closing) :].strip("\n")  # the closing tag, then newlines
        if final:
            self.sent += len(rest)
            return rest[:at] if ends else rest
        keep = len(rest) - at if ends else partial_suffix(rest, closing)
        self.sent += len(rest) - keep
        return rest[: len(rest) - keep]


_ENDS = (END, RETURN, CALL, START)  # what ends a message's text (a new <|start|> too, leniently)


@dataclass
class HarmonyStream:
    """One streamed choice's harmony messages, split as they grow into reasoning and content.
    A message's text goes out as it comes, less a tail that may be the start of a marker; a
    tool call waits for its end, then goes to the content whole (`harmony_call`)."""

    text: str = ""
    at: int = 0  # where the message being read starts (its header), or its text once `body`
    body: bool = False
    sink: str = "content"  # the message's: reasoning, content or call
    recipient: str = ""

    def feed(self, piece: str, final: bool) -> tuple[str, str]:
        self.text += piece
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            rest = self.text[self.at :]
            if not self.body:
                if not rest:
                    break
                head = rest.lstrip()
                if not head and final:
                    break
                if not head.startswith((START, CHANNEL)):
                    if not final and any(m.startswith(head) for m in (START, CHANNEL)):
                        break  # `<|sta`: wait
                    self.sink, self.recipient, self.body = "content", "", True  # no header: plain text
                    continue
                end = rest.find(MESSAGE)
                if end < 0:
                    if final:  # a header cut off: nothing to say
                        self.at = len(self.text)
                    break
                self._header(rest[:end])
                self.at += end + len(MESSAGE)
                self.body = True
                continue
            stops = [i for i in (rest.find(m) for m in _ENDS) if i >= 0]
            stop = min(stops) if stops else -1
            if stop < 0 and not final:
                if self.sink != "call":
                    keep = max(partial_suffix(rest, m) for m in _ENDS)
                    (reasoning if self.sink == "reasoning" else content).append(rest[: len(rest) - keep])
                    self.at += len(rest) - keep
                break
            part = rest if stop < 0 else rest[:stop]
            if self.sink == "call":  # (its text was held back whole: `at` is still where it starts)
                content.append(harmony_call(self.recipient, part.strip()))
            else:
                (reasoning if self.sink == "reasoning" else content).append(part)
            self.at += len(part)
            if stop >= 0 and not rest.startswith(START, stop):
                self.at += next(len(m) for m in _ENDS if rest.startswith(m, stop))
            self.body = False
            if stop < 0:
                break
        return "".join(reasoning), "".join(content)

    def _header(self, header: str) -> None:
        channel = ""
        if CHANNEL in header:
            channel = header.split(CHANNEL, 1)[1].split(CONSTRAIN, 1)[0].strip().split(" ", 1)[0]
        recipient = ""
        for word in header.replace(CHANNEL, " ").replace(CONSTRAIN, " ").split():
            if word.startswith("to="):
                recipient = word[3:]
        self.recipient = recipient
        if recipient.startswith("functions."):
            self.sink = "call"
        else:
            self.sink = "reasoning" if channel == "analysis" else "content"


ReasoningStream = TagStream | HarmonyStream
