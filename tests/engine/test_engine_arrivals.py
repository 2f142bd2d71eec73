"""Requests arriving over wall-clock time (``LLM.generate(..., arrival_s=...)``): each joins
at the first step boundary after its arrival, the engine idles while nothing has arrived, and
latencies count from the arrival, as in the serving simulator."""

from __future__ import annotations

import math
import time
import warnings

import numpy as np
import pytest
from llm_helpers import assert_all_returned, prompt, tiny_llm, tiny_models

from growpage import cli
from growpage.engine import cli as engine_cli
from growpage.engine import prompt_files
from growpage.engine.inputs import arrival_offsets, poisson_arrivals
from growpage.engine.sampling_params import SamplingParams
from growpage.errors import EngineError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_models()[0]


def _watch_admissions(llm) -> list[tuple[float, str, float]]:
    """``(time added, request id, its arrival time)`` of every request the engine takes."""
    added: list[tuple[float, str, float]] = []
    add = llm.engine.add_request

    def watched(*args, **kwargs):
        seq = add(*args, **kwargs)
        added.append((time.perf_counter(), seq.request_id, seq.arrival_s))
        return seq

    llm.engine.add_request = watched
    return added


def test_requests_join_after_they_arrive_and_the_engine_idles_between(model):
    llm = tiny_llm(model, policy="growpage")
    prompts = [prompt(9, i) for i in range(3)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    together = llm.generate(prompts, params, use_tqdm=False)
    added = _watch_admissions(llm)
    offsets = [0.0, 0.25, 0.6]  # each far after the one before has finished (a few ms)
    outs = llm.generate(prompts, params, use_tqdm=False, arrival_s=offsets)
    stats = llm.last_stats
    start = llm.engine.stats.start
    assert [o.token_ids for o in outs] == [o.token_ids for o in together]
    assert len(added) == 3
    for (when, _, arrival), offset in zip(added, offsets, strict=True):
        assert arrival == start + offset  # latencies count from the arrival...
        assert arrival <= when < arrival + 0.2  # ...and it joins once it has arrived
    for out, offset in zip(outs, offsets, strict=True):
        assert 0 < out.ttft_s <= out.e2e_s < 0.2  # no request waited for another
        assert out.arrival_s == pytest.approx(offset, abs=1e-9)
    assert [o.arrival_s for o in together] == [0.0, 0.0, 0.0]  # all at once: at the start
    assert stats.total_s >= 0.6 and stats.num_requests == 3
    # One request at a time and idle gaps between them: on average fewer than one resident.
    assert 0 < stats.avg_resident < 0.5
    assert_all_returned(llm)


def test_times_count_from_the_earliest_and_requests_join_in_arrival_order(model):
    llm = tiny_llm(model)
    added = _watch_admissions(llm)
    prompts = [prompt(6, i) for i in range(3)]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    begin = time.perf_counter()
    outs = llm.generate(
        prompts, params, use_tqdm=False, arrival_s=np.array([5.1, 5.0, 5.1])
    )  # unsorted, numpy
    assert time.perf_counter() - begin < 2.0  # the earliest, at 5.0, starts the run
    order = [rid for _, rid, _ in added]
    assert [int(r) for r in order] == sorted(int(r) for r in order)  # ids in joining order
    assert [o.request_id for o in outs] == [order[1], order[0], order[2]]  # prompt order
    assert added[1][2] - added[0][2] == pytest.approx(0.1)  # equal times: prompt order
    assert added[2][2] == added[1][2]


@pytest.mark.parametrize(
    "times, words",
    [
        ([0.0, 1.0], "arrival_s has 2 values for 3 prompts"),
        ([0.0], "arrival_s has 1 value for 3 prompts"),
        ("012", "arrival_s must be a list of seconds, one per prompt, got str"),
        ({0: 0.0}, "got dict"),
        ([0.0, True, 1.0], "arrival_s[1] must be a number of seconds, got bool"),
        ([0.0, "1", 1.0], "arrival_s[1] must be a number of seconds, got str"),
        ([0.0, 1.0, math.nan], "arrival_s[2] must be finite and >= 0, got nan"),
        ([0.0, -1.0, 1.0], "arrival_s[1] must be finite and >= 0, got -1.0"),
        ([0.0, math.inf, 1.0], "arrival_s[1] must be finite and >= 0, got inf"),
        ([0.0, 10**400, 1.0], "arrival_s[1] must be finite and >= 0, got 1000000"),
    ],
)
def test_bad_arrival_times_are_refused_before_anything_runs(model, times, words):
    llm = tiny_llm(model)
    added = _watch_admissions(llm)
    with pytest.raises(EngineError) as err:
        llm.generate([prompt(5, i) for i in range(3)], use_tqdm=False, arrival_s=times)
    assert words in str(err.value)
    assert added == [] and llm.last_stats is None
    assert_all_returned(llm)
    llm.generate([prompt(5, 0)], SamplingParams(max_tokens=2), use_tqdm=False)  # still works
    assert llm.last_stats.num_requests == 1


def test_a_late_request_that_cannot_run_fails_before_the_first_step(model):
    llm = tiny_llm(model)
    added = _watch_admissions(llm)
    too_long = prompt(model.config.max_position, 7)
    with pytest.raises(EngineError, match=r"leaves no room to generate \(prompts\[1\]\)"):
        llm.generate([prompt(5, 0), too_long], use_tqdm=False, arrival_s=[0.0, 30.0])
    # Named by the id it would have had: ids go in joining order (here prompts[1] joins first).
    first = llm._num_requests
    with pytest.raises(EngineError, match=rf"request '{first}': .* \(prompts\[1\]\)"):
        llm.generate([prompt(5, 0), too_long], use_tqdm=False, arrival_s=[30.0, 0.0])
    assert added == []  # refused up front, not after 30 s of serving the first
    assert_all_returned(llm)


def test_a_late_request_too_big_for_the_pool_fails_before_the_first_step(model):
    llm = tiny_llm(model, kv_pages=8)  # fullkv: a request needs room for all its tokens
    added = _watch_admissions(llm)
    params = [SamplingParams(max_tokens=2), SamplingParams(max_tokens=100, ignore_eos=True)]
    with pytest.raises(EngineError, match=r"cannot fit in the KV cache .*\(prompts\[1\]\)"):
        llm.generate([prompt(5, 0), prompt(5, 1)], params, use_tqdm=False, arrival_s=[0.0, 30.0])
    assert added == []  # refused up front, as when all arrive at once
    assert_all_returned(llm)


def test_stream_with_arrivals_gives_each_request_s_chunks_once_it_has_arrived(model):
    llm = tiny_llm(model)
    prompts = [prompt(7, i) for i in range(2)]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    expected = llm.generate(prompts, params, use_tqdm=False)
    chunks = list(llm.stream(prompts, params, arrival_s=[0.3, 0.0]))
    finals = {c.index: c.output for c in chunks if c.output is not None}
    assert [finals[i].token_ids for i in range(2)] == [o.token_ids for o in expected]
    # Request 0 arrives 0.3 s after request 1, which has long finished: its chunks come last.
    indices = [c.index for c in chunks]
    assert indices == sorted(indices, reverse=True) and indices[0] == 1
    assert llm.last_stats.total_s >= 0.3
    assert_all_returned(llm)


def test_a_request_arriving_while_the_stream_s_reader_holds_a_chunk_joins_the_next_step(model):
    llm = tiny_llm(model)
    added = _watch_admissions(llm)
    ends: list[float] = []  # when each step returned
    step = llm.engine.step

    def timed():
        done = step()
        ends.append(time.perf_counter())
        return done

    llm.engine.step = timed
    short, long = SamplingParams(max_tokens=1), SamplingParams(max_tokens=30, ignore_eos=True)
    chunks = llm.stream(
        [prompt(6, 0), prompt(6, 1), prompt(6, 2)],
        [short, short, long],
        arrival_s=[0.0, 0.2, 0.0],
    )
    first = next(chunks)  # request 0 finished in the first step (the prefill)
    assert first.index == 0 and len(ends) == 1
    while time.perf_counter() < llm.engine.stats.start + 0.25:  # request 1 arrives meanwhile
        time.sleep(0.05)
    rest = list(chunks)
    joined = [
        sum(end < when for end in ends) for when, rid, _ in added if rid == rest[0].request_id
    ]  # how many steps had run when it was added
    # It had arrived before the second step began: it joins that one, not the third.
    assert rest[0].index == 1 and joined == [1]
    assert llm.last_stats.num_requests == 3
    assert_all_returned(llm)


def test_idle_time_counts_what_the_engine_slept_not_what_it_asked_for(model, monkeypatch):
    llm = tiny_llm(model)
    sleep, slept = time.sleep, []

    def oversleeping(seconds):  # a loaded machine wakes the engine late
        begin = time.perf_counter()
        sleep(seconds + 1.0)
        slept.append(time.perf_counter() - begin)

    monkeypatch.setattr(time, "sleep", oversleeping)
    llm.generate(
        [prompt(6, 0), prompt(6, 1)],
        SamplingParams(max_tokens=3, ignore_eos=True),
        use_tqdm=False,
        arrival_s=[0.0, 0.2],
    )
    assert len(slept) == 1 and llm.engine.stats.step_s >= slept[0]  # all of it idle
    assert llm.last_stats.total_s >= slept[0]


def test_an_arrival_ages_away_waits_in_short_sleeps(model, monkeypatch):
    llm = tiny_llm(model)
    asked: list[float] = []

    def interrupted(seconds):  # time.sleep refuses ~300 years: OverflowError mid-run
        asked.append(seconds)
        raise KeyboardInterrupt

    monkeypatch.setattr(time, "sleep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(
            [prompt(6, 0), prompt(6, 1)],
            SamplingParams(max_tokens=3),
            use_tqdm=False,
            arrival_s=[0.0, 1e300],
        )
    assert len(asked) == 1 and 0 < asked[0] <= 60  # the first request served, then the wait
    assert llm.last_stats is None and not llm._serving
    assert_all_returned(llm)


def test_poisson_arrivals_are_seeded_exponential_gaps():
    times = poisson_arrivals(20000, 4.0, seed=3)
    assert times == poisson_arrivals(20000, 4.0, seed=3) != poisson_arrivals(20000, 4.0, seed=4)
    gaps = np.diff([0.0, *times])
    assert (gaps > 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)  # 1 / rate
    assert gaps.std() == pytest.approx(0.25, rel=0.05)  # exponential: std = mean
    assert poisson_arrivals(0, 1.0) == []
    # The offsets generate uses: the earliest arrival starts the run.
    assert arrival_offsets([2.0, 2.5, 2.25], 3) == [0.0, 0.5, 0.25]
    assert arrival_offsets(None, 3) is None


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"n": -1, "rate_per_s": 1.0}, "n must be an int >= 0, got -1"),
        ({"n": 2.0, "rate_per_s": 1.0}, "n must be an int >= 0, got 2.0"),
        ({"n": 2, "rate_per_s": 0.0}, "rate_per_s must be a finite number > 0, got 0.0"),
        ({"n": 2, "rate_per_s": math.inf}, "rate_per_s must be a finite number > 0, got inf"),
        ({"n": 2, "rate_per_s": "4"}, "rate_per_s must be a finite number > 0, got '4'"),
        ({"n": 2, "rate_per_s": 1.0, "seed": -1}, "seed must be an int >= 0, got -1"),
    ],
)
def test_poisson_arrivals_refuse_bad_arguments(kwargs, words):
    with pytest.raises(EngineError, match=r"poisson_arrivals: ") as err:
        poisson_arrivals(**kwargs)
    assert words in str(err.value)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        # An int too large for a float is not finite (it raised a bare OverflowError).
        ({"n": 2, "rate_per_s": 10**400}, "rate_per_s must be a finite number > 0, got 1000000"),
        # A rate so small that 1 / rate, or the sum of the gaps, passes the largest float: the
        # times were inf, which generate refused only later, as arrival_s the caller never gave
        # (the CLI after loading the model).
        ({"n": 2, "rate_per_s": 1e-320}, "rate_per_s 1e-320 is too small for 2 arrivals"),
        ({"n": 40, "rate_per_s": 1e-307}, "rate_per_s 1e-307 is too small for 40 arrivals"),
    ],
)
def test_poisson_arrivals_refuse_rates_whose_times_are_not_finite(kwargs, words):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning on the way
        with pytest.raises(EngineError, match=r"poisson_arrivals: ") as err:
            poisson_arrivals(**kwargs)
    assert words in str(err.value)
    assert all(map(math.isfinite, poisson_arrivals(3, 1e-300)))  # small, but finite times


