"""``LLMEngine``: requests in, one step at a time: schedule -> run -> update."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from growpage.engine.config import EngineConfig
from growpage.engine.loop.detokenizer import IncrementalDetokenizer
from growpage.engine.loop.kv_manager import KVCacheManager
from growpage.engine.loop.model_runner import ModelRunner
from growpage.engine.loop.recorder import TraceRecorder
from growpage.engine.loop.sampler import Sampler
from growpage.engine.loop.scheduler import Scheduler, SchedulerOutput
from growpage.engine.loop.sequence import FinishReason, Sequence
from growpage.engine.loop.stats import StatsCollector
from growpage.engine.loop.warmup import WarmupReport, warm_up
from growpage.engine.modeling.model import CausalLM
from growpage.engine.sampling_params import SamplingParams
from growpage.errors import EngineError
from growpage.policies.base import CapacityPolicy


class LLMEngine:
    """Continuous-batching engine over one model, one KV cache and one capacity policy.

    ``detokenize(ids) -> str`` is needed only for stop strings.
    """

    _single_texts: dict[int, str] | None = None  # detokenize([t]) of tokens seen (first use)

    def __init__(
        self,
        model: CausalLM,
        config: EngineConfig,
        policy: CapacityPolicy,
        eos_token_ids: tuple[int, ...] = (),
        detokenize: Callable[[list[int]], str] | None = None,
    ) -> None:
        # cuda_graphs / async_compaction None: decided here, where the backend is known.
        graphs_can_run = (
            str(config.device).startswith("cuda")
            and config.record_traces is None
            and bool(getattr(model.backend, "fuses_query_state", False))
        )
        config = config.resolved(graphs_can_run)
        self.model, self.config, self.policy = model, config, policy
        self.eos_token_ids = frozenset(eos_token_ids)
        self._max_position = model.config.max_position
        self.detokenize = detokenize
        self.kv = KVCacheManager(model.config, config, policy)
        self.scheduler = Scheduler(config, self.kv)
        self.recorder = None
        if config.record_traces is not None:
            self.recorder = TraceRecorder(
                config.record_traces,
                model.config,
                config.record_layers,
                config.record_values,
                meta={"policy": getattr(policy, "name", "custom"), "page_size": config.page_size},
            )
        self.runner = ModelRunner(model, self.kv, self.recorder)
        self.sampler = Sampler(config.seed)
        self.stats = StatsCollector(self.kv.controller.events, self._totals)
        self._next_id = 0
        self.warmup_report = WarmupReport()
        if config.warmup or (config.warmup is None and self.kv.cache.is_cuda):
            self.warmup_report = warm_up(self)
        if config.cuda_graphs:
            self._enable_cuda_graphs()

    def _enable_cuda_graphs(self) -> None:
        from growpage.engine.loop.cuda_graphs import DecodeGraphs

        if not self.kv.cache.is_cuda or not self.runner.fuses_query_state:
            raise EngineError(
                "cuda_graphs needs a CUDA device and attention_backend='triton' "
                f"(device {self.kv.cache.device}, backend "
                f"{getattr(self.model.backend, 'name', '?')})"
            )
        if self.recorder is not None:
            raise EngineError(
                "cuda_graphs cannot record traces (the recorder reads each step's "
                "keys and values); turn one of them off"
            )
        self.runner.graphs = DecodeGraphs(self.runner, self.config.max_num_seqs)

    def _totals(self) -> dict[str, float]:
        """Running totals whose growth over a call ``EngineStats`` reports."""
        kv = self.kv
        return {
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_hit_tokens": kv.prefix_hit_tokens,
            "boundary_s": kv.boundary_s,
            "deferred_s": kv.deferred.work_s,
            "deferred_waited_s": kv.deferred.waited_s,
        }

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        forced_token_ids: list[int] | None = None,
        prompt: str | None = None,
        arrival_s: float | None = None,
    ) -> Sequence:
        """Queue a request (``EngineError`` when it is empty or can never fit).

        Prompt and output share the model's context (``max_position`` tokens): the prompt must
        leave room for a token, a scored continuation must fit beside its prompt, and
        generation stops with finish reason ``length`` when the context is full.
        ``arrival_s`` (``time.perf_counter()`` seconds; default now) is when the request
        arrived, what its TTFT and end-to-end latency count from.
        """
        self.check_request(request_id, prompt_token_ids, params, forced_token_ids)
        seq = Sequence(
            self._next_id,
            request_id,
            prompt_token_ids,
            params,
            forced_token_ids,
            prompt,
            arrival_s=(time.perf_counter() if arrival_s is None else arrival_s),
        )
        self.scheduler.add(seq)
        self._next_id += 1
        return seq

    def check_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        forced_token_ids: list[int] | None = None,
    ) -> None:
        """What ``add_request`` refuses, without queueing anything (``EngineError``)."""
        if not prompt_token_ids:
            raise EngineError(f"request {request_id!r}: empty prompt")
        self._check_context(request_id, len(prompt_token_ids), forced_token_ids)
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise EngineError(f"request {request_id!r}: token ids must lie in [0, {vocab})")
        if forced_token_ids is not None and any(not 0 <= t < vocab for t in forced_token_ids):
            raise EngineError(
                f"request {request_id!r}: continuation token ids must lie in [0, {vocab})"
            )
        if params.stop and self.detokenize is None:
            raise EngineError("stop strings need a tokenizer")
        self.scheduler.check_fits(request_id, len(prompt_token_ids), params)

    def _check_context(
        self, request_id: str, num_prompt: int, forced_token_ids: list[int] | None
    ) -> None:
        context = self.model.config.max_position
        if num_prompt >= context:
            raise EngineError(
                f"request {request_id!r}: the prompt has {num_prompt} tokens; the "
                f"model's context of {context} tokens leaves no room to generate"
            )
        if forced_token_ids is not None and num_prompt + len(forced_token_ids) > context:
            raise EngineError(
                f"request {request_id!r}: prompt ({num_prompt}) + continuation "
                f"({len(forced_token_ids)}) = {num_prompt + len(forced_token_ids)}"
                f" tokens exceed the model's context of {context} tokens"
            )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort_all(self) -> list[Sequence]:
        """Finish every queued and running request as aborted (pages and slots returned)."""
        seqs = list(self.scheduler.running) + list(self.scheduler.waiting)
        for seq in seqs:
            self._abort(seq)
        return seqs

    def abort(self, request_id: str) -> Sequence | None:
        """Finish the queued or running request ``request_id`` as aborted (its pages and query
        slot go back, its recorded trace is dropped); None when no unfinished request has that
        id. Between steps only: the engine is not thread-safe."""
        for seq in (*self.scheduler.running, *self.scheduler.waiting):
            if seq.request_id == request_id:
                self._abort(seq)
                return seq
        return None

    def _abort(self, seq: Sequence) -> None:
        self.scheduler.finish(seq, FinishReason.ABORT)
        self.sampler.forget(seq.seq_id)
        if self.recorder is not None:
            self.recorder.discard(seq)

    # ---- the step -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Run one step; returns the sequences that finished in it.

        In ``torch.inference_mode``: a step's host work is hundreds of small tensor
        operations (the capacity boundaries above all), each of which costs less outside
        autograd's bookkeeping; the tensors a step makes are inference tensors."""
        start = time.perf_counter()
        out: SchedulerOutput | None = None
        try:
            out = self.scheduler.schedule()
            b = self.kv.page_size
            capacities = [] if out.is_prefill else [len(s.state.block_table) * b for s in out.seqs]
            prompts = [] if out.is_prefill else [len(s.prompt_token_ids) for s in out.seqs]
            seqs, logits = self.runner.run(out)
        except BaseException:
            self.kv.deferred.cancel()  # their requests are unchanged (still at the boundary)
            if out is not None:  # the forward failed: its slots and chunks are computed again
                self.scheduler.unschedule(out)
            raise
        try:
            self.kv.deferred.run()  # compressions that sat this step out, beside its forward
        except BaseException:
            self.update(out, seqs, logits)  # the forward ran: its requests keep their tokens
            raise
        finished = self.update(out, seqs, logits)
        self.stats.on_step(
            time.perf_counter() - start,
            len(self.scheduler.running) + len(finished),
            capacities,
            self.kv.pool.num_used_pages,
            len(self.scheduler.running),
            prompts,
        )
        return finished

    def update(
        self, out: SchedulerOutput, seqs: list[Sequence], logits: torch.Tensor
    ) -> list[Sequence]:
        """Append each sequence's next token (sampled, or forced when scoring); finish those
        that are done."""
        if out.is_prefill:
            for seq in out.seqs:
                self.kv.register_full_pages(seq)
        if not seqs:
            return []
        forced = [s.forced_token_ids is not None for s in seqs]
        if any(forced):
            tokens = (
                [0] * len(seqs)
                if all(forced)
                else self.sampler.sample(logits, [s.seq_id for s in seqs], [s.params for s in seqs])
            )
            tokens = [
                s.forced_token_ids[s.num_output_tokens] if s.forced_token_ids else t
                for s, t in zip(seqs, tokens, strict=True)
            ]
            logprobs, ranks = self.sampler.logprobs(logits, tokens)
            for i, seq in enumerate(seqs):
                if forced[i]:
                    seq.token_logprobs.append(logprobs[i])
                    seq.token_ranks.append(ranks[i])
        else:
            tokens = self.sampler.sample(logits, [s.seq_id for s in seqs], [s.params for s in seqs])
        now = time.perf_counter()
        finished = []
        for seq, token in zip(seqs, tokens, strict=True):
            seq.output_token_ids.append(token)
            if seq.first_token_s is None:
                seq.first_token_s = now
            reason = self._finish_reason(seq)
            if reason is not None:
                self._finish(seq, reason, now)
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence) -> FinishReason | None:
        p, out = seq.params, seq.output_token_ids
        token = out[-1]
        if seq.forced_token_ids is not None:
            return FinishReason.LENGTH if len(out) >= len(seq.forced_token_ids) else None
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            return FinishReason.STOP
        if p.stop and self._cut_at_stop(seq):
            return FinishReason.STOP
        if len(out) >= p.max_tokens:
            return FinishReason.LENGTH
        if len(seq.prompt_token_ids) + len(out) >= self._max_position:
            return FinishReason.LENGTH
        return None

    def detokenizer(self, seq: Sequence) -> IncrementalDetokenizer:
        """``seq``'s incremental detokenizer, brought up to date with its output tokens: each
        call decodes only the tokens added since the last one (and a little context)."""
        assert self.detokenize is not None
        if seq.detokenizer is None:
            if self._single_texts is None:
                self._single_texts = {}
            seq.detokenizer = IncrementalDetokenizer(self.detokenize, self._single_texts)
        seq.detokenizer.update(seq.output_token_ids)
        return seq.detokenizer

    def _cut_at_stop(self, seq: Sequence) -> bool:
        """Whether the text now contains a stop string; sets ``stop_text_len`` to the first.
        Searches only where a match can be new: from one stop's length before the text already
        searched (``stop_tail`` keeps those characters), through the unsettled tail (what a
        full decode shows)."""
        det = seq.detokenizer
        if det is None:
            det = self.detokenizer(seq)
            new = det.text
        else:
            new = det.update(seq.output_token_ids)
        stops = seq.params.stop
        searched, num_chars = seq.stop_searched_len, det.num_chars
        if len(new) != num_chars - searched:  # text settled by another caller since
            new = det.tail(num_chars - searched)
        text = seq.stop_tail + new
        start = searched - len(seq.stop_tail)
        region = text + det.pending if det.pending else text
        seq.stop_searched_len = num_chars
        keep = max(map(len, stops)) - 1
        seq.stop_tail = text[-keep:] if keep > 0 else ""
        hits = [i for i in map(region.find, stops) if i >= 0]
        if hits:
            seq.stop_text_len = start + min(hits)
        return bool(hits)

    def _finish(self, seq: Sequence, reason: FinishReason, now: float) -> None:
        seq.finish_s = now
        self.scheduler.finish(seq, reason)
        self.sampler.forget(seq.seq_id)
        self.stats.on_finish(seq)
        if self.recorder is not None:
            self.recorder.finish(
                seq, {"finish_reason": reason.value, "events": seq.state.events.as_dict()}
            )
