"""check_parity(model, **inputs): does a parallelized model compute on these inputs what one card does?

Two forwards, without gradients and in eval mode (no dropout):
- as trained: PrepareContextParallel splits the sequence over `sep` and the
  ContextParallel layers run across the ranks;
- the reference: context parallelism paused, every rank gives the whole input to
  the model's own code and attention (tensor, sequence and data parallel plans run
  in both: they are exact by construction and hold the only copy of their weights).
Each output of the first is gathered in token order (on the dim where its shape
differs from the reference's); a scalar (the loss) is combined over the sep group by
token counts, as the loss rule weighs it: labelled tokens when `labels` is given, else
tokens. Returned: {output name: largest absolute difference} over all ranks, the same
dict on every rank. Labels of a model whose PrepareContextParallel sits on an inner
layer (which does not split them) are split here, as the training script would.
"""
from __future__ import annotations

import numpy as np
import paddle

from .. import runtime
from ..attention import resolve_group
from ..comm import collectives
from ..sequence.shard import shard_sequence, unshard_sequence
from .parallelize import parallelized_state

IGNORED_LABEL = -100  # PaddleFormers' default `ignored_index`
STARTEND = "attn_mask_startend_row_indices"  # PaddleFormers' packed documents: both forwards understand them


def check_parity(model, **inputs):
    """{output name: largest absolute difference} between `model(**inputs)` with its plan's sequence
    splitting and without (the module docstring says how); the same dict on every rank. Collective."""
    state = parallelized_state(model)
    if state is None:
        raise ValueError("check_parity takes a model parallelize() returned: parallelize it first")
    if getattr(model, "_pcp_pipeline", None) is not None:
        raise ValueError("check_parity runs one forward of the whole model, which a pipeline (pp_config) splits "
                         "over its stages: check the model without pp_config")
    if len(state.prepare) > 1:
        raise ValueError("check_parity: the model has several PrepareContextParallel plans; give it one")
    prepare, prepared_layer = (state.prepare[0][0], state.prepare[0][1]()) if state.prepare else (None, None)
    if prepare is not None and prepare.documents is not None:
        raise ValueError(
            f"check_parity: PrepareContextParallel(documents={prepare.documents!r}) confines attention to documents "
            "the model's own forward does not know of, so there is no one-card forward to compare with; pass the "
            f"documents as PaddleFormers' {STARTEND} instead, which both forwards understand")
    split = _BatchSplit(prepare, state.mesh, inputs) if prepare is not None else None
    parallel_inputs, labels = dict(inputs), inputs.get("labels")
    local_labels = labels
    if split is not None and labels is not None:
        local_labels = split.shard(labels)
        if prepared_layer is not model:  # the plan splits the inner model's inputs, not the loss's labels
            parallel_inputs["labels"] = local_labels
    tokens = _local_tokens(model, inputs, local_labels, split)  # split before the forward, as a script would
    parallel, reference = _two_forwards(model, parallel_inputs, inputs)
    if list(parallel) != list(reference):
        raise ValueError(f"check_parity: the model returned outputs {list(parallel)} split and {list(reference)} "
                         "whole: it must return the same structure both ways")
    diffs = [_largest_difference(name, parallel[name], reference[name], split, tokens) for name in reference]
    mine = paddle.to_tensor(np.array(diffs or [0.0], dtype="float64"))
    gathered = collectives.all_gather(state.world, mine, tag="check_parity")
    worst = np.max(np.stack([t.numpy() for t in gathered]), axis=0)
    return {name: float(worst[i]) for i, name in enumerate(reference)}


class _BatchSplit:
    """This batch's split by the model's PrepareContextParallel (its row indices, if any, decide the layout)."""

    def __init__(self, prepare, mesh, inputs):
        self.prepare, self.mesh = prepare, mesh
        self.documents = {STARTEND: inputs.get(STARTEND)}

    def shard(self, x):
        return shard_sequence(x, backend=self.prepare, mesh=self.mesh, **self.documents)

    def gather(self, x, dim, seq_len):
        return unshard_sequence(x, seq_dim=dim, backend=self.prepare, mesh=self.mesh, seq_len=seq_len,
                                **self.documents)


def _two_forwards(model, parallel_inputs, whole_inputs):
    training = model.training
    model.eval()
    try:
        with paddle.no_grad():
            parallel = _named_outputs(model(**parallel_inputs), "labels" in whole_inputs)
            runtime.state.context_parallel_paused = True
            try:
                reference = _named_outputs(model(**whole_inputs), "labels" in whole_inputs)
            finally:
                runtime.state.context_parallel_paused = False
    finally:
        if training:
            model.train()
    return parallel, reference


def _named_outputs(output, has_labels):
    """{name: tensor} of a Tensor / ModelOutput / tuple output (nested ones dotted); with labels, a
    tuple's scalar first output is 'loss' (PaddleFormers' (loss, logits))."""
    named = _flatten(output, "")
    first = next(iter(named), None)
    if has_labels and "loss" not in named and first is not None and named[first].numel() == 1:
        named = {("loss" if name == first else name): value for name, value in named.items()}
    return named


def _flatten(output, prefix):
    if isinstance(output, paddle.Tensor):
        return {prefix or "output": output}
    if isinstance(output, dict):  # ModelOutput
        items = output.items()
    elif isinstance(output, (tuple, list)):
        items = ((str(i), v) for i, v in enumerate(output))
    else:
        return {}  # caches and other objects
    named = {}
    for key, value in items:
        named.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return named


def _local_tokens(model, inputs, local_labels, split):
    """The tokens behind this rank's scalar outputs: its labelled tokens, or all its tokens."""
    if local_labels is not None:
        ignored = getattr(getattr(model, "config", None), "ignored_index", IGNORED_LABEL)
        return float((local_labels != ignored).astype("int64").sum())
    ids = next((inputs[k] for k in ("input_ids", "inputs_embeds") if isinstance(inputs.get(k), paddle.Tensor)), None)
    if ids is None:
        return 1.0
    local = ids if split is None else split.shard(ids)
    return float(local.shape[0] * local.shape[1])


def _largest_difference(name, got, want, split, tokens):
    if got.numel() == 1 and want.numel() == 1:
        if split is not None:  # each sep rank's mean over its own tokens
            got = _token_mean(got, tokens, resolve_group(split.mesh))
        return abs(float(got) - float(want.astype("float64")))
    if tuple(got.shape) != tuple(want.shape):
        got = _in_token_order(name, got, want, split)
    return float((got.astype("float64") - want.astype("float64")).abs().max())


def _token_mean(value, tokens, sep_group):
    """Each sep rank's mean over its tokens, combined into the mean over all of them."""
    pair = paddle.to_tensor(np.array([float(value.astype("float64")) * tokens if tokens else 0.0, tokens]))
    collectives.all_reduce(sep_group, pair, tag="check_parity")
    total, count = pair.numpy()
    return total / count if count else 0.0


def _in_token_order(name, got, want, split):
    """A split output gathered in token order, along the one dim where it is shorter than the whole one."""
    dims = [d for d in range(got.ndim) if got.ndim == want.ndim and got.shape[d] != want.shape[d]]
    if split is None or len(dims) != 1:
        raise ValueError(f"check_parity: output {name!r} is {list(got.shape)} split and {list(want.shape)} whole; "
                         "only outputs that differ in one (sequence) dim can be gathered")
    return split.gather(got, dims[0], want.shape[dims[0]])
