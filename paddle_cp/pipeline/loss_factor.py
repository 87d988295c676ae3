"""The factor a script puts on the loss a scheduled step returned (`(loss * w).backward()`).

The schedule ran every backward inside `model(...)` with unscaled losses, so the factor can only
be applied afterwards, to each rank's accumulated gradients (the optimizer does, before reducing
them). That is exact only where one rank's gradients hold its own loss alone: across dp replicas.
Within a replica they are already mixed: ring attention sends dk/dv back to the ranks holding the
keys, tensor parallel sums partial activations' gradients, a stage's gradients come from the later
stages' losses (and with experts over dp, tokens of every replica reach each expert). There the
factor must be one number, checked here once per step on every rank: the step's factors are gathered
on the device and read at the next step, so no step waits for them and a mismatch raises one step late.
"""
from __future__ import annotations

import math

import numpy as np
import paddle

from .. import runtime
from ..comm import collectives
from ..comm.deferred import DeferredRead

RELATIVE_TOLERANCE = 1e-6


class LossFactorAgreement:
    """`agree(factor)`: one all-gather of this step's factor (and whether its calls differed) over the whole
    mesh, read at the next step's `agree` without stalling this one (comm/deferred.py): the same ValueError
    on every rank, one step after two ranks whose gradients mix used different factors."""

    def __init__(self, world, mesh, experts_span_dp=False):
        self._world = world  # the whole mesh's MeshGroup: ranks in mesh order
        self._dims = [d for d in mesh.dim_names if d != "dp" or experts_span_dp]
        self._shape, self._names = list(mesh.shape), list(mesh.dim_names)
        self._pending = None  # DeferredRead of the last step's gathered [ranks, 2] (factor, calls differed)

    def _replicas(self, values):
        """[n_replicas, ranks per replica] arrays of `values` (one per rank, mesh order): a row varies
        over the dims whose gradients mix."""
        axes = [self._names.index(d) for d in self._dims]
        size = math.prod(self._shape[a] for a in axes)
        grid = np.asarray(values).reshape(self._shape)
        return np.moveaxis(grid, axes, list(range(grid.ndim - len(axes), grid.ndim))).reshape(-1, size)

    def agree(self, factor):
        """`factor`: a device scalar (runtime.state.pipeline_loss_scale) or a float."""
        self.settle()
        differ, runtime.state.pipeline_loss_scales_differ = runtime.state.pipeline_loss_scales_differ, None
        factor = (factor.astype("float64").reshape([1]) if isinstance(factor, paddle.Tensor)
                  else paddle.full([1], factor, "float64"))
        differ = paddle.zeros([1], "float64") if differ is None else differ.astype("float64").reshape([1])
        mine = paddle.concat([factor, differ])  # [2]
        gathered = paddle.stack(collectives.all_gather(self._world, mine, tag="pp_loss_factor"))  # [ranks, 2]
        self._pending = DeferredRead(gathered)

    def settle(self):
        """Read the last step's factors: raise as its agreement would have."""
        if self._pending is None:
            return
        rows, self._pending = self._pending.result(), None
        differed = [int(r) for r, flag in zip(self._world.ranks, rows[:, 1]) if flag]
        if differed:
            raise ValueError(f"pipeline: on ranks {differed} the model(...) losses of one step were scaled by "
                             "different factors; their gradients are already summed, so every call before one "
                             "optimizer.step() must scale its loss by the same factor (or scale each "
                             "micro-batch's loss in pp_config['loss_fn'], e.g. by pcp.loss_weight)")
        factors = self._replicas(rows[:, 0])
        ranks = self._replicas(self._world.ranks)
        for row, ids in zip(factors, ranks):
            if not np.allclose(row, row[0], rtol=RELATIVE_TOLERANCE, atol=0.0):
                per_rank = {int(r): float(f) for r, f in zip(ids, row)}
                raise ValueError(
                    f"pipeline: the loss model(...) returned was scaled by different factors on ranks whose "
                    f"gradients mix (mesh dims {self._dims}): {per_rank}. The schedule ran every backward "
                    "unscaled inside model(...), and ring attention, tensor parallel and the stage boundaries "
                    "had already mixed the ranks' gradients, so a per-rank factor applied afterwards cannot be "
                    "exact: weight each micro-batch's loss inside pp_config['loss_fn'] instead, e.g. "
                    "loss_fn = lambda output, labels: criterion(output, labels) * pcp.loss_weight(local_tokens, "
                    "mesh); a factor equal on those ranks (loss / k, a GradScaler's scale) is fine")
