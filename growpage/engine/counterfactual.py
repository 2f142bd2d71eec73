"""Teacher-forced NLL of a reference trajectory under a counterfactual KV state (the paper's
growth advantage, Fig. 7).

At a capacity boundary at position t a request holds t tokens of KV. *Grow by One Page* keeps
all of them; *Compress & Hold* keeps a selection of ``t - b`` per layer and KV head. Both then
decode the reference's next ``b`` tokens, which need no further boundary. The KV of positions
before t is the same in both branches (it was computed before the boundary), so one dense
forward of the whole reference gives every layer's keys and values, and the NLL of the grow
branch; the compress branch runs only the ``b`` tokens after t, attending, per layer and KV
head, to the kept positions and causally to each other::

    positions:  0 ......................... t-1 | t ........ t+b-1
    grow:       [ all keys                      ] [ causal new   ]
    compress:   [ kept keys (per layer, head)   ] [ causal new   ]
    scored:     the predictions of tokens t+1 .. t+b (from the forwards of t .. t+b-1)

``reference(model, token_ids)`` runs the dense forward once; ``ReferenceKV.nll_kept(start, kept,
length)`` the compress branch, ``ReferenceKV.nlls[start:start + length]`` is the grow branch.
"""

from __future__ import annotations

import attrs
import torch

from growpage.engine.modeling.attention import AttentionBackend
from growpage.engine.modeling.model import CausalLM
from growpage.engine.modeling.step_context import (
    StepCapture,
    StepContext,
    prefill_context,
    use_context,
)
from growpage.errors import EngineError

#: Positions whose logits are computed at once (a vocabulary of 151k makes each row 0.6 MB).
LOGIT_CHUNK = 256


@attrs.frozen
class ReferenceKV:
    """A reference trajectory's dense forward: every layer's post-RoPE keys and values
    ``[T, Hkv, d]`` and the NLL of each next token, ``nlls[i] = -log p(token[i+1] | :i+1)``
    (``[T - 1]`` fp32)."""

    model: CausalLM
    token_ids: torch.Tensor  # [T] int64
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    nlls: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    @torch.inference_mode()
    def nll_kept(self, start: int, kept: torch.Tensor, length: int) -> torch.Tensor:
        """NLLs ``[length]`` of tokens ``start + 1 .. start + length`` when, from the forward
        of token ``start`` on, each layer and KV head attends only to the positions
        ``kept [L, Hkv, K]`` (each < ``start``) of the first ``start`` and to the new tokens.

        With every position kept this is ``nlls[start : start + length]`` (up to rounding)."""
        cfg = self.model.config
        if not (0 < start and start + length < self.num_tokens):
            raise EngineError(
                f"cannot score {length} tokens after position {start} of a {self.num_tokens}-"
                f"token reference"
            )
        if kept.dim() != 3 or tuple(kept.shape[:2]) != (cfg.num_layers, cfg.num_kv_heads):
            raise EngineError(
                f"kept must be [L={cfg.num_layers}, Hkv={cfg.num_kv_heads}, K], "
                f"got {tuple(kept.shape)}"
            )
        if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= start):
            raise EngineError(f"kept positions must lie in [0, {start})")
        masks = torch.zeros(cfg.num_layers, cfg.num_kv_heads, start, dtype=torch.bool)
        masks.scatter_(2, kept.long().cpu(), True)
        layers = self.model.model.attention_layers()
        backends = [attn.backend for attn in layers]
        try:
            for i, attn in enumerate(layers):
                attn.backend = _KeptPast(self.keys[i][:start], self.values[i][:start], masks[i])
            ids = self.token_ids[start : start + length]
            positions = torch.arange(start, start + length)
            with use_context(prefill_context([length])):
                hidden = self.model(ids, positions)
        finally:
            for attn, backend in zip(layers, backends, strict=True):
                attn.backend = backend
        targets = self.token_ids[start + 1 : start + length + 1]
        return _nlls(self.model, hidden, targets)


@torch.inference_mode()
def reference(model: CausalLM, token_ids: list[int] | torch.Tensor) -> ReferenceKV:
    """The dense forward of ``token_ids`` (one prefill, no KV cache)."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    if ids.numel() < 2:
        raise EngineError("a reference needs at least two tokens")
    capture = StepCapture(record_kv=True)
    with use_context(prefill_context([ids.numel()], capture=capture)):
        hidden = model(ids, torch.arange(ids.numel()))
    num_layers = model.config.num_layers
    keys = tuple(capture.keys[i] for i in range(num_layers))
    values = tuple(capture.values[i] for i in range(num_layers))
    return ReferenceKV(model, ids, keys, values, _nlls(model, hidden[:-1], ids[1:]))


def _nlls(model: CausalLM, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    out = []
    for lo in range(0, targets.numel(), LOGIT_CHUNK):
        logits = model.compute_logits(hidden[lo : lo + LOGIT_CHUNK])
        logp = logits.log_softmax(dim=-1)
        out.append(-logp.gather(1, targets[lo : lo + LOGIT_CHUNK, None]).squeeze(1))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


class _KeptPast(AttentionBackend):
    """One layer's attention over a fixed past (``keys/values [P, Hkv, d]``, ``mask [Hkv, P]``:
    the positions each KV head may see) followed by the step's new tokens, causally."""

    name = "kept-past"

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> None:
        self.keys, self.values, self.mask = keys, values, mask

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: torch.Tensor | None,
        ctx: StepContext,
        scale: float,
    ) -> torch.Tensor:
        n, num_q, _ = q.shape
        group = num_q // k.shape[1]
        keys = torch.cat([self.keys.to(k.dtype), k]).transpose(0, 1)  # [Hkv, P + n, d]
        values = torch.cat([self.values.to(v.dtype), v]).transpose(0, 1)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        heads = self.mask.shape[0]
        allowed = torch.cat(
            [self.mask[:, None, :].expand(-1, n, -1), causal.expand(heads, n, n)], dim=-1
        )  # [Hkv, n, P + n]
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1),
            keys.repeat_interleave(group, dim=0),
            values.repeat_interleave(group, dim=0),
            attn_mask=allowed.repeat_interleave(group, dim=0),
            scale=scale,
        )
        return out.transpose(0, 1)

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        raise EngineError("a counterfactual forward stores no KV")

    def decode(
        self, q: torch.Tensor, layer_cache: torch.Tensor, ctx: StepContext, scale: float
    ) -> torch.Tensor:
        raise EngineError("a counterfactual forward runs its new tokens as one prefill")
