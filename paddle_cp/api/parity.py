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
A plan with `documents=` finds each batch's documents in inputs the model's own code
does not read as documents (restarting position ids, a document-id input): the
reference gets them as PaddleFormers' causal attn_mask_startend_row_indices
[b, 1, s, 1], built here from the plan's reading of the same inputs (a document-id
input taken out).

A difference above 1e-5 may be the model's own fp32 rounding (Qwen3-Next's Gated DeltaNet:
one card differs from itself by 2e-5 when its rule merely chunks otherwise) or a fault. Then
(or when asked, reference="float64") a third forward, the reference's in float64
(float64_truth.py: weights widened in place and restored, every fp32 computation widened),
gives the truth; one card's distance from it is the model's own rounding, and the verdict is
whether the parallel run is as close to it (within TRUTH_FACTOR x). Its cost: one more
whole-sequence forward per rank in float64 (on a GPU, float64 runs at a fraction of the fp32
rate, and no flash kernel takes it: the model's attention must have a float64 path) and the
weights held in float64 meanwhile (2x their fp32 bytes).

A low-precision model (bf16/fp16 parameters, as decorate(level="O2") leaves them, or outputs, as autocast
gives them) differs from one card by its own rounding at every output, far above 1e-5. Its measure is the
same model run in fp32 on one card (weights widened in place and restored, autocast off, low-precision
inputs widened): one card's distance from that run is the model's own rounding, and the verdict is whether
the parallel run is as close to it (within ROUNDING_FACTOR x). Its cost: one more
whole-sequence forward per rank in fp32, and the weights held in fp32 meanwhile.
"""
from __future__ import annotations

import inspect

import numpy as np
import paddle

from .. import runtime
from ..attention import resolve_group
from ..comm import collectives
from ..sequence.shard import shard_sequence, unshard_sequence
from ..attention.kernels.full_precision import autocast_off
from ..dtypes import ROUNDOFF
from .float64_truth import float64_math, float64_weights, weights_as, widened_inputs
from .parallelize import parallelized_state

IGNORED_LABEL = -100  # PaddleFormers' default `ignored_index`
STARTEND = "attn_mask_startend_row_indices"  # PaddleFormers' packed documents: both forwards understand them
TOLERANCE = 1e-5  # fp32 parity; a larger difference may be the model's own rounding: the float64 pass tells
# As close to the truth as one card: within this factor of one card's distance or within TOLERANCE. One card's
# distance is one sample of the model's fp32 rounding noise and paddle_cp's another: on Qwen3-Next correct runs
# measured up to 2.38x one card's on one CPU (1.43x on another), faults 16x and more (docs/hybrid_models.md).
TRUTH_FACTOR = 3
# A low-precision run as close to its fp32 run as one card: within this factor of one card's distance (a bf16 O2
# Llama on dp2 x sep2 under the tests' emulated AMP: correct runs 0.12-1.08x; each ring block's log-sum-exp 5% off
# 2.4-8.4x, 20% off 8-11x, the ring's later blocks left out 21-106x), or within one rounding of the output's
# magnitude in the model's dtype: a scalar (the loss) is one sample of the rounding, which one card may happen to
# meet closely (6e-5 against the parallel run's 7e-4 on a loss of 4.8, whose bf16 rounding is 1.9e-2).
ROUNDING_FACTOR = 2


def check_parity(model, reference=None, **inputs):
    """{output name: largest absolute difference} between `model(**inputs)` with its plan's sequence
    splitting and without (the module docstring says how), as a Parity: with one card's distance from the
    float64 truth beside each and the verdict when the float64 pass ran (`reference="float64"`, or a difference
    above TOLERANCE). The same on every rank. Collective."""
    if reference not in (None, "float64"):
        raise ValueError(f"check_parity: reference={reference!r}; give None (the float64 pass only when a "
                         f"difference exceeds {TOLERANCE}) or 'float64' (always)")
    state = parallelized_state(model)
    if state is None:
        raise ValueError("check_parity takes a model parallelize() returned: parallelize it first")
    if getattr(model, "_pcp_pipeline", None) is not None:
        raise ValueError("check_parity runs one forward of the whole model, which a pipeline (pp_config) splits "
                         "over its stages: check the model without pp_config")
    if len(state.prepare) > 1:
        raise ValueError("check_parity: the model has several PrepareContextParallel plans; give it one")
    prepare, prepared_layer = (state.prepare[0][0], state.prepare[0][1]()) if state.prepare else (None, None)
    if getattr(prepare, "pool", False):
        raise ValueError("check_parity compares a sep group's split against one card; a PrepareContextParallel(pool=True) "
                         "splits the global batch over every dp x sep rank: check the model's plan without pool=True")
    split = _BatchSplit(prepare, state.mesh, inputs) if prepare is not None else None
    whole_inputs = split.one_card_inputs(model, inputs) if split is not None else inputs
    parallel_inputs, labels = dict(inputs), inputs.get("labels")
    local_labels = labels
    if split is not None and labels is not None:
        local_labels = split.shard(labels)
        if prepared_layer is not model:  # the plan splits the inner model's inputs, not the loss's labels
            parallel_inputs["labels"] = local_labels
    tokens = _local_tokens(model, inputs, local_labels, split)  # split before the forward, as a script would
    parallel = _outputs(model, parallel_inputs, "labels" in inputs)
    one_card = _outputs(model, whole_inputs, "labels" in inputs, paused=True)
    if list(parallel) != list(one_card):
        raise ValueError(f"check_parity: the model returned outputs {list(parallel)} split and {list(one_card)} "
                         "whole: it must return the same structure both ways")
    parallel = {name: _whole(name, parallel[name], one_card[name], split, tokens) for name in one_card}
    # and whether any rank holds low-precision parameters or outputs (each rank sees only its own initialized
    # parameters and its own outputs): every rank takes the same branch below, whose collectives differ
    *differences, roundoff = _largest_over_ranks(
        state, [_distance(parallel[n], one_card[n]) for n in one_card] + [_roundoff(model, one_card)])
    if roundoff:
        with weights_as(model, paddle.float32), autocast_off():
            fp32 = _outputs(model, widened_inputs(whole_inputs, paddle.float32), "labels" in inputs, paused=True)
        count = len(one_card)
        distances = _largest_over_ranks(state, [_distance(x[n], fp32[n]) for x in (one_card, parallel)
                                                for n in one_card] + [_magnitude(fp32[n]) for n in one_card])
        return Parity(zip(one_card, differences), one_card=dict(zip(one_card, distances[:count])),
                      parallel=dict(zip(one_card, distances[count:2 * count])), reference="float32",
                      rounding=dict(zip(one_card, (roundoff * m for m in distances[2 * count:]))))
    if reference != "float64" and max(differences, default=0.0) <= TOLERANCE:  # the same choice on every rank
        return Parity(zip(one_card, differences))
    # before float64_math: these casts are the float32 operators it refuses
    wide_inputs = widened_inputs(whole_inputs, paddle.float64)
    with float64_weights(model), float64_math():
        truth = _outputs(model, wide_inputs, "labels" in inputs, paused=True)
    distances = _largest_over_ranks(state, [_distance(x[n], truth[n]) for x in (one_card, parallel) for n in one_card])
    count = len(one_card)
    return Parity(zip(one_card, differences), one_card=dict(zip(one_card, distances[:count])),
                  parallel=dict(zip(one_card, distances[count:])))


class Parity(dict):
    """{output name: largest difference from one card} over all ranks, and when the float64 pass ran, beside each
    output: `one_card[name]`, one card's distance from the float64 truth (the model's own fp32 rounding) and
    `parallel[name]`, the parallel run's; `ratio` theirs. `as_close_as_one_card`: the verdict (every output within
    TRUTH_FACTOR x one card's distance, or TOLERANCE; without the float64 pass, every difference within
    TOLERANCE). A low-precision model (`reference` "float32"): the distances are from the model's fp32 run on one
    card, the verdict within ROUNDING_FACTOR x or within `rounding[name]`, one rounding of the output's magnitude in
    the model's dtype. Compares equal to the plain {name: difference} dict."""

    def __init__(self, differences, one_card=None, parallel=None, reference="float64", rounding=None):
        super().__init__(differences)
        self.one_card, self.parallel, self.reference = one_card, parallel, reference
        self.rounding = rounding or {}

    @property
    def ratio(self):
        if self.one_card is None:
            return None
        return {name: _ratio(self.parallel[name], self.one_card[name]) for name in self}

    def close(self, name):
        """Whether output `name` is as close to the truth as one card (or, without the float64 pass, to one card
        within TOLERANCE)."""
        if self.one_card is None:
            return self[name] <= TOLERANCE
        factor = ROUNDING_FACTOR if self.reference == "float32" else TRUTH_FACTOR
        return self.parallel[name] <= max(TOLERANCE, factor * self.one_card[name], self.rounding.get(name, 0.0))

    @property
    def as_close_as_one_card(self):
        return all(self.close(name) for name in self)

    def as_dict(self):
        """Every figure, as plain numbers (for JSON)."""
        figures = {"difference": dict(self), "as_close_as_one_card": self.as_close_as_one_card}
        if self.one_card is not None:
            figures.update(one_card=self.one_card, parallel=self.parallel, ratio=self.ratio)
        if self.reference == "float32":
            figures.update(reference="float32", rounding=self.rounding)
        return figures

    def __str__(self):
        if self.one_card is None:
            rows = [f"{name}: {diff:.2e} from one card" for name, diff in self.items()]
            return "\n".join(rows + [f"{'equal to one card' if self.as_close_as_one_card else 'DIFFERS'} "
                                      f"within {TOLERANCE:g}"])
        truth, factor = ("its fp32 run", ROUNDING_FACTOR) if self.reference == "float32" else \
            ("the float64 truth", TRUTH_FACTOR)
        rows = [f"{name}: {diff:.2e} from one card; from {self.reference}: {self.parallel[name]:.2e}, one card's "
                f"own {self.one_card[name]:.2e} (x{self.ratio[name]:.2f})"
                + (f", one rounding {self.rounding[name]:.2e}" if name in self.rounding else "")
                for name, diff in self.items()]
        verdict = (f"as close to {truth} as one card" if self.as_close_as_one_card else
                   f"FARTHER from {truth} than one card (over {factor}x)")
        return "\n".join(rows + [verdict])


