"""Gated DeltaNet (Qwen3-Next's `linear_attn`, and any layer with a `chunk_gated_delta_rule`) across ranks.

The layer's model code stays; its two sequence-mixing primitives are intercepted:
- its causal depthwise conv: the `conv1d` sublayer is a Conv1D over the sequence (mixers/conv1d.py,
  the kernel - 1 tokens before each run); where the model calls a fused `causal_conv1d_fn` instead
  (GPU), that call gets the same windows;
- its `chunk_gated_delta_rule` attribute (on GPU fla's kernel, on CPU PaddleFormers' Paddle code):
  this rank's q/k/v [b, s, h, d], g and beta [b, s, h] become the outputs of the rule over the whole
  sequence. Ulysses (inside groups of U ranks): an all-to-all trades the sequence split for a head
  split, the rule runs over the group's tokens for this rank's heads, and one trades back. State
  passing (across the ring groups; attention/algorithms/state_passing.py): the model's own rule summarises each
  run, the summaries are all-gathered, and each rank scans the states entering its runs. `all2all` is
  Ulysses alone, `p2p` state passing alone, `hybrid` both. The conv stays on the sequence split in
  every backend: its kernel - 1 tokens per run cost far less than moving it under the all-to-all, and
  the model reshapes between conv and rule with fixed channel counts.

PaddleFormers' rule carries its state across documents packed into one row; so does this. A call
that asks otherwise (fla's `cu_seqlens`, a conv `seq_idx`), or for a cache (`initial_state`,
`output_final_state`, the token-by-token `recurrent_gated_delta_rule`) is refused with the fix.
"""
from __future__ import annotations

import inspect

from ..dispatch import routing
from ..algorithms.state_passing import recurrence_across
from ..algorithms.ulysses import head_split, to_heads, to_sequence
from .base import TokenMixer
from .conv1d import windows_for

RULE = "chunk_gated_delta_rule"
REFUSED = {  # argument -> (None: must be None, False: must be falsy; why and the fix)
    "initial_state": (None, "a cached state: under context parallelism the recurrence starts from zero at the "
                            "sequence start, as in training; call the model with use_cache=False"),
    "output_final_state": (False, "the final state (a cache): call the model with use_cache=False"),
    "cu_seqlens": (None, "a state reset at each document start (cu_seqlens), which paddle_cp does not run across "
                         "ranks yet: pack documents without cu_seqlens (the state then flows across them, as "
                         "PaddleFormers' own rule does) or train without context parallelism"),
    "head_first": (False, "head-first [b, h, s, d] tensors: pass [b, s, h, d] (head_first=False)"),
    "seq_idx": (None, "a state reset at each document start (seq_idx): pack documents without it"),
    "initial_states": (None, "a cached conv state: call the model with use_cache=False"),
    "return_final_states": (False, "the final conv state (a cache): call the model with use_cache=False"),
}


def _arguments(function, signature, args, kwargs):
    """The call's arguments by name (a **kwargs parameter's entries flattened), refused ones checked."""
    bound = signature.bind(*args, **kwargs)
    arguments = {}
    for name, value in bound.arguments.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(value)
        else:
            arguments[name] = value
    for name, (allowed, why) in REFUSED.items():
        value = arguments.get(name, allowed)
        if (value is not None) if allowed is None else bool(value):
            raise ValueError(f"{getattr(function, '__name__', function)} under ContextParallel was called with "
                             f"{name}={arguments[name]!r}: {why}")
    return arguments


def _head_counts(q, k, v, ulysses):
    if not q.shape[2] == k.shape[2] == v.shape[2]:
        raise ValueError(f"the gated delta rule under a Ulysses head split needs as many q/k heads as v heads, got "
                         f"{q.shape[2]}/{k.shape[2]}/{v.shape[2]}: repeat q/k to the v heads before the rule (as "
                         "Qwen3-Next does) or use backend='p2p'")
    return head_split(v.shape[2], v.shape[2], ulysses).kv_counts


