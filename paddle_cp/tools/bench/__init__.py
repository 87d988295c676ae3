"""pcp-bench (cli.py: context-parallel attention vs one process) and its parts: a Gated DeltaNet layer (gdn.py),
host planning time (planning.py), the GPU tile model's table of packed layouts (gpu_layouts.py); and pcp-bench-pp
(pp.py: pipeline schedules)."""
