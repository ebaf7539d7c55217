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

Tool calls and everything else about the answer are read from the content alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.server.tool_parsers import partial_suffix

OPEN, CLOSE = "<think>", "</think>"
# Each parser's (opening tag, closing tag, whether an output that does not open the block is
# inside it already: the template opened it in the prompt).
TAGS = {
    "deepseek_r1": (OPEN, CLOSE, True),
    "glm45": (OPEN, CLOSE, False),
    "mistral": ("[THINK]", "[/THINK]", False),
    "qwen3": (OPEN, CLOSE, False),
}
PARSERS = tuple(sorted(TAGS))


def split_reasoning(text: str, parser: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output; None where there is none."""
    reasoning, content = ReasoningStream(parser).feed(text, final=True)
    return reasoning or None, content or None


@dataclass
class ReasoningStream:
    """One streamed choice's text, split as it grows into reasoning and content deltas. A tail
    that could be the start of a tag is held back until the next piece tells."""

    parser: str
    text: str = ""
    sent: int = 0  # characters of `text` passed on
    state: str = "start"  # start (before the first non-space), reasoning, content

    def feed(self, piece: str, final: bool) -> tuple[str, str]:
        """(new reasoning, new content)."""
        self.text += piece
        opening, closing, inside = TAGS[self.parser]
        reasoning, content = "", ""
        while True:
            rest = self.text[self.sent :]
            if self.state == "start":
                stripped = rest.lstrip()
                if not final and (not stripped or (opening.startswith(stripped) and stripped != opening)):
                    return reasoning, content  # nothing yet, or `<thi`: wait
                if stripped.startswith(opening):
                    self.sent += len(rest) - len(stripped) + len(opening)
                    self.state = "reasoning"
                else:
                    self.state = "reasoning" if inside else "content"
            elif self.state == "reasoning":
                end = rest.find(closing)
                if end >= 0:
                    reasoning += rest[:end]
                    self.sent += end + len(closing)
                    self.state = "after"
                    continue
                keep = 0 if final else partial_suffix(rest, closing)
                reasoning += rest[: len(rest) - keep]
                self.sent += len(rest) - keep
                return reasoning, content
            elif self.state == "after":  # the newlines after </think> are not the answer's
                stripped = rest.lstrip("\n")
                self.sent += len(rest) - len(stripped)
                if not stripped and not final:
                    return reasoning, content
                self.state = "content"
            else:
                content += rest
                self.sent += len(rest)
                return reasoning, content
