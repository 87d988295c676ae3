"""pcp-selftest inside a launch with a fault planted on rank 1 only (argv: the fault, then the selftest's flags):

- `case`: building the fp32 case (no collectives) raises on rank 1: every rank skips its checks alike;
  each rank writes `exit<rank>.json` with the code cli.main exits with, rank 0 the summary;
- `kernel`: the attention kernel raises on rank 1 in the ring check, after its first ring step, while its peers
  wait in that check's exchanges for its next message.

The collective timeout is set far above what the run needs, so a rank left waiting shows as the watchdog's
report and exit 17, not as a slow pass.
"""
import json
import os
import sys

import paddle.distributed as dist

import paddle_cp as pcp
from paddle_cp.attention import kernels
from paddle_cp.tools.selftest import checks, cli

TIMEOUT = 60  # seconds: gloo gives up after its own 30 s first, which the guard reports as "failed after"

fault, flags, reports = sys.argv[1], sys.argv[2:], os.environ["PCP_REPORT_DIR"]
dist.init_parallel_env()
pcp.set_timeout(TIMEOUT)
rank = dist.get_rank()
if rank == 1 and fault == "case":
    def failing_case(self, args, dtype):
        raise RuntimeError("planted fault: the case cannot be built on rank 1")
    checks.Case.__init__ = failing_case
if rank == 1 and fault == "kernel":
    forward, check_backend, calls = kernels.BlockwiseKernel.forward, checks.check_backend, []

    def failing_forward(self, *args):
        calls.append(1)
        if len(calls) == 2:  # the second ring step: the first exchange done, the next one awaited by the peers
            raise RuntimeError("planted fault: the kernel failed on rank 1")
        return forward(self, *args)

    def check_with_fault(pcp_module, mesh, case, backend):
        kernels.BlockwiseKernel.forward = failing_forward
        return check_backend(pcp_module, mesh, case, backend)
    checks.check_backend = check_with_fault
try:
    cli.main([*flags, "--json", os.path.join(reports, "selftest.json")])
except SystemExit as exit_:
    with open(os.path.join(reports, f"exit{rank}.json"), "w") as out:
        json.dump({"code": exit_.code}, out)
    raise
