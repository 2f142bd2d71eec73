"""``LLM``: the user-facing facade (``growpage.LLM``), in the manner of vLLM's ``LLM`` class.

::

    llm = LLM(policy="growpage", page_size=64, kv_pages=256)
    outs = llm.generate(["What is 2+2?"], SamplingParams(max_tokens=64), chat=True)
    outs[0].text, outs[0].trajectory, llm.last_stats.table()
    llm.score(["The capital of France is"], [" Paris."])[0].mean_nll
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Mapping
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import attrs
import numpy as np
import torch

from growpage.core.config import GrowPageConfig, fitted_recent_window
from growpage.engine.config import SETTINGS, EngineConfig, settings_help
from growpage.engine.inputs import (
    Prompt,
    arrival_offsets,
    as_prompt_list,
    encode_continuation,
    encode_prompt,
    per_prompt_params,
    where,
)
from growpage.engine.loop.llm_engine import LLMEngine
from growpage.engine.loop.sequence import Sequence
from growpage.engine.modeling.model import CausalLM
from growpage.engine.outputs import EngineStats, RequestOutput, ScoreOutput, StreamChunk
from growpage.engine.sampling_params import SamplingParams
from growpage.errors import ConfigError, EngineError
from growpage.policies.base import CapacityPolicy
from growpage.policies.registry import resolve_policy

if TYPE_CHECKING:
    from tqdm import tqdm as ProgressBar

    from growpage.engine.modeling.attention import AttentionBackend

_GROWPAGE_FIELDS = {f.name for f in attrs.fields(GrowPageConfig)}
_ENGINE_FIELDS = {f.name for f in SETTINGS}
_MAX_IDLE_S = 60.0  # longest sleep waiting for an arrival (time.sleep refuses ~300 years)
# One request of a call: prompt ids, params, forced continuation ids (score), prompt text.
_Work = tuple[list[int], SamplingParams, list[int] | None, str | None]


def _close_keywords(unknown: set[str]) -> str:
    """``"; did you mean 'page_size'?"`` for misspelled keywords of ``LLM`` or GrowPageConfig
    fields, else a pointer to where the keywords are."""
    import difflib
    import inspect

    own = set(inspect.signature(LLM.__init__).parameters) - {"self", "settings"}
    known = own | _ENGINE_FIELDS | _GROWPAGE_FIELDS
    close = [
        match for name in sorted(unknown) for match in difflib.get_close_matches(name, known, n=1)
    ]
    if close:
        return f"; did you mean {', '.join(map(repr, close))}?"
    return (
        "; LLM takes its own keywords and GrowPageConfig's fields; its own include "
        "EngineConfig's settings (help(LLM) lists them; docs/engine.md, Parameters)"
    )


class LLM:
    """Load a model, build the engine, generate and score.

    Args:
        model: a GGUF file or Hugging Face directory; None = SmolLM2-135M-Instruct; or a
            ready ``CausalLM`` (then pass ``tokenizer`` or use token-id prompts).
        policy: a registered policy name, ``"module:Class"``, ``"file.py:Class"`` or an
            instance; ``policy_kwargs`` are its hyperparameters.
        config: a ``GrowPageConfig``; ``page_size`` and any other ``GrowPageConfig`` field
            given as a keyword (``recent_window=8``...) override it. With a ``page_size`` not
            above the default recent window (16) and no ``recent_window``, the window is
            ``page_size // 4``.
        **settings: ``GrowPageConfig`` fields, and ``EngineConfig``'s engine settings, with
            their defaults there (listed below). Recording needs ``policy="fullkv"`` and turns
            prefix caching off; so does a policy that reads H2O accumulated attention
            (``needs_accumulated_attention``, e.g. ``"h2o"``).

    ``last_stats`` holds the ``EngineStats`` of the last ``generate`` / ``score`` call; it is
    None from the start of a call until the call returns, so a failed call leaves None.

    Engine settings, ``name (default): what`` (``EngineConfig``)::

    """

    def __init__(
        self,
        model: str | Path | CausalLM | None = None,
        policy: str | CapacityPolicy = "growpage",
        policy_kwargs: dict | None = None,
        *,
        tokenizer: Any = None,
        config: GrowPageConfig | None = None,
        **settings: Any,
    ) -> None:
        unknown = set(settings) - _ENGINE_FIELDS - _GROWPAGE_FIELDS
        if unknown:
            raise TypeError(
                f"LLM() got unexpected keyword argument(s) {sorted(unknown)}"
                f"{_close_keywords(unknown)}"
            )
        if config is not None and not isinstance(config, GrowPageConfig):
            raise ConfigError(
                f"LLM(config=...) takes a GrowPageConfig, got "
                f"{type(config).__name__} {config!r:.80}"
            )
        if policy_kwargs is not None and not isinstance(policy_kwargs, Mapping):
            raise ConfigError(
                f"LLM(policy_kwargs=...) takes a dict of the policy's "
                f"hyperparameters, got {type(policy_kwargs).__name__} "
                f"{policy_kwargs!r:.80}"
            )
        engine = {k: v for k, v in settings.items() if k in _ENGINE_FIELDS}
        growpage_fields = {k: v for k, v in settings.items() if k in _GROWPAGE_FIELDS}
        base = config or GrowPageConfig()
        page_size = growpage_fields.get("page_size")
        if isinstance(page_size, int) and "recent_window" not in growpage_fields:
            growpage_fields["recent_window"] = fitted_recent_window(base.recent_window, page_size)
        gp = base.replace(**growpage_fields)
        policy_obj = resolve_policy(policy, **(policy_kwargs or {}))
        recording = engine.get("record_traces") is not None
        if recording and getattr(policy_obj, "name", "") != "fullkv":
            raise EngineError("trace recording needs policy='fullkv' (traces hold full KV)")
        # Per-slot H2O sums cannot live in shared prompt pages
        # (growpage.engine.modeling.accumulation).
        sums = bool(getattr(policy_obj, "needs_accumulated_attention", False))
        # A non-bool goes through as given, for the config to refuse.
        if (recording or sums) and isinstance(engine.get("enable_prefix_caching", True), bool):
            engine["enable_prefix_caching"] = False
        self.config = EngineConfig(growpage=gp, **engine)
        self.model, self.tokenizer = _load(model, tokenizer, self.config)
        eos = set(self.model.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        detok = None if self.tokenizer is None else self.tokenizer.decode
        self.engine = LLMEngine(self.model, self.config, policy_obj, tuple(sorted(eos)), detok)
        self.config = self.engine.config  # what the engine decided (CUDA graphs, async...)
        self.last_stats: EngineStats | None = None
        self._num_requests = 0
        self._serving = False  # a call (or an open stream) is adding and stepping requests

    @property
    def policy(self) -> CapacityPolicy:
        return self.engine.policy

    # ---- public API -----------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        chat: bool = False,
        use_tqdm: bool | None = None,
        arrival_s: Seq[float] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, or token ids as a list or a tensor: ``[N]`` is one
        prompt, ``[B, N]`` B of them); outputs in prompt order.

        ``use_tqdm``: True shows a progress bar (over requests, or over the tokens of a lone
        request), False none, None (default) one over requests when there are several and
        stderr is a terminal (not in a log file).

        ``arrival_s`` (seconds, one per prompt; default: all at once) serves the prompts as
        requests arriving over wall-clock time, the earliest at once: a request joins the
        engine at the first step boundary after its arrival, the engine waits idle when nothing
        has arrived yet, and its TTFT and end-to-end latency count from its arrival. This is
        the simulator's serving setting (``growpage sim serve``); ``poisson_arrivals`` draws
        such times.
        """
        self._check_idle()  # first: an open stream keeps its last_stats
        self.last_stats = None  # a call that fails leaves none, not the previous call's
        _check_chat(chat)
        work, arrivals = self._work(prompts, params, chat, arrival_s)
        seqs = self._run(work, use_tqdm, arrivals)
        return [self._request_output(s) for s in seqs]

    def _work(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None,
        chat: bool,
        arrival_s: object,
    ) -> tuple[list[_Work], list[float] | None]:
        """The requests of a ``generate`` or ``stream`` call, checked as ``add_request`` would
        check them (before any runs: a request arriving late must not fail mid-run), and the
        arrival offsets."""
        prompt_list = as_prompt_list(prompts)
        params_list = per_prompt_params(
            SamplingParams() if params is None else params, len(prompt_list)
        )
        n = len(prompt_list)
        arrivals = arrival_offsets(arrival_s, n)
        rank = {i: r for r, i in enumerate(_joining_order(n, arrivals))}  # ids go by joining
        work: list[_Work] = []
        for i, (prompt, prm) in enumerate(zip(prompt_list, params_list, strict=True)):
            ids, text = encode_prompt(prompt, self.tokenizer, chat, where("prompts", i, n))
            try:
                self.engine.check_request(str(self._num_requests + rank[i]), ids, prm)
            except EngineError as e:  # say which of the caller's prompts it was
                raise EngineError(f"{e}{where('prompts', i, n)}") from None
            work.append((ids, prm, None, text))
        return work, arrivals

    def score(
        self,
        prompts: Prompt | Seq[Prompt],
        continuations: Prompt | Seq[Prompt],
        *,
        chat: bool = False,
        use_tqdm: bool = False,
    ) -> list[ScoreOutput]:
        """Teacher-forced NLL of each continuation after its prompt under the policy (paper
        section 5.3): capacity decisions happen as in decoding, the next token is forced."""
        self._check_idle()  # first: an open stream keeps its last_stats
        self.last_stats = None
        _check_chat(chat)
        prompt_list = as_prompt_list(prompts)
        cont_list = as_prompt_list(continuations, "continuations")
        if len(prompt_list) != len(cont_list):
            raise EngineError(f"{len(prompt_list)} prompts but {len(cont_list)} continuations")
        work: list[_Work] = []
        n = len(prompt_list)
        for i, (p, c) in enumerate(zip(prompt_list, cont_list, strict=True)):
            ids, text = encode_prompt(p, self.tokenizer, chat, where("prompts", i, n))
            forced = encode_continuation(c, self.tokenizer, where("continuations", i, n))
            vocab = self.model.config.vocab_size
            if any(not 0 <= t < vocab for t in forced):
                raise EngineError(
                    f"continuation token ids must lie in [0, {vocab}){where('continuations', i, n)}"
                )
            params = SamplingParams(max_tokens=len(forced), ignore_eos=True)
            work.append((ids, params, forced, text))
        seqs = self._run(work, use_tqdm)
        return [
            ScoreOutput(
                request_id=s.request_id,
                prompt_token_ids=s.prompt_token_ids,
                continuation_token_ids=s.output_token_ids,
                token_nlls=[-lp for lp in s.token_logprobs],
                token_ranks=list(s.token_ranks),
                trajectory=list(s.state.trajectory),
                events=s.state.events.as_dict(),
                num_preemptions=s.num_preemptions,
            )
            for s in seqs
        ]

    def stream(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        chat: bool = False,
        use_tqdm: bool | None = False,
        arrival_s: Seq[float] | None = None,
    ) -> Iterator[StreamChunk]:
        """``generate``, yielding each request's new text after every engine step.

        A ``StreamChunk`` comes for each request that produced visible text in a step, and a
        last one, with ``output`` set, when it finishes; a request's chunks add up to the text
        ``generate`` returns. Leaving the loop early aborts the requests still running (their
        pages come back). ``last_stats`` is set when every request has finished. One stream
        at a time: another call while a stream is open raises ``EngineError``.
        ``arrival_s`` as for ``generate``: a request's chunks start after it arrives.
        """
        self._check_idle()
        self.last_stats = None
        _check_chat(chat)
        work, arrivals = self._work(prompts, params, chat, arrival_s)
        return self._stream(work, use_tqdm, arrivals)

    def _stream(
        self, work: list[_Work], use_tqdm: bool | None, arrivals: list[float] | None
    ) -> Iterator[StreamChunk]:
        shown = [StreamProgress() for _ in work]
        for seqs in self._serve(work, use_tqdm, arrivals):  # noqa: B007
            for i, seq in enumerate(seqs):
                chunk = None if seq is None else self.stream_chunk(i, seq, shown[i])
                if chunk is not None:
                    yield chunk

    def stream_chunk(self, index: int, seq: Sequence, shown: StreamProgress) -> StreamChunk | None:
        """What ``seq`` produced since ``shown`` (which it advances); None when nothing new is
        visible. Text is shown when it is settled (see ``IncrementalDetokenizer``) and cannot
        still turn out to be the start of a stop string; the last chunk carries the rest of
        the final text. ``stream`` calls it after every step; a server that drives
        ``engine`` itself calls it between steps, with one ``StreamProgress`` per request."""
        if shown.done:
            return None
        ids = seq.output_token_ids
        new_ids = ids[shown.num_tokens :]
        output = self._request_output(seq) if seq.is_finished else None
        if output is not None:  # the final text is one full decode: the shown text leads it
            det = seq.detokenizer
            shown_text = "" if det is None else det.text[: shown.num_chars]
            new_text = output.text[shown.num_chars :] if output.text.startswith(shown_text) else ""
        elif self.tokenizer is None:
            new_text = ""
        else:
            det = self.engine.detokenizer(seq)
            stops = seq.params.stop
            hold = _stop_hold(det.tail(max(map(len, stops), default=1) - 1), stops)
            new_text = det.tail(det.num_chars - shown.num_chars)[
                : max(0, det.num_chars - hold - shown.num_chars)
            ]
        if output is None and not new_text:
            return None  # the tokens are shown with the text they complete
        shown.num_tokens, shown.done = len(ids), output is not None
        shown.num_chars += len(new_text)
        return StreamChunk(
            index=index,
            request_id=seq.request_id,
            text=new_text,
            token_ids=list(new_ids),
            output=output,
        )

    # ---- helpers --------------------------------------------------------------------------
    def _check_idle(self) -> None:
        if self._serving:
            raise EngineError(
                "this LLM has a stream open: read it to the end, or call its "
                "close(), before starting another call"
            )

    def _run(
        self, work: list[_Work], use_tqdm: bool | None, arrivals: list[float] | None = None
    ) -> list[Sequence]:
        seqs: list[Sequence | None] = []
        for seqs in self._serve(work, use_tqdm, arrivals):  # noqa: B007
            pass  # the last step's sequences are the result
        return [s for s in seqs if s is not None]  # every one, once all have finished

    def _serve(
        self, work: list[_Work], use_tqdm: bool | None, arrivals: list[float] | None = None
    ) -> Iterator[list[Sequence | None]]:
        """Add the requests, each at its arrival offset (seconds after the first; None: all at
        once), and step until all have arrived and finished, yielding them in ``work``'s order
        after each step (None for one that has not arrived yet); on any error, or a consumer
        that stops early, the unfinished ones are aborted. ``last_stats`` is set before the
        last yield."""
        self._check_idle()
        engine = self.engine
        engine.stats.reset()
        start = engine.stats.start  # the clock of the run: the first arrival
        seqs: list[Sequence | None] = [None] * len(work)
        pending = deque(_joining_order(len(work), arrivals))
        bar = None
        self._serving = True

        def admit(now: float) -> None:
            while pending and (arrivals is None or start + arrivals[pending[0]] <= now):
                i = pending.popleft()
                ids, params, forced, text = work[i]
                try:
                    seqs[i] = engine.add_request(
                        str(self._num_requests),
                        ids,
                        params,
                        forced,
                        text,
                        arrival_s=start + (0.0 if arrivals is None else arrivals[i]),
                    )
                except EngineError as e:  # say which of the caller's prompts it was
                    raise EngineError(f"{e}{where('prompts', i, len(work))}") from None
                self._num_requests += 1

        try:
            admit(start)
            if not work:  # nothing to run: an empty call's statistics, all zero
                self.last_stats = self._summary()
            bar = _progress(work, use_tqdm)
            while pending or engine.has_unfinished():
                admit(time.perf_counter())  # arrived since: while a stream's reader had seqs
                if not engine.has_unfinished():  # idle until the next request arrives
                    assert arrivals is not None
                    idle = time.perf_counter()
                    time.sleep(min(max(0.0, start + arrivals[pending[0]] - idle), _MAX_IDLE_S))
                    engine.stats.on_idle(time.perf_counter() - idle)  # as slept: it may be late
                    continue
                done = engine.step()
                admit(time.perf_counter())
                if bar is not None:
                    bar.update(
                        len(done)
                        if len(work) > 1
                        else (seqs[0].num_output_tokens if seqs[0] else 0) - bar.n
                    )
                if not pending and not engine.has_unfinished():
                    self.last_stats = self._summary()
                yield seqs
        except BaseException:  # GeneratorExit included: the consumer stopped early
            engine.abort_all()
            raise
        finally:
            self._serving = False
            if bar is not None:
                bar.close()

    def _summary(self) -> EngineStats:
        engine = self.engine
        return engine.stats.summary(
            getattr(engine.policy, "name", type(engine.policy).__name__),
            self.config.page_size,
            engine.kv.num_pages,
        )

    def _request_output(self, s: Sequence) -> RequestOutput:
        text = "" if self.tokenizer is None else self.tokenizer.decode(s.output_token_ids)
        if s.stop_text_len is not None:
            text = text[: s.stop_text_len]
        ttft = (s.first_token_s or s.arrival_s) - s.arrival_s
        n = s.num_output_tokens
        tpot = ((s.finish_s or 0) - (s.first_token_s or 0)) / (n - 1) if n > 1 else 0.0
        return RequestOutput(
            request_id=s.request_id,
            prompt=s.prompt,
            prompt_token_ids=s.prompt_token_ids,
            text=text,
            token_ids=list(s.output_token_ids),
            finish_reason=s.finish_reason.value if s.finish_reason else "abort",
            trajectory=list(s.state.trajectory),
            events=s.state.events.as_dict(),
            num_preemptions=s.num_preemptions,
            num_cached_tokens=s.num_cached_tokens,
            ttft_s=ttft,
            tpot_s=tpot,
            e2e_s=(s.finish_s or s.arrival_s) - s.arrival_s,
            arrival_s=s.arrival_s - self.engine.stats.start,
        )


