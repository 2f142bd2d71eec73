"""Bad request bodies get a 400 OpenAI error body whose ``param`` names the field, and leave
the server as it was: wrong JSON types (the request models are strict: integers are integers,
booleans booleans, token ids ints), text that is not valid Unicode (a lone surrogate), token
ids outside the vocabulary, too many stop strings, tool messages."""

from __future__ import annotations

import json

import openai
import pytest
from server_helpers import MODEL_NAME, ServerThread, post_json, write_tiny_model

from growpage.engine.llm import LLM
from growpage.server.app import ServerConfig, create_app

pytestmark = pytest.mark.usefixtures("one_thread")

ENGINE = dict(policy="growpage", page_size=4, recent_window=2, kv_pages=96)
COMPLETION = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
USER = {"role": "user", "content": "Hi"}


@pytest.fixture(scope="module")
def served(tmp_path_factory, one_thread):
    """``(server, llm)`` over a tiny model (vocabulary 128, pool of 384 tokens)."""
    llm = LLM(str(write_tiny_model(tmp_path_factory.mktemp("tiny"))), **ENGINE)
    with ServerThread(create_app(llm, ServerConfig(model_name=MODEL_NAME))) as server:
        yield server, llm


def _refused(url: str, path: str, body: dict, param: str) -> str:
    """The message of the 400 the server answers ``body`` with, after checking its shape."""
    status, reply = post_json(url, path, body)
    assert status == 400, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    return error["message"]


def _assert_untouched(llm: LLM) -> None:
    """Nothing queued or running, every page free."""
    kv = llm.engine.kv
    assert not llm.engine.has_unfinished()
    assert kv.pool.num_free_pages == kv.num_pages


@pytest.mark.parametrize(
    ("change", "param", "says"),
    [
        ({"prompt": [True, False]}, "prompt", "list of token ids"),
        ({"prompt": [1.0, 2.0]}, "prompt", "list of token ids"),
        ({"prompt": [[1, 2.5]]}, "prompt", "list of token ids"),
        ({"prompt": None}, "prompt", "list of token ids"),
        ({"max_tokens": "5"}, "max_tokens", "valid integer"),
        ({"max_tokens": 5.0}, "max_tokens", "valid integer"),
        ({"max_tokens": True}, "max_tokens", "valid integer"),
        ({"stream": "yes"}, "stream", "valid boolean"),
        ({"stream": 1}, "stream", "valid boolean"),
        ({"ignore_eos": "true"}, "ignore_eos", "valid boolean"),
        ({"temperature": "0"}, "temperature", "valid number"),
        ({"temperature": False}, "temperature", "valid number"),
        ({"seed": "7"}, "seed", "valid integer"),
        ({"n": 1.0}, "n", "valid integer"),
        ({"stop": 5}, "stop", "a string or a list of strings"),
        ({"stop": ["a", 5]}, "stop", "a string or a list of strings"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "boolean"),
    ],
)
def test_completions_refuse_values_of_the_wrong_type(served, change, param, says):
    server, llm = served
    message = _refused(server.url, "/v1/completions", {**COMPLETION, **change}, param)
    assert f"Invalid '{param}'" in message and says in message
    _assert_untouched(llm)


@pytest.mark.parametrize(
    ("message", "param", "says"),
    [
        ({"role": "user", "content": None}, "messages.0.content", "a user message needs content"),
        ({"role": "system"}, "messages.0.content", "a system message needs content"),
        ({"role": "user", "content": 5}, "messages.0.content", "a string or a list of text"),
        ({"role": "user", "content": [{"type": "image_url"}]}, "messages.0.content", "text"),
        ({"role": "user", "content": [{"type": "text", "text": 5}]}, "messages.0.content", "text"),
        ({"role": 1, "content": "Hi"}, "messages.0.role", "'user'"),
        ({"role": "tool", "content": "42", "tool_call_id": "c1"}, "messages.0.role", "'user'"),
    ],
)
def test_chat_refuses_messages_of_the_wrong_type(served, message, param, says):
    server, llm = served
    body = {**CHAT, "messages": [message]}
    assert says in _refused(server.url, "/v1/chat/completions", body, param)
    _assert_untouched(llm)


def test_chat_refuses_an_assistant_message_with_tool_calls(served):
    server, llm = served
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [USER, {"role": "assistant", "content": None, "tool_calls": [call]}, USER]
    message = _refused(
        server.url, "/v1/chat/completions", {**CHAT, "messages": messages}, "messages.1.tool_calls"
    )
    assert "tool calls are not supported" in message
    _assert_untouched(llm)


def test_the_valid_types_openai_clients_send_are_accepted(served):
    """Integers for floats, null for optional fields, text parts, an assistant message without
    content, token ids in a list of one: all served."""
    server, llm = served
    ok = {"temperature": 0, "top_p": 1, "seed": None, "stop": None, "stream": False, "n": 1}
    status, reply = post_json(server.url, "/v1/completions", {**COMPLETION, **ok})
    assert status == 200 and reply["usage"]["completion_tokens"] == 4
    status, reply = post_json(server.url, "/v1/completions", {**COMPLETION, "prompt": [[40, 41]]})
    assert status == 200 and reply["usage"]["prompt_tokens"] == 2
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}],
    }
    messages = [{"role": "developer", "content": "Be brief."}, parts, {"role": "assistant"}, USER]
    status, reply = post_json(server.url, "/v1/chat/completions", {**CHAT, "messages": messages})
    assert status == 200 and reply["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize(
    ("path", "change", "param"),
    [
        ("/v1/completions", {"prompt": "ab\ud800c"}, "prompt"),
        ("/v1/completions", {"prompt": ["\udfff"]}, "prompt"),
        ("/v1/completions", {"stop": ["\ud800"]}, "stop"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "-"),
        (
            "/v1/chat/completions",
            {"messages": [USER, {"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            "-",
        ),
    ],
)
def test_text_that_is_not_valid_unicode_is_refused(served, path, change, param):
    """JSON may escape a lone surrogate (``"\\ud800"``); UTF-8 cannot encode it, nor can a
    tokenizer take it."""
    server, llm = served
    body = {**(COMPLETION if path == "/v1/completions" else CHAT), **change}
    if param == "-":  # the message that holds it
        param = f"messages.{len(change['messages']) - 1}.content"
    raw = json.dumps(body).encode()
    assert b"\\ud" in raw or b"\\udfff" in raw  # sent as JSON's escape, as clients send it
    message = _refused(server.url, path, body, param)
    assert "not valid Unicode text" in message and "lone surrogate" in message
    _assert_untouched(llm)


def test_token_ids_outside_the_vocabulary_or_the_pool_name_the_prompt(served):
    server, llm = served
    for prompt in ([5, 128], [-1], [3] * 400):  # vocabulary of 128; pool of 384 tokens
        _refused(server.url, "/v1/completions", {**COMPLETION, "prompt": prompt}, "prompt")
    long = {**CHAT, "messages": [{"role": "user", "content": "y" * 400}]}
    assert "cannot fit" in _refused(server.url, "/v1/chat/completions", long, "messages")
    _assert_untouched(llm)


def test_too_many_stop_strings_is_an_invalid_request_naming_stop(served):
    server, llm = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="Hi", stop=list("abcde"))
    error = info.value.body
    assert (error["type"], error["param"]) == ("invalid_request_error", "stop")
    assert error["message"] == "at most 4 stop sequences, got 5"
    _assert_untouched(llm)
