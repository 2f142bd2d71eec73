"""Does today's code give a stored accuracy table's outputs, and at what speed, side by side?

Reruns rows of a table that ``growpage eval accuracy`` stored, with the table's settings (model,
problems, pool, dtype, rows), one after the other in this process, so the rerun rows ran at like
loads and their tokens per second compare. Each problem's output (its text and its token count)
is compared with the stored one: a change meant to touch only speed must leave them identical.
Prints, per row, the stored and the new engine steps, TPS and machine load, and how many outputs
are identical; writes the same as ``report.md`` and ``report.json`` beside the rerun table.

    python benchmarks/table_rerun.py results/accuracy/qwen2.5-coder-0.5b-gsm8k --rows fullkv gp-f64

Exit status 1 when an output differs. The rerun table goes to ``--out/<table name>`` and can be
continued with ``--resume``; a row whose policy reads another row (``@LABEL.budget``) needs that
row rerun with it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from script_args import add_out, add_threads, parser, run_main

from growpage.errors import ConfigError
from growpage.eval.accuracy import (
    AccuracySettings,
    load_text,
    read_outputs,
    read_results,
    run_table,
)
from growpage.eval.rows import parse_row


def rerun_settings(stored: dict[str, Any], labels: list[str]) -> AccuracySettings:
    """The stored table's settings with only the rows ``labels``, in the table's order."""
    texts = {parse_row(t).label: t for t in stored["settings"].get("rows") or ()}
    done = {r["label"] for r in stored["rows"]}
    for label in labels:
        if label not in texts or label not in done:
            raise ConfigError(
                f"row {label!r} is not a finished row of the stored table (rows: "
                f"{', '.join(r['label'] for r in stored['rows'])})"
            )
        missing = {ref.label for ref in parse_row(texts[label]).references} - set(labels)
        if missing:
            raise ConfigError(
                f"row {label!r} reads row(s) {', '.join(sorted(missing))}: rerun them with it"
            )
    kept = [text for label, text in texts.items() if label in labels]  # the table's order
    return AccuracySettings.from_dict({**stored["settings"], "rows": kept})


def compare(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> tuple[int, list[str]]:
    """How many problems have the same output text and token count in both, and the ids of
    those that do not."""
    if [o["id"] for o in old] != [o["id"] for o in new]:
        raise ConfigError("the rerun's problems are not the stored table's")
    differ = [
        a["id"]
        for a, b in zip(old, new, strict=True)
        if (a["output"], a.get("num_tokens")) != (b["output"], b.get("num_tokens"))
    ]
    return len(old) - len(differ), differ


def ran_at(rerun: dict[str, Any]) -> str:
    """The commit(s) whose code ran the rerun's rows (each row records the code its process
    loaded; the report's own ``commit`` is the checkout's when it was last written)."""
    return ", ".join(sorted({r.get("commit", rerun["commit"]) for r in rerun["rows"]}))


def report_markdown(
    table: Path,
    stored: dict[str, Any],
    rerun: dict[str, Any],
    same: dict[str, tuple[int, list[str]]],
) -> str:
    old_rows = {r["label"]: r for r in stored["rows"]}
    head = (
        f"Rerun of {table} (stored {stored['date']}, last written at commit {stored['commit']}; "
        "a row's own commit where it recorded one) with the code of commit "
        f"{ran_at(rerun)}, {rerun['date']}; the rerun rows ran one after the other in one "
        "process.\n\n"
        "| row | outputs identical | commit stored | steps stored | steps now | TPS stored "
        "| TPS now | load stored | load now | accuracy stored | accuracy now |\n"
        "|---|---|---|---:|---:|---:|---:|---|---|---:|---:|\n"
    )
    lines = []
    for r in rerun["rows"]:
        o = old_rows[r["label"]]
        n, differ = same[r["label"]]
        lines.append(
            f"| {r['label']} | {n} of {n + len(differ)} | {o.get('commit', '-')} "
            f"| {o.get('steps', '-')} | "
            f"{r.get('steps', '-')} | {o['tps']:.1f} | {r['tps']:.1f} | {load_text(o.get('load_avg'))} | {load_text(r.get('load_avg'))} "
            f"| {o['accuracy']:.3f} | {r['accuracy']:.3f} |"
        )
    first = rerun["rows"][0]
    ratios = "; ".join(f"{r['label']} {r['tps'] / first['tps']:.2f}x" for r in rerun["rows"][1:])
    tail = f"\nTPS now against {first['label']}'s, same run: {ratios}.\n" if ratios else "\n"
    for label, (_, differ) in same.items():
        if differ:
            tail += f"\n{label}: {len(differ)} outputs differ, first {', '.join(differ[:5])}.\n"
    return head + "\n".join(lines) + "\n" + tail


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("table", type=Path, help="a folder of growpage eval accuracy")
    p.add_argument("--rows", nargs="+", required=True, help="labels of the rows to rerun")
    p.add_argument("--resume", action="store_true", help="continue a rerun in --out")
    add_threads(p, None)
    add_out(p, "table_rerun")
    args = p.parse_args(argv)
    stored = read_results(args.table)  # names a missing, malformed or foreign results.json
    settings = rerun_settings(stored, args.rows)
    out = args.out / args.table.name
    started = time.time()
    rerun = run_table(settings, out, resume=args.resume, threads=args.threads)
    same = {
        r["label"]: compare(read_outputs(args.table, r["label"]), read_outputs(out, r["label"]))
        for r in rerun["rows"]
    }
    text = report_markdown(args.table, stored, rerun, same)
    print(text)
    (out / "report.md").write_text(text)
    (out / "report.json").write_text(
        json.dumps(
            {
                "table": str(args.table),
                "commit": ran_at(rerun),
                "elapsed_s": time.time() - started,
                "rows": {
                    label: {"identical": n, "differ": differ} for label, (n, differ) in same.items()
                },
            },
            indent=1,
        )
    )
    return 1 if any(differ for _, differ in same.values()) else 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