def _ratio(parallel, one_card):
    if one_card > 0:
        return parallel / one_card
    return 0.0 if parallel == 0 else float("inf")


def _roundoff(model, outputs):
    """The unit roundoff of the coarsest low-precision dtype among this rank's initialized parameters and its
    outputs; 0.0 for an fp32 model."""
    dtypes = {p.dtype for p in model.parameters() if p._is_initialized()}
    dtypes |= {x.dtype for x in outputs.values() if isinstance(x, paddle.Tensor)}
    return max((ROUNDOFF.get(dtype, 0.0) for dtype in dtypes), default=0.0)


def _magnitude(value):
    """Largest absolute value of an output (a float or a tensor), in float64."""
    if isinstance(value, float):
        return abs(value)
    return float(value.astype("float64").abs().max())


def _largest_over_ranks(state, values):
    """Each of `values` at its largest over every rank (the same list on every rank)."""
    mine = paddle.to_tensor(np.array(values or [0.0], dtype="float64"))
    gathered = collectives.all_gather(state.world, mine, tag="check_parity")
    return [float(x) for x in np.max(np.stack([t.numpy() for t in gathered]), axis=0)][:len(values)]


class _BatchSplit:
    """This batch's split by the model's PrepareContextParallel (its documents, if any, decide the layout)."""

    def __init__(self, prepare, mesh, inputs):
        self.prepare, self.mesh = prepare, mesh
        if prepare.documents == "position_ids":
            self.documents = {"position_ids": inputs.get("position_ids")}
        elif prepare.documents is not None:
            self.documents = {"doc_ids": inputs.get(prepare.documents)}
        else:
            self.documents = {STARTEND: inputs.get(STARTEND)}

    def one_card_inputs(self, model, inputs):
        """The reference forward's inputs: a documents plan's documents as PaddleFormers' causal row indices
        [b, 1, s, 1] (key j seen by rows j <= i < end of its document: the shape its models' one-card mask code
        reads), the plan's document-id input taken out; other plans' inputs as they are."""
        if self.prepare.documents is None:
            return inputs
        parameters = inspect.signature(model.forward).parameters
        if STARTEND not in parameters and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            raise ValueError(
                f"check_parity: PrepareContextParallel(documents={self.prepare.documents!r}) confines attention to "
                f"documents, which the one-card forward is given as PaddleFormers' {STARTEND}; "
                f"{type(model).__name__}.forward takes no {STARTEND}: check it with a plan without documents=")
        documents = self.prepare.documents_of(**self.documents)
        extra = "doc_ids" in self.documents and self.prepare.documents  # an input only the plan reads
        whole = {name: value for name, value in inputs.items() if name != extra}
        whole[STARTEND] = paddle.to_tensor(documents.end[:, None, :, None], dtype="int32")  # [b, 1, s, 1]
        return whole

    def shard(self, x):
        return shard_sequence(x, backend=self.prepare, mesh=self.mesh, **self.documents)

    def gather(self, x, dim, seq_len):
        return unshard_sequence(x, seq_dim=dim, backend=self.prepare, mesh=self.mesh, seq_len=seq_len,
                                **self.documents)


