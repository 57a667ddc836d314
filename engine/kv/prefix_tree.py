"""A radix tree of token sequences: the prompt cache's index.

Each node holds the run of tokens (`edge`) from its parent to it; children are
keyed by their first token, so a lookup walks one node per branching point of
the prompt's path and compares each edge in one slice comparison (plus one
chunked refinement where the prompt leaves the tree). Its cost grows with the
prompt (and the number of branching points on its path), not with the number
of sequences held: 2,000 entries that share a system prompt cost a lookup the
same as 10.

A node ends at most one entry (an entry id). Every node counts the entries
below it (itself included) that may be trimmed back to a shorter prefix, and
keeps its children that have such entries in `live`: the deepest point of the
prompt's path with a trimmable entry below it is found during the walk, and one
such entry is reached from there in one step per level.

`ops` counts the walk's Python-level steps (nodes visited, slice comparisons,
tokens compared one by one): a deterministic cost proxy for the tests.
"""

from __future__ import annotations

from typing import Optional

CHUNK = 64   # tokens compared per slice while refining where two sequences part


class Node:
    __slots__ = ("edge", "parent", "children", "live", "entry", "entry_trimmable",
                 "trimmable", "depth")

    def __init__(self, edge: tuple, parent: Optional["Node"], depth: int):
        self.edge = edge                  # tokens from the parent to here
        self.parent = parent
        self.children: dict = {}          # first token of the child's edge -> child
        self.live: dict = {}              # the children with trimmable > 0
        self.entry = None                 # the id of the entry that ends here
        self.entry_trimmable = False
        self.trimmable = 0                # trimmable entries here and below
        self.depth = depth                # tokens from the root to the end of edge

    def tokens(self) -> tuple:
        """The tokens from the root to the end of this node's edge."""
        edges, node = [], self
        while node is not None:
            edges.append(node.edge)
            node = node.parent
        return tuple(t for e in reversed(edges) for t in e)


class Match:
    """The best entries for a prompt: `end`, the deepest node on the prompt's path
    that ends an entry (reusable whole, no trim); `trim`/`trim_len`, a node with a
    trimmable entry that shares `trim_len` tokens with the prompt (the most any
    trimmable entry shares)."""
    __slots__ = ("end", "trim", "trim_len")

    def __init__(self):
        self.end: Optional[Node] = None
        self.trim: Optional[Node] = None
        self.trim_len = 0


class PrefixTree:
    def __init__(self):
        self.root = Node((), None, 0)
        self.ops = 0

    def _common(self, edge: tuple, tokens: tuple, pos: int, limit: int) -> int:
        """How many leading tokens of `edge` equal tokens[pos:limit]."""
        m = min(len(edge), limit - pos)
        self.ops += 1
        if edge[:m] == tokens[pos:pos + m]:
            return m
        i = 0
        while i + CHUNK <= m and edge[i:i + CHUNK] == tokens[pos + i:pos + i + CHUNK]:
            self.ops += 1
            i += CHUNK
        while i < m and edge[i] == tokens[pos + i]:
            self.ops += 1
            i += 1
        return i

    def match(self, tokens: tuple, limit: int) -> Match:
        """Walk tokens[:limit] down the tree."""
        out, node, pos = Match(), self.root, 0
        while pos < limit:
            self.ops += 1
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = self._common(child.edge, tokens, pos, limit)
            if child.trimmable:
                out.trim, out.trim_len = child, pos + n
            if n < len(child.edge):
                break
            node, pos = child, pos + n
            if child.entry is not None:
                out.end = child
        return out

    def trimmable_below(self, node: Node) -> Node:
        """A node at or below `node` that ends a trimmable entry (node.trimmable > 0)."""
        while not node.entry_trimmable:
            self.ops += 1
            node = next(iter(node.live.values()))
        return node

    # --- updates ----------------------------------------------------------------------

    def insert(self, tokens: tuple) -> Node:
        """The node that ends `tokens` (created, splitting an edge where needed)."""
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = Node(tokens[pos:], node, len(tokens))
                node.children[tokens[pos]] = leaf
                return leaf
            n = self._common(child.edge, tokens, pos, len(tokens))
            if n < len(child.edge):
                child = self._split(child, n)
            node, pos = child, pos + n
        return node

    def _split(self, child: Node, n: int) -> Node:
        """Cut child's edge after n tokens: a new node between child and its parent."""
        parent, first = child.parent, child.edge[0]
        mid = Node(child.edge[:n], parent, child.depth - len(child.edge) + n)
        child.edge, child.parent = child.edge[n:], mid
        mid.children[child.edge[0]] = child
        mid.trimmable = child.trimmable
        if child.trimmable:
            mid.live[child.edge[0]] = child
            parent.live[first] = mid
        parent.children[first] = mid
        return mid

    def set_entry(self, node: Node, eid, trimmable: bool) -> None:
        node.entry, node.entry_trimmable = eid, trimmable
        if trimmable:
            self._count(node, +1)

    def clear_entry(self, node: Node) -> None:
        if node.entry_trimmable:
            self._count(node, -1)
        node.entry, node.entry_trimmable = None, False
        self._prune(node)

    def _count(self, node: Node, delta: int) -> None:
        while node is not None:
            node.trimmable += delta
            parent = node.parent
            if parent is not None:
                if node.trimmable:
                    parent.live[node.edge[0]] = node
                else:
                    parent.live.pop(node.edge[0], None)
            node = parent

    def _prune(self, node: Node) -> None:
        """Drop nodes that end nothing and lead nowhere; merge a pass-through node
        (no entry, one child) into its child."""
        while node.parent is not None and node.entry is None and len(node.children) <= 1:
            parent, first = node.parent, node.edge[0]
            if node.children:
                (child,) = node.children.values()
                child.edge, child.parent = node.edge + child.edge, parent
                parent.children[first] = child
                if child.trimmable:
                    parent.live[first] = child
                return
            del parent.children[first]
            parent.live.pop(first, None)
            node = parent

    def ends_on_path(self, tokens: tuple) -> list:
        """The nodes that end an entry whose sequence is a prefix of `tokens` (or it)."""
        out, node, pos = [], self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if (child is None
                    or self._common(child.edge, tokens, pos, len(tokens)) < len(child.edge)):
                break
            node, pos = child, pos + len(child.edge)
            if node.entry is not None:
                out.append(node)
        return out

    def empty(self) -> bool:
        return not self.root.children
