"""Weighting each rank's loss when ranks hold different numbers of tokens."""
from __future__ import annotations

import paddle

from .. import mesh as mesh_lib
from ..comm import collectives


def loss_weight(local_tokens, mesh=None):
    """Factor for this rank's mean loss over its `local_tokens` labelled tokens (labels other than the ignored
    -100: the tokens its loss averages over).

    The optimizer averages gradients over the dp x sep replicas, so a rank's
    mean loss times local_tokens * replicas / global_tokens makes that average
    the gradient of the global token mean (what one card computes), however
    unevenly the tokens are split. One all-reduce of a scalar.
    """
    local_tokens = int(local_tokens)
    group = mesh_lib.dims_of(mesh).data
    total = paddle.to_tensor([float(local_tokens)])
    collectives.all_reduce(group, total, tag="loss_weight")
    return local_tokens * group.size / total.item()
