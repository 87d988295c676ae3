"""The reference: PaddleFormers' own `run_tuner` (-> run_sft) in one process, for each argv list in
argv[1] (JSON), one after another; a `PCP_RUN <name>` line before each marks its log lines."""
import json
import sys

from paddleformers.cli.train.tuner import run_tuner

from paddle_cp.integrations.paddleformers.cli import read_config

for name, argv in json.loads(sys.argv[1]).items():
    print(f"PCP_RUN {name}", file=sys.stderr, flush=True)
    run_tuner(read_config(argv))
