"""What host work (torch ops, Triton launches, syncs) does one capacity boundary cost the engine?

On a GPU a boundary of a small model costs launch overhead and host syncs, not FLOPs, so this
counts them, per outcome, on any machine (on CPU the Triton path runs under the interpreter):

    python benchmarks/boundary_ops.py                     # tiny random model, Triton path
    python benchmarks/boundary_ops.py --model smollm2 --kv-pages 60   # on a GPU: real ms
    python benchmarks/boundary_ops.py --path torch        # the torch path (CPU default)
    python benchmarks/boundary_ops.py --json out.json
    python benchmarks/boundary_ops.py --host-only          # host ms per boundary, any machine
    python benchmarks/boundary_ops.py --phases             # and ms by boundary phase

Counted inside ``KVCacheManager.make_room`` for every boundary the policy decided:

* ``ops``: torch operator calls (``aten``) that launch work; views and metadata calls
  (``view``, ``select``, ``slice``, ``expand``...) are counted apart as ``views``;
* ``launches``: Triton kernel launches;
* ``syncs``: calls that make the host wait for the device (``.item()``, ``bool(tensor)``,
  ``float(tensor)``, ``.tolist()``, device-to-host copies);
* ``h2d``: tensors built from host data (``torch.tensor(list, device=...)``): on a GPU each is
  a host-to-device copy, which waits for the copy;
* ``ms``: mean wall time of the boundary in a second, uncounted run (on CPU with the Triton
  path this is the interpreter's time, not a GPU's; the torch path's is host overhead).
  ``--host-only`` runs once, with every Triton launch a no-op and nothing counted: ``ms`` is
  then the host's part of a kernel-path boundary (Python, torch dispatch, launch wrappers),
  measurable on any machine. The kernels' outputs stay unwritten, so the decisions are not the
  real run's; the code path of each outcome is.

The counts do not depend on the model's size (every step is vectorized over layers and heads),
so the tiny model stands for SmolLM2 or Llama here.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import random
import time
from pathlib import Path

import torch
from script_args import parser, run_main
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

# NOTE: first, before anything imports triton: growpage.kernels turns Triton's interpreter on
# when there is no CUDA device.
import growpage.kernels  # noqa: E402, F401
from growpage.core import selection  # noqa: E402
from growpage.core.decision import Action  # noqa: E402
from growpage.core.rope import RopeConfig  # noqa: E402
from growpage.engine.llm import LLM  # noqa: E402
from growpage.engine.loading.loader import build_model, meta_shapes  # noqa: E402
from growpage.engine.modeling.model import CausalLM, ModelConfig  # noqa: E402
from growpage.engine.profiling.boundary_profile import profile_boundaries  # noqa: E402
from growpage.engine.sampling_params import SamplingParams  # noqa: E402
from growpage.kernels import without_index_checks  # noqa: E402
from growpage.kernels.variants import stubbed_launches  # noqa: E402

VIEW_OPS = {
    "view",
    "_unsafe_view",
    "select",
    "slice",
    "unsqueeze",
    "squeeze",
    "permute",
    "expand",
    "transpose",
    "t",
    "alias",
    "detach",
    "detach_",
    "as_strided",
    "unbind",
    "split",
    "lift_fresh",
    "_reshape_alias",
    "reshape",
    "flatten",
    "unflatten",
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
}
SYNC_OPS = {"_local_scalar_dense", "is_nonzero", "item", "nonzero"}


def _kind(func: object) -> str:
    name = str(func).split(".")[1] if str(func).startswith("aten.") else str(func)
    if name in SYNC_OPS:
        return "syncs"
    if name == "lift_fresh":
        return "h2d"
    return "views" if name in VIEW_OPS else "ops"


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.names: collections.Counter[str] = collections.Counter()

    def __enter__(self):
        # ``tolist()`` reads a tensor on the host (a sync on a GPU) without an aten operator
        # on the CPU: counted here, and its own device-to-host copy not counted again.
        original = self._tolist = torch.Tensor.tolist

        def tolist(tensor):
            self.counts["syncs"] += 1
            with _disable_current_modes():
                return original(tensor)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # In inference mode (the engine's step) ``Tensor.to`` reaches this mode whole, also
        # where it returns its input: run its decomposition through the mode, so that only a
        # conversion or a copy (``_to_copy``) counts, as outside inference mode.
        if func.overloadpacket is torch.ops.aten.to:
            TorchDispatchMode.__enter__(self)  # the mode again, not this class's tolist patch
            try:
                return func.decompose(*args, **(kwargs or {}))
            finally:
                TorchDispatchMode.__exit__(self, None, None, None)
        kind = _kind(func)
        self.counts[kind] += 1
        if kind != "views":
            self.names[str(func)] += 1
        if str(func).startswith("aten._to_copy") and args and _crosses_to_host(args, kwargs):
            self.counts["syncs"] += 1
        return func(*args, **(kwargs or {}))


def _crosses_to_host(args: tuple, kwargs: dict | None) -> bool:
    src = args[0]
    dst = (kwargs or {}).get("device")
    return isinstance(src, torch.Tensor) and src.device.type != "cpu" and str(dst) == "cpu"


@contextlib.contextmanager
def _counting_triton_launches(counter: _Counter):
    """Count Triton launches and keep the interpreter's own tensor traffic out of the counts
    (the launch methods are restored on exit)."""
    from triton.runtime import interpreter, jit

    originals = {cls: cls.run for cls in (interpreter.InterpretedFunction, jit.JITFunction)}
    for cls, original in originals.items():

        def run(self, *args, _original=original, **kwargs):
            if kwargs.get("warmup"):
                return _original(self, *args, **kwargs)
            counter.counts["launches"] += 1
            counter.names[f"triton.{getattr(self, '__name__', 'kernel')}"] += 1
            with _disable_current_modes():
                return _original(self, *args, **kwargs)

        cls.run = run
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.run = original


def tiny_model(seed: int = 0) -> CausalLM:
    """A random 4-layer GQA model (6 query heads on 2 KV heads, head dim 32)."""
    cfg = ModelConfig(
        arch="llama",
        vocab_size=256,
        hidden_size=96,
        intermediate_size=128,
        num_layers=4,
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=32,
        rope=RopeConfig(head_dim=32),
        bos_token_id=1,
        eos_token_ids=(2,),
        name="tiny-random",
    )
    gen = torch.Generator().manual_seed(seed)
    shapes = meta_shapes(cfg)
    sd = {
        name: (1.0 + 0.1 * torch.randn(shape, generator=gen))
        if name.endswith("norm.weight")
        else torch.randn(shape, generator=gen) * (1.5 / shape[-1] ** 0.5)
        for name, shape in shapes.items()
    }
    return build_model(cfg, sd)


def outcome_kind(outcome) -> str:
    if outcome.decision is None:
        return "forced grow"
    if outcome.action is Action.GROW:
        return "decided grow"
    return "compress" if outcome.action is Action.COMPRESS else outcome.action.value


def measure(args: argparse.Namespace) -> dict:
    # The kernel path stands for a GPU: the selection's global top-k as a GPU runs it (one
    # stable argsort, not the CPU's keyed partial top-k; the same slots either way), and no
    # checks of the kernels' index values (the interpreter always checks them, a GPU by default
    # does not).
    from growpage.core.boundary_context import BoundaryBatch

    keyed, pad = selection.keyed_top_k, BoundaryBatch.pad
    if args.path == "triton":
        selection.keyed_top_k = False
    BoundaryBatch.pad = getattr(args, "pad", None)
    try:
        with without_index_checks():
            return {**_measure(args), "pad": BoundaryBatch.pad}
    finally:
        selection.keyed_top_k, BoundaryBatch.pad = keyed, pad


def _measure(args: argparse.Namespace) -> dict:
    if args.host_only:  # one run, launches stubbed: host milliseconds only, no counts
        phases: dict | None = {} if args.phases else None
        with stubbed_launches():
            rows, _ = _run(args, None, phases)
        return {
            "path": args.path,
            "policy": args.policy,
            "model": args.model,
            "device": args.device,
            "host_only": True,
            "top_ops": [],
            "rows": {
                kind: {"boundaries": r["boundaries"], "ms": r["ms"]}
                for kind, r in rows.items()
                if kind != "shared steps"
            },
            **({"phases": phases} if phases else {}),
        }
    counter = _Counter()
    with _counting_triton_launches(counter):
        counted_rows, names = _run(args, counter)
    timed_rows, _ = _run(args, None)  # again, without the counting overhead
    for kind, row in counted_rows.items():
        if kind != "shared steps":
            row["ms"] = timed_rows[kind]["ms"]
    report = {
        "path": args.path,
        "policy": args.policy,
        "model": args.model,
        "host_only": False,
        "device": args.device,
        "rows": counted_rows,
        "top_ops": names.most_common(args.top),
    }
    if args.phases:  # a third run: the phase timers (and their syncs) stay out of the ms above
        _run(args, None, report.setdefault("phases", {}))
    return report


def _run(
    args: argparse.Namespace, counter: _Counter | None, phases: dict | None = None
) -> tuple[dict[str, dict], collections.Counter]:
    """One generation; per outcome the mean counts (``counter``) or host time (None).
    ``phases``: filled with the run's boundary phases (synced per phase on CUDA)."""
    model = (
        tiny_model() if args.model == "tiny" else (None if args.model == "smollm2" else args.model)
    )
    llm = LLM(
        model,
        policy=args.policy,
        page_size=args.page_size,
        kv_pages=args.kv_pages,
        max_num_seqs=args.requests,
        min_capacity=2,
        enable_prefix_caching=False,
        device=args.device,
        boundary_kernels=args.path == "triton",
        # The synchronous boundary path, whole inside make_room, on every device.
        cuda_graphs=False,
        async_compaction=False,
    )
    kv = llm.engine.kv
    make_room, prepare, run_compactions = kv.make_room, kv.prepare_boundaries, kv.run_compactions
    buckets: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    seconds: dict[str, float] = collections.defaultdict(float)
    shared_steps: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    step: dict = {"id": 0, "shared": False, "booked": None}

    def prepared(seqs):
        prepare(seqs)
        step["id"] += 1
        step["shared"] = kv._batch is not None  # two or more decided boundaries this step
        step["booked"] = None  # the kind of a lone compression booked this step

    def compacted(compactions):
        # The step's booked compressions (their selections, check and compaction): a lone
        # one's work is its boundary's, a shared step's the step's.
        start = time.perf_counter()
        if counter is None:
            run_compactions(compactions)
        else:
            counter.counts.clear()
            with counter:
                run_compactions(compactions)
        elapsed = time.perf_counter() - start
        counts = counter.counts if counter is not None else collections.Counter()
        if step["shared"]:
            shared_steps[step["id"]].update(counts)
        elif step["booked"] is not None:
            buckets[step["booked"]].update(counts)
            seconds[step["booked"]] += elapsed

    def counted(seq):
        if not kv.controller.needs_decision(seq.state):
            return make_room(seq)
        start = time.perf_counter()
        if counter is None:
            outcome = make_room(seq)
        else:
            counter.counts.clear()
            with counter:
                outcome = make_room(seq)
        elapsed = time.perf_counter() - start
        kind = outcome_kind(outcome) if outcome is not None else "none"
        if kind in ("compress", "shrink") and not step["shared"]:
            step["booked"] = kind
        if step["shared"] and kind != "forced grow":
            shared_steps[step["id"]].update(counter.counts if counter is not None else {})
            shared_steps[step["id"]][kind] += 1
            kind += " (shared step)"
        if counter is not None:
            buckets[kind].update(counter.counts)
        buckets[kind]["n"] += 1
        seconds[kind] += elapsed
        return outcome

    kv.make_room = counted  # type: ignore[method-assign]
    kv.prepare_boundaries = prepared  # type: ignore[method-assign]
    kv.run_compactions = compacted  # type: ignore[method-assign]
    rng = random.Random(0)
    lo, hi = args.prompt_len
    prompts = [
        [rng.randrange(3, 256) for _ in range(rng.randint(lo, hi))] for _ in range(args.requests)
    ]
    with (
        profile_boundaries(llm, sync=True) if phases is not None else contextlib.nullcontext()
    ) as profile:
        llm.generate(
            prompts, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True), use_tqdm=False
        )
    if phases is not None:
        phases.update(profile.as_dict(), markdown=profile.markdown())
    rows = {}
    if shared_steps:  # steps whose decided boundaries shared one BoundaryBatch
        rows["shared steps"] = _shared_summary(list(shared_steps.values()))
    for kind, c in sorted(buckets.items()):
        n = c["n"]
        rows[kind] = {
            "boundaries": n,
            **{k: round(c[k] / n, 2) for k in ("ops", "views", "launches", "syncs", "h2d")},
            "ms": round(1000 * seconds[kind] / n, 3),
        }
    return rows, (counter.names if counter is not None else collections.Counter())