def _load(
    model: str | Path | CausalLM | None, tokenizer: Any, config: EngineConfig
) -> tuple[CausalLM, Any]:
    """The model, with the engine's attention backend installed, and its tokenizer.

    NOTE: a ready ``CausalLM`` is moved to the engine's device and dtype in place and gets the
    engine's backend. Several ``LLM`` may share one: each engine installs its own backend and
    KV cache in the model before each of its steps.
    """
    backend = _attention_backend(config)
    if isinstance(model, CausalLM):
        model.to(device=torch.device(config.device), dtype=config.dtype)
        model.set_backend(backend)
        return model, tokenizer
    from growpage.engine.loading.loader import load_model
    from growpage.engine.loading.tokenizer import load_tokenizer

    loaded = load_model(model, dtype=config.dtype, device=config.device, backend=backend)
    return loaded, tokenizer if tokenizer is not None else load_tokenizer(model)


def _attention_backend(config: EngineConfig) -> AttentionBackend:
    """``"torch"`` (``PagedTorchBackend``), ``"triton"``, or ``"auto"`` (triton on CUDA)."""
    from growpage.engine.modeling.backends import make_attention_backend

    return make_attention_backend(config.attention_backend, config.device)


def _joining_order(n: int, arrivals: list[float] | None) -> list[int]:
    """The order in which ``n`` requests join: by arrival, equal times in prompt order."""
    return list(range(n)) if arrivals is None else sorted(range(n), key=arrivals.__getitem__)


