"""Test and benchmark harness (not part of the product): a standalone receiver process and its
client, a point-to-point chunk channel, and a fake in-process transport. Tests import it as
`harness` (tests/ is on sys.path); scripts/bench_transfer.py adds tests/ to its path."""