def _shared_summary(steps: list[collections.Counter]) -> dict:
    """Per step with a shared batch: decided boundaries, compressions and the host syncs of all
    of them together (one for every Delta_t of the step, one per compression's check)."""
    decided = [sum(c[k] for k in c if k in ("decided grow", "compress", "shrink")) for c in steps]
    return {
        "steps": len(steps),
        "boundaries": sum(decided),
        "per_step": [
            {
                "decided": d,
                "compress": c["compress"] + c["shrink"],
                "syncs": c["syncs"],
                "launches": c["launches"],
                "ops": c["ops"],
            }
            for d, c in zip(decided, steps, strict=True)
        ],
    }


def _prompt_len(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--path", choices=("triton", "torch"), default="triton")
    p.add_argument("--model", default="tiny", help="tiny (random), smollm2, or a GGUF path")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--policy", default="growpage")
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-pages", type=int, default=30)
    p.add_argument(
        "--prompt-len",
        type=_prompt_len,
        default=(20, 59),
        metavar="LO-HI",
        help="prompt lengths drawn from LO..HI (equal lengths put the requests' "
        "boundaries in the same steps)",
    )
    p.add_argument("--top", type=int, default=0, help="also list the N most called operators")
    p.add_argument(
        "--host-only",
        action="store_true",
        help="time the boundaries with Triton launches stubbed out (host cost only)",
    )
    p.add_argument(
        "--phases",
        action="store_true",
        help="also time each boundary phase, the device synced per phase on CUDA "
        "(growpage.engine.profiling.boundary_profile), in a run of its own (with "
        "--host-only: in the same run)",
    )
    p.add_argument(
        "--pad",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sort a step's members of different candidate counts together, "
        "zero-padded (BoundaryBatch.pad); default: as the device does (a GPU "
        "pads, a CPU does not)",
    )
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = measure(args)
    host = ", launches stubbed: ms is host time" if report["host_only"] else ""
    print(
        f"{report['policy']} on the {report['path']} path ({report['model']} model, "
        f"{report['device']}{host}); per boundary:"
    )
    print(
        "| outcome | boundaries | ops | views | Triton launches | syncs | host->device | "
        "ms (this machine) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind, r in report["rows"].items():
        if kind == "shared steps":
            continue
        counts = " | ".join(
            str(r.get(k, "-")) for k in ("ops", "views", "launches", "syncs", "h2d")
        )
        print(f"| {kind} | {r['boundaries']} | {counts} | {r['ms']} |")
    shared = report["rows"].get("shared steps")
    if shared:
        print(
            f"\n{shared['steps']} steps held {shared['boundaries']} decided boundaries between "
            "them (a shared BoundaryBatch); per step:"
        )
        print(
            "| decided | compressions | syncs | Triton launches | ops |\n|---:|---:|---:|---:|---:|"
        )
        for row in shared["per_step"]:
            print(
                f"| {row['decided']} | {row['compress']} | {row['syncs']} | "
                f"{row['launches']} | {row['ops']} |"
            )
    for name, n in report["top_ops"]:
        print(f"{n:6d}  {name}")
    if "phases" in report:
        print("\n" + report["phases"]["markdown"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
