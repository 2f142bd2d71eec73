"""TritonAttentionBackend against the torch backend on a tiny random Llama, the fused
query-summary hook against ``update_query_summaries``, and the backend factory.

Runs under Triton's CPU interpreter without CUDA (importing the backend sets it up) and on the
GPU when there is one: the model, cache and step tensors then live on CUDA.
"""

from __future__ import annotations

import functools
import warnings

import attrs
import pytest
import torch
from engine_helpers import PagedDriver, random_state_dict, tiny_config

from growpage import kernels
from growpage.core.demand import update_query_summaries
from growpage.engine.loading.loader import build_model
from growpage.engine.modeling import backends
from growpage.engine.modeling.attention import AttentionBackend, TorchAttentionBackend
from growpage.engine.modeling.backends import QueryStateFusion, make_attention_backend
from growpage.engine.modeling.model import CausalLM
from growpage.engine.modeling.step_context import (
    StepCapture,
    StepContext,
    decode_context,
    use_context,
)
from growpage.engine.modeling.triton_backend import TritonAttentionBackend
from growpage.errors import EngineError

ON_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
PAGE_SIZE = 5  # divides none of the lengths below
PROMPT_LENS = {0: 7, 1: 13, 2: 3}
LATE_SEQ, LATE_CHUNKS = 3, (6, 3)  # joins after JOIN_AT decodes; prefilled in two chunks
NUM_DECODES, JOIN_AT = 8, 4
# (atol, rtol) of triton-vs-torch logits per model/cache dtype (logits are O(10))
TOL = {torch.float32: (5e-5, 1e-5), torch.float16: (3e-2, 1e-2), torch.bfloat16: (2e-1, 2e-2)}


pytestmark = pytest.mark.usefixtures("one_thread")


@attrs.define
class FusedStepContext(StepContext):
    """A step context carrying the fusion hook (what the engine's context would hold)."""

    query_state: QueryStateFusion | None = None


