"""Tests of ``growpage.core.pages.PagePool``: a stateful model check plus targeted unit tests.

The state machine keeps an independent model of the pool (reference counts, free-list order,
prefix-cache table, and the token content each page holds) and drives it through the same calls
the controller and a serving engine make: allocate, free, fork, copy-on-write, register,
prefix hit (match_prefix + acquire) and invalidate.  After every step the real pool must agree
with the model and with the holders' block tables.
"""

from __future__ import annotations

import itertools
import tracemalloc
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from growpage.core.pages import PagePool, bookkeeping_bytes, chain_hash
from growpage.errors import ConfigError, GrowPageError, PoolExhaustedError

ALPHABET = (0, 1)  # tiny alphabet: equal page contents (and equal keys) happen all the time


def snapshot(pool: PagePool) -> tuple:
    """Everything observable about a pool, to assert "nothing changed"."""
    return (
        list(pool._free),
        list(pool.refcounts),
        dict(pool._hash_of),
        dict(pool._page_of),
        dict(pool._tokens_of),
    )


def hashes_of(token_ids, page_size):
    """Chained hashes of the full leading pages of ``token_ids`` (as a caller computes them)."""
    out, prev = [], None
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        prev = chain_hash(prev, token_ids[start : start + page_size])
        out.append(prev)
    return out


