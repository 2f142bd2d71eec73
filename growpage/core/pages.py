"""``PagePool``: the page accounting shared by the simulator and the engine.

::

    page ids 0..num_pages-1
    +------+------+------+------+------+
    |  0   |  1   |  2   |  3   |  4   |     refcount[p] = number of block tables holding p
    +------+------+------+------+------+
      held   free   held   free   free       free list: least recently freed first
      rc=2          rc=1  cached               cached: a free page still holding a full
                                               prefix page; reused on a hit, evicted on reuse

Prefix caching: a full page's hash chains the previous page's hash with the page's token ids.
A page's KV depends on its whole prefix, so a hit must match three things: the hash, the page's
own token ids, and its *parent* (the cached page that held the previous page when it was
registered). Forgetting a page forgets its cached descendants, so parent identity implies the
whole prefix is the same and even a hash collision cannot share wrong KV.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from growpage.errors import ConfigError, PoolExhaustedError
from growpage.validators import is_int, positive_int

#: Bytes a fresh pool takes per page: its refcount slot, its free-list entry and the page id's
#: int (131 measured on CPython 3.11; rounded up). The prefix cache's tables add to it as pages
#: are cached.
BOOKKEEPING_BYTES_PER_PAGE = 160


def bookkeeping_bytes(num_pages: int) -> int:
    """Bytes ``PagePool(num_pages, ...)`` takes when built: to check before building one."""
    return num_pages * BOOKKEEPING_BYTES_PER_PAGE


def chain_hash(prev_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of one full page, chained with the previous page's hash."""
    return hash((prev_hash, tuple(token_ids)))


