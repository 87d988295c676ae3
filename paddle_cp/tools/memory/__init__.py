"""pcp-memory (cli.py: a PaddleFormers Llama step's memory per rank) and its parts: what its ranks run
(breakdown.py), the measured step (step.py), planned layouts beside the planner's estimate (layouts.py), startup
and I/O phases (phases.py, io_phases.py), expert parallelism (experts.py), sharding levels (sharding.py); and
gradient-reduction bytes from the bucket plan (grad_bytes.py, python -m paddle_cp.tools.memory.grad_bytes)."""