# ============================================================================================
# Stateful model check
# ============================================================================================
class PagePoolMachine(RuleBasedStateMachine):
    """Several holders (requests), each with a block table, sharing one pool."""

    def __init__(self) -> None:
        super().__init__()
        self.pool: PagePool | None = None

    @initialize(
        num_pages=st.integers(1, 8), page_size=st.integers(1, 2), watermark=st.integers(0, 5)
    )
    def setup(self, num_pages: int, page_size: int, watermark: int) -> None:
        watermark %= num_pages
        self.pool = PagePool(num_pages, page_size, watermark)
        self.n = num_pages
        self.ps = page_size
        self.holders: dict[int, list[int]] = {}
        self.next_holder = 0
        # ---- the model ----
        self.rc = [0] * num_pages
        self.free_order = list(range(num_pages))  # least recently freed first
        # hash -> (page, tokens, parent page)
        self.cache: dict[int, tuple[int, tuple[int, ...], int | None]] = {}
        self.content: dict[int, tuple[int, ...]] = {}  # page -> full-page tokens it holds
        self.chunks = [tuple(c) for c in itertools.product(ALPHABET, repeat=page_size)]
        self.prompts: list[list[int]] = []  # token sequences seen so far, to aim prefix hits

    # ---- model helpers ------------------------------------------------------------------
    def _new_holder(self, pages: list[int]) -> None:
        self.holders[self.next_holder] = pages
        self.next_holder += 1

    def _m_forget(self, page: int) -> None:
        """Forget a page's entry and, recursively, every entry registered after it."""
        for h, (p, _, _) in list(self.cache.items()):
            if p == page:
                del self.cache[h]
                for child in [c for c, _, par in self.cache.values() if par == page]:
                    self._m_forget(child)

    def _m_take(self, num: int) -> list[int]:
        pages = self.free_order[:num]
        del self.free_order[:num]
        for p in pages:
            self._m_forget(p)  # reuse evicts a cached free page
            self.content.pop(p, None)  # fresh page: content unknown until written
            self.rc[p] = 1
        return pages

    def _m_drop(self, pages: list[int]) -> None:
        for p in pages:
            self.rc[p] -= 1
            assert self.rc[p] >= 0
            if self.rc[p] == 0:
                self.free_order.append(p)

    def _m_cached(self, page: int) -> bool:
        return any(p == page for p, _, _ in self.cache.values())

    def _m_register(self, page: int, h: int, tokens: tuple[int, ...], parent: int | None) -> None:
        if self._m_lookup(h, tokens, parent) == page:
            return  # cached as exactly this already: nothing changes, its descendants stay
        self._m_forget(page)
        if h in self.cache or (parent is not None and not self._m_cached(parent)):
            return  # keep the first page cached under this hash; no orphan entries
        self.cache[h] = (page, tokens, parent)

    def _m_lookup(self, h: int, tokens: tuple[int, ...], parent: int | None = None) -> int | None:
        entry = self.cache.get(h)
        if entry is None or entry[1] != tuple(tokens) or entry[2] != parent:
            return None
        return entry[0]

    def _m_match(self, token_ids: list[int]) -> list[int]:
        pages, prev = [], None
        for start in range(0, len(token_ids) - self.ps + 1, self.ps):
            chunk = tuple(token_ids[start : start + self.ps])
            prev = chain_hash(prev, chunk)
            page = self._m_lookup(prev, chunk, pages[-1] if pages else None)
            if page is None:
                break
            pages.append(page)
        return pages

    def _nonempty(self) -> list[int]:
        return sorted(h for h, t in self.holders.items() if t)

    def has_holder(self) -> bool:
        return self.pool is not None and bool(self.holders)

    def has_pages(self) -> bool:
        return self.pool is not None and bool(self._nonempty())

    # ---- rules ----------------------------------------------------------------------------
    @precondition(lambda self: self.pool is not None)
    @rule(data=st.data(), num=st.integers(0, 3) | st.integers(4, 9), respect=st.booleans())
    def allocate(self, data, num, respect):
        target = data.draw(st.sampled_from([None, *sorted(self.holders)]), label="holder")
        reserve = self.pool.watermark if respect else 0
        before = snapshot(self.pool)
        if num > len(self.free_order) - reserve:
            assert not self.pool.can_allocate(num, respect_watermark=respect)
            with pytest.raises(PoolExhaustedError):
                self.pool.allocate(num, respect_watermark=respect)
            assert snapshot(self.pool) == before, "failed allocate changed the pool"
            return
        assert self.pool.can_allocate(num, respect_watermark=respect)
        pages = self.pool.allocate(num, respect_watermark=respect)
        expected = self._m_take(num)
        assert pages == expected, "allocate must take the least recently freed pages"
        assert len(set(pages)) == len(pages)
        for p in pages:
            assert self.pool.refcounts[p] == 1
            assert not self.pool.is_cached(p), f"reallocated page {p} still cached"
        if target is None:
            if pages:
                self._new_holder(pages)
        else:
            self.holders[target].extend(pages)

    @precondition(has_holder)
    @rule(data=st.data())
    def free_holder(self, data):
        hid = data.draw(st.sampled_from(sorted(self.holders)), label="holder")
        pages = self.holders.pop(hid)
        self.pool.free(pages)
        self._m_drop(pages)

    @precondition(has_pages)
    @rule(data=st.data())
    def free_one_page(self, data):
        hid = data.draw(st.sampled_from(self._nonempty()), label="holder")
        table = self.holders[hid]
        idx = data.draw(st.integers(0, len(table) - 1), label="slot")
        page = table.pop(idx)
        was = self.pool.refcounts[page]
        self.pool.free([page])
        self._m_drop([page])
        assert self.pool.refcounts[page] == was - 1

    @precondition(has_pages)
    @rule(data=st.data())
    def fork(self, data):
        hid = data.draw(st.sampled_from(self._nonempty()), label="holder")
        table = self.holders[hid]
        shared = self.pool.fork(table)
        assert shared == table
        for p in table:
            self.rc[p] += 1
            assert self.pool.is_shared(p)
        self._new_holder(list(shared))

    @precondition(has_pages)
    @rule(data=st.data())
    def copy_on_write(self, data):
        hid = data.draw(st.sampled_from(self._nonempty()), label="holder")
        table = self.holders[hid]
        idx = data.draw(st.integers(0, len(table) - 1), label="slot")
        page = table[idx]
        if self.rc[page] == 1:
            new = self.pool.copy_on_write(page)
            assert new == page, "an unshared page is its own private copy"
            self._m_forget(page)  # about to be written: no longer a prefix page
            assert not self.pool.is_cached(page)
            return
        if not self.free_order:
            before = snapshot(self.pool)
            with pytest.raises(PoolExhaustedError):
                self.pool.copy_on_write(page)
            assert snapshot(self.pool) == before, "failed copy_on_write changed the pool"
            return
        new = self.pool.copy_on_write(page)
        (expected,) = self._m_take(1)
        assert new == expected and new != page
        if page in self.content:  # the caller copies the content into its private page
            self.content[new] = self.content[page]
        self._m_drop([page])
        assert self.rc[page] >= 1
        assert self.pool.refcounts[new] == 1 and not self.pool.is_cached(new)
        table[idx] = new

    @precondition(has_pages)
    @rule(data=st.data(), collide=st.booleans())
    def register(self, data, collide):
        """Write a full page of a holder and register it; ``collide`` simulates a hash collision.

        With ``collide`` the page (holding ``tokens``) is registered under the hash of other
        tokens, as if the two contents hashed equal; lookups with those other tokens must miss.
        """
        hid = data.draw(st.sampled_from(self._nonempty()), label="holder")
        table = self.holders[hid]
        last = 0  # slots 0..last are registrable: every earlier slot holds a known full page
        while last < len(table) - 1 and table[last] in self.content:
            last += 1
        idx = data.draw(st.integers(0, last), label="slot")
        page = table[idx]
        prev = None
        for p in table[:idx]:
            prev = chain_hash(prev, self.content[p])
        if self.rc[page] > 1:  # a shared page cannot be written; re-register its content only
            if page not in self.content:
                return
            tokens = self.content[page]
        else:
            tokens = data.draw(st.sampled_from(self.chunks), label="tokens")
        key = tokens
        if collide:
            key = data.draw(st.sampled_from([c for c in self.chunks if c != tokens]), label="key")
        h = chain_hash(prev, key)
        if self.content.get(page, tokens) != tokens and self.pool.is_cached(page):
            self.pool.invalidate(page)  # contract: invalidate a prefix page before rewriting it
            self._m_forget(page)
        self.content[page] = tokens
        parent = table[idx - 1] if idx else None
        self.pool.register(page, h, list(tokens), parent=parent)
        self._m_register(page, h, tokens, parent)
        if key != tokens:  # the key's tokens may be cached legitimately, but never on `page`
            got = self.pool.lookup(h, key, parent)
            assert got != page, "collision returned a page holding other tokens"
            assert got == self._m_lookup(h, key, parent)
        assert self.pool.lookup(h, tokens, parent) == self._m_lookup(h, tokens, parent)

    def _draw_tokens(self, data) -> list[int]:
        """A prompt: often a cut of a known sequence (to hit the cache) plus random tokens."""
        sources = list(self.prompts)
        for table in self.holders.values():
            seq = []
            for p in table:
                if p not in self.content:
                    break
                seq.extend(self.content[p])
            if seq:
                sources.append(seq)
        base = []
        if sources and data.draw(st.booleans(), label="from known"):
            base = data.draw(st.sampled_from(sources), label="source")
            base = base[: data.draw(st.integers(0, len(base)), label="cut")]
        tail = data.draw(
            st.lists(st.sampled_from(ALPHABET), max_size=2 * self.ps + 1), label="tail"
        )
        return base + tail

    def _hit(self, tokens: list[int]) -> list[int]:
        """match_prefix + acquire, checked against the model; returns the acquired pages."""
        pages = self.pool.match_prefix(tokens)
        assert pages == self._m_match(tokens)
        assert len(pages) <= len(tokens) // self.ps, "match_prefix used a partial page"
        assert len(set(pages)) == len(pages)
        for k, p in enumerate(pages):
            chunk = tuple(tokens[k * self.ps : (k + 1) * self.ps])
            assert self.pool._tokens_of[p] == chunk, "hit on a page storing other tokens"
            assert self.content[p] == chunk, "hit on a page holding other tokens"
        for p in pages:
            self.pool.acquire(p)
            if self.rc[p] == 0:
                self.free_order.remove(p)
            self.rc[p] += 1
            assert p not in self.pool._free
            assert self.pool.refcounts[p] == self.rc[p]
        return pages

    @precondition(lambda self: self.pool is not None)
    @rule(data=st.data())
    def prefix_hit(self, data):
        """A new holder takes the cached pages of a prompt's longest cached prefix."""
        pages = self._hit(self._draw_tokens(data))
        if pages:
            self._new_holder(list(pages))

    @precondition(lambda self: self.pool is not None)
    @rule(data=st.data(), use_cache=st.booleans(), finish=st.booleans())
    def prefill(self, data, use_cache, finish):
        """What an engine does for a new prompt: reuse cached pages, allocate the rest (or give
        the hits back when the pool is too small), write and register every new full page.

        Without ``use_cache`` (a prefill that raced another one for the same prompt) every page
        is computed afresh, so registering finds equal pages already cached: the first is kept.
        With ``finish`` the request ends at once: its pages go back to the free list, cached.
        """
        tokens = self._draw_tokens(data)
        self.prompts.append(tokens)
        hits = self._hit(tokens) if use_cache else []
        num_full = len(tokens) // self.ps
        need = -(-len(tokens) // self.ps) - len(hits)
        if need > len(self.free_order):
            before = snapshot(self.pool)
            with pytest.raises(PoolExhaustedError):
                self.pool.allocate(need)
            assert snapshot(self.pool) == before
            self.pool.free(hits)
            self._m_drop(hits)
            return
        fresh = self.pool.allocate(need)
        assert fresh == self._m_take(need)
        table = hits + fresh
        hashes = hashes_of(tokens, self.ps)
        for k in range(len(hits), num_full):
            chunk = tuple(tokens[k * self.ps : (k + 1) * self.ps])
            self.content[table[k]] = chunk
            parent = table[k - 1] if k else None
            self.pool.register(table[k], hashes[k], list(chunk), parent=parent)
            self._m_register(table[k], hashes[k], chunk, parent)
        if finish:
            cached = [p for p in table if self.pool.is_cached(p)]
            self.pool.free(table)
            self._m_drop(table)
            assert all(self.pool.is_cached(p) for p in cached), "free dropped a cached page"
        elif table:
            self._new_holder(table)

    @precondition(lambda self: self.pool is not None)
    @rule(data=st.data())
    def invalidate(self, data):
        page = data.draw(st.integers(0, self.n - 1), label="page")
        self.pool.invalidate(page)
        self._m_forget(page)
        assert not self.pool.is_cached(page)

    # ---- invariants -----------------------------------------------------------------------
    @invariant()
    def pool_matches_holders_and_model(self):
        if self.pool is None:
            return
        pool = self.pool
        pool.check_invariants()
        held = Counter(p for table in self.holders.values() for p in table)
        for page in range(self.n):
            assert pool.refcounts[page] == held[page] == self.rc[page], (
                f"page {page}: pool refcount {pool.refcounts[page]}, holders {held[page]}, "
                f"model {self.rc[page]}"
            )
        assert 0 <= pool.num_used_pages <= pool.num_pages
        assert pool.num_free_pages + pool.num_used_pages == pool.num_pages
        assert pool.num_used_pages == len(held)
        free = list(pool._free)
        assert free == self.free_order, "free list order differs from the model"
        assert not set(free) & set(held), "a held page is on the free list"
        assert set(free) | set(held) == set(range(self.n))

    @invariant()
    def cache_matches_model(self):
        if self.pool is None:
            return
        pool = self.pool
        cached_pages = {p for p, _, _ in self.cache.values()}
        for page in range(self.n):
            assert pool.is_cached(page) == (page in cached_pages), f"page {page} cached state"
        for h, (page, tokens, parent) in self.cache.items():
            assert pool.lookup(h, tokens, parent) == page
            assert self.content[page] == tokens
        # A lookup never returns a page whose tokens differ from the key's tokens.
        parents = [None, *sorted(cached_pages)]
        for h in list(self.cache) + [chain_hash(None, c) for c in self.chunks]:
            for chunk, parent in itertools.product(self.chunks, parents):
                got = pool.lookup(h, chunk, parent)
                assert got == self._m_lookup(h, chunk, parent)
                if got is not None:
                    assert self.content[got] == chunk and pool._tokens_of[got] == chunk

    def teardown(self):
        if self.pool is None:
            return
        pool = self.pool
        for hid in sorted(self.holders):
            pool.free(self.holders.pop(hid))
        pool.check_invariants()
        assert pool.num_free_pages == pool.num_pages, "pages leaked"
        assert pool.num_used_pages == 0
        assert all(rc == 0 for rc in pool.refcounts)
        before = snapshot(pool)
        for page in range(pool.num_pages):
            with pytest.raises(ValueError):
                pool.free([page])  # double free
        assert snapshot(pool) == before, "a rejected double free changed the pool"


PagePoolMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPagePoolStateMachine = PagePoolMachine.TestCase


# ============================================================================================
# Targeted unit tests
# ============================================================================================
def test_fresh_pool_state():
    pool = PagePool(5, 16, watermark=1)
    assert (pool.num_pages, pool.page_size, pool.watermark) == (5, 16, 1)
    assert pool.num_free_pages == 5 and pool.num_used_pages == 0
    assert list(pool._free) == [0, 1, 2, 3, 4]
    assert pool.refcounts == [0] * 5
    pool.check_invariants()


def test_allocate_takes_least_recently_freed_first():
    pool = PagePool(4, 1)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.free([2])
    pool.free([0, 3])
    assert pool.allocate(1) == [2]
    assert pool.allocate(2) == [0, 3]
    assert pool.allocate(0) == []
    pool.check_invariants()


def test_allocate_is_all_or_nothing():
    pool = PagePool(5, 2)
    held = pool.allocate(3)
    pool.register(held[0], chain_hash(None, [1, 2]), [1, 2], parent=None)
    pool.free([held[0]])  # a cached free page: must stay cached after a failed allocate
    before = snapshot(pool)
    free_before = list(pool._free)
    with pytest.raises(PoolExhaustedError):
        pool.allocate(4)
    assert list(pool._free) == free_before, "failed allocate changed the free list"
    assert snapshot(pool) == before
    assert pool.is_cached(held[0])
    pool.check_invariants()
    assert issubclass(PoolExhaustedError, GrowPageError)


def test_allocate_negative_raises_value_error():
    pool = PagePool(3, 2)
    before = snapshot(pool)
    with pytest.raises(ValueError):
        pool.allocate(-1)
    assert snapshot(pool) == before


def test_watermark_respected_only_when_asked():
    pool = PagePool(6, 2, watermark=2)
    pool.allocate(2)  # 4 free
    assert pool.can_allocate(2, respect_watermark=True)
    assert not pool.can_allocate(3, respect_watermark=True)
    assert pool.can_allocate(4) and pool.can_allocate(4, respect_watermark=False)
    assert not pool.can_allocate(5)
    before = snapshot(pool)
    with pytest.raises(PoolExhaustedError):
        pool.allocate(3, respect_watermark=True)
    assert snapshot(pool) == before
    assert len(pool.allocate(2, respect_watermark=True)) == 2  # 2 free, both held back now
    with pytest.raises(PoolExhaustedError):
        pool.allocate(1, respect_watermark=True)
    assert len(pool.allocate(2)) == 2  # without the flag the reserve can be used
    assert pool.num_free_pages == 0
    with pytest.raises(PoolExhaustedError):
        pool.allocate(1)


def test_double_free_raises_and_changes_nothing():
    pool = PagePool(4, 2)
    a, b = pool.allocate(2)
    pool.free([a])
    before = snapshot(pool)
    with pytest.raises(ValueError):
        pool.free([a])
    assert snapshot(pool) == before
    # A batch with one bad page frees nothing (the good page stays held).
    with pytest.raises(ValueError):
        pool.free([b, a])
    assert snapshot(pool) == before and pool.refcounts[b] == 1
    # The same page twice in one call while held once: rejected, nothing changed.
    with pytest.raises(ValueError):
        pool.free([b, b])
    assert snapshot(pool) == before
    # Out-of-range and non-int page ids.
    for bad in (-1, 4, 100, 1.0, "1", None):
        with pytest.raises(ValueError):
            pool.free([bad])
        assert snapshot(pool) == before
    pool.check_invariants()


def test_free_of_shared_page_keeps_it_held():
    pool = PagePool(3, 2)
    (p,) = pool.allocate(1)
    pool.fork([p])
    assert pool.refcounts[p] == 2 and pool.is_shared(p)
    pool.free([p])
    assert pool.refcounts[p] == 1 and not pool.is_shared(p)
    assert p not in pool._free and pool.num_used_pages == 1
    pool.free([p])
    assert pool.refcounts[p] == 0 and p in pool._free
    pool.check_invariants()


def test_free_same_page_twice_in_one_call_when_held_twice():
    pool = PagePool(2, 2)
    (p,) = pool.allocate(1)
    pool.fork([p])
    pool.free([p, p])
    assert pool.refcounts[p] == 0 and list(pool._free)[-1] == p
    pool.check_invariants()


def test_fork_rejects_unheld_pages_without_changes():
    pool = PagePool(3, 2)
    (a,) = pool.allocate(1)
    before = snapshot(pool)
    with pytest.raises(ValueError):
        pool.fork([a, 2])
    assert snapshot(pool) == before


def test_copy_on_write():
    pool = PagePool(3, 2)
    a, b = pool.allocate(2)
    h = chain_hash(None, [1, 1])
    pool.register(a, h, [1, 1], parent=None)
    # Unshared: the page itself, no longer a prefix page (its content is about to change).
    assert pool.copy_on_write(a) == a
    assert not pool.is_cached(a) and pool.lookup(h, [1, 1]) is None
    assert pool.refcounts[a] == 1
    # Shared: a fresh page, the caller's reference to the old one dropped; the shared page
    # keeps its prefix-cache entry (its content is unchanged).
    pool.register(b, h, [1, 1], parent=None)
    pool.fork([b])
    new = pool.copy_on_write(b)
    assert new not in (a, b)
    assert pool.refcounts[b] == 1 and pool.refcounts[new] == 1
    assert pool.lookup(h, [1, 1]) == b and not pool.is_cached(new)
    pool.check_invariants()
    # Shared but nothing free: PoolExhaustedError, nothing changed.
    pool.fork([b])
    before = snapshot(pool)
    with pytest.raises(PoolExhaustedError):
        pool.copy_on_write(b)
    assert snapshot(pool) == before
    with pytest.raises(ValueError):
        pool.free([b, b, b])
    assert snapshot(pool) == before


def test_copy_on_write_ignores_watermark():
    pool = PagePool(3, 2, watermark=2)
    (p,) = pool.allocate(1)
    pool.fork([p])
    new = pool.copy_on_write(p)  # the reserve exists for exactly this kind of allocation
    assert new != p and pool.num_free_pages == 1


def test_freed_cached_page_is_reused_by_prefix_hit_and_evicted_on_reallocation():
    pool = PagePool(3, 2)
    tokens = [7, 8, 9, 10]
    hashes = hashes_of(tokens, 2)
    p0, p1 = pool.allocate(2)
    pool.register(p0, hashes[0], tokens[:2], parent=None)
    pool.register(p1, hashes[1], tokens[2:], parent=p0)
    pool.free([p0, p1])
    assert pool.num_free_pages == 3 and pool.is_cached(p0) and pool.is_cached(p1)
    # A later request with the same prompt hits both pages; acquire takes them off the list.
    assert pool.match_prefix(tokens + [11]) == [p0, p1]
    pool.acquire(p0)
    assert p0 not in pool._free and pool.refcounts[p0] == 1
    assert pool.num_free_pages == 2
    pool.check_invariants()
    # Acquiring an already held cached page only bumps its refcount.
    pool.acquire(p0)
    assert pool.refcounts[p0] == 2
    pool.free([p0, p0])
    # Reallocating the cached free page p1 evicts it: its hash is forgotten.
    order = list(pool._free)
    got = pool.allocate(order.index(p1) + 1)
    assert p1 in got
    assert not pool.is_cached(p1)
    assert pool.lookup(hashes[1], tokens[2:], p0) is None
    assert pool.match_prefix(tokens) == ([p0] if p0 not in got else [])
    with pytest.raises(ValueError):
        pool.acquire(p1)  # no longer a prefix page
    pool.check_invariants()


def test_acquire_rejects_uncached_page_without_changes():
    pool = PagePool(2, 2)
    before = snapshot(pool)
    with pytest.raises(ValueError):
        pool.acquire(0)
    assert snapshot(pool) == before


def test_lookup_same_hash_different_tokens_is_a_miss():
    pool = PagePool(3, 2)
    (p,) = pool.allocate(1)
    h = chain_hash(None, [1, 2])
    pool.register(p, h, [1, 2], parent=None)
    assert pool.lookup(h, [1, 2]) == p
    assert pool.lookup(h, (1, 2)) == p
    assert pool.lookup(h, [2, 1]) is None
    assert pool.lookup(h, [1, 2, 3]) is None
    assert pool.lookup(h + 1, [1, 2]) is None
    # A genuine Python hash collision: hash(-1) == hash(-2).
    (q,) = pool.allocate(1)
    hc = chain_hash(None, [-1, 0])
    assert hc == chain_hash(None, [-2, 0])
    pool.register(q, hc, [-1, 0], parent=None)
    assert pool.lookup(hc, [-2, 0]) is None
    assert pool.match_prefix([-2, 0]) == []
    assert pool.match_prefix([-1, 0]) == [q]


def test_register_keeps_first_page_and_requires_full_held_page():
    pool = PagePool(4, 2)
    a, b = pool.allocate(2)
    h = chain_hash(None, [3, 4])
    pool.register(a, h, [3, 4], parent=None)
    pool.register(
        b, h, [3, 4], parent=None
    )  # same content computed twice: the first page stays cached
    assert pool.lookup(h, [3, 4]) == a and not pool.is_cached(b)
    before = snapshot(pool)
    with pytest.raises(ValueError):
        pool.register(b, chain_hash(None, [3]), [3], parent=None)  # partial page
    with pytest.raises(ValueError):
        pool.register(3, chain_hash(None, [5, 6]), [5, 6], parent=None)  # not held
    assert snapshot(pool) == before
    # Registering a page under a new hash replaces its old entry.
    pool.register(a, chain_hash(None, [5, 6]), [5, 6], parent=None)
    assert pool.lookup(h, [3, 4]) is None
    assert pool.lookup(chain_hash(None, [5, 6]), [5, 6]) == a
    pool.check_invariants()


def test_invalidate_forgets_cached_content():
    pool = PagePool(3, 2)
    (p,) = pool.allocate(1)
    h = chain_hash(None, [0, 0])
    pool.register(p, h, [0, 0], parent=None)
    pool.invalidate(p)
    assert not pool.is_cached(p) and pool.lookup(h, [0, 0]) is None
    pool.invalidate(p)  # idempotent
    pool.invalidate(2)  # an uncached (free) page: no-op
    assert pool.refcounts[p] == 1
    pool.check_invariants()


def test_match_prefix_stops_at_first_miss_and_uses_only_full_pages():
    pool = PagePool(6, 2)
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = hashes_of(tokens, 2)
    pages = pool.allocate(3)
    for k, (p, h) in enumerate(zip(pages, hashes, strict=True)):
        pool.register(p, h, tokens[2 * k : 2 * k + 2], parent=pages[k - 1] if k else None)
    assert pool.match_prefix(tokens) == pages
    assert pool.match_prefix(tokens + [7]) == pages  # trailing partial page ignored
    assert pool.match_prefix(tokens[:5]) == pages[:2]  # partial third page not matched
    assert pool.match_prefix(tokens[:1]) == []
    assert pool.match_prefix([]) == []
    # A different second page: stops after the first page even though page 3 is cached.
    assert pool.match_prefix([1, 2, 9, 9, 5, 6]) == pages[:1]
    # A different first page: nothing, even though later pages' tokens are cached.
    assert pool.match_prefix([0, 2, 3, 4, 5, 6]) == []
    # A miss in the middle (page 2 evicted) hides page 3.
    pool.invalidate(pages[1])
    assert pool.match_prefix(tokens) == pages[:1]
    # match_prefix does not acquire.
    assert pool.refcounts == [1, 1, 1, 0, 0, 0]


def test_match_prefix_never_shares_kv_computed_under_another_prefix():
    """A page's KV depends on its whole prefix: when two different prefixes' chain hashes
    collide, a page computed after one prefix must not be handed out for the other (the pool
    checks the parent page too). hash(-1) == hash(-2) in CPython gives a real collision.
    """
    pool = PagePool(4, 1)
    # Request A: prompt [-1, 5]; only its first page gets registered so far.
    (a0,) = pool.allocate(1)
    pool.register(a0, chain_hash(None, [-1]), [-1], parent=None)
    # Request B: prompt [-2, 5]; both pages registered with the hashes it computes itself.
    b0, b1 = pool.allocate(2)
    hb = hashes_of([-2, 5], 1)
    pool.register(b0, hb[0], [-2], parent=None)  # hash cached already (a0): b0 not cached
    pool.register(b1, hb[1], [5], parent=b0)  # b1's KV was computed after token -2
    assert hb[0] == chain_hash(None, [-1])  # the collision
    # Request C: prompt [-1, 5] (same as A).  b1 must not be reused: its KV follows -2, not -1.
    hit = pool.match_prefix([-1, 5])
    assert hit[:1] == [a0]
    assert b1 not in hit, (
        f"match_prefix([-1, 5]) returned {hit}: page {b1} holds KV computed under prefix [-2]"
    )


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_pages=0, page_size=4), "num_pages"),
        (dict(num_pages=-3, page_size=4), "num_pages"),
        (dict(num_pages=2.0, page_size=4), "num_pages"),
        (dict(num_pages="8", page_size=4), "num_pages"),
        (dict(num_pages=None, page_size=4), "num_pages"),
        (dict(num_pages=4, page_size=0), "page_size"),
        (dict(num_pages=4, page_size=-1), "page_size"),
        (dict(num_pages=4, page_size=1.5), "page_size"),
        (dict(num_pages=4, page_size=4, watermark=-1), "watermark"),
        (dict(num_pages=4, page_size=4, watermark=4), "watermark"),
        (dict(num_pages=4, page_size=4, watermark=9), "watermark"),
        (dict(num_pages=4, page_size=4, watermark=1.0), "watermark"),
    ],
)
def test_invalid_constructor_args_raise_config_error(kwargs, field):
    with pytest.raises(ConfigError, match=field) as info:
        PagePool(**kwargs)
    assert isinstance(info.value, ValueError) and isinstance(info.value, GrowPageError)