class PagePool:
    """Fixed set of KV pages with reference counts, a free list and a prefix-cache table.

    Allocation is all-or-nothing: ``allocate(n)`` either returns ``n`` pages or raises
    ``PoolExhaustedError`` and changes nothing.
    """

    def __init__(self, num_pages: int, page_size: int, watermark: int = 0) -> None:
        positive_int.require("PagePool.num_pages", num_pages)
        positive_int.require("PagePool.page_size", page_size)
        if not (is_int(watermark) and 0 <= watermark < num_pages):
            raise ConfigError(f"PagePool.watermark must be in [0, num_pages), got {watermark!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.watermark = watermark
        self.refcounts = [0] * num_pages
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages))
        self._hash_of: dict[int, int] = {}  # page -> hash of the prefix page it holds
        self._page_of: dict[int, int] = {}  # hash -> page
        self._tokens_of: dict[int, tuple[int, ...]] = {}  # page -> token ids it holds
        self._parent_of: dict[int, int | None] = {}  # page -> cached page of the previous chunk
        self._children: dict[int, set[int]] = {}  # page -> cached pages registered after it

    # ---- allocation ---------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, num: int, respect_watermark: bool = False) -> bool:
        reserve = self.watermark if respect_watermark else 0
        return num <= len(self._free) - reserve

    def allocate(self, num: int, respect_watermark: bool = False) -> list[int]:
        """Take ``num`` free pages (refcount 1 each); all or nothing."""
        if num < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({num})")
        if not self.can_allocate(num, respect_watermark):
            reserve = self.watermark if respect_watermark else 0
            raise PoolExhaustedError(
                f"need {num} page(s), {len(self._free)} free ({reserve} held back by the watermark)"
            )
        pages = []
        for _ in range(num):
            page, _ = self._free.popitem(last=False)
            self._forget(page)  # a cached free page is evicted when reused
            self.refcounts[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page; a page with no holder returns to the free list."""
        pages = list(pages)
        for page in pages:
            self._check_held(page)
        if len(set(pages)) != len(pages):
            counts = {p: pages.count(p) for p in pages}
            for page, n in counts.items():
                if n > self.refcounts[page]:
                    raise ValueError(f"page {page} freed {n} times but held {self.refcounts[page]}")
        for page in pages:
            self.refcounts[page] -= 1
            if self.refcounts[page] == 0:
                self._free[page] = None

    def fork(self, pages: Iterable[int]) -> list[int]:
        """Share held pages with another holder (refcount + 1 each)."""
        pages = list(pages)
        for page in pages:
            self._check_held(page)
        for page in pages:
            self.refcounts[page] += 1
        return pages

    def is_shared(self, page: int) -> bool:
        self._check_index(page)
        return self.refcounts[page] > 1

    def copy_on_write(self, page: int) -> int:
        """Give the caller a private page for ``page``: itself if unshared, else a new one.

        With a new page the caller must copy the content; its reference to ``page`` is dropped.
        """
        self._check_held(page)
        if self.refcounts[page] == 1:
            self.invalidate(page)
            return page
        (new,) = self.allocate(1)
        self.free([page])
        return new

    # ---- prefix cache -------------------------------------------------------------------
    def register(
        self, page: int, page_hash: int, token_ids: Sequence[int], *, parent: int | None
    ) -> bool:
        """Record that held ``page`` holds the full prefix page ``token_ids`` hashed ``page_hash``.

        ``parent`` is the cached page holding the previous page of the same prefix (None for a
        first page). Returns False when nothing was cached: an equal page is cached already
        (the first one stays), or the parent is no longer cached. Registering a page again as
        the prefix page it is cached as changes nothing (its cached descendants stay).
        """
        self._check_held(page)
        if len(token_ids) != self.page_size:
            raise ValueError(f"only full pages are cached ({len(token_ids)} != {self.page_size})")
        if self.lookup(page_hash, token_ids, parent) == page:
            return True  # a prefix hit's page, registered by its new holder: already so
        self._forget(page)
        if page_hash in self._page_of or (parent is not None and parent not in self._hash_of):
            return False
        self._hash_of[page] = page_hash
        self._page_of[page_hash] = page
        self._tokens_of[page] = tuple(token_ids)
        self._parent_of[page] = parent
        if parent is not None:
            self._children.setdefault(parent, set()).add(page)
        return True

    def register_prefix(self, pages: Sequence[int], token_ids: Sequence[int]) -> int:
        """Register every full page of a sequence's leading ``pages``; returns how many are
        cached now. Stops at the first page that cannot be cached."""
        prev_hash, parent, b = None, None, self.page_size
        for i, page in enumerate(pages[: len(token_ids) // b]):
            chunk = token_ids[i * b : (i + 1) * b]
            prev_hash = chain_hash(prev_hash, chunk)
            if self.lookup(prev_hash, chunk, parent) == page:
                parent = page
                continue
            if not self.register(page, prev_hash, chunk, parent=parent):
                return i
            parent = page
        return min(len(pages), len(token_ids) // b)

    def extend_chain(
        self,
        page: int,
        token_ids: Sequence[int],
        prev_hash: int | None,
        parent: int | None,
        first: bool,
    ) -> tuple[int, int | None]:
        """Enter held ``page``, the full page ``token_ids`` after a prefix of chain hash
        ``prev_hash`` whose cached page is ``parent`` (``first``: no prefix before it).

        Returns the chain hash through this page and the cached page of the prefix through it:
        this page, or an equal one cached first by another holder (then a later page chains to
        that one), or None when the prefix before it is not cached (nor is this page, then).
        """
        page_hash = chain_hash(prev_hash, token_ids)
        if not first and parent is None:
            return page_hash, None
        self.register(page, page_hash, token_ids, parent=parent)
        return page_hash, self.lookup(page_hash, token_ids, parent)

    def lookup(
        self, page_hash: int, token_ids: Sequence[int], parent: int | None = None
    ) -> int | None:
        """The cached page holding exactly ``token_ids`` after ``parent`` under ``page_hash``."""
        page = self._page_of.get(page_hash)
        if page is None or self._tokens_of[page] != tuple(token_ids):
            return None
        if self._parent_of[page] != parent:
            return None
        return page

    def acquire(self, page: int) -> None:
        """Take a reference to a cached page (it leaves the free list if it was there)."""
        if page not in self._hash_of:
            raise ValueError(f"page {page} is not a cached prefix page")
        if self.refcounts[page] == 0:
            del self._free[page]
        self.refcounts[page] += 1

    def invalidate(self, page: int) -> None:
        """Forget the cached content of a page about to be overwritten (and its descendants)."""
        self._check_index(page)
        self._forget(page)

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Cached pages for the longest run of full leading pages of ``token_ids`` (not acquired)."""
        pages: list[int] = []
        prev: int | None = None
        b = self.page_size
        for start in range(0, len(token_ids) - b + 1, b):
            chunk = token_ids[start : start + b]
            prev = chain_hash(prev, chunk)
            page = self.lookup(prev, chunk, pages[-1] if pages else None)
            if page is None:
                break
            pages.append(page)
        return pages

    def is_cached(self, page: int) -> bool:
        return page in self._hash_of

    # ---- internals ----------------------------------------------------------------------
    def _forget(self, page: int) -> None:
        h = self._hash_of.pop(page, None)
        if h is None:
            return
        del self._page_of[h]
        del self._tokens_of[page]
        parent = self._parent_of.pop(page)
        if parent is not None:
            self._children[parent].discard(page)
        # Descendants were computed after this page's content: they can no longer be matched.
        for child in self._children.pop(page, set()):
            self._parent_of[child] = None  # detach first so the recursion does not revisit us
            self._forget(child)

    def _check_index(self, page: int) -> None:
        if not (is_int(page) and 0 <= page < self.num_pages):
            raise ValueError(f"page id {page!r} out of range [0, {self.num_pages})")

    def _check_held(self, page: int) -> None:
        self._check_index(page)
        if self.refcounts[page] <= 0:
            raise ValueError(f"page {page} is not allocated (double free?)")

    def check_invariants(self) -> None:
        """Raise AssertionError when the internal bookkeeping is inconsistent (for tests)."""
        free = set(self._free)
        assert len(free) == len(self._free)
        for page, rc in enumerate(self.refcounts):
            assert rc >= 0, f"negative refcount on page {page}"
            assert (rc == 0) == (page in free), f"page {page}: refcount {rc} vs free list"
        for page, h in self._hash_of.items():
            assert self._page_of[h] == page and page in self._tokens_of
        assert len(self._page_of) == len(self._hash_of) == len(self._tokens_of)
        assert self._parent_of.keys() == self._hash_of.keys()
        for page, parent in self._parent_of.items():
            assert parent is None or page in self._children.get(parent, ()), (
                f"cached page {page} lost its link to parent {parent}"
            )
