"""The engine's flags on the command line: one per ``LLM`` setting (``EngineConfig``'s fields),
the model, policy and KV flags, and their ``LLM`` keywords read back. ``growpage generate`` and
``record`` take them, and so do ``growpage serve`` and ``growpage bench``."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from growpage._argtypes import positive_int
from growpage.engine.config import SETTINGS
from growpage.policies.registry import parse_policy_params

#: Engine settings ``generate`` and ``record`` have no flag for, and why.
NO_FLAG = {
    "seed": "--seed seeds the requests' sampling here (the engine's generator starts from 0)",
    "record_traces": "record's --out (generate does not record)",
    "record_layers": "record's --layers",
    "record_values": "record's --no-values",
}


def add_engine_flags(p: argparse.ArgumentParser, skip: Mapping[str, str]) -> None:
    """A flag for each engine setting (``EngineConfig``'s fields, ``SETTINGS``) but those in
    ``skip`` (name: why not), named, typed, defaulted and explained by the field."""
    for field in SETTINGS:
        if field.name in skip:
            continue
        options = dict(field.metadata["flag"])
        options.pop("name", None)
        flag = flag_name(field)
        default = options.pop("default", field.default)
        if isinstance(default, torch.dtype):
            default = str(default).removeprefix("torch.")  # its name among the choices
        text = field.metadata["help"]
        if str(field.type).startswith("bool"):
            options["action"] = argparse.BooleanOptionalAction
            default_text = {True: "on", False: "off", None: None}[default]
        else:
            default_text = default
        if default_text is not None:
            text += f" (default {default_text})"
        p.add_argument(flag, dest=field.name, default=default, help=text, **options)


def flag_name(field: attrs.Attribute) -> str:
    """``--max-num-seqs`` for ``max_num_seqs``, unless the field's metadata names another."""
    return "--" + field.metadata["flag"].get("name", field.name.replace("_", "-"))


def engine_settings(args: argparse.Namespace, skip: Mapping[str, str]) -> dict[str, Any]:
    """The ``LLM`` keywords of the flags ``add_engine_flags(p, skip)`` gave ``p``."""
    return {f.name: getattr(args, f.name) for f in SETTINGS if f.name not in skip}


def add_llm_flags(p: argparse.ArgumentParser, default_policy: str = "growpage") -> None:
    """The flags of an ``LLM`` as ``generate`` takes them: ``--model``, ``--policy`` and
    ``--param``, ``--page-size``, ``--threads``, ``--recent-window`` and one per engine setting
    (``llm_kwargs`` reads them back)."""
    model_flags(p, default_policy)
    kv_flags(p)
    add_engine_flags(p, NO_FLAG)


def llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``LLM`` arguments of the flags ``add_llm_flags`` gave (``--threads`` is applied here,
    to torch)."""
    return {
        "policy": args.policy,
        "policy_kwargs": parse_policy_params(args.policy_arg, "--param"),
        **engine_kwargs(args),
    }


def model_flags(p: argparse.ArgumentParser, default_policy: str | None) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="GGUF file, Hugging Face directory, or a model name from `growpage models list` "
        "(qwen2.5-coder-0.5b...; default: smollm2-135m, SmolLM2-135M-Instruct)",
    )
    if default_policy is not None:
        p.add_argument(
            "--policy",
            default=default_policy,
            help="policy name, 'module:Class' or 'file.py:Class' (default growpage)",
        )
        p.add_argument(
            "--param",
            "--policy-arg",
            dest="policy_arg",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="policy hyperparameter, e.g. tau=0.01 (repeatable; read as the "
            "simulator's --param)",
        )


def kv_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--page-size",
        type=int,
        default=64,
        help="tokens per KV page (default 64 for short CPU runs; the paper uses 256)",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch CPU threads (default: torch's, one per core; on a machine other "
        "jobs share, 1 or 2 avoids oversubscription)",
    )
    p.add_argument(
        "--recent-window",
        type=int,
        default=None,
        help="protected recent tokens (default 16, or page size / 4 for pages of 16 "
        "tokens or fewer, as the simulator's)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``LLM`` arguments of the engine flags (``--threads`` is applied here, to torch)."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    window = {} if args.recent_window is None else {"recent_window": args.recent_window}
    return {
        "model": args.model,
        "page_size": args.page_size,
        **window,
        **engine_settings(args, NO_FLAG),
    }