class Driver(PagedDriver):
    """PagedDriver with the model and cache on DEVICE in ``dtype``, and an EMA hook on decode."""

    def __init__(self, model: CausalLM, dtype: torch.dtype) -> None:
        super().__init__(model, num_pages=24, page_size=PAGE_SIZE, seed=7)
        self.cache = self.cache.to(DEVICE, dtype)
        model.bind_kv_cache(self.cache)

    def prefill_last(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        with torch.device(DEVICE):
            return {s: x[-1] for s, x in self.prefill(chunks, last_only=True).items()}

    @torch.inference_mode()
    def decode_fused(
        self, tokens: dict[int, int], capture: StepCapture, fusion: QueryStateFusion | None
    ) -> dict[int, torch.Tensor]:
        seqs = list(tokens)
        positions = [self.lens[s] for s in seqs]
        with torch.device(DEVICE):
            slots = torch.tensor([self._append_slots(s, 1)[0] for s in seqs])
            base = decode_context(
                slots,
                self.block_tables(seqs),
                torch.tensor([self.lens[s] for s in seqs]),
                capture=capture,
            )
            ctx = FusedStepContext(**attrs.asdict(base, recurse=False), query_state=fusion)
            with use_context(ctx):
                hidden = self.model(
                    torch.tensor([tokens[s] for s in seqs]), torch.tensor(positions)
                )
            logits = self.model.compute_logits(hidden)
        return {s: logits[i] for i, s in enumerate(seqs)}


def tiny_model(backend: AttentionBackend, dtype: torch.dtype) -> CausalLM:
    cfg = tiny_config("llama")
    return build_model(cfg, random_state_dict(cfg, seed=1234), backend=backend).to(DEVICE, dtype)


def prompts() -> dict[int, list[int]]:
    gen = torch.Generator().manual_seed(0)
    lens = {**PROMPT_LENS, LATE_SEQ: sum(LATE_CHUNKS)}
    return {s: torch.randint(3, 128, (n,), generator=gen).tolist() for s, n in lens.items()}


def run(
    backend: AttentionBackend,
    dtype: torch.dtype,
    forced: list[dict[int, int]] | None = None,
    summaries: SummaryCheck | None = None,
) -> tuple[list[dict[int, int]], list[dict[int, torch.Tensor]]]:
    """Prefill seqs 0-2, decode, let seq 3 join (two prefill chunks), decode all.

    Returns the greedy token of every sequence after every step and the logits it came from.
    ``forced`` feeds those tokens instead of the own argmax (teacher forcing), so two backends
    are compared on the same histories; ``summaries`` hooks the query-state update in.
    """
    model = tiny_model(backend, dtype)
    drv, ids = Driver(model, dtype), prompts()
    logits = [drv.prefill_last({s: ids[s] for s in PROMPT_LENS})]
    for step in range(NUM_DECODES + 1):
        if step == JOIN_AT:
            late = ids[LATE_SEQ]
            drv.prefill_last({LATE_SEQ: late[: LATE_CHUNKS[0]]})  # cached prefix
            logits[-1] |= drv.prefill_last({LATE_SEQ: late[LATE_CHUNKS[0] :]})
        if step == NUM_DECODES:
            break
        choice = forced[len(logits) - 1] if forced else None
        tokens = choice or {s: int(x.argmax()) for s, x in logits[-1].items()}
        capture = StepCapture()
        fusion = summaries.before(drv, tokens) if summaries else None
        logits.append(drv.decode_fused(tokens, capture, fusion))
        if summaries:
            summaries.after(capture)
    model.bind_kv_cache(None)
    greedy = [{s: int(x.argmax()) for s, x in step.items()} for step in logits]
    return greedy, logits


@functools.cache
def torch_run(dtype: torch.dtype) -> tuple[list[dict[int, int]], list[dict[int, torch.Tensor]]]:
    return run(TorchAttentionBackend(), dtype)


def assert_matches_torch(got: list[dict[int, torch.Tensor]], dtype: torch.dtype) -> None:
    """Logits allclose to the torch backend's at every step; each greedy pick is a torch
    argmax up to the tolerance (in half precision a near-tie may resolve the other way)."""
    want_tokens, want_logits = torch_run(dtype)
    atol, rtol = TOL[dtype]
    assert len(got) == len(want_logits)
    for step, (got_step, want_step) in enumerate(zip(got, want_logits, strict=True)):
        assert got_step.keys() == want_step.keys()
        for s, want in want_step.items():
            where = f"step {step} seq {s}"
            torch.testing.assert_close(
                got_step[s],
                want,
                atol=atol,
                rtol=rtol,
                msg=functools.partial("{}: {}".format, where),
            )
            pick = int(got_step[s].argmax())
            assert pick == want_tokens[step][s] or want[pick] >= want.max() - atol, where


# NOTE: fp16 and split-K: CUDA only here (~10 s per interpreter run); tests/kernels cover both.
CUDA_ONLY = pytest.mark.skipif(not ON_CUDA, reason="slow under the interpreter; CUDA only")
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, id="fp16", marks=CUDA_ONLY),
]


