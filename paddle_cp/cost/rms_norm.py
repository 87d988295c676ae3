"""What an RMSNorm keeps for its backward, per token (pure): the one count the decoder's and the vision tower's
norms share."""
from __future__ import annotations

from .attention import FP32


def rms_norm_kept(hidden, elem, fused=False):
    """Bytes a norm keeps per token besides its output. PaddleFormers' eager RMSNorm: its input cast to fp32 and
    the normalized value (the output, its weight times that, is counted by whoever reads it). Fused (GPU): its input
    and an fp32 inverse rms, from the kernel's contract, not measured."""
    return hidden * elem + FP32 if fused else hidden * (FP32 + elem)
