"""A docs page's script as written (the page's first python block), run on the launch's ranks, then what it
logged set beside one card: the same model (same seed) and AdamW trained on the same batches, which it is given
with their documents as PaddleFormers' attn_mask_startend_row_indices.

argv: the page. The script's `model`, `packed_batch(rng)` (the batches of `np.random.RandomState(0)`, in turn)
and printed lines `step N: loss X` (rank 0) are what the reference reads.
"""
import contextlib
import io
import runpy
import sys
import tempfile
from pathlib import Path

import numpy as np
import paddle
from report import run

from paddle_cp.attention import Documents

LEARNING_RATE = 1e-3  # the script's AdamW


def script_of(page):
    return Path(page).read_text().split("```python\n", 1)[1].split("\n```", 1)[0] + "\n"


def one_card_losses(namespace, steps):
    paddle.seed(0)
    model = type(namespace["model"])(namespace["model"].config)
    optimizer = paddle.optimizer.AdamW(learning_rate=LEARNING_RATE, parameters=model.parameters())
    rng, losses = np.random.RandomState(0), []
    for _ in range(steps):
        ids, labels, positions = namespace["packed_batch"](rng)
        ends = Documents.from_position_ids(positions.numpy()).end  # [b, s]: where each token's document ends
        rows = paddle.to_tensor(ends[:, None, :, None], dtype="int32")  # [b, 1, s, 1]
        loss = model(input_ids=ids, labels=labels, position_ids=positions, attn_mask_startend_row_indices=rows)[0]
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(float(loss))
    return losses


def main(report):
    printed = io.StringIO()
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory, "script.py")
        path.write_text(script_of(sys.argv[1]))
        with contextlib.redirect_stdout(printed):
            namespace = runpy.run_path(str(path), run_name="__main__")
    text = printed.getvalue()
    report.value("printed", text)
    logged = [float(line.split("loss ")[1]) for line in text.splitlines() if line.startswith("step ")]
    report.value("logged", logged)
    if logged:  # rank 0 logs
        report.diff("script.loss", np.array(logged), np.array(one_card_losses(namespace, len(logged))))


run(main)
