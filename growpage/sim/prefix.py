"""Prefix caching in the serving simulator, as the engine's (``KVCacheManager``).

A workload request may name a shared prefix (``WorkloadRequest.prefix``, its first
``prefix_tokens`` prompt tokens, equal in every request naming it: a system prompt, a few-shot
template). The simulator has no token ids, so it makes them up: the prefix's tokens get ids of
their group, every other token (the rest of the prompt, the generated ones) ids of its own
request, and the shared ``PagePool``'s prefix cache does the rest, as in the engine:

* on admission the request takes the cached pages of its longest cached run of full leading
  pages (not the last token's: its logits must be computed), reviving freed ones, and its
  prefill computes only what follows;
* after each prefill step the full pages a request has computed enter the cache (decode pages
  do not, as in the engine; a recompute after preemption computes them again and enters them);
* pages are freed tail first, so cached heads stay longest, and a freed cached page stays
  cached until it is reused;
* a compression of a shared page copies it first (the controller's copy-on-write).

Two requests whose prompts are equal share only what their ``prefix`` says: the engine would
also share their decode pages when they generate the same tokens, which the simulator does not
know.

Ids are in the pool's units: one per token in trace mode; one per page in script mode, where the
pool counts pages (a page is shared when all its tokens lie in the prefix).
"""

from __future__ import annotations

from growpage.core.pages import PagePool
from growpage.core.residency import PrefixChain, cached_prefix
from growpage.sim.requests import SimRequest

_SPAN = 1 << 40  # ids per group or request: more units than any request has


class PrefixCache:
    """The engine's prefix caching over the simulator's pool (see the module docstring).

    ``scale``: tokens per pool unit (1 in trace mode, the page size in script mode).
    ``enabled``: False makes every method a no-op (``SimConfig(prefix_caching=False)``).
    """

    def __init__(self, pool: PagePool, scale: int, enabled: bool) -> None:
        self.pool, self.scale, self.enabled = pool, scale, enabled
        self.page_tokens = pool.page_size * scale
        self.hit_tokens = 0  # prompt tokens taken from the cache, in all
        self._groups: dict[str, int] = {}
        self._requests: dict[str, int] = {}

    def _ids(self, r: SimRequest, num_tokens: int) -> list[int]:
        """Made-up token ids of ``r``'s first ``num_tokens`` tokens, one per whole pool unit."""
        units = num_tokens // self.scale
        spec = r.spec
        shared = min(spec.prefix_tokens // self.scale, units) if spec.prefix else 0
        ids: list[int] = []
        if spec.prefix and shared:
            group = self._groups.setdefault(spec.prefix, len(self._groups))
            ids = list(range(group * _SPAN, group * _SPAN + shared))
        own = -(1 + self._requests.setdefault(r.request_id, len(self._requests))) * _SPAN
        ids.extend(range(own + shared, own + units))
        return ids

    def cached_pages(self, r: SimRequest, num_tokens: int) -> list[int]:
        """Cached pages for the first tokens of a prefill of ``num_tokens`` tokens (not taken);
        never all of them: the last token is computed for its logits."""
        if not self.enabled:
            return []
        return cached_prefix(self.pool, self._ids(r, num_tokens), num_tokens, self.page_tokens)

    def took(self, r: SimRequest, cached: list[int]) -> None:
        """``r`` was admitted holding ``cached`` (``residency.admit``) and has computed them."""
        r.prefix_chain = PrefixChain()
        self.hit_tokens += len(cached) * self.page_tokens

    def register(self, r: SimRequest, computed: int) -> None:
        """Enter ``r``'s full pages of its first ``computed`` tokens in the cache, each chained
        to the cached page before it (``PrefixChain.register``)."""
        full = computed // self.page_tokens
        if self.enabled and r.prefix_chain.num_registered_pages < full:
            ids = self._ids(r, full * self.page_tokens)
            r.prefix_chain.register(self.pool, r.state.block_table, ids, full)
