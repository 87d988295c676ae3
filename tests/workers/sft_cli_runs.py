"""pcp-train inside an existing launch: every rank runs `paddle_cp.integrations.paddleformers.cli.main`
for each run given (argv[1]: JSON, runs: {name: argv}), one after another in the same processes,
then tries configs it must refuse and records each error (type, message) for the pytest side, which
compares the runs' trainer_state.json and saved weights with PaddleFormers' run_sft in one process.
"""
import json
import sys

from report import run

from paddle_cp.integrations.paddleformers.cli import main


def runs(report):
    spec = json.loads(sys.argv[1])
    for name, argv in spec["runs"].items():
        print(f"PCP_RUN {name}", file=sys.stderr, flush=True)  # PaddleFormers logs to stderr
        main(argv)
    for name, argv in spec["refused"].items():
        report.expect_error(name, lambda argv=argv: main(argv))


run(runs)
