"""Decode's prefix cache: the KV of finished requests kept in whole pages, keyed by token ids.

    blocks.py   a hash of each whole page's token ids (the child key in the tree), vectorized
    tree.py     RadixTree: token ids -> pool pages at page granularity, users per node, LRU
    prefix.py   PrefixCache: the one owner of the tree and of the pool holds it takes

Modules import each other by module path, never through this __init__."""
