"""Context-parallel plans: split the inputs of the top model layer, run attention across ranks."""
from __future__ import annotations

import inspect

import paddle

from .. import mesh as mesh_lib
from ..attention import SequenceLayout, check_backend, context_parallel_attention
from .base import Plan, refuse_param_plan

_SEQUENCE_KEYS = ("input_ids", "inputs_embeds")


def _sequence_length(args, kwargs):
    """Length of the full sequence: dim 1 of input_ids / inputs_embeds, else of the first 2-D+ tensor."""
    for key in _SEQUENCE_KEYS:
        if isinstance(kwargs.get(key), paddle.Tensor):
            return kwargs[key].shape[0], kwargs[key].shape[1]
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, paddle.Tensor) and value.ndim >= 2:
            return value.shape[0], value.shape[1]
    return None, None


class _SepPlan(Plan):
    """A context-parallel plan: a backend, a whole layer, and the mesh's `sep` slice."""

    def __init__(self, backend="p2p"):
        self.backend = check_backend(backend)

    def check(self, layer, mesh, param_names=()):
        refuse_param_plan(self, param_names)
        mesh_lib.require_dim(mesh, "sep", type(self).__name__)

    def _join_sep_group(self, layer, mesh, param_names):
        self.check(layer, mesh, param_names)
        self._group = mesh_lib.mesh_group(mesh, ["sep"], p2p=True)


class PrepareContextParallel(_SepPlan):
    """Forward pre-hook on the top model layer: split every [batch, seq, ...] input over `sep`.

    `p2p`: rank r keeps chunks r and 2N-1-r of 2N (balanced causal work);
    `all2all`: contiguous chunks. If the layer takes `position_ids` and gets
    none, it is given the global positions of the local tokens (exact RoPE).
    """

    def apply(self, layer, mesh, param_names=()):
        self._join_sep_group(layer, mesh, param_names)
        self._layout = SequenceLayout(self.backend, self._group.size)
        signature = inspect.signature(layer.forward)
        self._signature = signature if "position_ids" in signature.parameters else None
        return layer.register_forward_pre_hook(self._split_inputs, with_kwargs=True)

    def _split_inputs(self, layer, args, kwargs):
        batch, seq_len = _sequence_length(args, kwargs)
        if seq_len is None:
            return None
        self._layout.check_length(seq_len, what="input sequence")
        index = self._group.index

        def split(value):
            if isinstance(value, paddle.Tensor) and value.ndim >= 2 and value.shape[1] == seq_len:
                return self._layout.shard(value, 1, index)
            return value

        args = tuple(split(a) for a in args)
        kwargs = {k: split(v) for k, v in kwargs.items()}
        if self._signature is not None:
            bound = self._signature.bind_partial(*args, **kwargs)
            if bound.arguments.get("position_ids") is None:
                positions = paddle.to_tensor(self._layout.positions(seq_len, index), dtype="int64")
                bound.arguments["position_ids"] = positions.unsqueeze(0).expand([batch, positions.shape[0]])
                args, kwargs = bound.args, bound.kwargs
        return args, kwargs


_original_sdpa = None
_active = []  # ContextParallel plans whose layer is running, innermost last


def _context_parallel_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, training=True,
                           backend=None, scale=None, enable_gqa=True, name=None):
    plan = _active[-1]
    return context_parallel_attention(plan.backend, query, key, value, attn_mask, dropout_p, is_causal,
                                      training, scale, plan._group)


class ContextParallel(_SepPlan):
    """Every `paddle.nn.functional.scaled_dot_product_attention` call made while this
    layer runs becomes context-parallel attention over `sep` (ring for `p2p`,
    Ulysses for `all2all`)."""

    def apply(self, layer, mesh, param_names=()):
        self._join_sep_group(layer, mesh, param_names)
        layer.register_forward_pre_hook(self._enter)
        return layer.register_forward_post_hook(self._exit, always_call=True)

    def _enter(self, layer, inputs):
        global _original_sdpa
        if not _active:
            _original_sdpa = paddle.nn.functional.scaled_dot_product_attention
            paddle.nn.functional.scaled_dot_product_attention = _context_parallel_sdpa
        _active.append(self)

    def _exit(self, layer, inputs, outputs):
        _active.pop()
        if not _active:
            paddle.nn.functional.scaled_dot_product_attention = _original_sdpa
