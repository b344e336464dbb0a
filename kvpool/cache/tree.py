r"""RadixTree: token ids -> pool pages, at page granularity.

    root ── [t0..t3 | t4..t7] ──┬── [t8..t11]              (a node: a run of whole pages, their
      (pages 17, 4)             │     (page 9)              token ids and the pool page of each)
                                └── [u8..u11 | u12..u15]
                                      (pages 30, 2)

A path from the root spells a prefix of some finished request, whole pages only; a node's
children are keyed by the key of their first page (kvpool.cache.blocks) and always compared by
their token ids, so a key collision costs a miss, never wrong KV. Matching walks one node at a
time and compares a node's pages in one numpy expression: no loop over tokens.

`users` counts the live requests (and admissions in progress) whose matched path passes
through a node: a node in use is never evicted. Eviction trims least-recently-used leaves from
their tail, so what stays is still a prefix. The tree holds page ids only; what those pages
cost the pool (the holds) is its owner's business (kvpool.cache.prefix).
"""

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvpool.cache.blocks import page_blocks, page_keys
from kvpool.indices import INDEX_DTYPE


class Node:
    __slots__ = ("blocks", "pages", "children", "parent", "users", "used")

    def __init__(self, blocks: np.ndarray, pages: np.ndarray, parent: "Node | None"):
        self.blocks = blocks  # int64 [k, page_size]: the token ids of its pages
        self.pages = pages  # int32 [k]: the pool page holding each
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.users = 0  # live requests whose match ends at or below it
        self.used = 0  # tick of its last match or insert (LRU)

    def __len__(self) -> int:
        return len(self.pages)


@dataclass(frozen=True)
class Match:
    """The longest cached prefix of a request: `pages` (int32, the pool pages of its first
    len(pages) pages), ending at `node` (the root when nothing matched)."""

    node: Node
    pages: np.ndarray

    @property
    def num_pages(self) -> int:
        return len(self.pages)


def _common(blocks: np.ndarray, query: np.ndarray) -> int:
    """How many leading pages of `blocks` equal those of `query` (both [k, page_size])."""
    q = min(len(blocks), len(query))
    same = (blocks[:q] == query[:q]).all(axis=1)
    return q if same.all() else int(np.argmin(same))


