"""pcp-selftest run inside a launch (selftest.main on every rank, as a user's script would), its JSON written to
the report directory. argv: "fault" plants one first (the ring's point-to-point exchanges carry floats in
bfloat16, as a misconfigured transport might: k/v blocks on their way round the ring, and on gloo the Ulysses
all-to-all, whose rounds are such exchanges), then the selftest's own flags."""
import os
import sys

import paddle

from paddle_cp.comm import p2p
from paddle_cp.tools import selftest


def in_bfloat16(shift):
    def rounded(group, tensor, *args, **kwargs):
        if tensor.dtype == paddle.float32:
            tensor = tensor.astype("bfloat16").astype("float32")
        return shift(group, tensor, *args, **kwargs)
    return rounded


flags = sys.argv[1:]
if flags[:1] == ["fault"]:
    p2p.shift, flags = in_bfloat16(p2p.shift), flags[1:]
selftest.main([*flags, "--json", os.path.join(os.environ["PCP_REPORT_DIR"], "selftest.json")])
