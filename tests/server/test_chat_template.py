"""vLLM's `--chat-template` (a file, or the template's text) in place of the model's, over the
library and the chat API, and OpenAI's `reasoning_effort` handed to the template (as vLLM hands
it to gpt-oss's): the prompt's ids (`return_token_ids`) read back as the template renders them."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from conveyor import LLM, ConfigError, InvalidRequestError
from tests.server.conftest import ServerProcess

TEMPLATE = ("{%- for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant effort={{ reasoning_effort | default('') }}>{% endif %}")


def test_the_library_renders_with_the_template_given(smollm2: str, tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    llm = LLM(smollm2, chat_template=str(path), num_kv_blocks=64)
    tok = llm.engine.tokenizer
    assert tok is not None
    messages = [{"role": "user", "content": "Hi."}]
    out = llm.chat(messages, use_tqdm=False)[0]
    assert tok.decode(out.prompt_token_ids) == "<user>Hi.<assistant effort=>"
    own = LLM(smollm2, num_kv_blocks=64)  # the model's own template, and one given for a call
    assert "<|im_start|>" in own.engine.tokenizer.decode(own.chat(messages, use_tqdm=False)[0].prompt_token_ids,
                                                         skip_special_tokens=False)
    once = own.chat(messages, use_tqdm=False, chat_template=TEMPLATE,
                    chat_template_kwargs={"reasoning_effort": "low"})[0]
    assert tok.decode(once.prompt_token_ids) == "<user>Hi.<assistant effort=low>"
    with pytest.raises(ConfigError, match="no such file"):
        LLM(smollm2, chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(InvalidRequestError, match="no such file"):
        own.chat(messages, chat_template=str(tmp_path / "missing.jinja"))


def test_the_server_renders_with_the_template_and_the_reasoning_effort(smollm2: str, tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    server = ServerProcess(["--model", smollm2, "--num-kv-blocks", "64", "--chat-template", str(path)],
                           tmp_path / "server.log")
    try:
        server.wait_ready()

        def rendered(**extra: object) -> str:
            body = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 1, "return_token_ids": True,
                    **extra}
            r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            ids = r.json()["prompt_token_ids"]
            return str(httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"])

        assert rendered() == "<user>Hi.<assistant effort=>"
        assert rendered(reasoning_effort="high") == "<user>Hi.<assistant effort=high>"
        # The Responses API's reasoning.effort reaches the template too: its prompt's token count
        # is that of the text the template renders with it.
        r = httpx.post(server.url + "/v1/responses", timeout=60,
                       json={"input": "Hi.", "max_output_tokens": 1, "reasoning": {"effort": "medium"}})
        assert r.status_code == 200, r.text
        count = httpx.post(server.url + "/tokenize", json={"prompt": "<user>Hi.<assistant effort=medium>",
                                                            "add_special_tokens": False}).json()["count"]
        none = httpx.post(server.url + "/tokenize", json={"prompt": "<user>Hi.<assistant effort=>",
                                                           "add_special_tokens": False}).json()["count"]
        assert r.json()["usage"]["input_tokens"] == count != none
        bad = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                         json={"messages": [{"role": "user", "content": "Hi."}], "reasoning_effort": "extreme"})
        assert bad.status_code == 400
    finally:
        assert server.stop() == 0
