"""The public parallel plans, each a small class that validates and applies hooks."""
from .base import Plan  # noqa: F401
from .context_parallel import ContextParallel, PrepareContextParallel, TokenWise  # noqa: F401
from .conv_parallel import ConvParallel  # noqa: F401
from .expert_parallel import ExpertParallel  # noqa: F401
from .layer_hooks import PrepareLayerInput, PrepareLayerOutput  # noqa: F401
from .sequence_parallel import (  # noqa: F401
    SequenceParallelBegin,
    SequenceParallelDisable,
    SequenceParallelEnable,
    SequenceParallelEnd,
)
from .offload import OffloadRecomputeInputs  # noqa: F401
from .sequence_tiled import SequenceTiled  # noqa: F401
from .tensor_parallel import ColWiseParallel, RowWiseParallel  # noqa: F401