def _outputs(model, inputs, has_labels, paused=False):
    """{name: tensor} of one forward without gradients in eval mode; `paused`: context parallelism paused (every
    rank runs the model's own code on the whole input)."""
    training = model.training
    model.eval()
    runtime.state.context_parallel_paused = paused
    try:
        with paddle.no_grad():
            return _named_outputs(model(**inputs), has_labels)
    finally:
        runtime.state.context_parallel_paused = False
        if training:
            model.train()


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


def _whole(name, got, want, split, tokens):
    """The parallel output `got` as the whole one `want`: a scalar (0-D, or the loss) combined over the sep ranks by
    their tokens (a float), a split tensor gathered in token order, any other as it is (rope deltas)."""
    if got.numel() == 1 and want.numel() == 1 and (got.ndim == 0 or name.rpartition(".")[2] == "loss"):
        if split is not None:  # each sep rank's mean over its own tokens
            return _token_mean(got, tokens, resolve_group(split.mesh))
        return float(got.astype("float64").reshape([]))
    if tuple(got.shape) != tuple(want.shape):
        return _in_token_order(name, got, want, split)
    return got


def _distance(got, want):
    """Largest absolute difference, in float64 (a scalar output is a float or a one-element tensor)."""
    if isinstance(got, float) or isinstance(want, float):
        return abs(float(got) - float(want.astype("float64") if isinstance(want, paddle.Tensor) else want))
    return float((got.astype("float64") - want.astype("float64")).abs().max())


def _token_mean(value, tokens, sep_group):
    """Each sep rank's mean over its tokens, combined into the mean over all of them."""
    pair = paddle.to_tensor(np.array([float(value.astype("float64").reshape([])) * tokens if tokens else 0.0, tokens]))
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
