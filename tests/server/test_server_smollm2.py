"""``growpage serve`` over the real SmolLM2-135M-Instruct: greedy chat and completion outputs
over HTTP, streamed and not, equal ``LLM.generate`` on the same prompts (its byte-level BPE and
chat template, which the tiny model's character tokenizer does not exercise)."""

from __future__ import annotations

import openai
import pytest
import torch
from server_helpers import ServerThread

from growpage.engine.llm import LLM
from growpage.engine.loading.loader import load_model
from growpage.engine.loading.tokenizer import load_tokenizer
from growpage.engine.sampling_params import SamplingParams
from growpage.server.app import ServerConfig, create_app

pytestmark = pytest.mark.slow

NAME = "SmolLM2-135M-Instruct"
CHATS = ["What is 2+2?", "Name three colors."]
MAX_TOKENS = 32
# No prefix cache: the second request of a prompt would prefill only its tail, whose logits
# may differ from a whole prefill's in the last bits.
ENGINE = dict(policy="growpage", page_size=16, kv_pages=128, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def smol():
    """``(server, expected chat outputs, expected completion outputs)``: the reference runs
    on an engine of its own over the same loaded model, before the server takes its own."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tokenizer = load_model(), load_tokenizer()
    ref = LLM(model, tokenizer=tokenizer, **ENGINE)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    chats = [ref.generate([c], params, chat=True)[0] for c in CHATS]
    plain = [ref.generate([c], params, chat=False)[0] for c in CHATS]
    llm = LLM(model, tokenizer=tokenizer, **ENGINE)
    with ServerThread(create_app(llm, ServerConfig(model_name=NAME))) as server:
        yield server, chats, plain
    torch.set_num_threads(threads)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_greedy_chat_and_completions_over_http_equal_generate(smol, stream):
    server, chats, plain = smol
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    for prompt, want_chat, want_plain in zip(CHATS, chats, plain, strict=True):
        args = dict(model=NAME, temperature=0, max_tokens=MAX_TOKENS)
        messages = [{"role": "user", "content": prompt}]
        if stream:
            parts = client.chat.completions.create(**args, messages=messages, stream=True)
            chat = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
            parts = client.completions.create(**args, prompt=prompt, stream=True)
            text = "".join(c.choices[0].text for c in parts if c.choices)
        else:
            chat = client.chat.completions.create(**args, messages=messages)
            chat = chat.choices[0].message.content
            text = client.completions.create(**args, prompt=prompt).choices[0].text
        assert chat == want_chat.text and want_chat.text.strip()
        assert text == want_plain.text
