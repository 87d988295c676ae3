"""Command-line tools and the cost model they share: pcp-bench, pcp-bench-pp, pcp-memory, pcp-plan."""
