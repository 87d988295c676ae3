"""How the current run holds each parameter and its optimizer state: the link between local
tensors and the single-card (global) tensors a checkpoint stores.

Everything comes from the parameter's `ParamRecord` (paddle_cp/params.py), whatever its
placements: its local tensor holds the boxes of the global tensor `local_boxes` says (its
tensor-parallel pieces; nothing where it keeps only a placeholder: a level-3 non-owner,
another pipeline stage); its optimizer state exists only where the optimizer steps it
(`steps_here`: the owner at sharding levels 1-3, on the stages that hold it). Buffers and
unparallelized models have no record.
"""
from __future__ import annotations

import numpy as np
import paddle
import paddle.distributed as dist

from .. import mesh as mesh_lib
from ..dtypes import LOW_PRECISION
from ..params import find_record, local_boxes

# Adam's step powers are one number per parameter; every other accumulator has the parameter's shape.
SCALAR_ACCUMULATORS = ("beta1_pow_acc", "beta2_pow_acc")
# The fp32 master copy of a float16/bfloat16 parameter: `{param}.w_0`, the key Paddle's
# Optimizer.sharded_state_dict gives it.
MASTER_WEIGHT = "w"


def inner_optimizer(optimizer):
    """The Paddle optimizer holding the state (parallelize's wrapper or a plain optimizer)."""
    return getattr(optimizer, "inner", optimizer)


def global_shape(tensor):
    """The single-card shape of a parameter or buffer held by this rank."""
    record = find_record(tensor)
    return tuple(tensor.shape) if record is None else tuple(record.full_shape)


def dtype_name(dtype):
    return str(dtype).replace("paddle.", "")


def holds_value(tensor):
    """False for a level-3 placeholder: the owner holds the value."""
    record = find_record(tensor)
    return record is None or record.holds_value()


def steps_here(param):
    """Whether this rank's optimizer steps `param` (and so holds its state and master weight)."""
    record = find_record(param)
    return record is None or record.steps_here()


def has_master_weight(optimizer, param):
    """Whether the optimizer keeps an fp32 master copy of `param` (multi_precision over fp16/bf16):
    then every accumulator of it is the master copy's, in fp32."""
    return bool(getattr(inner_optimizer(optimizer), "_multi_precision", False)) and param.dtype in LOW_PRECISION


def state_dtype(optimizer, param, name):
    """Adam keeps every accumulator of a float16/bfloat16 parameter (step powers too) in float32, of
    others in the parameter's dtype; Momentum's velocity has the parameter's dtype unless there is a
    master weight (then it is the master's, float32, like the master weight itself)."""
    if has_master_weight(optimizer, param) or (name != "velocity" and param.dtype in LOW_PRECISION):
        return paddle.float32
    return param.dtype


def accumulator_names(optimizer):
    """The accumulators the optimizer keeps per parameter; TypeError for optimizers checkpoints do not cover."""
    inner = inner_optimizer(optimizer)
    if isinstance(inner, (paddle.optimizer.Adam, paddle.optimizer.AdamW)):
        names = ("moment1", "moment2", "beta1_pow_acc", "beta2_pow_acc")
        return names + (("moment2_max",) if getattr(inner, "_amsgrad", False) else ())
    if isinstance(inner, paddle.optimizer.Momentum):
        return ("velocity",)
    raise TypeError(f"checkpoints save the state of Adam, AdamW and Momentum, not {type(inner).__name__}: "
                    "use one of those, or save without optimizer=")


def state_names(optimizer, param):
    """The optimizer states of `param` a checkpoint holds: its accumulators, then its master weight if any."""
    return accumulator_names(optimizer) + ((MASTER_WEIGHT,) if has_master_weight(optimizer, param) else ())


def state_tensor(optimizer, param, name):
    """This rank's tensor of state `name` for `param`, or None when the optimizer has not created it.
    Accumulators of a parameter with a master weight are keyed by the master weight's name."""
    inner = inner_optimizer(optimizer)
    master = inner._master_weights.get(param.name) if has_master_weight(optimizer, param) else None
    if name == MASTER_WEIGHT:
        return master
    target = master if has_master_weight(optimizer, param) else param
    return None if target is None else inner._accumulators.get(name, {}).get(target.name)


def world_group():
    """The MeshGroup of every launched rank, or None in one process."""
    if dist.get_world_size() == 1:
        return None
    mesh = mesh_lib.get_mesh()
    if mesh is None:
        raise ValueError("a multi-rank checkpoint needs the mesh: call pcp.set_mesh(mesh) or pcp.parallelize first")
    return mesh_lib.dims_of(mesh).world


def local_value(tensor, read_box):
    """This rank's local value of a parameter (or of an accumulator laid out like it) assembled box by box:
    `read_box(global_offset, shape)` gives the values of one box of the single-card tensor (numpy). None,
    reading nothing, where this rank holds no value (a level-3 non-owner, another pipeline stage)."""
    record = find_record(tensor)
    if record is None:
        return read_box((0,) * len(tensor.shape), tuple(tensor.shape))
    local = None
    for box in local_boxes(tensor):
        block = read_box(box.global_offset, box.local_shape)
        if local is None:
            local = np.empty(record.local_shape(), dtype=block.dtype)
        local[box.local_slice] = block
    return local
