"""`Node.tokens()`: the sequence a node of the prompt caches' radix tree ends, after the
inserts that split its edges (what a restarted server's warm-up reads back from the disk
prompt cache's index: `DiskCache.longest_ids`)."""

import random

from engine.kv.prefix_tree import PrefixTree


def test_every_inserted_node_gives_back_its_sequence_after_splits():
    rng = random.Random(0)
    tree, nodes = PrefixTree(), {}
    base = tuple(rng.randrange(50) for _ in range(300))
    for _ in range(60):          # shared prefixes of every length: edges split again and again
        seq = base[:rng.randrange(1, 300)] + tuple(rng.randrange(50) for _ in range(rng.randrange(0, 40)))
        nodes[seq] = tree.insert(seq)
    for seq, node in nodes.items():
        assert node.tokens() == seq
        assert node.depth == len(seq)
    assert tree.root.tokens() == ()
