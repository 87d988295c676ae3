"""The examples as their docs run them, in one launch: train_llama_cp.py with every YAML in
examples/configs for 2 steps (each config's checkpoints in a folder of its own), then the main job
train_long_context.py at 512 tokens: 3 steps saving a checkpoint every 2 steps (and at the end), then the same
command for 4 steps, which resumes from it.

argv: a directory for the main job's checkpoints and curves. Rank 0 reports each run's losses and
their largest difference from the example's own one-process replay. Rank 0 replays alone while the
other ranks would wait in the next run's first collective, longer than gloo's fixed 30 s on a busy
machine: they wait for a file instead.
"""
import sys
import time
from pathlib import Path

import paddle.distributed as dist
import train_llama_cp
import train_long_context
from report import run


def in_turn(directory, name, example_main, argv):
    """Run an example's main; rank 0 marks `name` done when it returns or fails (its replay is over),
    the other ranks wait for the mark before they go on."""
    mark = Path(directory, f"{name}.done")
    if dist.get_rank() == 0:
        try:
            return example_main(argv)
        finally:
            mark.touch()
    example_main(argv)
    while not mark.exists():
        time.sleep(0.2)
    return None


def main(report):
    out = sys.argv[1]
    for config in sorted(Path(train_llama_cp.__file__).parent.glob("configs/*.yaml")):
        result = in_turn(out, config.stem, train_llama_cp.main, ["--config", str(config), "--steps", "2",
                                                                 "--checkpoint-dir", str(Path(out, config.stem))])
        if result:
            report.value(f"config.{config.name}", {"losses": result[0], "gap": result[2]})
    short = ["--seq-len", "512", "--save-every", "2", "--out", out]
    for name, argv in (("first", ["--steps", "3", *short]), ("resumed", ["--steps", "4", *short])):
        result = in_turn(out, name, train_long_context.main, argv)
        if result:
            report.value(f"long_context.{name}", {"losses": result[0], "reference": result[1], "gap": result[2],
                                                  "balance": result[3]})


run(main)
