"""Paddle's own plan objects (`dist.ColWiseParallel(gather_output=True)`, ...) as paddle_cp's plans.

Scripts, PaddleFormers' `auto_dist_config` and the seed documents build their configs
from `paddle.distributed`'s classes; each is turned into the paddle_cp plan of the
same name by reading the attributes Paddle's constructor stored (the intermediate
API's classes in paddle/distributed/auto_parallel/intermediate/). Only the exact
classes are known: a subclass may override `apply`, which paddle_cp cannot run.
"""
from __future__ import annotations

from paddle.distributed.auto_parallel.intermediate import context_parallel as paddle_context_plans
from paddle.distributed.auto_parallel.intermediate import tensor_parallel as paddle_tp_plans
from paddle.distributed.auto_parallel.intermediate.tensor_parallel import PlanBase

from .. import plans


# Paddle class -> its paddle_cp plan, built from the attributes Paddle's __init__ stores
_TRANSLATIONS = {
    paddle_tp_plans.ColWiseParallel: lambda p: plans.ColWiseParallel(gather_output=p.gather_output),
    paddle_tp_plans.RowWiseParallel: lambda p: plans.RowWiseParallel(is_input_parallel=p.is_input_parallel),
    paddle_tp_plans.SequenceParallelBegin: lambda p: plans.SequenceParallelBegin(need_transpose=p.need_transpose),
    paddle_tp_plans.SequenceParallelEnd: lambda p: plans.SequenceParallelEnd(need_transpose=p.need_transpose),
    paddle_tp_plans.SequenceParallelEnable: lambda p: plans.SequenceParallelEnable(),
    paddle_tp_plans.SequenceParallelDisable: lambda p: plans.SequenceParallelDisable(need_transpose=p.need_transpose),
    paddle_tp_plans.PrepareLayerInput: lambda p: plans.PrepareLayerInput(p.fn),
    paddle_tp_plans.PrepareLayerOutput: lambda p: plans.PrepareLayerOutput(p.fn),
    paddle_tp_plans.ConvParallel: lambda p: plans.ConvParallel(),
    paddle_context_plans.PrepareContextParallel: lambda p: plans.PrepareContextParallel(backend=p.backend),
    paddle_context_plans.ContextParallel: lambda p: plans.ContextParallel(backend=p.backend),
}

SUPPORTED = sorted(cls.__name__ for cls in _TRANSLATIONS)


def is_paddle_plan(value):
    return isinstance(value, PlanBase)


def translate(key, plan):
    """The paddle_cp plan for Paddle's plan object `plan` (given for plan key `key`)."""
    make = _TRANSLATIONS.get(type(plan))
    if make is None:
        raise TypeError(
            f"plan for {key!r} is {type(plan).__module__}.{type(plan).__name__}, a Paddle plan paddle_cp does not "
            f"know: use one of paddle.distributed's {SUPPORTED} or a paddle_cp plan"
        )
    return make(plan)