def test_chain_hash_is_chained_and_order_sensitive():
    h1 = chain_hash(None, [1, 2])
    assert h1 == chain_hash(None, (1, 2))
    assert chain_hash(h1, [3, 4]) != chain_hash(None, [3, 4])
    assert chain_hash(None, [1, 2]) != chain_hash(None, [2, 1])


def test_register_prefix_links_pages_and_forgetting_a_parent_forgets_descendants():
    pool = PagePool(8, 2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    pages = pool.allocate(4)
    assert pool.register_prefix(pages, tokens) == 3  # three full pages; the partial one is not
    assert pool.match_prefix(tokens) == pages[:3]
    assert pool.register_prefix(pages, tokens) == 3  # idempotent
    pool.invalidate(pages[1])  # rewriting the middle page invalidates the pages after it
    assert pool.match_prefix(tokens) == pages[:1]
    assert not pool.is_cached(pages[2])
    pool.check_invariants()
    # Re-registering the same page under new content drops its old entry (no stale hit).
    old_hash = chain_hash(None, [1, 2])
    assert pool.register(pages[0], chain_hash(None, [9, 9]), [9, 9], parent=None)
    assert pool.lookup(old_hash, [1, 2]) is None
    pool.check_invariants()


def test_registering_a_hit_s_pages_again_keeps_the_other_branches():
    """A request that acquires cached pages registers them again as its own: that must not
    forget what is cached below them for other prompts (their later pages)."""
    pool = PagePool(8, 2)
    a, b = [1, 2, 3, 4, 9], [1, 2, 5, 6, 9]  # one shared page, then their own
    a_pages = pool.allocate(3)
    assert pool.register_prefix(a_pages, a) == 2
    pool.free(list(reversed(a_pages)))
    hit = pool.match_prefix(b)  # b shares a's first page
    assert hit == a_pages[:1]
    pool.acquire(hit[0])
    b_pages = hit + pool.allocate(2)
    assert pool.register(hit[0], chain_hash(None, [1, 2]), [1, 2], parent=None)  # already so
    assert pool.register_prefix(b_pages, b) == 2
    pool.free(list(reversed(b_pages)))
    # both branches below the shared page are cached
    assert len(pool.match_prefix(a)) == 2 and len(pool.match_prefix(b)) == 2
    pool.check_invariants()


def test_bookkeeping_bytes_bounds_what_a_fresh_pool_takes():
    # The simulator checks a pool's size against memory with it before building one.
    num_pages = 100_000
    tracemalloc.start()
    try:
        pool = PagePool(num_pages, 4)
        taken, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert pool.num_free_pages == num_pages
    assert bookkeeping_bytes(num_pages) / 2 < taken <= bookkeeping_bytes(num_pages)