def _check_chat(chat: object) -> None:
    if not isinstance(chat, (bool, np.bool_)):
        raise EngineError(f"chat must be True or False, got {type(chat).__name__} {chat!r:.80}")


@attrs.define
class StreamProgress:
    """What a stream has shown of one request (``LLM.stream_chunk`` advances it)."""

    num_tokens: int = 0
    num_chars: int = 0
    done: bool = False


def _stop_hold(tail: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of ``tail`` to hold back from a stream: the longest end
    that is the start of a stop string (the text is cut there if the stop string completes)."""
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(tail)), hold, -1):
            if tail.endswith(stop[:k]):
                hold = k
                break
    return hold


def _progress(work: list[_Work], enabled: bool | None) -> ProgressBar[NoReturn] | None:
    """A tqdm bar over the requests of ``work``, or over the tokens of a lone one
    (``enabled=True``)."""
    if enabled is False or not work or (enabled is None and len(work) == 1):
        return None
    from tqdm.auto import tqdm

    disable = None if enabled is None else False  # None: tqdm shows it on a terminal only
    if len(work) > 1:
        return tqdm(
            total=len(work), desc="requests", unit="req", dynamic_ncols=True, disable=disable
        )
    return tqdm(
        total=work[0][1].max_tokens, desc="tokens", unit="tok", dynamic_ncols=True, disable=disable
    )


LLM.__doc__ = f"{(LLM.__doc__ or '').rstrip(' ')}{settings_help(' ' * 8)}\n"