def gated_delta_across(plan, rule, q, k, v, g, beta):
    """Outputs [b, s_local, h, dv] of `rule` over the whole sequence for this rank's [b, s_local, ...] inputs.

    `rule(q, k, v, g, beta, initial_state=None)` -> (outputs, final state): the model's rule, bound."""
    batch = routing.sequence(plan, q.shape[1])
    layout, seq_len, groups = batch.layout, batch.seq_len, batch.groups
    ring_index = groups.sep.index // layout.ulysses
    inputs = (q, k, v, g, beta)
    if groups.ulysses.size > 1:
        counts = _head_counts(q, k, v, groups.ulysses.size)
        lengths = layout.group_lengths(seq_len, ring_index)
        inputs = [to_heads(x, groups.ulysses, counts, lengths) for x in inputs]  # [b, s_group, h_u, ...]
    out = recurrence_across(rule, inputs, layout.ring_positions(seq_len), ring_index, groups.ring)  # [b, s_group, h_u, dv]
    if groups.ulysses.size > 1:
        out = to_sequence(out, groups.ulysses, counts, lengths)  # [b, s_local, h, dv]
    return out


def _routed_rule(original, plan):
    signature = inspect.signature(original)
    tensors = list(signature.parameters)[:5]  # q, k, v, g, beta (fla and PaddleFormers name them differently)

    def chunk_gated_delta_rule(*args, **kwargs):
        if routing.paused():
            return original(*args, **kwargs)
        arguments = _arguments(original, signature, args, kwargs)
        q, k, v, g, beta = (arguments.pop(name) for name in tensors)
        rest = {name: value for name, value in arguments.items()
                if name not in ("initial_state", "output_final_state")}

        def rule(q, k, v, g, beta, initial_state=None):
            return original(q, k, v, g, beta, initial_state=initial_state, output_final_state=True, **rest)

        out = gated_delta_across(plan, rule, q, k, v, g, beta)
        routing.mark_ran()
        return out, None

    chunk_gated_delta_rule.paddle_cp_original = original
    return chunk_gated_delta_rule


def _routed_conv(original, plan):
    """A fused causal conv `fn(x [b, C, s], weight [C, k], ...)` on this rank's windows."""
    signature = inspect.signature(original)
    first = next(iter(signature.parameters))

    def causal_conv1d_fn(*args, **kwargs):
        if routing.paused():
            return original(*args, **kwargs)
        arguments = _arguments(original, signature, args, kwargs)
        x = arguments.pop(first)
        reach = arguments["weight"].shape[-1] - 1
        windows = windows_for(plan, x.shape[2], reach, 0)
        out = original(windows.widen(x, 2, plan.groups.sep), **arguments)  # [b, C, windows]
        routing.mark_ran()
        return windows.narrow(out, 2)  # [b, C, s_local]

    causal_conv1d_fn.paddle_cp_original = original
    return causal_conv1d_fn


def _refused_decoding(original):
    def recurrent_gated_delta_rule(*args, **kwargs):
        raise ValueError("token-by-token decoding with a cache (recurrent_gated_delta_rule) does not run under "
                         "ContextParallel: generate without context parallelism")

    recurrent_gated_delta_rule.paddle_cp_original = original
    return recurrent_gated_delta_rule


def _original(function):
    return getattr(function, "paddle_cp_original", function)


class GatedDeltaNet(TokenMixer):
    name = "Gated DeltaNet (linear attention)"

    def claims(self, layer):
        return callable(getattr(layer, RULE, None))

    def check(self, layer, layout):
        heads = getattr(layer, "num_v_heads", None)
        if isinstance(heads, int) and layout.ulysses > 1:
            head_split(heads, heads, layout.ulysses)

    def _route(self, layer, plan):
        setattr(layer, RULE, _routed_rule(_original(getattr(layer, RULE)), plan))
        if getattr(layer, "causal_conv1d_fn", None) is not None:
            layer.causal_conv1d_fn = _routed_conv(_original(layer.causal_conv1d_fn), plan)
        if callable(getattr(layer, "recurrent_gated_delta_rule", None)):
            layer.recurrent_gated_delta_rule = _refused_decoding(_original(layer.recurrent_gated_delta_rule))
