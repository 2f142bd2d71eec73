"""``LLMEngine.abort``: one request ends, its pages and slot go back, the others run on as if
it had never been there; a policy error names its request (``PolicyError.request_id``), so a
server can abort that request alone and step on."""

from __future__ import annotations

import attrs
import pytest
from llm_helpers import assert_all_returned, prompt, tiny_llm, tiny_model

from growpage.core.capacity import Decision
from growpage.engine.loop.sequence import FinishReason
from growpage.engine.sampling_params import SamplingParams
from growpage.errors import PolicyError
from growpage.policies.base import CapacityPolicy

pytestmark = pytest.mark.usefixtures("one_thread")
PARAMS = SamplingParams(max_tokens=20, ignore_eos=True)
PROMPTS = [prompt(6, 11), prompt(9, 12), prompt(7, 13)]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _run(engine) -> None:
    while engine.has_unfinished():
        engine.step()


@pytest.fixture(scope="module")
def alone(model):
    """Greedy tokens of ``PROMPTS[i]`` generated alone under ``policy`` (computed once)."""
    cache: dict[tuple[str, int], list[int]] = {}

    def tokens(policy: str, i: int) -> list[int]:
        if (policy, i) not in cache:
            llm = tiny_llm(model, policy)
            cache[policy, i] = llm.generate([PROMPTS[i]], PARAMS, use_tqdm=False)[0].token_ids
        return cache[policy, i]

    return tokens


@pytest.mark.parametrize("policy", ["fullkv", "growpage"])
@pytest.mark.parametrize("steps_before", [0, 1, 5])
def test_aborting_one_request_leaves_the_others_tokens_and_frees_its_pages(
    model, alone, policy, steps_before
):
    """Aborted while queued (0 steps), right after its prefill, or mid-decode: its pages come
    back at once, and the others generate what each generates alone (greedy)."""
    llm = tiny_llm(model, policy)
    engine = llm.engine
    seqs = [engine.add_request(str(i), ids, PARAMS) for i, ids in enumerate(PROMPTS)]
    for _ in range(steps_before):
        engine.step()
    used = engine.kv.pool.num_used_pages
    assert engine.abort("1") is seqs[1]
    assert seqs[1].finish_reason is FinishReason.ABORT and seqs[1].is_finished
    assert seqs[1] not in engine.scheduler.running and seqs[1] not in engine.scheduler.waiting
    if steps_before:
        assert engine.kv.pool.num_used_pages < used  # its pages, back before the next step
    assert engine.abort("1") is None  # finished: nothing to abort
    assert engine.abort("no such request") is None
    _run(engine)
    for i in (0, 2):
        assert seqs[i].output_token_ids == alone(policy, i)
    assert len(seqs[1].output_token_ids) < PARAMS.max_tokens
    assert_all_returned(llm)


@attrs.define
class FailsForOneRequest(CapacityPolicy):
    """Grows, except that every decision for request ``bad`` raises."""

    name = "fails-for-one"
    bad: str = "1"

    def decide(self, ctx):
        if ctx.request_id == self.bad:
            raise RuntimeError("policy bug")
        return Decision.GROW


def test_a_policy_error_names_its_request_which_can_be_aborted_alone(model, alone):
    """The failed step changes nothing; aborting the request the error names lets the others
    finish with the tokens a clean run gives them."""
    llm = tiny_llm(model, FailsForOneRequest())
    engine = llm.engine
    seqs = [engine.add_request(str(i), ids, PARAMS) for i, ids in enumerate(PROMPTS)]
    failures = 0
    while engine.has_unfinished():
        try:
            engine.step()
        except PolicyError as exc:
            failures += 1
            assert exc.request_id == "1" and "policy bug" in str(exc)
            assert engine.abort(exc.request_id) is seqs[1]
    assert failures == 1
    for i in (0, 2):  # it grows as fullkv does
        assert seqs[i].output_token_ids == alone("fullkv", i)
    assert_all_returned(llm)


def test_a_policy_error_outside_a_boundary_names_no_request():
    assert PolicyError("cannot load policy file x.py").request_id is None
