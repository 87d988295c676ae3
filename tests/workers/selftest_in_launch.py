"""pcp-selftest run inside a launch, as a user's script would (its JSON written to the report directory), twice:

- `emulated.json`: on the GPU path (emulated_flash.py: paddle_cp selects the flash and flashmask kernels, whose
  ops are emulated on CPU with the GPU kernels' bf16 rounding), bf16 taken as the device's: the bf16 checks and
  their bound run, on the kernels a GPU would call;
- `selftest.json`, through cli.main (which exits 1 on a failure): with a fault planted, the ranks'
  point-to-point exchanges carrying floats in bfloat16, as a misconfigured transport might (k/v blocks on
  their way round the ring and, on gloo, the Ulysses all-to-all, whose rounds are such exchanges).

argv: the selftest's flags.
"""
import contextlib
import json
import os
import sys

import emulated_flash
import paddle
import paddle.distributed as dist

from paddle_cp.comm import p2p
from paddle_cp.tools.selftest import checks, cli

MISSING = object()


@contextlib.contextmanager
def emulated_gpu():
    saved = []

    def set_attr(owner, name, value):
        saved.append((owner, name, getattr(owner, name, MISSING)))
        setattr(owner, name, value)

    emulated_flash.install(set_attr)
    set_attr(checks, "_bf16_matmul_runs", lambda: True)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            if value is MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


def in_bfloat16(shift):
    def rounded(group, tensor, *args, **kwargs):
        if tensor.dtype == paddle.float32:
            tensor = tensor.astype("bfloat16").astype("float32")
        return shift(group, tensor, *args, **kwargs)
    return rounded


flags, reports = sys.argv[1:], os.environ["PCP_REPORT_DIR"]
dist.init_parallel_env()
with emulated_gpu():
    emulated = checks.run_ranks(cli.parse_args(flags))
if dist.get_rank() == 0:
    with open(os.path.join(reports, "emulated.json"), "w") as out:
        json.dump({**emulated, "table": cli.table(emulated)}, out)
p2p.shift = in_bfloat16(p2p.shift)
cli.main([*flags, "--json", os.path.join(reports, "selftest.json")])