class _Generate:
    """Stands in for ``LLM``: keeps what ``generate`` was asked, answers nothing."""

    def __init__(self) -> None:
        self.kwargs: dict = {}

    def generate(self, prompts, params, **kwargs):
        self.kwargs = {**kwargs, "prompts": prompts}
        raise EngineError("stop here")


def _generate_kwargs(monkeypatch, capsys, argv: list[str]) -> dict:
    fake = _Generate()
    monkeypatch.setattr(engine_cli, "_build_llm", lambda **kw: fake)
    assert cli.main(["generate", *argv]) == 2
    assert "stop here" in capsys.readouterr().err
    return fake.kwargs


def test_cli_arrival_rate_and_jsonl_arrival_times(monkeypatch, capsys, tmp_path):
    kwargs = _generate_kwargs(monkeypatch, capsys, ["--prompt", "a", "--prompt", "b"])
    assert kwargs["arrival_s"] is None
    kwargs = _generate_kwargs(
        monkeypatch,
        capsys,
        ["--prompt", "a", "--prompt", "b", "--arrival-rate", "2", "--arrival-seed", "5"],
    )
    assert kwargs["arrival_s"] == poisson_arrivals(2, 2.0, seed=5)
    kwargs = _generate_kwargs(
        monkeypatch, capsys, ["--prompt", "a", "--prompt", "b", "--arrival-rate", "2"]
    )
    assert kwargs["arrival_s"] == poisson_arrivals(2, 2.0, seed=0)  # the default seed
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "arrival_s": 1.5}\n\n{"prompt": "b", "arrival_s": 0}\n')
    kwargs = _generate_kwargs(monkeypatch, capsys, ["--prompts", str(path)])
    assert kwargs["prompts"] == ["a", "b"] and kwargs["arrival_s"] == [1.5, 0.0]
    assert prompt_files.read_prompts(path) == ["a", "b"]  # record ignores the times


