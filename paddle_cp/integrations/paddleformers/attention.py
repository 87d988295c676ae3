"""PaddleFormers' attention functions, routed to paddle_cp for modules ContextParallel covers.

Every PaddleFormers attention layer looks its function up at call time in
`paddleformers.nn.attention.interface.ALL_ATTENTION_FUNCTIONS[_attn_implementation]`
and calls it as `fn(module, query, key, value, attention_mask, ..., sink=, scaling=)`
with [b, heads, s, d] tensors, returning ([b, s, heads * d_v], None). Each entry
("eager", "sdpa", "flashmask", any registered one) is wrapped so a routed call
(routing.plan_for) runs paddle_cp and any other the original; "paddle_cp" is
registered too. PaddleFormers is never imported here: the wrap happens when
it already is (a model of it exists), else paddle_cp works without it. Registered
with the core as the attention adapter ADAPTER (attention/adapters/__init__.py).

Semantics of a routed call: what the original function computes for the same
call on one card, from the module and the batch paddle_cp knows (one_card_semantics).
Causality: "eager" has none of its own (its mask decides: called with no mask it
attends both ways, as Qwen3-Next's full-attention layers are called; with the
batch's causal attn_mask_startend_row_indices it is causal); "sdpa", "flashmask"
and the others take `is_causal`, else `module.is_causal` (default True). Masks the
model built from local lengths are dropped and stand for causality, the window and
the padding of the 2-D attention_mask given to the top layer, which paddle_cp
applies over global positions; a call with no mask sees padding keys too, as on one
card ("flashmask" ignores attention_mask altogether). Packed documents given as
attn_mask_startend_row_indices stay inside their documents, as PaddleFormers means
them, under "sdpa" too (which hands Paddle's SDPA their mask with is_causal=True:
its flash kernel keeps it, its CPU math kernel drops it). A full dense mask the user
gave (its rows split by PrepareContextParallel) is applied instead of causality, as
"eager" does. The sliding window comes from the `sliding_window` keyword (Phi3) or
`module.sliding_window`; sinks from `sink`; scale from `scaling` (as "eager";
"sdpa" drops it, a PaddleFormers bug that one card shows), except "flashmask"
without sinks, whose op uses 1/sqrt(head_dim) and whose callers (DeepSeek-V3)
pre-scale q for it.
"""
from __future__ import annotations

import sys

from ...attention.dispatch import routing
from ...attention.dispatch.api import call_mask
from ...attention.dispatch.batch import current as current_batch

INTERFACE_MODULE = "paddleformers.nn.attention.interface"
NAME = "paddle_cp"
ADAPTER = "paddleformers_attention"  # the name its patch is held under


def one_card_semantics(implementation, module, attention_mask, is_causal, seq_len, documents):
    """(causal, dense mask to apply or None, whether padding keys are masked) of an original call."""
    from_startend = documents is not None and documents.causal_only  # the call had causal start-end indices
    module_causal = getattr(module, "is_causal", True)
    declared = is_causal if is_causal is not None else module_causal
    if implementation == "flashmask":  # attention_mask is never read
        return (is_causal if is_causal is not None else from_startend or module_causal), None, False
    if attention_mask is not None and attention_mask.shape[-1] == seq_len:
        return False, attention_mask, True  # the user's full dense mask, as "eager" applies it
    if attention_mask is not None:  # built by the model from local lengths: causal (its window, its padding)
        return declared, None, True
    if implementation == "eager":  # no mask: both directions unless the indices made it causal
        return from_startend, None, False
    return from_startend or declared, None, False


def _attend(plan, implementation, module, query, key, value, attention_mask=None, dropout=0.0, sink=None,
            scaling=None, is_causal=None, attn_mask_startend_row_indices=None, **kwargs):
    if attn_mask_startend_row_indices is not None:  # PrepareContextParallel turns the top layer's into documents
        raise ValueError(
            "attn_mask_startend_row_indices reached a context-parallel attention: pass them to the layer "
            "PrepareContextParallel hooks (the top model), which turns them into documents over global positions"
        )
    # q/k/v [b, h, s, d] -> [b, s, h, d]
    query, key, value = (x.transpose([0, 2, 1, 3]) for x in (query, key, value))
    scale = None if implementation == "flashmask" and sink is None else scaling
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    batch = current_batch()
    seq_len = batch.seq_len if batch is not None else query.shape[1] * plan.layout.world
    documents = batch.documents if batch is not None else None
    causal, dense, padding = one_card_semantics(implementation, module, attention_mask, is_causal, seq_len,
                                                documents)
    mask = call_mask(dense, causal, window if causal else None)
    out = routing.attend(plan, query, key, value, mask, dropout, module.training, scale, sinks=sink, padding=padding)
    b, s, h, dv = out.shape
    return out.reshape([b, s, h * dv]), None  # [b, s, h, dv] -> [b, s, h * dv]


def _routed(implementation, original):
    def attention(module, query, key, value, *args, **kwargs):
        plan = routing.plan_for(module)
        if plan is None:
            routing.refuse_unrouted(f"PaddleFormers' {implementation!r} attention of {type(module).__name__}")
            return original(module, query, key, value, *args, **kwargs)
        if args:
            raise TypeError(f"paddle_cp's {implementation!r} attention takes its arguments after q/k/v by keyword, "
                            "as PaddleFormers' layers pass them")
        return _attend(plan, implementation, module, query, key, value, **kwargs)

    attention.paddle_cp_original = original
    return attention


def paddle_cp_attention(module, query, key, value, **kwargs):
    """The "paddle_cp" implementation: context-parallel under a plan, else a clear error."""
    plan = routing.plan_for(module)
    if plan is None:
        raise ValueError("_attn_implementation='paddle_cp' runs only in layers ContextParallel covers: "
                         "parallelize the model with a ContextParallel plan on its attention layers")
    return _attend(plan, NAME, module, query, key, value, **kwargs)


def _replace_each(interface, replacement):
    """Set every entry of ALL_ATTENTION_FUNCTIONS for which `replacement(name, function)` is not None (in the
    mapping that holds it: a model's local one, else the global one)."""
    functions = interface.ALL_ATTENTION_FUNCTIONS
    for implementation in list(functions):
        new = replacement(implementation, functions[implementation])
        if new is None:
            continue
        if implementation in functions._local_mapping:
            functions[implementation] = new
        else:
            interface.AttentionInterface.register(implementation, new)


def install():
    """Wrap every entry of ALL_ATTENTION_FUNCTIONS once, if PaddleFormers is imported."""
    interface = sys.modules.get(INTERFACE_MODULE)
    if interface is None:
        return
    _replace_each(interface, lambda implementation, original: None if (
        implementation == NAME or hasattr(original, "paddle_cp_original")) else _routed(implementation, original))
    interface.AttentionInterface.register(NAME, paddle_cp_attention)


def uninstall():
    """PaddleFormers' own functions back ("paddle_cp" stays registered: outside a plan it raises)."""
    interface = sys.modules.get(INTERFACE_MODULE)
    if interface is not None:
        _replace_each(interface, lambda implementation, function: getattr(function, "paddle_cp_original", None))
