"""What does a decode step cost the engine's host, before and after a change, in one run?

Each point runs the engine on the CPU with the model's forward stubbed (``FixedForward``: it
records fixed queries for the query summaries and returns fixed logits), so what a decode step
costs is what the engine does around the forward: scheduling, building the step's inputs,
sampling, detokenizing for stop strings, bookkeeping, the query summaries and the capacity
boundaries. ``B`` requests (prompts of 45-75 tokens, 256 generated tokens, two stop strings, EOS
ignored) start together and decode together, so every decode step has the batch ``B``;
growpage gets 40% of the pages fullkv needs (the GPU check's pool), so its boundaries compress.
The model has SmolLM2-135M's 30 layers and 9 query heads on 3 KV heads, with head dim 8 and 512
logits (``--head-dim``, ``--vocab``): the tensor arithmetic left outside the forward then costs
about what launching it costs on a GPU, so the numbers read as host time. The tokens are
SmolLM2's and so is the tokenizer that detokenizes them.

The "before" engine is the tree of a git ref (``--before``), exported with ``git archive`` to a
temporary folder; "after" is the working tree. Worker processes alternate between the two
(``--repeats`` each), and the table gives medians:

    python benchmarks/host_cost.py                           # fullkv, growpage x 1/16/64/256
    python benchmarks/host_cost.py --batches 64 --repeats 5 --policies growpage
    python benchmarks/host_cost.py --real --batches 16 64    # SmolLM2's real forward, CPU
    python benchmarks/host_cost.py --tiny --before 5af9401   # a tiny Llama's real forward
    python benchmarks/host_cost.py --profile triton:growpage:64   # cProfile of one point

Per point it prints ms per decode step (mean over the decode steps, boundary work included)
before and after, their ratio, and the breakdown into phases; and whether before and after
produced the same tokens, boundary decisions and trajectories (they must). ``--real`` runs
SmolLM2-135M itself (real forward, 32 generated tokens per request): the forward dominates there,
and the other phases show what is left around it on a CPU. ``--tiny`` runs a tiny random Llama
with its real forward (2 layers, 4 query and 2 KV heads of 16, 128 logits: the tests' shapes),
as a new user tries the engine: 256 tokens per request, pages of 16, and both policies get
the pages fullkv needs, so each decodes the whole batch in every step; its table gives the ms
of whole decode steps (CPU time), forward included, and growpage's against fullkv's.

NOTE: the CPU is shared with other jobs: before and after run alternately and the medians of
several runs are compared, never one run against a number from another time.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import hashlib
import json
import os
import pstats
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from script_args import (
    ROOT,
    add_out,
    add_threads,
    git_export,
    parser,
    run_main,
    tree_only_command,
)

DEFAULT_BEFORE = "756fc51"  # the engine before a step's boundaries were batched (issue 36)
# Modules the worker imports: a "before" tree must have them (growpage/engine in sub-packages
# since d9c3893).
WORKER_MODULES = (
    "growpage/engine/loading/loader.py",
    "growpage/engine/loading/tokenizer.py",
    "growpage/engine/modeling/model.py",
    "growpage/engine/modeling/step_context.py",
    "growpage/engine/llm.py",
    "growpage/core/rope.py",
)
PHASES = (
    "schedule",
    "inputs",
    "forward",
    "query state",
    "sampling",
    "detokenize",
    "bookkeeping",
    "boundary",
)
STOPS = ("</answer>", "\n\nQuestion:")


# ---- the worker: one engine tree, every point ----------------------------------------------
class FixedForward:
    """Stands in for a ``CausalLM`` inside the model runner: records fixed pre-RoPE queries for
    every layer (as the model does into ``ctx.capture``) and returns fixed hidden states;
    ``compute_logits`` returns fixed logits, row ``i`` peaking at ``token_ids[i % n]``."""

    def __init__(
        self, model: Any, max_tokens: int, max_batch: int, token_ids: list[int], seed: int = 1
    ) -> None:
        cfg = model.config
        self.config = cfg
        self.kv_cache = model.kv_cache
        self.backend = model.backend
        gen = torch.Generator().manual_seed(seed)
        self.queries = [
            torch.randn(max_tokens, cfg.num_q_heads, cfg.head_dim, generator=gen)
            for _ in range(cfg.num_layers)
        ]
        self.hidden = torch.zeros(max_tokens, cfg.hidden_size)
        self.logits = torch.randn(max_batch, cfg.vocab_size, generator=gen)
        peaks = torch.tensor([token_ids[i % len(token_ids)] for i in range(max_batch)])
        self.logits[torch.arange(max_batch), peaks] = 10.0
        self.seconds = 0.0
        self.clock: Callable[[], float] = time.perf_counter

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        from growpage.engine.modeling.step_context import get_context

        start = self.clock()
        capture = get_context().capture
        n = ids.shape[0]
        if capture is not None:
            for i, q in enumerate(self.queries):
                if capture.wants(i):
                    capture.queries[i] = q[:n]
        self.seconds += self.clock() - start
        return self.hidden[:n]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits[: hidden.shape[0]]


class PhaseClock:
    """Wraps methods of the engine's parts (by name, where the tree has them) and adds the
    seconds of each call to its phase."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._wrapped: list[tuple[object, str]] = []

    def restore(self) -> None:
        """Take the wrappers off again (instance attributes over the class's methods)."""
        for owner, name in self._wrapped:
            delattr(owner, name)
        self._wrapped.clear()

    def wrap(
        self, owner: object, name: str, phase: str, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        method = getattr(owner, name, None)
        if method is None:
            return
        seconds = self.seconds

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[phase] += clock() - start

        setattr(owner, name, timed)
        self._wrapped.append((owner, name))

    def wrap_host_phases(self, engine: Any, clock: Callable[[], float] = time.perf_counter) -> None:
        """The schedule, inputs, query state, sampling and detokenize phases of ``engine``'s
        decode step (the forward is wrapped on the model; the boundary and bookkeeping phases
        are worked out after each step)."""
        runner = engine.runner
        self.wrap(engine.scheduler, "schedule", "schedule", clock)
        self.wrap(runner, "_prepare_decode", "inputs", clock)
        self.wrap(runner, "_update_query_state", "query state", clock)
        self.wrap(engine.sampler, "sample", "sampling", clock)
        self.wrap(engine, "_cut_at_stop", "detokenize", clock)


def watch_schedule(engine: Any) -> dict[str, Any]:
    """What ``engine``'s scheduler scheduled last, kept current in the returned dict by a
    wrapper around its ``schedule``: ``prefill`` (the step's kind) and ``batch`` (its
    sequences)."""
    last: dict[str, Any] = {"prefill": True, "batch": 0}
    schedule = engine.scheduler.schedule

    def scheduled() -> Any:
        out = schedule()
        last["prefill"], last["batch"] = out.is_prefill, len(out.seqs)
        return out

    engine.scheduler.schedule = scheduled
    return last


def narrow_model(head_dim: int, vocab: int, layers: int) -> Any:
    from growpage.core.rope import RopeConfig
    from growpage.engine.loading.loader import build_model, meta_shapes
    from growpage.engine.modeling.model import ModelConfig

    cfg = ModelConfig(
        arch="llama",
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=64,
        num_layers=layers,
        num_q_heads=9,
        num_kv_heads=3,
        head_dim=head_dim,
        rope=RopeConfig(head_dim=head_dim),
        bos_token_id=1,
        eos_token_ids=(2,),
        name="narrow-smollm2",
    )
    gen = torch.Generator().manual_seed(0)
    shapes = meta_shapes(cfg)
    return build_model(
        cfg, {name: torch.randn(shape, generator=gen) * 0.1 for name, shape in shapes.items()}
    )


def text_tokens(tokenizer: Any, vocab: int) -> list[int]:
    """SmolLM2 ids below ``vocab`` that decode to whole characters of text on their own (no
    special tokens, no lone UTF-8 bytes, which would keep a detokenizer waiting for the rest of
    a character)."""
    ids = []
    for token in range(vocab):
        text = tokenizer.decode([token])
        if text.strip() and "\ufffd" not in text and text.isprintable():
            ids.append(token)
    return ids


def tiny_model() -> Any:
    """A tiny random Llama (the tests' shapes), weights seeded and large enough that attention
    is peaked and the logits far from uniform."""
    from growpage.core.rope import RopeConfig
    from growpage.engine.loading.loader import build_model, meta_shapes
    from growpage.engine.modeling.model import ModelConfig

    cfg = ModelConfig(
        arch="llama",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope=RopeConfig(head_dim=16),
        bos_token_id=1,
        eos_token_ids=(2,),
        name="tiny-llama",
    )
    gen = torch.Generator().manual_seed(1234)
    weights = {}
    for name, shape in meta_shapes(cfg).items():
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.2 * torch.randn(shape, generator=gen)
        elif "embed_tokens" in name:
            weights[name] = torch.randn(shape, generator=gen)
        else:
            weights[name] = torch.randn(shape, generator=gen) * (1.5 / shape[-1] ** 0.5)
    return build_model(cfg, weights)


def pool_pages(policy: str, lengths: list[int], page: int, same: bool = False) -> int:
    """fullkv (and every policy with ``same``): every page it needs; others: 40% of those
    (the GPU check's pool)."""
    need = sum(-(-n // page) for n in lengths)
    if policy == "fullkv" or same:
        return need
    return max(need * 2 // 5, max(lengths) // page + 2)


def measure_point(
    backend: str, policy: str, batch: int, args: argparse.Namespace, parts: dict
) -> dict:
    """One engine, ``batch`` requests decoding together; ms per decode step and its phases.

    ``backend`` "triton": the GPU's path (Triton attention and boundary kernels, query
    summaries fused into attention) with every launch stubbed, so only the host's part runs;
    the kernels' outputs are left unwritten, so boundary decisions are arbitrary there.
    "torch": the CPU's path, computed in full."""
    with _launches(backend):
        clean = _measure(backend, policy, batch, args, parts, phases=False)
        split = _measure(backend, policy, batch, args, parts, phases=True)
    return {
        **clean,
        "phases_ms": split["phases_ms"],
        "phases_total_ms": split["wall_ms_per_step"],
        "fingerprint": clean["fingerprint"] if split["fingerprint"] == clean["fingerprint"] else "",
    }


@contextlib.contextmanager
def _launches(backend: str) -> Iterator[None]:
    if backend != "triton":
        yield
        return
    from growpage.kernels import without_index_checks
    from growpage.kernels.variants import stubbed_launches

    # No index-value checks: the interpreter always runs them, a GPU by default does not.
    with stubbed_launches(), without_index_checks(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="attention_backend='triton' on the CPU")
        yield


def _measure(
    backend: str, policy: str, batch: int, args: argparse.Namespace, parts: dict, phases: bool
) -> dict:
    """One run of the point: without wrappers (``phases`` False: CPU and wall time per step),
    or with every phase timed (wall clock; the wrappers cost a little)."""
    from growpage.engine.llm import LLM
    from growpage.engine.sampling_params import SamplingParams

    model, tokenizer = parts["model"], parts["tokenizer"]
    vocab = model.config.vocab_size
    rng = random.Random(batch)
    prompts = [[rng.randrange(17, vocab) for _ in range(rng.randint(45, 75))] for _ in range(batch)]
    lengths = [len(p) + args.max_tokens + 1 for p in prompts]
    llm = LLM(
        model,
        policy=policy,
        tokenizer=tokenizer,
        page_size=args.page_size,
        kv_pages=pool_pages(policy, lengths, args.page_size, same=args.tiny),
        max_num_seqs=batch,
        device="cpu",
        attention_backend=backend,
        boundary_kernels=backend == "triton",
    )
    engine = llm.engine
    runner = engine.runner
    if not args.real_forward:
        gen = torch.Generator().manual_seed(2)
        engine.kv.cache.normal_(generator=gen)  # keys and values to decide on
        runner.model = FixedForward(
            model, args.max_batched_tokens, batch, text_tokens(tokenizer, vocab)
        )
    clock = PhaseClock()
    last = watch_schedule(engine)
    if phases:
        clock.wrap_host_phases(engine)
        if args.real_forward:
            clock.wrap(model, "forward", "forward")
            clock.wrap(model, "compute_logits", "forward")
    elif args.real_forward:
        clock.wrap(model, "forward", "forward", time.thread_time)
        clock.wrap(model, "compute_logits", "forward", time.thread_time)
    else:
        runner.model.clock = time.thread_time
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, stop=list(STOPS))
    seqs = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
    totals = dict.fromkeys(PHASES, 0.0)
    around = parts.get("around")
    with around(llm) if around is not None else contextlib.nullcontext():
        num_steps, wall_s, cpu_s = _decode_all(engine, clock, last, totals, args.real_forward)
    clock.restore()
    per_step = 1000 / max(num_steps, 1)
    return {
        "backend": backend,
        "policy": policy,
        "batch": batch,
        "steps": num_steps,
        "ms_per_step": cpu_s * per_step,
        "wall_ms_per_step": wall_s * per_step,
        "forward_ms": totals["forward"] * per_step,
        "phases_ms": {k: v * per_step for k, v in totals.items()},
        "events": engine.kv.controller.events.as_dict(),
        "kv_pages": engine.kv.num_pages,
        "fingerprint": fingerprint(seqs),
    }


def _decode_all(
    engine: Any, clock: PhaseClock, last: dict, totals: dict[str, float], real: bool
) -> tuple[int, float, float]:
    """Step until every request has finished; adds the phases' seconds of the decode steps to
    ``totals``; returns the decode steps' count, wall seconds and CPU seconds (this thread's:
    what other jobs on the machine take is not counted)."""
    num_steps, wall_s, cpu_s = 0, 0.0, 0.0
    while engine.has_unfinished():
        before = dict(clock.seconds)
        boundary_before = engine.kv.boundary_s
        forward_before = getattr(engine.runner.model, "seconds", 0.0)
        cpu = time.thread_time()
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        cpu = time.thread_time() - cpu
        if last["prefill"]:
            continue
        num_steps += 1
        wall_s += elapsed
        cpu_s += cpu
        phases = {k: clock.seconds[k] - before[k] for k in PHASES}
        phases["boundary"] = engine.kv.boundary_s - boundary_before
        phases["schedule"] -= phases["boundary"]  # no deferred work: all of it scheduling
        if not real:
            phases["forward"] = engine.runner.model.seconds - forward_before
        phases["bookkeeping"] = elapsed - sum(v for k, v in phases.items() if k != "bookkeeping")
        for k in PHASES:
            totals[k] += phases[k]
    return num_steps, wall_s, cpu_s


def fingerprint(seqs: list[Any]) -> str:
    """Hash of every request's tokens, trajectory and boundary events."""
    h = hashlib.sha256()
    for s in seqs:
        h.update(
            repr((s.output_token_ids, list(s.state.trajectory), s.state.events.as_dict())).encode()
        )
    return h.hexdigest()[:16]


def chosen_model(args: argparse.Namespace) -> Any:
    """The model the flags name: SmolLM2 (``--real``), the tiny Llama (``--tiny``) or the
    narrow stubbed one."""
    if args.real:
        from growpage.engine.loading.loader import load_model

        return load_model(None, dtype=torch.float32, device="cpu")
    if args.tiny:
        return tiny_model()
    return narrow_model(args.head_dim, args.vocab, args.layers)


def worker(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    import growpage.kernels  # noqa: F401  (first: it turns Triton's interpreter on)
    from growpage.engine.loading.tokenizer import load_tokenizer

    parts = {"model": chosen_model(args), "tokenizer": load_tokenizer(None)}
    rows = []
    for backend in args.backends:
        for policy in args.policies:
            for batch in args.batches:
                rows.append(measure_point(backend, policy, batch, args, parts))
    Path(args.worker_out).write_text(json.dumps(rows))
    return 0


# ---- the driver: trees, repeats, medians ---------------------------------------------------
def export_tree(ref: str, into: Path) -> Path:
    """``growpage/`` and ``kernels/`` of ``ref`` under ``into``; returns a folder to put on
    ``PYTHONPATH`` that holds only the ``growpage`` package (never the checkout root)."""
    tree = into / "tree"
    tree.mkdir(parents=True)
    git_export(ref, ["growpage", "kernels"], tree, f"--before {ref}")
    check_tree(ref, tree)
    path = into / "path"
    path.mkdir()
    (path / "growpage").symlink_to(tree / "growpage")
    return path


def check_tree(ref: str, tree: Path) -> None:
    """Refuse a ``before`` tree whose package the worker cannot import (``WORKER_MODULES``),
    naming what it lacks, before any worker starts."""
    missing = [m for m in WORKER_MODULES if not (tree / m).is_file()]
    if missing:
        raise SystemExit(
            f"--before {ref}: its tree lacks {', '.join(missing)}, which this script's worker "
            "imports; pick a commit from d9c3893 (growpage/engine in sub-packages) on, e.g. "
            f"the default {DEFAULT_BEFORE}"
        )


def run_worker(args: argparse.Namespace, pythonpath: Path | None, out: Path) -> list[dict]:
    """One worker process (the ``before`` tree's package when ``pythonpath`` is given); a
    worker that fails ends the run, and one that cannot import a module of the ``before``
    tree (``WORKER_MODULES`` lists the ones checked up front) names it and the ref."""
    flags = ["--worker-out", str(out), *_point_flags(args)]
    cmd = [sys.executable, __file__, *flags]
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
        cmd = tree_only_command(__file__, flags)  # the tree's modules, or an import error
    else:
        env.pop("PYTHONPATH", None)
    done = subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), stderr=subprocess.PIPE)
    err = done.stderr.decode(errors="replace")
    sys.stderr.write(err)
    if done.returncode != 0:
        side = "the working tree's" if pythonpath is None else f"the --before {args.before}"
        missing = re.search(r"No module named '([^']+)'", err)
        if missing and pythonpath is not None:
            raise SystemExit(
                f"--before {args.before}: the worker imports {missing.group(1)}, which that "
                f"tree lacks; pick a later commit (from d9c3893 on, e.g. {DEFAULT_BEFORE})"
            )
        raise SystemExit(f"{side} worker failed (exit {done.returncode}); its output is above")
    return json.loads(out.read_text())


def _point_flags(args: argparse.Namespace) -> list[str]:
    flags = [
        "--backends",
        *args.backends,
        "--policies",
        *args.policies,
        "--batches",
        *map(str, args.batches),
        "--max-tokens",
        str(args.max_tokens),
        "--page-size",
        str(args.page_size),
        "--head-dim",
        str(args.head_dim),
        "--vocab",
        str(args.vocab),
        "--layers",
        str(args.layers),
        "--threads",
        str(args.threads),
    ]
    return flags + (["--real"] if args.real else []) + (["--tiny"] if args.tiny else [])


def compare(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    runs: dict[str, list[list[dict]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="host-cost-") as tmp:
        before_path = export_tree(args.before, Path(tmp) / "before")
        order = [("before", before_path), ("after", None)]
        bar = tqdm(total=2 * args.repeats, desc="worker runs", unit="run")
        for rep in range(args.repeats):
            for name, path in order if rep % 2 == 0 else order[::-1]:
                out = Path(tmp) / f"{name}-{rep}.json"
                runs[name].append(run_worker(args, path, out))
                bar.update(1)
        bar.close()
    return summarize(runs)


def summarize(runs: dict[str, list[list[dict]]]) -> dict:
    points = []
    for i, first in enumerate(runs["after"][0]):
        point: dict[str, Any] = {
            "backend": first["backend"],
            "policy": first["policy"],
            "batch": first["batch"],
        }
        for name, reps in runs.items():
            rows = [rep[i] for rep in reps]
            point[name] = {
                "ms_per_step": statistics.median(r["ms_per_step"] for r in rows),
                "wall_ms_per_step": statistics.median(r["wall_ms_per_step"] for r in rows),
                "forward_ms": statistics.median(r["forward_ms"] for r in rows),
                "host_ms": statistics.median(r["ms_per_step"] - r["forward_ms"] for r in rows),
                "phases_total_ms": statistics.median(r["phases_total_ms"] for r in rows),
                "phases_ms": {
                    k: statistics.median(r["phases_ms"][k] for r in rows) for k in PHASES
                },
                "steps": rows[0]["steps"],
                "events": rows[0]["events"],
                "runs_ms": [r["ms_per_step"] for r in rows],
            }
            point[name + "_fingerprints"] = sorted({r["fingerprint"] for r in rows})
        point["identical"] = point["before_fingerprints"] == point["after_fingerprints"] and (
            len(point["after_fingerprints"]) == 1
        )
        if point["backend"] == "triton":  # stubbed kernels: decisions on unwritten outputs
            point["identical"] = None
        point["ratio"] = point["after"]["host_ms"] / point["before"]["host_ms"]
        points.append(point)
    return {"points": points}


def markdown(report: dict, args: argparse.Namespace) -> str:
    pts = report["points"]
    forward = "the real forward" if args.real_forward else "the stubbed forward"
    lines = [
        f"Host ms per decode step: this thread's CPU time per decode step (mean over a run's "
        f"decode steps, boundary work included) less {forward}; medians of {args.repeats} "
        f"runs each. before = {args.before}, after = the working tree at {report['commit']}; "
        f"{report['machine']}.",
        "",
        "| backend | policy | batch | host ms before | host ms after | after / before "
        "| wall ms before | wall ms after | same tokens and decisions |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in pts:
        same = {True: "yes", False: "NO", None: "n/a (stubbed kernels)"}[p["identical"]]
        b, a = p["before"], p["after"]
        lines.append(
            f"| {p['backend']} | {p['policy']} | {p['batch']} | {b['host_ms']:.3f} | "
            f"{a['host_ms']:.3f} | {p['ratio']:.2f} | {b['wall_ms_per_step']:.3f} | "
            f"{a['wall_ms_per_step']:.3f} | {same} |"
        )
    for name in ("before", "after"):
        lines += [
            "",
            f"{name}: wall ms per decode step by phase (a second run with each phase timed)",
            "",
        ]
        lines.append("| backend | policy | batch | total | " + " | ".join(PHASES) + " |")
        lines.append("|---|---|---:|---:|" + "---:|" * len(PHASES))
        for p in pts:
            ph = p[name]["phases_ms"]
            lines.append(
                f"| {p['backend']} | {p['policy']} | {p['batch']} | "
                f"{p[name]['phases_total_ms']:.3f} | "
                + " | ".join(f"{ph[k]:.3f}" for k in PHASES)
                + " |"
            )
    growth = _growth(pts)
    if growth:
        lines += ["", "after, host ms from batch 64 to 256 (4x the requests): " + growth]
    if args.real_forward:
        lines += ["", *_whole_steps(pts)]
    return "\n".join(lines)


def _whole_steps(points: list[dict]) -> list[str]:
    """ms of whole decode steps (CPU, forward included): growpage against fullkv at each batch,
    and each policy from batch 64 to 256, before and after."""
    runs = {
        (name, p["backend"], p["policy"], p["batch"]): p[name]["runs_ms"]
        for p in points
        for name in ("before", "after")
    }
    lines = [
        "ms per decode step, forward included (CPU time; steps: decode steps of the run)",
        "",
        "| backend | policy | batch | steps | ms before | ms after | after / before |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for p in points:
        b, a = p["before"]["ms_per_step"], p["after"]["ms_per_step"]
        lines.append(
            f"| {p['backend']} | {p['policy']} | {p['batch']} | {p['after']['steps']} | "
            f"{b:.3f} | {a:.3f} | {a / b:.2f} |"
        )
    ratios = []
    for (name, backend, policy, batch), values in runs.items():
        full = runs.get((name, backend, "fullkv", batch))
        if policy != "fullkv" and full:
            ratios.append(
                f"{name} {backend} {policy} / fullkv at {batch}: {run_ratios(values, full)}"
            )
        wide = runs.get((name, backend, policy, 256))
        if batch == 64 and wide:
            ratios.append(f"{name} {backend} {policy} from 64 to 256: {run_ratios(wide, values)}")
    return lines + ["", RATIOS_NOTE, ""] + [f"- {r}" for r in ratios]


RATIOS_NOTE = (
    "Each ratio is taken within one worker run (both points measured by the same process, "
    "minutes apart at most), then the median over runs, with the lowest and highest run."
)


def run_ratios(top: list[float], bottom: list[float]) -> str:
    """``top[i] / bottom[i]`` of each worker run i: their median, and their range."""
    ratios = sorted(a / b for a, b in zip(top, bottom, strict=True))
    if len(ratios) == 1:
        return f"{ratios[0]:.2f}x"
    return f"{statistics.median(ratios):.2f}x (runs {ratios[0]:.2f}-{ratios[-1]:.2f})"


def _growth(points: list[dict]) -> str:
    by = {(p["backend"], p["policy"], p["batch"]): p["after"]["host_ms"] for p in points}
    keys = dict.fromkeys((p["backend"], p["policy"]) for p in points)
    return ", ".join(
        f"{backend} {policy} {by[(backend, policy, 256)] / by[(backend, policy, 64)]:.2f}x"
        for backend, policy in keys
        if (backend, policy, 64) in by and (backend, policy, 256) in by
    )


def profile_point(args: argparse.Namespace) -> int:
    """cProfile of one point on the working tree: where its host time goes."""
    backend, policy, batch = (args.profile.split(":") + ["64"])[:3]
    torch.set_num_threads(args.threads)
    import growpage.kernels  # noqa: F401  (first: it turns Triton's interpreter on)
    from growpage.engine.loading.tokenizer import load_tokenizer

    parts = {"model": chosen_model(args), "tokenizer": load_tokenizer(None)}
    from growpage.engine.profiling.boundary_profile import profile_boundaries

    boundary: list[Any] = []

    @contextlib.contextmanager
    def around(llm: Any) -> Iterator[None]:
        with profile_boundaries(llm) as phases:
            boundary.append(phases)
            yield

    parts["around"] = around
    prof = cProfile.Profile()
    prof.enable()
    row = measure_point(backend, policy, int(batch), args, parts)
    prof.disable()
    print(
        f"{backend} {policy} batch {row['batch']}: {row['ms_per_step']:.3f} CPU ms per decode "
        f"step, {row['forward_ms']:.3f} of it the forward"
    )
    print(" | ".join(f"{k} {v:.3f}" for k, v in row["phases_ms"].items()))
    if boundary and boundary[0].boundaries:
        print(boundary[0].markdown())
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile_top)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--backends", nargs="+", choices=["triton", "torch"], default=None)
    p.add_argument("--policies", nargs="+", default=["fullkv", "growpage"])
    p.add_argument("--batches", nargs="+", type=int, default=None)
    p.add_argument("--before", default=DEFAULT_BEFORE, help="git ref of the 'before' engine")
    p.add_argument("--repeats", type=int, default=3, help="worker runs per tree")
    p.add_argument("--max-tokens", type=int, default=None, help="generated tokens per request")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=8)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--layers", type=int, default=30)
    add_threads(p, 1)
    p.add_argument("--real", action="store_true", help="SmolLM2-135M with its real forward")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama with its real forward")
    p.add_argument("--profile", default=None, metavar="BACKEND:POLICY:BATCH")
    p.add_argument("--profile-top", type=int, default=30)
    add_out(p, "host_cost")
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.max_batched_tokens = 4096  # LLM's default max_num_batched_tokens
    if args.real and args.tiny:
        p.error("--real and --tiny are two models: give one")
    args.real_forward = args.real or args.tiny
    if args.backends is None:
        args.backends = ["torch"] if args.real_forward else ["triton", "torch"]
    if args.batches is None:
        args.batches = [16, 64] if args.real else [64, 256] if args.tiny else [1, 16, 64, 256]
    if args.max_tokens is None:
        args.max_tokens = 32 if args.real else 256
    if args.tiny and "--page-size" not in (argv if argv is not None else sys.argv):
        args.page_size = 16
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker_out is not None:
        return worker(args)
    if args.profile is not None:
        return profile_point(args)
    from growpage.eval.machine import describe_machine

    machine = describe_machine()
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    report = compare(args)
    report.update(commit=commit, machine=machine, args=_point_flags(args), before=args.before)
    text = markdown(report, args)
    print(text)
    from growpage.core.traces import atomic_write

    args.out.mkdir(parents=True, exist_ok=True)
    name = "real" if args.real else "tiny" if args.tiny else "stubbed"
    atomic_write(args.out / f"{name}.json", lambda tmp: Path(tmp).write_text(json.dumps(report)))
    atomic_write(args.out / f"{name}.md", lambda tmp: Path(tmp).write_text(text + "\n"))
    return 0 if all(p["identical"] is not False for p in report["points"]) else 1


if __name__ == "__main__":
    raise SystemExit(run_main(main))
