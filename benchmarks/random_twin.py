"""How fast does a model run on a device that its weights cannot travel to?

The twin: the model's config and tokenizer, exported here, with random weights drawn there.

A device call carries 64 MiB with the working tree, and the tree leaves no room for SmolLM2's
98 MB GGUF. A decode step's time does not depend on the weights' values when every request
generates its ``max_tokens`` (EOS ignored, as ``step_profile.py`` and the GPU check's engine
rows run), so those runs can use a twin: the same architecture, shapes and tokenizer, weights
drawn from a seed. ``export`` writes the small part here; ``weights`` draws the rest there::

    python benchmarks/random_twin.py export smollm2-135m .twin/smollm2   # here (about 3 MB)
    PYTHONPATH=. python benchmarks/random_twin.py weights .twin/smollm2   # on the device
    python benchmarks/gpu_check.py --sections step --model .twin/smollm2 --skip-tests

The folder is a Hugging Face model directory (``config.json``, ``tokenizer.json``,
``tokenizer_config.json``, then ``model.safetensors``) that ``growpage.engine.loading`` loads
as any other; ``twin.json`` names the source model, its sha256 and the seed. Its tokens are
not the model's, nor are a policy's decisions (random weights attend almost evenly): use it for
timings, never for outputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from script_args import parser, run_main

from growpage.engine.loading import catalog
from growpage.engine.loading.loader import (
    hf_config_to_model_config,
    load_checkpoint,
    meta_shapes,
    read_json,
    resolve_model_path,
)
from growpage.engine.loading.tokenizer import load_tokenizer
from growpage.engine.modeling.model import ModelConfig
from growpage.errors import EngineError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_config(cfg: ModelConfig) -> dict:
    """``cfg`` as a Hugging Face ``config.json`` that ``hf_config_to_model_config`` reads back
    to ``cfg`` (its name aside)."""
    rope = cfg.rope
    out = {
        "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_q_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "max_position_embeddings": cfg.max_position,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids),
        "rope_theta": rope.theta,
        "_name_or_path": f"{cfg.name} (random twin)",
    }
    if rope.scaling_factor is not None:
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": rope.scaling_factor,
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position,
        }
    return out


def export(model: str, out: Path) -> Path:
    """Config, tokenizer and provenance of ``model`` (a catalog name, GGUF file or HF
    directory) into the folder ``out``; no weights."""
    source = resolve_model_path(model)
    cfg, _ = load_checkpoint(source)
    tok = load_tokenizer(source)
    out.mkdir(parents=True, exist_ok=True)
    (out / "model.safetensors").unlink(missing_ok=True)  # weights of an earlier twin
    write_json(out / "config.json", hf_config(cfg))
    tok.backend.save(str(out / "tokenizer.json"))
    special = {
        key: tok.id_to_token(token_id)
        for key, token_id in (("bos_token", tok.bos_token_id), ("eos_token", tok.eos_token_id))
        if token_id is not None
    }
    write_json(out / "tokenizer_config.json", {"chat_template": tok.chat_template, **special})
    known = next((m for m in catalog.CATALOG.values() if model == m.name), None)
    write_json(
        out / "twin.json",
        {
            "source": model,
            "source_sha256": known.sha256 if known is not None else None,
            "note": "random weights (random_twin.py weights): timings only, never outputs",
        },
    )
    return out


def draw_weights(cfg: ModelConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Weights for ``cfg`` from ``seed``: norms near 1, embeddings N(0, 1), projections
    N(0, 1 / fan-in), so activations stay of order one through the layers."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in meta_shapes(cfg).items():
        w = torch.randn(shape, generator=gen)
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * w
        elif "embed_tokens" not in name and len(shape) > 1:
            w = w / shape[-1] ** 0.5
        elif name.endswith(".bias"):
            w = 0.1 * w
        weights[name] = w.to(dtype)
    return weights


def weights(folder: Path, seed: int, dtype: torch.dtype) -> Path:
    """``model.safetensors`` of the twin in ``folder`` (from ``export``), drawn from ``seed``."""
    from safetensors.torch import save_file

    config = folder / "config.json"
    if not config.is_file():
        raise EngineError(f"{folder}: no config.json (run `random_twin.py export` first)")
    cfg = hf_config_to_model_config(read_json(config), folder)
    path = folder / "model.safetensors"
    partial = path.with_suffix(".partial")
    save_file(draw_weights(cfg, seed, dtype), str(partial))
    partial.replace(path)  # no half-written weights under the name the loader reads
    info = folder / "twin.json"
    meta = read_json(info) if info.is_file() else {}
    write_json(info, {**meta, "seed": seed, "dtype": str(dtype).removeprefix("torch.")})
    return path


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="config and tokenizer of a model into a folder")
    e.add_argument("model", help="catalog name (growpage models list), GGUF file or HF folder")
    e.add_argument("out", type=Path)
    w = sub.add_parser("weights", help="random weights for an exported folder")
    w.add_argument("folder", type=Path)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    args = p.parse_args(argv)
    if args.command == "export":
        out = export(args.model, args.out)
        size = sum(f.stat().st_size for f in out.iterdir())
        print(f"{out}: config and tokenizer of {args.model} ({size / 2**20:.1f} MiB)")
    else:
        path = weights(args.folder, args.seed, DTYPES[args.dtype])
        print(f"{path}: random weights, seed {args.seed}, {args.dtype}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
