"""The README's main job: the training example runs and reproduces one process."""
import re

import pytest
from launcher import EXAMPLES, launch_script


@pytest.mark.parametrize("config", ["cp4_p2p.yaml", "cp4_ulysses.yaml", "cp4_hybrid.yaml", "pp2_cp2.yaml"])
def test_training_example_matches_single_process(config):
    out = launch_script(EXAMPLES / "train_llama_cp.py", 4, "--config", EXAMPLES / "configs" / config,
                        "--steps", "3")
    losses = [float(x) for x in re.findall(r"step +\d+ +loss ([0-9.]+) +tokens/s", out)]
    assert len(losses) == 3, out[-3000:]
    gap = float(re.search(r"max \|loss - single-process loss\| over 3 steps: ([0-9.e+-]+)", out).group(1))
    assert gap < 1e-5
