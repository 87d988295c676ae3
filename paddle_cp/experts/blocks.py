"""MoE blocks recognized by class: where the routed experts are, how they are stored, and the call through
which their output is computed (the seam ExpertParallel takes over).

A model library registers the kinds of block it ships (`register_block_kind`; PaddleFormers' through its
integration, paddle_cp/integrations/). Every kind computes `sum_j w[t, j] * expert_{i[t, j]}(x_t)` from a
router's top-k indices and weights through its `experts` layer: `experts(hidden [T, H], indices [T, k],
weights [T, k])` when the block's attribute `fallback_flag` is set (stacked experts; a list of expert layers is
given that call by the plan), or, with `dense_weights`, `experts(hidden [b, s, H], router_indices=[T, k],
routing_weights=[T, E])`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import paddle

from ..runtime import installed


@dataclass(frozen=True)
class BlockKind:
    classes: tuple              # class names, any in the block's MRO
    runs_idle_experts: bool     # one card runs each listed expert in training even on no token (zero gradient)
    router_output: bool         # its (hidden, router logits) output reaches the model's aux loss
    dense_weights: bool         # the experts call takes weights [T, E] (gpt-oss), else [T, k]
    # the block's attribute that, set, makes it call experts(hidden, indices [T, k], weights [T, k]); None: it
    # always calls its experts layer that way or, with dense_weights, with the router's dense weights
    fallback_flag: Optional[str] = None
    shared_experts: tuple = ()  # attribute names of the block's dense part run on every token, if it has one


def register_block_kind(kind):
    """Recognize MoE blocks of `kind` (a BlockKind) from now on."""
    if not isinstance(kind, BlockKind):
        raise TypeError(f"register_block_kind takes a BlockKind, got {type(kind).__name__}")
    if kind not in installed.block_kinds:
        installed.block_kinds.append(kind)


@dataclass(frozen=True)
class MoEBlock:
    """One MoE block as ExpertParallel sees it."""

    layer: object
    kind: BlockKind
    experts: object             # the routed experts: an nn.LayerList, or one layer of stacked [E, ...] tensors

    @property
    def listed(self):
        return isinstance(self.experts, paddle.nn.LayerList)

    @property
    def num_experts(self):
        return len(self.experts) if self.listed else int(self.stacked_parameters()[0][1].shape[0])

    def stacked_parameters(self):
        """(name, parameter) of stacked experts, each [E, ...] (expert first)."""
        return [(n, p) for n, p in self.experts.named_parameters() if p is not None]

    def shared_experts(self):
        """(attribute name, layer) of the block's shared experts, or None."""
        return next(((name, layer) for name in self.kind.shared_experts
                     if isinstance(layer := getattr(self.layer, name, None), paddle.nn.Layer)), None)


def _kind_of(layer):
    names = {cls.__name__ for cls in type(layer).__mro__}
    return next((kind for kind in installed.block_kinds if names & set(kind.classes)), None)


def find_moe_block(layer) -> Optional[MoEBlock]:
    """The MoE block `layer` is, or None (a dense MLP, anything else)."""
    kind = _kind_of(layer)
    experts = getattr(layer, "experts", None)
    if kind is None or not isinstance(experts, paddle.nn.Layer):
        return None
    return MoEBlock(layer, kind, experts)


def known_blocks():
    """The class names recognized, for error messages."""
    return [name for kind in installed.block_kinds for name in kind.classes]


def check_block(name, block):
    """Raise on a MoE block ExpertParallel cannot split; before any collective."""
    if getattr(getattr(block.layer, "config", None), "sequence_parallel", False) or getattr(
            block.layer, "sequence_parallel", False):
        raise ValueError(f"{name} ({type(block.layer).__name__}) was built with sequence_parallel=True (its model "
                         "library's own gather/scatter inside the block): build the model with sequence_parallel=False "
                         "for ExpertParallel")
    if not block.listed:
        shapes = {n: list(p.shape) for n, p in block.stacked_parameters()}
        if not shapes or len({s[0] for s in shapes.values()}) != 1:
            raise ValueError(f"{name}.experts stacks its experts in tensors {shapes}: ExpertParallel needs every "
                             "stacked tensor to lead with the expert dim")
