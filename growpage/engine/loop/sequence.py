"""``Sequence``: one request inside the engine (tokens, status, pages, query slot).

Token bookkeeping of a running sequence (``state`` is the core ``RequestState``)::

    token_ids   = prompt_token_ids + output_token_ids
    position    = tokens whose KV has been computed in this residency (= next token's position)
    num_tokens  = resident KV slots (< position after a compaction)
    prefilling  : position < prefill_target        (prefill_target = len(token_ids) at admission)
    decoding    : position == len(token_ids) - 1   (the last token is fed next)

Slot ``i`` of the request lives at ``block_table[i // b] * b + i % b``. Until the first compaction
slot ``i`` holds position ``i``; afterwards each (layer, KV head) holds the positions in
``kept_positions [L, Hkv, K]`` followed by the consecutive positions ``tail_start, ...``.
"""

from __future__ import annotations

import enum

import torch

from growpage.core.request import RequestState
from growpage.core.residency import PrefixChain
from growpage.engine.loop.detokenizer import IncrementalDetokenizer
from growpage.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an end token or a stop string
    LENGTH = "length"  # max_tokens reached (or the model's maximum position)
    ABORT = "abort"  # aborted by the caller or by an error elsewhere


class Sequence:
    """A request's tokens and engine-side state."""

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        forced_token_ids: list[int] | None = None,
        prompt: str | None = None,
        arrival_s: float = 0.0,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.forced_token_ids = None if forced_token_ids is None else list(forced_token_ids)
        self.token_logprobs: list[float] = []  # log-probability of each forced token
        self.token_ranks: list[int] = []  # its rank among all tokens (0 = greedy pick)
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_text_len: int | None = None  # text cut at a stop string
        self.detokenizer: IncrementalDetokenizer | None = None  # output text, for stops/streams
        self.stop_searched_len = 0  # settled output text already searched for stop strings
        self.stop_tail = ""  # its last characters, one stop string's length less one
        self.state = RequestState(request_id, num_prompt_tokens=len(self.prompt_token_ids))
        self.prefill_target = 0
        self.query_slot: int | None = None
        self.num_decode_steps = 0  # in this residency; EMAs start at the first
        self.num_cached_tokens = 0  # prefix-cache hit tokens of the last admission
        self.prefix_chain = PrefixChain()  # its pages in the prefix cache
        self.kept_positions: torch.Tensor | None = None
        self.tail_start = 0
        self.num_preemptions = 0
        self.arrival_s = arrival_s
        self.first_token_s: float | None = None
        self.finish_s: float | None = None

    # ---- tokens -------------------------------------------------------------------------
    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        return self.state.position < self.prefill_target

    @property
    def num_uncomputed_prefill(self) -> int:
        return self.prefill_target - self.state.position

    @property
    def has_query_state(self) -> bool:
        return self.query_slot is not None and self.num_decode_steps > 0

    # ---- residency ----------------------------------------------------------------------
    def reset_residency(self) -> None:
        """Forget pages, slots and KV progress (on preemption or finish); keep the tokens,
        the events and the trajectory."""
        self.state.block_table = []
        self.state.num_tokens = 0
        self.state.position = 0
        self.prefill_target = 0
        self.query_slot = None
        self.num_decode_steps = 0
        self.prefix_chain = PrefixChain()
        self.kept_positions = None
        self.tail_start = 0

    def slot_positions(
        self, num_layers: int, num_kv_heads: int, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Absolute position held by each resident slot, ``[L, Hkv, num_tokens]`` int64, on
        ``device`` (default: where ``kept_positions`` lives, else the CPU)."""
        n = self.state.num_tokens
        kept = self.kept_positions
        if device is None:
            device = kept.device if kept is not None else "cpu"
        if kept is None:
            return torch.arange(n, device=device).expand(num_layers, num_kv_heads, n)
        tail = torch.arange(self.tail_start, self.tail_start + n - kept.shape[-1], device=device)
        return torch.cat([kept.to(device), tail.expand(num_layers, num_kv_heads, -1)], dim=-1)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, prompt={len(self.prompt_token_ids)}, "
            f"out={len(self.output_token_ids)}, pages={self.state.num_pages})"
        )
