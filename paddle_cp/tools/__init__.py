"""Command-line tools, each folder a command (cli.py) beside its parts: pcp-bench and pcp-bench-pp (bench/), pcp-memory
(memory/), pcp-plan (plan/, over the cost model in paddle_cp/cost/), pcp-selftest (selftest/); and what they share:
the one launcher of CPU ranks (launcher.py), what the launched ranks run alike (ranks.py), plain-text tables
(text.py), token counts with K/M suffixes (units.py), the host allocator's statistics (allocator.py), host reads
counted by line (host_reads.py), packed-document batches (packing.py)."""
