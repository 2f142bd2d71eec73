"""Tokenizer from GGUF metadata (byte-level BPE) or a Hugging Face ``tokenizer.json``.

Built on the ``tokenizers`` package; the chat template (Jinja, from the GGUF metadata or
``tokenizer_config.json``) is rendered with ``jinja2`` as Hugging Face does.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from growpage.errors import EngineError

if TYPE_CHECKING:
    import tokenizers

    from growpage.engine.loading.gguf_file import GGUFFile

# GGUF token types (llama.cpp): 3 = control (special), 4 = user-defined (added, not special).
_CONTROL, _USER_DEFINED = 3, 4
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp pre-tokenizer name -> regex splits applied in order before byte-level BPE.
_PRE_SPLITS = {
    "default": [_GPT2_SPLIT],
    "gpt2": [_GPT2_SPLIT],
    "smollm": [r"\p{N}", _GPT2_SPLIT],
    "llama-bpe": [_LLAMA3_SPLIT],
    "llama3": [_LLAMA3_SPLIT],
    "qwen2": [_QWEN2_SPLIT],
}


class Tokenizer:
    """Text <-> token ids, plus the model's chat template.

    Attributes: ``bos_token_id``, ``eos_token_id`` (``None`` when unknown), ``vocab_size``.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_template: str | None,
    ) -> None:
        self._tok = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The ``tokenizers.Tokenizer`` underneath (``.save(path)`` writes a ``tokenizer.json``)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are recognized.

        ``add_special_tokens`` adds what the model's tokenizer adds to a plain prompt (a BOS
        for models that want one; nothing for SmolLM2)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, str]] | str, add_generation_prompt: bool = True
    ) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}]`` or one user string)."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not self.chat_template:
            raise EngineError("this model has no chat template; pass a plain prompt instead")
        import jinja2.sandbox

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        special = {
            "bos_token": self._token_or_empty(self.bos_token_id),
            "eos_token": self._token_or_empty(self.eos_token_id),
        }
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **special
        )

    def encode_chat(self, messages: list[dict[str, str]] | str) -> list[int]:
        """Ids of the chat-formatted prompt, ready for generation (the template writes any
        BOS itself)."""
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)

    def _token_or_empty(self, token_id: int | None) -> str:
        return "" if token_id is None else (self._tok.id_to_token(token_id) or "")


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Tokenizer of a GGUF file or HF directory; ``None`` = the default model."""
    from growpage.engine.loading.loader import resolve_model_path

    p = resolve_model_path(path)
    return _tokenizer_from_hf_dir(p) if p.is_dir() else tokenizer_from_gguf(p)


def tokenizer_from_gguf(path: str | Path, reader: GGUFFile | None = None) -> Tokenizer:
    """Byte-level BPE tokenizer from ``tokenizer.ggml.*`` metadata (``model == "gpt2"``)."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    from growpage.engine.loading.loader import gguf_value, open_gguf

    reader = reader if reader is not None else open_gguf(Path(path))
    kind = gguf_value(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise EngineError(f"{path}: tokenizer model {kind!r} not supported (byte-level BPE only)")
    tokens = gguf_value(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        raise EngineError(f"{path}: GGUF metadata lacks tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in gguf_value(reader, "tokenizer.ggml.merges", [])]
    types = gguf_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise EngineError(
            f"{path}: tokenizer.ggml.token_type has {len(types)} entries for "
            f"{len(tokens)} tokens (one type per token expected)"
        )
    pre = gguf_value(reader, "tokenizer.ggml.pre", "default")
    if pre not in _PRE_SPLITS:
        raise EngineError(f"{path}: unknown pre-tokenizer {pre!r}")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_SPLITS[pre]]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _USER_DEFINED
        ]
    )
    bos = gguf_value(reader, "tokenizer.ggml.bos_token_id")
    if bos is not None and gguf_value(reader, "tokenizer.ggml.add_bos_token", False):
        if not 0 <= bos < len(tokens):
            raise EngineError(
                f"{path}: BOS token id {bos} lies outside its vocabulary of {len(tokens)} tokens"
            )
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A",
            pair=f"{tokens[bos]} $A $B",
            special_tokens=[(tokens[bos], bos)],
        )
    return Tokenizer(
        tok,
        bos,
        gguf_value(reader, "tokenizer.ggml.eos_token_id"),
        gguf_value(reader, "tokenizer.chat_template"),
    )


def _tokenizer_from_hf_dir(path: Path) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    from growpage.engine.loading.loader import read_json

    if not (path / "tokenizer.json").is_file():
        raise EngineError(f"{path}: no tokenizer.json")
    try:
        tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception
        raise EngineError(f"{path / 'tokenizer.json'}: cannot read it ({exc})") from None
    cfg_file = path / "tokenizer_config.json"
    cfg = read_json(cfg_file) if cfg_file.is_file() else {}
    template = cfg.get("chat_template")
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()

    def token_id(key: str) -> int | None:
        value = cfg.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        return None if value is None else tok.token_to_id(value)

    return Tokenizer(tok, token_id("bos_token"), token_id("eos_token"), template)
