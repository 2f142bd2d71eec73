"""``TraceRecorder``: writes each finished request as a trace (format: docs/trace-format.md).

Row ``t`` of a trace is the token at position ``t`` whose query and key were computed: the
prompt and every generated token fed back. The last generated token is never fed back, so it
is not a row; it is kept in ``meta["last_token_id"]``. Recording needs every position computed
by this request, so the engine turns prefix caching off while recording; after a preemption
the recompute overwrites the rows from where it restarts.
"""

from __future__ import annotations

from pathlib import Path

import torch

from growpage.core.trace_set import TraceSet
from growpage.core.traces import Trace, TraceHeader
from growpage.engine.loop.scheduler import SchedulerOutput
from growpage.engine.loop.sequence import Sequence
from growpage.engine.modeling.model import ModelConfig
from growpage.engine.modeling.step_context import StepCapture
from growpage.errors import EngineError

KINDS = ("q", "k", "v")


class TraceRecorder:
    """Accumulates per-layer q/k/v of running requests and writes finished ones to a set."""

    def __init__(
        self,
        directory: str | Path,
        model_config: ModelConfig,
        layers: tuple[int, ...] | None = None,
        with_values: bool = True,
        meta: dict | None = None,
    ) -> None:
        num_layers = model_config.num_layers
        self.layers = tuple(range(num_layers)) if layers is None else tuple(layers)
        if not self.layers or any(not 0 <= i < num_layers for i in self.layers):
            raise EngineError(
                f"record_layers must be model layers in [0, {num_layers}), got {list(self.layers)}"
            )
        self.model_config, self.with_values = model_config, with_values
        self.meta = dict(meta or {})
        self.trace_set = TraceSet(directory, create=True)
        self._rows: dict[int, dict[str, list[torch.Tensor]]] = {}
        self._counts: dict[int, int] = {}

    def record(self, out: SchedulerOutput, capture: StepCapture) -> None:
        """Keep the rows of this step's new tokens, per sequence (capture over all layers)."""
        offset = 0
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            start = seq.state.position - n
            self._truncate(seq.seq_id, start)
            rows = self._rows.setdefault(seq.seq_id, {k: [] for k in KINDS})
            for kind, source in zip(
                KINDS, (capture.queries, capture.keys, capture.values), strict=True
            ):
                if kind == "v" and not self.with_values:
                    continue
                rows[kind].append(
                    torch.stack([source[i][offset : offset + n] for i in self.layers]).to(
                        "cpu", torch.float16
                    )
                )
            self._counts[seq.seq_id] = start + n
            offset += n

    def _truncate(self, seq_id: int, start: int) -> None:
        count = self._counts.get(seq_id, 0)
        if start == count:
            return
        if start > count:
            raise EngineError(
                f"trace recorder: sequence {seq_id} skipped positions "
                f"{count}..{start - 1} (prefix caching must be off)"
            )
        rows = self._rows[seq_id]
        for kind, parts in rows.items():
            if parts:
                rows[kind] = [torch.cat(parts, dim=1)[:, :start]]
        self._counts[seq_id] = start

    def discard(self, seq: Sequence) -> None:
        self._rows.pop(seq.seq_id, None)
        self._counts.pop(seq.seq_id, None)

    def _free_id(self, request_id: str) -> str:
        """``request_id``, or ``request_id-N`` with the smallest N >= 1 not yet in the set (a
        second engine recording into an existing set starts its ids at 0 again)."""
        taken = {e.request_id for e in self.trace_set.index}
        candidate, n = request_id, 0
        while candidate in taken:
            n += 1
            candidate = f"{request_id}-{n}"
        return candidate

    def finish(self, seq: Sequence, extra_meta: dict | None = None) -> Path | None:
        """Write ``seq``'s trace; returns its file (None when nothing was recorded)."""
        rows = self._rows.pop(seq.seq_id, None)
        count = self._counts.pop(seq.seq_id, 0)
        if rows is None or count == 0:
            return None
        tokens = seq.token_ids[:count]
        c = self.model_config
        request_id = self._free_id(seq.request_id)
        header = TraceHeader(
            request_id=request_id,
            model=c.name or c.arch,
            num_layers=c.num_layers,
            layer_ids=self.layers,
            num_q_heads=c.num_q_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            rope=c.rope,
            softmax_scale=c.head_dim**-0.5,
            prompt_len=min(len(seq.prompt_token_ids), count),
            token_ids=tokens,
            has_values=self.with_values,
            meta={
                **self.meta,
                **(extra_meta or {}),
                "last_token_id": seq.token_ids[count] if count < seq.num_total_tokens else None,
            },
        )
        tensors = {kind: torch.cat(parts, dim=1) for kind, parts in rows.items() if parts}
        trace = Trace(
            header=header, queries=tensors["q"], keys=tensors["k"], values=tensors.get("v")
        )
        entry = self.trace_set.write(trace)
        return self.trace_set.directory / entry.file
