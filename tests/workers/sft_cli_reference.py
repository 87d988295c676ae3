"""The reference: PaddleFormers' own `run_tuner` (-> run_sft) in one process, for each run in argv[1] (JSON: runs:
{name: argv}, emulated: the names run in the CPU emulation of Paddle's GPU AMP), one after another; a
`PCP_RUN <name>` line before each marks its log lines. With gradient accumulation PaddleFormers calls
paddle.device.synchronize(), which raises on CPU builds (no queue to wait for). The model is built as pcp-train
builds it (sft_workflow.one_card_models: in one process PaddleFormers' own loading, and its own class except for
Qwen3-VL, whose class PaddleFormers names is fleet's: paddlefleet has no CPU build)."""
import json
import sys

import paddle
from amp_emulation import emulated
from paddleformers.cli.train.tuner import run_tuner

from paddle_cp.integrations.paddleformers.cli import read_config
from paddle_cp.integrations.paddleformers.sft_workflow import one_card_models

if not paddle.is_compiled_with_cuda():
    paddle.device.synchronize = lambda device=None: None
spec = json.loads(sys.argv[1])
for name, argv in spec["runs"].items():
    print(f"PCP_RUN {name}", file=sys.stderr, flush=True)
    with emulated(name in spec["emulated"]), one_card_models():
        run_tuner(read_config(argv))
