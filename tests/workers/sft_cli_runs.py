"""pcp-train inside an existing launch: every rank runs `paddle_cp.integrations.paddleformers.cli.main`
for each run given (argv[1]: JSON, runs: {name: argv}, emulated: the names run in the CPU emulation of Paddle's
GPU AMP), one after another in the same processes, and
records what paddle_cp did in each (bytes sent by collective tag, batches split by their documents,
forwards in which this rank held no label);
then tries configs it must refuse and records each error (type, message). The pytest side compares
the runs' logged losses and saved weights with PaddleFormers' run_sft in one process.
"""
import json
import sys

from amp_emulation import emulated
from report import run

from paddle_cp import PrepareContextParallel
from paddle_cp.comm import counters
from paddle_cp.integrations.paddleformers.cli import main
from paddle_cp.integrations.paddleformers import trainer

document_batches = []  # Documents each PrepareContextParallel read off a batch (a test spy, not the package)
documents_of = PrepareContextParallel.documents_of


def counted_documents_of(self, *args, **kwargs):
    found = documents_of(self, *args, **kwargs)
    document_batches.append(found is not None)
    return found


PrepareContextParallel.documents_of = counted_documents_of
empty_shares = []  # forwards whose part of the batch held no label on this rank (its loss layer's guard zeroes it)
local_tokens = trainer.local_tokens


def counted_local_tokens(*args, **kwargs):
    tokens = local_tokens(*args, **kwargs)
    if tokens == 0:
        empty_shares.append(1)
    return tokens


trainer.local_tokens = counted_local_tokens


def runs(report):
    spec = json.loads(sys.argv[1])
    for name, argv in spec["runs"].items():
        counters.reset()
        document_batches.clear()
        empty_shares.clear()
        print(f"PCP_RUN {name}", file=sys.stderr, flush=True)  # PaddleFormers logs to stderr
        with emulated(name in spec["emulated"]):
            main(argv)
        report.value(f"{name}.bytes", {tag: n for tag, n in counters.bytes_sent().items() if n})
        report.value(f"{name}.document_batches", sum(document_batches))
        report.value(f"{name}.empty_shares", len(empty_shares))
    for name, argv in spec["refused"].items():
        report.expect_error(name, lambda argv=argv: main(argv))


run(runs)
