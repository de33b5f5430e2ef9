"""Radix tree over token ids: cached prompt prefixes, their KV pages and GDN state snapshots.

Plain Python, no tensors. One tree per DP rank (page ids and snapshot ids are rank-local).

Every edge holds a whole number of pages (``len(key) == len(pages) * page_size``): node ``n``
owns the KV pages of the tokens on the edge from its parent, and the tokens from the root to
the end of ``n`` (``n.depth`` of them) are a prefix some request has computed. A node may also
own a GDN state snapshot (``snapshot``): the conv + recurrent state of every GDN layer after
consuming exactly those ``n.depth`` tokens. A hybrid model can only resume from a prefix whose
GDN state is known, so a match ends at the deepest node *with a snapshot*; nodes without one
(created by splitting an edge) only share pages on the way down.

Reference counts: a running request that uses a cached prefix holds a lock on the node where
its prefix ends, which counts on every node up to the root (``lock_ref``). Unlocked nodes are
evictable, leaves first, least recently used first; evicting a node returns its pages to the
page pool and its snapshot to the snapshot pool.

``flush`` frees every unlocked node at once and detaches the locked ones from the tree ("doomed":
no new request matches them); each doomed node is freed when its last lock is released.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools

from sglang_tpu_backend.mem_cache.id_allocator import IdAllocator
from sglang_tpu_backend.mem_cache.page_pool import PagePool


class SnapshotPool(IdAllocator):
    """Owns which GDN snapshot ids ``[0, num_snapshots)`` are free (arrays live in the runner)."""

    def __init__(self, num_snapshots: int):
        super().__init__(num_snapshots, "GDN state snapshot")
        self.num_snapshots = num_snapshots

    def allocate(self) -> int | None:
        """One snapshot id, or None when none is free."""
        return self._take(1)[0] if self.num_free else None

    def free(self, snapshot: int) -> None:
        self._give_back([snapshot])


class TreeNode:
    """One edge of the tree: ``key`` (token ids, whole pages) and the ``pages`` holding their KV."""

    __slots__ = ("key", "pages", "parent", "children", "depth", "lock_ref", "snapshot",
                 "last_access", "doomed")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: "TreeNode | None"):
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: dict[tuple[int, ...], TreeNode] = {}  # keyed by the child's first page
        self.depth = (parent.depth if parent else 0) + len(key)  # tokens from the root to the end
        self.lock_ref = 0
        self.snapshot: int | None = None
        self.last_access = 0
        self.doomed = False

    def __repr__(self) -> str:
        return (f"TreeNode(depth={self.depth}, pages={self.pages}, lock={self.lock_ref}, "
                f"snapshot={self.snapshot})")


@dataclasses.dataclass
class PrefixMatch:
    """The longest cached prefix of a token list that ends at a snapshot.

    length: tokens matched (a multiple of the page size; 0 = no match).
    node:   the node ending at ``length`` (the root when nothing matched).
    pages:  the KV pages of those tokens, in order (``length // page_size`` of them).
    num_unlocked_pages: pages among ``pages`` that are evictable now (locking ``node`` makes
            them unevictable, which admission must account for).
    """

    length: int
    node: TreeNode
    pages: list[int]
    num_unlocked_pages: int

    @property
    def snapshot(self) -> int | None:
        return self.node.snapshot


class RadixCache:
    """Prefix tree of one DP rank; frees pages into ``page_pool`` and snapshots into
    ``snapshot_pool`` when nodes are evicted."""

    def __init__(self, page_pool: PagePool, snapshot_pool: SnapshotPool):
        self.page_pool = page_pool
        self.snapshot_pool = snapshot_pool
        self.page_size = page_pool.page_size
        self.root = TreeNode((), [], None)
        self.num_evictable_pages = 0  # pages of unlocked nodes
        self.num_cached_pages = 0  # pages owned by the tree, doomed nodes included
        self.num_evicted_pages = 0  # pages freed by eviction (memory pressure or flush), total
        self._clock = itertools.count(1)

    # Matching ----------------------------------------------------------------------------
    def _matching_pages(self, key: tuple[int, ...], tokens: list[int], pos: int, limit: int) -> int:
        """Tokens (whole pages) at the start of ``key`` equal to ``tokens[pos:limit]``."""
        P, k = self.page_size, 0
        while k < len(key) and pos + k + P <= limit and key[k:k + P] == tuple(tokens[pos + k:pos + k + P]):
            k += P
        return k

    def match_prefix(self, tokens: list[int], max_len: int) -> PrefixMatch:
        """Longest cached prefix of ``tokens[:max_len]`` that ends at a snapshot. No side effects."""
        P = self.page_size
        node, pos, pages, unlocked = self.root, 0, [], 0
        best = PrefixMatch(0, self.root, [], 0)
        while pos + P <= max_len:
            child = node.children.get(tuple(tokens[pos:pos + P]))
            if child is None:
                break
            k = self._matching_pages(child.key, tokens, pos, max_len)
            if k < len(child.key):
                break  # a snapshot only ever sits at the end of an edge
            pages += child.pages
            unlocked += len(child.pages) if child.lock_ref == 0 else 0
            pos, node = pos + k, child
            if node.snapshot is not None:
                best = PrefixMatch(pos, node, list(pages), unlocked)
        return best

    def has_snapshot_at(self, tokens: list[int], length: int) -> bool:
        """Whether the prefix ``tokens[:length]`` is cached with a snapshot at its end."""
        return self.match_prefix(tokens, length).length == length

    # Locks -------------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        """A running request now uses the prefix ending at ``node``."""
        now = next(self._clock)
        while node is not None and node.parent is not None:
            if node.lock_ref == 0 and not node.doomed:
                self.num_evictable_pages -= len(node.pages)
            node.lock_ref += 1
            node.last_access = now
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Release a lock taken with ``lock(node)``; doomed nodes are freed at their last one."""
        while node is not None and node.parent is not None:
            if node.lock_ref <= 0:
                raise ValueError(f"unlock of an unlocked node {node}")
            node.lock_ref -= 1
            parent = node.parent
            if node.lock_ref == 0:
                if node.doomed:
                    if not node.children:
                        self._free_node(node)
                else:
                    self.num_evictable_pages += len(node.pages)
            node = parent

    # Insertion -----------------------------------------------------------------------------
    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Cut ``child``'s edge after ``k`` tokens; returns the new upper node (no snapshot)."""
        n = k // self.page_size
        parent = child.parent
        upper = TreeNode(child.key[:k], child.pages[:n], parent)
        upper.lock_ref, upper.last_access, upper.doomed = child.lock_ref, child.last_access, child.doomed
        child.key, child.pages, child.parent = child.key[k:], child.pages[n:], upper
        upper.children[child.key[:self.page_size]] = child
        parent.children[upper.key[:self.page_size]] = upper
        return upper

    def insert(self, tokens: list[int], pages: list[int], snapshot: int
               ) -> tuple[TreeNode, list[int], list[int], bool]:
        """Cache the prefix ``tokens`` (whole pages) whose KV is in ``pages`` and whose GDN state
        is in ``snapshot``.

        Returns (node ending at ``len(tokens)``, the tree's pages for ``tokens``, the caller's
        pages the tree did not take because it already held those tokens (the caller frees
        them once it stops using them), whether ``snapshot`` was taken (False: the node
        already had one; the caller frees it)). The new node is unlocked: lock it to keep it.
        """
        P = self.page_size
        if len(tokens) != len(pages) * P or not tokens:
            raise ValueError(f"insert needs whole pages: {len(tokens)} tokens, {len(pages)} pages")
        node, pos, tree_pages = self.root, 0, []
        now = next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tuple(tokens[pos:pos + P]))
            if child is None:
                child = TreeNode(tuple(tokens[pos:]), list(pages[pos // P:]), node)
                node.children[child.key[:P]] = child
                self.num_evictable_pages += len(child.pages)
                self.num_cached_pages += len(child.pages)
                k = len(child.key)
            else:
                k = self._matching_pages(child.key, tokens, pos, len(tokens))
                if k < len(child.key):
                    child = self._split(child, k)
            child.last_access = now
            tree_pages += child.pages
            pos, node = pos + k, child
        unused = [p for p, q in zip(pages, tree_pages) if p != q]
        taken = node.snapshot is None
        if taken:
            node.snapshot = snapshot
        return node, tree_pages, unused, taken

    # Eviction ------------------------------------------------------------------------------
    def _free_node(self, node: TreeNode) -> None:
        self.page_pool.free(node.pages)
        self.num_cached_pages -= len(node.pages)
        if node.snapshot is not None:
            self.snapshot_pool.free(node.snapshot)
        parent = node.parent
        del parent.children[node.key[:self.page_size]]
        node.parent = None

    def _evictable_leaves(self) -> list[tuple[int, int, int, TreeNode]]:
        """Heap entries of unlocked leaves: leaves without a snapshot first (no use), then LRU."""
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n is not self.root and not n.children and n.lock_ref == 0:
                out.append((n.snapshot is not None, n.last_access, id(n), n))
        heapq.heapify(out)
        return out

    def evict(self, num_pages: int = 0, num_snapshots: int = 0) -> None:
        """Evict unlocked leaves (LRU) until ``num_pages`` pages and ``num_snapshots`` snapshots
        are free in the pools, or nothing evictable is left."""
        heap = None
        while (self.page_pool.num_free < num_pages
               or self.snapshot_pool.num_free < num_snapshots):
            if heap is None:
                heap = self._evictable_leaves()
            if not heap:
                return
            *_, node = heapq.heappop(heap)
            parent = node.parent
            self.num_evictable_pages -= len(node.pages)
            self.num_evicted_pages += len(node.pages)
            self._free_node(node)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.snapshot is not None, parent.last_access, id(parent), parent))

    def drop_snapshot(self) -> bool:
        """Free the least recently used snapshot of any node, locked ones included (a lock
        protects pages; a snapshot is only read when a request is admitted, and the step copies
        it into the request's slot before any snapshot written in that step). The node keeps
        its pages. False when no node has a snapshot."""
        best, stack = None, list(self.root.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.snapshot is not None and (best is None or n.last_access < best.last_access):
                best = n
        if best is None:
            return False
        self.snapshot_pool.free(best.snapshot)
        best.snapshot = None
        return True

    def flush(self) -> None:
        """Free every unlocked node; detach locked ones (freed when released)."""
        self.evict(num_pages=self.page_pool.num_pages, num_snapshots=self.snapshot_pool.num_snapshots)
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            n.doomed = True
            stack.extend(n.children.values())
        self.root = TreeNode((), [], None)
        self.num_evictable_pages = 0

    # Introspection -------------------------------------------------------------------------
    def num_nodes(self) -> int:
        count, stack = 0, list(self.root.children.values())
        while stack:
            n = stack.pop()
            count += 1
            stack.extend(n.children.values())
        return count