@pytest.mark.parametrize(
    "lines, words",
    [
        (
            ['{"prompt": "a", "arrival_s": 1}', '{"prompt": "b"}'],
            ":2: 'arrival_s' must be on every line or on none (line 2 lacks it",
        ),
        (
            ['{"prompt": "a"}', '{"prompt": "b", "arrival_s": 1}'],
            ":2: 'arrival_s' must be on every line or on none (line 2 has it",
        ),
        (
            ['{"prompt": "a", "arrival_s": -1}'],
            ":1: 'arrival_s' must be a number of seconds >= 0, got -1",
        ),
        (
            ['{"prompt": "a", "arrival_s": "soon"}'],
            ":1: 'arrival_s' must be a number of seconds >= 0, got 'soon'",
        ),
        (
            ['{"prompt": "a", "arrival_s": true}'],
            ":1: 'arrival_s' must be a number of seconds >= 0, got True",
        ),
        (
            ['{"prompt": "a", "arrival_s": NaN}'],
            ":1: 'arrival_s' must be a number of seconds >= 0, got nan",
        ),
        (
            ['{"prompt": "a", "arrival_s": 1' + "0" * 400 + "}"],
            ":1: 'arrival_s' must be a number of seconds >= 0, got 1000000",
        ),
    ],
)
def test_cli_bad_arrival_times_in_a_prompt_file(monkeypatch, capsys, tmp_path, lines, words):
    monkeypatch.setattr(engine_cli, "_build_llm", lambda **kw: pytest.fail("engine built"))
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert cli.main(["generate", "--prompts", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("growpage: error: ") and f"{path}{words}" in err


@pytest.mark.parametrize(
    "lines",
    [
        ['{"prompt": "a", "arrival_s": null}', '{"prompt": "b", "arrival_s": null}'],
        ['{"prompt": "a", "arrival_s": 1}', '{"prompt": "b", "arrival_s": null}'],
        ['{"prompt": "a", "arrival_s": null}', '{"prompt": "b", "arrival_s": 1}'],
    ],
)
def test_cli_a_null_arrival_time_in_a_prompt_file_is_refused(monkeypatch, capsys, tmp_path, lines):
    # What pandas writes for a missing (NaN) time. It read as no 'arrival_s' at all: a file of
    # nulls ran all at once without a word, and beside numbers the error said the line lacked
    # the field it has.
    monkeypatch.setattr(engine_cli, "_build_llm", lambda **kw: pytest.fail("engine built"))
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert cli.main(["generate", "--prompts", str(path)]) == 2
    err = capsys.readouterr().err
    line = 1 + lines.index(next(ln for ln in lines if "null" in ln))
    assert f"{path}:{line}: 'arrival_s' must be a number of seconds >= 0, got None" in err


def test_cli_arrival_rate_with_a_file_s_own_times_is_an_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(engine_cli, "_build_llm", lambda **kw: pytest.fail("engine built"))
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "arrival_s": 0}\n')
    assert cli.main(["generate", "--prompts", str(path), "--arrival-rate", "1"]) == 2
    assert "gives its own arrival times ('arrival_s'): leave out --arrival-rate" in (
        capsys.readouterr().err
    )
    assert cli.main(["generate", "--prompt", "a", "--arrival-rate", "0"]) == 2
    assert "rate_per_s must be a finite number > 0, got 0.0" in capsys.readouterr().err


def test_cli_an_arrival_seed_without_a_rate_is_refused(monkeypatch, capsys, tmp_path):
    """Until 2026-12 it was ignored without a word, also beside a file's own times."""
    monkeypatch.setattr(engine_cli, "_build_llm", lambda **kw: pytest.fail("model loaded"))
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "arrival_s": 1.5}\n')
    for source in (["--prompt", "a"], ["--prompts", str(path)]):
        assert cli.main(["generate", *source, "--arrival-seed", "3"]) == 2
        assert (
            "--arrival-seed 3 seeds --arrival-rate's arrival times: give --arrival-rate too"
        ) in capsys.readouterr().err
