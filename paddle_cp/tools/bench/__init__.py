"""pcp-bench (cli.py: context-parallel attention vs one process) and its parts: what its ranks run
(attention_ranks.py) and the figures made of it (attention_figures.py), a Gated DeltaNet layer (gdn.py),
host planning time (planning.py), the GPU tile model's table of packed layouts (gpu_layouts.py); and pcp-bench-pp
(pp.py: pipeline schedules)."""
