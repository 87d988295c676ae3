"""A plan with ContextParallel layers and no PrepareContextParallel leaves the sequence to the script: it
passes each rank its shard (`shard_sequence`, with the global `position_ids`). Ranks that pass the same full
batch instead (the top layer's plan forgotten) would each attend with their whole copy as if it were their
shard and train silently wrong. So the model's first forward compares its inputs over the `sep` group and
refuses the same full batch on every rank of the mesh (the sep groups' verdicts agreed: a group that raised
alone would leave the other data replicas waiting in their collectives), before any of the forward's collectives.

Inputs are the same batch when every `[b, ...]` tensor the model gets has the same shape and values on every
sep rank; shards differ in values (their tokens, their positions) or in length. Cost: an exact integer
fingerprint of each input (comm/fingerprint.py), one all-gather of 2 int64 per rank over sep and, where the mesh
has other dims (several sep groups), one all-reduce of 1 int64 over every rank, each with a host read, in the
first forward only (a replay of it in backward, and later forwards, skip it; that forward runs on every rank).
"""
from __future__ import annotations

import inspect
import zlib

import paddle

from .. import runtime
from ..comm import collectives
from ..comm.fingerprint import fingerprint
from .context_parallel import ContextParallel, PrepareContextParallel

TAG = "cp_sharded_inputs"  # its bytes in paddle_cp.bytes_sent()


class ShardedInputsCheck:
    """The forward pre-hook of a model whose ContextParallel layers get inputs the script sharded. Made at
    parallelize (collective: the sep groups and the whole mesh's)."""

    def __init__(self, dims, layers):
        self.group = dims.sep
        self.world = dims.world
        self.layers = layers  # the names of the ContextParallel layers, for the error
        self.confirmed = False  # a forward has found the inputs sharded: later forwards are not checked

    def __call__(self, layer, args, kwargs):
        if self.confirmed or self.group.size == 1 or runtime.state.context_parallel_paused:
            return None
        named = {**{f"argument {i}": v for i, v in enumerate(args)}, **kwargs}
        inputs = {name: value for name, value in sorted(named.items())
                  if isinstance(value, paddle.Tensor) and value.ndim >= 2}
        if not inputs:
            self.confirmed = True
            return None
        shapes = repr([(name, list(value.shape), str(value.dtype)) for name, value in inputs.items()])
        values = paddle.zeros([1], "int64")
        for position, value in enumerate(inputs.values()):
            values = values + (position + 1) * fingerprint(value)
        row = paddle.concat([paddle.to_tensor([zlib.crc32(shapes.encode())], dtype="int64"), values])
        rows = [tuple(r.numpy().tolist()) for r in collectives.all_gather(self.group, row, tag=TAG)]
        same_here = len(set(rows)) == 1
        groups_refusing = paddle.to_tensor([int(same_here)], dtype="int64")  # [1]: summed over every rank
        if self.world.size > self.group.size:
            collectives.all_reduce(self.world, groups_refusing, tag=TAG)
        if int(groups_refusing.item()) > 0:
            given = ", ".join(f"{name} {list(value.shape)}" for name, value in inputs.items())
            where = (f"every rank of this sep group passed the same batch ({given})" if same_here else
                     "every rank of another sep group passed the same batch")
            raise ValueError(
                f"ContextParallel ({self.layers}) gets no inputs split by "
                f"PrepareContextParallel, and {where}: each "
                "rank would attend with its whole copy as if it were its own shard, and train silently wrong. Add "
                "PrepareContextParallel for the top layer to the plan ({'': pcp.PrepareContextParallel(backend), "
                "...}: it splits the model's inputs and labels), or pass each rank its shard: "
                "pcp.shard_sequence(input_ids, backend=...) and labels alike, with position_ids="
                "pcp.sequence_positions(seq_len, backend=...)")
        self.confirmed = True
        return None


def require_sharded_inputs(model, dims, applications):
    """Refuse, at `model`'s first forward, the same full batch on every sep rank when the plan has ContextParallel
    layers but nothing splits their inputs (no PrepareContextParallel); over the groups of `dims`."""
    if any(isinstance(plan, PrepareContextParallel) for plan, _, _ in applications):
        return
    names = {id(layer): name or "the model" for name, layer in model.named_sublayers(include_self=True)}
    layers = [names.get(id(layer), type(layer).__name__) for plan, layer, _ in applications
              if isinstance(plan, ContextParallel)]
    if layers:
        more = f" and {len(layers) - 1} more" if len(layers) > 1 else ""
        model.register_forward_pre_hook(ShardedInputsCheck(dims, layers[0] + more), with_kwargs=True)


class WholeLabelsCheck:
    """The forward pre-hook of a model whose PrepareContextParallel sits on an inner layer: that layer's inputs
    are split, not the labels the model itself takes, so its loss would meet this rank's logits with the whole
    sequence's labels (Paddle: "Input(Logits) and Input(Label) should in same shape"). Labels as long as the
    input ids are refused, on every rank alike (the sep ranks hold one batch), before any collective."""

    def __init__(self, group, inner):
        self.group, self.inner = group, inner

    def __call__(self, layer, args, kwargs):
        if self.group.size == 1 or runtime.state.context_parallel_paused:
            return None
        labels, ids = kwargs.get("labels"), kwargs.get("input_ids")
        if not all(isinstance(t, paddle.Tensor) and t.ndim >= 2 for t in (labels, ids)) or \
                labels.shape[1] != ids.shape[1]:
            return None
        raise ValueError(
            f"PrepareContextParallel on '{self.inner}' splits that layer's inputs over the {self.group.size} sep ranks, "
            f"but the labels ({labels.shape[1]} tokens, as many as input_ids) reach the model whole, and its loss "
            "would meet this rank's part of the logits: key PrepareContextParallel by '' (the model itself) to "
            "split the labels with the inputs, or pass each rank its labels: "
            "pcp.shard_sequence(labels, backend=...)")


def require_split_labels(model, dims, applications):
    """Refuse whole-sequence labels at `model`'s first forwards when its only PrepareContextParallel sits on an
    inner layer that takes no labels (PaddleFormers' `model` under `LlamaForCausalLM`, Paddle's spelling)."""
    prepared = [layer for plan, layer, _ in applications if isinstance(plan, PrepareContextParallel)]
    if not prepared or any(layer is model for layer in prepared):
        return
    parameters = [inspect.signature(layer.forward).parameters for layer in prepared]
    if any("labels" in p or any(a.kind is a.VAR_KEYWORD for a in p.values()) for p in parameters):
        return  # the inner layer may take the labels: its own hook splits them
    names = {id(layer): name for name, layer in model.named_sublayers()}
    model.register_forward_pre_hook(WholeLabelsCheck(dims.sep, names.get(id(prepared[0]), "")), with_kwargs=True)
