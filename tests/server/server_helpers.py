"""Helpers for the server tests: a tiny random model on disk (weights, config, a character-level
tokenizer with a chat template) and a server on a free port in a background thread."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

TINY_CONFIG = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
MODEL_NAME = "tiny"


def _tokenizer_json() -> str:
    """One token per character: ids 9, 10 and 32-126 are those ASCII characters; 0-3 are
    <pad>, <s>, </s>, <unk>; the rest print as <N>."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for i in range(len(specials), 128):
        vocab[chr(i) if i in (9, 10) or 32 <= i < 127 else f"<{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok.to_str()


def write_tiny_model(path: Path, seed: int = 1234) -> Path:
    """A Hugging Face directory holding a tiny random Llama (weights peaked enough that greedy
    decoding is far from ties) that ``LLM(path)`` and ``growpage serve --model`` load."""
    from safetensors.torch import save_file

    from growpage.engine.loading.loader import hf_config_to_model_config, meta_shapes

    path.mkdir(parents=True, exist_ok=True)
    cfg = hf_config_to_model_config(TINY_CONFIG, path)
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in meta_shapes(cfg).items():
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.2 * torch.randn(shape, generator=gen)
        elif "embed_tokens" in name:
            weights[name] = torch.randn(shape, generator=gen)
        else:
            weights[name] = torch.randn(shape, generator=gen) * (1.5 / shape[-1] ** 0.5)
    save_file(weights, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(TINY_CONFIG))
    (path / "tokenizer.json").write_text(_tokenizer_json())
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE})
    )
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_json(url: str, path: str, body: bytes | dict) -> tuple[int, dict]:
    """``(status, JSON body)`` of a POST of ``body`` (a dict is sent as JSON)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url + path, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


class ServerThread:
    """``app`` under uvicorn on a free port of 127.0.0.1, in a daemon thread."""

    def __init__(self, app) -> None:
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
