"""Docs pages' scripts as written (each page's first python block), run on the launch's ranks, then what each
logged set beside one card: the same model (same seed) and AdamW trained on the same batches.

argv: the pages. What the reference reads of a script: its `model`, its printed lines `step N: loss X` (rank 0),
and its batches, those of `np.random.RandomState(0)` in turn: `packed_batch(rng)` (ids, labels, position ids;
one card is given their documents as PaddleFormers' attn_mask_startend_row_indices) or `sample(rng)` (the model's
keyword inputs, as one card takes them).
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


def one_card_inputs(namespace, rng):
    if "sample" in namespace:
        return namespace["sample"](rng)
    ids, labels, positions = namespace["packed_batch"](rng)
    ends = Documents.from_position_ids(positions.numpy()).end  # [b, s]: where each token's document ends
    rows = paddle.to_tensor(ends[:, None, :, None], dtype="int32")  # [b, 1, s, 1]
    return dict(input_ids=ids, labels=labels, position_ids=positions, attn_mask_startend_row_indices=rows)


def one_card_losses(namespace, steps):
    paddle.seed(0)
    model = type(namespace["model"])(namespace["model"].config)
    optimizer = paddle.optimizer.AdamW(learning_rate=LEARNING_RATE, parameters=model.parameters())
    rng, losses = np.random.RandomState(0), []
    for _ in range(steps):
        loss = model(**one_card_inputs(namespace, rng))[0]
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(float(loss))
    return losses


def main(report):
    for page in sys.argv[1:]:
        name = Path(page).stem
        printed = io.StringIO()
        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory, "script.py")
            path.write_text(script_of(page))
            with contextlib.redirect_stdout(printed):
                namespace = runpy.run_path(str(path), run_name="__main__")
        text = printed.getvalue()
        report.value(f"{name}.printed", text)
        logged = [float(line.split("loss ")[1]) for line in text.splitlines() if line.startswith("step ")]
        report.value(f"{name}.logged", logged)
        if logged:  # rank 0 logs
            report.diff(f"{name}.loss", np.array(logged), np.array(one_card_losses(namespace, len(logged))))


run(main)