class RadixTree:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self.root = Node(np.zeros((0, page_size), np.int64), np.zeros(0, INDEX_DTYPE), None)
        self.num_pages = 0  # pages the tree holds
        self._tick = itertools.count(1)

    # ---- lookups ------------------------------------------------------------------------
    def match(self, tokens: np.ndarray, most_pages: int) -> Match:
        """The longest cached prefix of `tokens`, at most `most_pages` pages; a node it ends
        inside is split there, so the match ends at a node (which acquire() can hold)."""
        blocks = page_blocks(tokens, self.page_size)[: max(0, most_pages)]
        keys = page_keys(tokens[: len(blocks) * self.page_size], self.page_size)
        node, i, found, tick = self.root, 0, [], next(self._tick)
        while i < len(blocks):
            child = node.children.get(int(keys[i]))
            j = 0 if child is None else _common(child.blocks, blocks[i:])
            if j == 0:
                break
            if j < len(child):
                child = self._split(child, j)
            child.used = tick
            found.append(child.pages)
            node, i = child, i + j
        pages = np.concatenate(found) if found else np.zeros(0, INDEX_DTYPE)
        return Match(node, pages)

    def acquire(self, node: Node) -> None:
        """A request uses the path to `node`: none of it is evicted until release()."""
        while node is not None:
            node.users += 1
            node = node.parent

    def release(self, node: Node) -> None:
        while node is not None:
            node.users -= 1
            node = node.parent

    # ---- changes ------------------------------------------------------------------------
    def insert(self, tokens: np.ndarray, pages: np.ndarray) -> np.ndarray:
        """Cache `pages` (int32, one per whole page of `tokens`); returns the ones the tree
        took (new to it). A page whose block is cached already is not taken (its owner frees
        it); nor is anything from a key collision on."""
        blocks = page_blocks(tokens, self.page_size)[: len(pages)]
        keys = page_keys(tokens[: len(blocks) * self.page_size], self.page_size)
        node, i, tick = self.root, 0, next(self._tick)
        while i < len(blocks):
            child = node.children.get(int(keys[i]))
            if child is None:
                leaf = Node(blocks[i:].copy(), np.array(pages[i : len(blocks)], dtype=INDEX_DTYPE), node)
                leaf.used = tick
                node.children[int(keys[i])] = leaf
                self.num_pages += len(leaf)
                return leaf.pages
            j = _common(child.blocks, blocks[i:])
            if j == 0:
                break  # another block with this key: not cached (never shared)
            if j < len(child):
                child = self._split(child, j)
            child.used = tick
            node, i = child, i + j
        return np.zeros(0, INDEX_DTYPE)

    def _split(self, node: Node, j: int) -> Node:
        """Cut `node` after its first j pages; returns the upper part (a new node in its place)."""
        upper = Node(node.blocks[:j], node.pages[:j], node.parent)
        upper.users, upper.used = node.users, node.used
        key = int(page_keys(node.blocks[0], self.page_size)[0])
        upper.children[int(page_keys(node.blocks[j], self.page_size)[0])] = node
        node.parent.children[key] = upper
        node.blocks, node.pages, node.parent = node.blocks[j:], node.pages[j:], upper
        return upper

    def evict(self, wanted: int, helps: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
        """Remove pages from least-recently-used leaves no request uses, from their tail, until
        `wanted` of them count (`helps(pages)`: a bool mask of the ones that do; None: all
        do) or nothing is left to evict. Returns the pages removed (int32)."""
        heap = [(n.used, id(n), n) for n in self._leaves() if n.users == 0]
        heapq.heapify(heap)
        removed: list[np.ndarray] = []
        while wanted > 0 and heap:
            _, _, leaf = heapq.heappop(heap)
            counts = np.ones(len(leaf), bool) if helps is None else np.asarray(helps(leaf.pages), bool)
            from_tail = np.cumsum(counts[::-1])
            cut = int(np.searchsorted(from_tail, wanted)) + 1 if from_tail[-1] >= wanted else len(leaf)
            removed.append(leaf.pages[len(leaf) - cut :])
            wanted -= int(from_tail[cut - 1])
            parent = self._trim(leaf, cut)
            if parent is not None:
                heapq.heappush(heap, (parent.used, id(parent), parent))
        out = np.concatenate(removed) if removed else np.zeros(0, INDEX_DTYPE)
        self.num_pages -= len(out)
        return out

    def _trim(self, leaf: Node, cut: int) -> Node | None:
        """Drop the last `cut` pages of `leaf` (all: the leaf goes); returns its parent when
        that became an unused leaf (the next candidate), else None."""
        if cut < len(leaf):
            leaf.blocks, leaf.pages = leaf.blocks[: len(leaf) - cut], leaf.pages[: len(leaf) - cut]
            return None
        parent = leaf.parent
        del parent.children[int(page_keys(leaf.blocks[0], self.page_size)[0])]
        leaf.parent = None
        if parent is not self.root and not parent.children and parent.users == 0:
            return parent
        return None

    # ---- accounting ---------------------------------------------------------------------
    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _leaves(self):
        return (n for n in self._nodes() if not n.children)

    def pages(self, unused_only: bool = False) -> np.ndarray:
        """Every page the tree holds (only those no request uses: what eviction could free)."""
        parts = [n.pages for n in self._nodes() if not unused_only or n.users == 0]
        return np.concatenate(parts) if parts else np.zeros(0, INDEX_DTYPE)

    def check(self) -> None:
        """AssertionError unless the tree is consistent (tests): keys, parents, page counts."""
        total = 0
        for node in self._nodes():
            assert len(node) > 0 and node.blocks.shape == (len(node), self.page_size)
            assert node.parent.children[int(page_keys(node.blocks[0], self.page_size)[0])] is node
            below = sum(c.users for c in node.children.values())
            assert node.users >= below >= 0, "a node has fewer users than its children"
            total += len(node)
        assert total == self.num_pages, f"{total} pages in nodes, {self.num_pages} counted"