@pytest.mark.parametrize(
    "num_splits", [None, pytest.param(4, marks=CUDA_ONLY)], ids=["splits-auto", "splits-4"]
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matches_torch(dtype: torch.dtype, num_splits: int | None) -> None:
    want_tokens, _ = torch_run(dtype)
    backend = TritonAttentionBackend(num_splits=num_splits)
    got_tokens, got_logits = run(backend, dtype, forced=want_tokens)
    assert_matches_torch(got_logits, dtype)
    if dtype == torch.float32:
        assert got_tokens == want_tokens  # same argmax on the same history: same greedy output


class SummaryCheck:
    """Gives each decode step a QueryStateFusion and keeps a reference pool up to date with
    ``update_query_summaries`` on the captured pre-RoPE queries."""

    SLOTS = {0: 5, 1: 2, 2: -1, 3: 0}  # seq 2 has no slot: its row is skipped

    def __init__(self) -> None:
        cfg = tiny_config("llama")
        shape = (cfg.num_layers, 6, 2, cfg.num_q_heads, cfg.head_dim)
        self.pool = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
        self.pool[:, [0, 2, 5]] = float("nan")  # stale garbage, overwritten on the first step
        self.ref = self.pool.clone()
        self.seen: set[int] = set()

    def before(self, drv: Driver, tokens: dict[int, int]) -> QueryStateFusion:
        seqs = list(tokens)
        self.first = [s not in self.seen for s in seqs]
        self.slot_ids = [self.SLOTS[s] for s in seqs]
        self.seen |= set(seqs)
        return QueryStateFusion(
            self.pool,
            torch.tensor(self.slot_ids, dtype=torch.int32, device=DEVICE),
            torch.tensor(self.first, device=DEVICE),
            drv.cache,
        )

    def after(self, capture: StepCapture) -> None:
        assert sorted(capture.queries) == list(range(self.pool.shape[0]))
        for layer, q_pre in capture.queries.items():
            for row, (slot, first) in enumerate(zip(self.slot_ids, self.first, strict=True)):
                if slot >= 0:
                    update_query_summaries(self.ref[layer, slot], q_pre[row], 0.9, 0.999, first)


def test_fused_query_state_update_matches_reference() -> None:
    check = SummaryCheck()
    want_tokens, _ = torch_run(torch.float32)
    got_tokens, got_logits = run(
        TritonAttentionBackend(), torch.float32, forced=want_tokens, summaries=check
    )
    assert got_tokens == want_tokens
    assert_matches_torch(got_logits, torch.float32)  # the update leaves attention untouched
    assert not check.pool[:, [0, 2, 5]].isnan().any()  # every used slot initialized
    assert check.pool[:, [1, 3, 4]].equal(check.ref[:, [1, 3, 4]])  # others untouched
    torch.testing.assert_close(check.pool, check.ref, atol=1e-6, rtol=1e-6)


def test_fusion_hook_errors() -> None:
    assert (backends.BETA_SHORT, backends.BETA_LONG) == (kernels.BETA_SHORT, kernels.BETA_LONG)
    cfg = tiny_config("llama")
    cache = torch.zeros(2, cfg.num_layers, 4, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim)
    pool = torch.zeros(cfg.num_layers, 3, 2, cfg.num_q_heads, cfg.head_dim)
    ids, first = torch.tensor([0, 1]), torch.tensor([True, False])
    fusion = QueryStateFusion(pool, ids, first, cache)
    assert fusion.layer_of(cache[:, 1]) == 1
    for not_a_layer in (cache[:, 1].clone(), cache[:, :, 1:2].squeeze(2), cache[0]):
        with pytest.raises(EngineError, match="not a view"):
            fusion.layer_of(not_a_layer)
    with pytest.raises(EngineError, match="pre-RoPE query of layer 1"):
        fusion.pre_rope_query(None, 1)
    with pytest.raises(EngineError, match="stale capture"):
        fusion.pre_rope_query(StepCapture(queries={0: torch.zeros(3, 4, 16)}), 0)
    with pytest.raises(EngineError, match="fp32"):
        QueryStateFusion(pool.half(), ids, first, cache)
    with pytest.raises(EngineError, match="differ"):
        QueryStateFusion(pool, ids, first[:1], cache)
    with pytest.raises(EngineError, match="layers"):
        QueryStateFusion(pool[:1], ids, first, cache)
    with pytest.raises(EngineError, match="beta_long"):
        QueryStateFusion(pool, ids, first, cache, beta_long=1.0)


def test_factory_names_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(make_attention_backend("torch", "cuda"), TorchAttentionBackend)
    assert isinstance(make_attention_backend("triton", DEVICE), TritonAttentionBackend)
    assert make_attention_backend(" Auto ", "cpu").name == "torch"
    assert make_attention_backend("auto", torch.device("cuda", 0)).name == "triton"
    for bad in ("flash", "", None):
        with pytest.raises(EngineError, match="unknown attention backend.*'auto', 'torch'"):
            make_attention_backend(bad, "cpu")  # type: ignore[arg-type]
    with pytest.raises(EngineError, match="bad device 'gpu'"):
        make_attention_backend("auto", "gpu")
    with pytest.raises(EngineError, match="not on mps"):
        make_attention_backend("triton", "mps")
    # Kernels imported without the interpreter (the flag is read once, at import, as Triton
    # reads it when the kernels are decorated): the triton backend cannot run on CPU.
    from growpage.kernels import _utils

    monkeypatch.setattr(_utils, "_INTERPRETER", False)
    with pytest.raises(EngineError, match="TRITON_INTERPRET=1"):
        make_attention_backend("triton", "cpu")


@pytest.mark.skipif(ON_CUDA, reason="the interpreter runs only without CUDA")
def test_triton_on_cpu_warns_that_it_is_the_interpreter() -> None:
    with pytest.warns(UserWarning, match="runs Triton's interpreter .* tens of times slower"):
        make_attention_backend("triton", "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_attention_backend("torch", "cpu")
        make_attention_backend("auto", "cpu")
