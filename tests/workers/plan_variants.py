"""A small model for the plan variants PaddleFormers' plans do not use, and its plan.

Each variant is placed where a local-tensor mistake would change the result:
the user hooks are not elementwise (wrong on a split input or on partial sums),
and `head` has only a RowWise(is_input_parallel=False) sibling, which takes a
whole input, so its split output must still be gathered for the loss.
"""
import paddle
import paddle.nn.functional as F
from paddle import nn

import paddle_cp as pcp

VOCAB, HIDDEN = 32, 16


def centre(process_mesh):
    """PrepareLayerInput fn: subtract the mean over the hidden dim (needs the whole input)."""
    def hook(layer, inputs):
        x = inputs[0]
        return (x - x.mean(axis=-1, keepdim=True),)
    return hook


def squash(process_mesh):
    """PrepareLayerOutput fn: tanh of the output (needs the summed output, not partial sums)."""
    return lambda layer, inputs, output: paddle.tanh(output)


class Block(nn.Layer):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class SmallModel(nn.Layer):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.block = Block()
        self.norm = nn.LayerNorm(HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.wide = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.head = nn.Linear(2 * HIDDEN, VOCAB)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        x = self.norm(x + self.block(x))
        logits = self.head(F.gelu(self.wide(self.proj(x))))
        return (F.cross_entropy(logits.reshape([-1, VOCAB]), labels.reshape([-1])),)


def small_model():
    return SmallModel()


def add_reference_hooks(model):
    """The single card runs the same user hooks the plan registers."""
    model.proj.register_forward_pre_hook(centre(process_mesh=None))
    model.block.down.register_forward_post_hook(squash(process_mesh=None))


def variants_plan():
    return {
        "block.up": pcp.ColWiseParallel(),  # with bias; split output feeds its RowWise sibling
        "block.down": [pcp.PrepareLayerOutput(squash), pcp.RowWiseParallel()],  # hook listed first, sees the sum
        "norm": pcp.SequenceParallelEnable(),  # its weight and bias see 1/mp of the tokens: summed over mp
        "proj": [pcp.PrepareLayerInput(centre), pcp.RowWiseParallel(is_input_parallel=False)],
        "wide": pcp.ColWiseParallel(gather_output=True),  # with bias
        "head": pcp.ColWiseParallel(),
    }
