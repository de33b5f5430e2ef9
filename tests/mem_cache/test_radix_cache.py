"""The radix tree on its own: insert / match / split / lock counts / LRU eviction / flush,
checked against the page and snapshot pools' accounting (plain Python, page size 4)."""

from __future__ import annotations

import pytest

from sglang_tpu_backend.mem_cache.page_pool import PagePool
from sglang_tpu_backend.mem_cache.radix_cache import RadixCache, SnapshotPool

P = 4


def make(num_pages=32, num_snapshots=8) -> RadixCache:
    return RadixCache(PagePool(num_pages, P), SnapshotPool(num_snapshots))


def put(cache: RadixCache, tokens: list[int]):
    """Insert ``tokens`` like a request that computed them into fresh pages + a snapshot."""
    pages = cache.page_pool.allocate(len(tokens) // P)
    snap = cache.snapshot_pool.allocate()
    node, tree_pages, unused, taken = cache.insert(tokens, pages, snap)
    cache.page_pool.free(unused)
    if not taken:
        cache.snapshot_pool.free(snap)
    return node, tree_pages, pages


def check_accounting(cache: RadixCache) -> None:
    """Pages/snapshots the tree owns == what the pools have handed out (nothing else holds any)."""
    pages, snaps, evictable, stack = [], [], 0, list(cache.root.children.values())
    while stack:
        n = stack.pop()
        pages += n.pages
        snaps += [n.snapshot] if n.snapshot is not None else []
        evictable += len(n.pages) if n.lock_ref == 0 else 0
        for c in n.children.values():
            assert c.parent is n and c.depth == n.depth + len(c.key) and c.lock_ref <= n.lock_ref
            assert len(c.key) == len(c.pages) * P
        stack.extend(n.children.values())
    assert len(pages) == len(set(pages)) == cache.page_pool.num_used == cache.num_cached_pages
    assert len(snaps) == len(set(snaps)) == cache.snapshot_pool.num_used
    assert evictable == cache.num_evictable_pages


def test_match_ends_at_a_snapshot_and_respects_max_len():
    c = make()
    a = list(range(100, 112))  # 3 pages
    node, pages, _ = put(c, a)
    m = c.match_prefix(a + [1, 2, 3], 100)
    assert (m.length, m.pages, m.node) == (12, pages, node)
    assert m.snapshot == node.snapshot and m.num_unlocked_pages == 3
    assert c.match_prefix(a, 11).length == 0  # the only snapshot is at 12
    assert c.match_prefix(a[:8] + [0] * 8, 16).length == 0  # diverges inside the edge
    assert c.match_prefix([7] + a[1:], 16).length == 0
    check_accounting(c)


def test_insert_splits_edges_and_shares_pages():
    c = make()
    a = list(range(100, 116))  # 4 pages
    na, pa, _ = put(c, a)
    b = a[:8] + [1, 2, 3, 4, 5, 6, 7, 8]  # shares 2 pages with a
    nb, pb, own_b = put(c, b)
    assert pb[:2] == pa[:2] and pb[2:] == own_b[2:]  # b's first 2 pages were not taken
    assert c.page_pool.num_used == 6  # 4 + 2 new; b's duplicates went back to the pool
    upper = nb.parent
    assert upper is na.parent and upper.depth == 8 and upper.snapshot is None
    assert len(upper.children) == 2 and c.num_nodes() == 3
    assert c.match_prefix(a, 16).length == 16 and c.match_prefix(b, 16).length == 16
    assert c.match_prefix(a, 15).length == 0  # the split point has no snapshot yet
    # A request that ends at the split point adds a snapshot there without new pages.
    n8, p8, _ = put(c, a[:8])
    assert n8 is upper and n8.snapshot is not None and p8 == pa[:2]
    assert c.match_prefix(a[:8] + [9] * 4, 12).length == 8
    # Inserting an already cached prefix keeps the tree's snapshot and pages.
    before = (c.page_pool.num_used, c.snapshot_pool.num_used)
    n2, _, _ = put(c, a)
    assert n2 is na and (c.page_pool.num_used, c.snapshot_pool.num_used) == before
    check_accounting(c)


def test_insert_rejects_partial_pages():
    c = make()
    with pytest.raises(ValueError, match="whole pages"):
        c.insert([1, 2, 3], [0], 0)


def test_locks_protect_from_eviction_and_count_on_the_path():
    c = make()
    a = list(range(100, 116))
    na, _, _ = put(c, a)
    nb, _, _ = put(c, a[:8] + [1] * 8)
    c.lock(nb)
    assert nb.lock_ref == 1 and nb.parent.lock_ref == 1 and na.lock_ref == 0
    assert c.num_evictable_pages == 2  # only a's own 2 pages
    c.evict(num_pages=c.page_pool.num_pages)  # as much as possible
    assert c.match_prefix(a, 16).length == 0 and c.match_prefix(a[:8] + [1] * 8, 16).length == 16
    assert c.page_pool.num_used == 4 and c.num_evictable_pages == 0
    c.unlock(nb)
    assert c.num_evictable_pages == 4
    with pytest.raises(ValueError):
        c.unlock(nb)
    c.evict(num_pages=c.page_pool.num_pages)
    assert c.page_pool.num_used == 0 and c.snapshot_pool.num_used == 0 and c.num_nodes() == 0
    check_accounting(c)


def test_eviction_is_lru_and_stops_when_enough_is_free():
    c = make(num_pages=8)
    x, y, z = [[k] * 8 for k in (1, 2, 3)]  # 2 pages each
    for t in (x, y, z):
        put(c, t)
    c.lock(c.match_prefix(x, 8).node)  # touch x: y is now the least recently used
    c.unlock(c.match_prefix(x, 8).node)
    assert c.page_pool.num_free == 2
    c.evict(num_pages=4)
    assert c.page_pool.num_free == 4
    assert c.match_prefix(y, 8).length == 0
    assert c.match_prefix(x, 8).length == 8 and c.match_prefix(z, 8).length == 8
    c.evict(num_snapshots=c.snapshot_pool.num_snapshots)  # frees every snapshot: all nodes go
    assert c.num_nodes() == 0 and c.page_pool.num_free == 8
    check_accounting(c)


def test_eviction_frees_parents_that_become_leaves():
    c = make()
    a = list(range(100, 116))
    put(c, a[:8])
    put(c, a)
    put(c, a[:8] + [1] * 4)
    assert c.num_nodes() == 3
    c.evict(num_pages=c.page_pool.num_pages)
    assert c.num_nodes() == 0 and c.page_pool.num_used == 0 and c.snapshot_pool.num_used == 0


def test_flush_frees_unlocked_now_and_locked_on_release():
    c = make()
    a, b = list(range(100, 116)), list(range(200, 208))
    na, _, _ = put(c, a)
    put(c, b)
    nsub, _, _ = put(c, a[:8])  # split: a's path is upper(8) -> na
    c.lock(na)
    c.flush()
    assert c.num_nodes() == 0 and c.match_prefix(a, 16).length == 0  # new matches miss
    assert c.page_pool.num_used == 4 and c.snapshot_pool.num_used == 2  # a's path is in use
    assert c.num_evictable_pages == 0
    c.evict(num_pages=c.page_pool.num_pages)  # eviction does not touch the detached nodes
    assert c.page_pool.num_used == 4
    c.unlock(na)
    assert c.page_pool.num_used == 0 and c.snapshot_pool.num_used == 0 and c.num_cached_pages == 0
    put(c, a)  # the tree is usable after a flush
    assert c.match_prefix(a, 16).length == 16
    check_accounting(c)


def test_snapshot_pool_allocates_until_empty():
    pool = SnapshotPool(2)
    assert {pool.allocate(), pool.allocate()} == {0, 1} and pool.allocate() is None
    pool.free(1)
    with pytest.raises(ValueError):
        pool.free(1)
    assert pool.allocate() == 1


def test_drop_snapshot_takes_the_oldest_even_when_locked():
    c = make()
    a = list(range(100, 116))
    n8, _, _ = put(c, a[:8])
    n16, _, _ = put(c, a)
    c.lock(n16)  # locks n8 too; n8 is the older one
    assert c.drop_snapshot() and n8.snapshot is None and n16.snapshot is not None
    assert c.page_pool.num_used == 4 and c.match_prefix(a, 16).length == 16
    c.unlock(n16)
    check_accounting(c)
