"""Command-line tools: `pcp-bench` (tools/bench.py) and `pcp-plan` (tools/plan.py)."""
