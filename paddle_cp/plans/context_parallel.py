"""Context-parallel plans: split the inputs of the top model layer, run attention across ranks."""
from __future__ import annotations

import functools
import inspect

import numpy as np
import paddle

from .. import mesh as mesh_lib
from .. import runtime
from ..activations import recompute
from ..attention import Documents, SequenceLayout, adapters, check_rotation, mixers, resolve_groups
from ..attention.dispatch import batch as batch_context
from ..attention.dispatch import routing
from ..attention import resolve_group, ulysses_size
from ..attention.layout.pool import joined_documents, joined_valid, pool_layout, row_positions
from ..attention.layout.sequence_layout import check_split
from ..cost.links import LinkCost, Links
from ..cost.tiles import tile_counts
from ..params import mark_fetch_unit
from .base import Plan, refuse_param_plan
from . import vision_language, vision_split
from .same_batch import BATCH_CHECK_GROUPS, BatchCheck

_SEQUENCE_KEYS = ("input_ids", "inputs_embeds")
_STARTEND = "attn_mask_startend_row_indices"  # PaddleFormers' packed-document input
# RoPE variants that pick their frequencies from max(position_ids) + 1, which differs per rank.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _padding(mask, batch, seq_len):
    """Keys that are not padding ([batch, seq_len] bool numpy) from a 2-D attention_mask, None if none is."""
    if not isinstance(mask, paddle.Tensor) or mask.ndim != 2 or list(mask.shape) != [batch, seq_len]:
        return None
    valid = mask.numpy().astype(bool)
    return None if valid.all() else valid


def _check_rope(layer):
    for name, sub in layer.named_sublayers(include_self=True):
        kinds = getattr(sub, "rope_type", None)
        kinds = kinds.values() if isinstance(kinds, dict) else [kinds]
        for kind in kinds:
            if kind in _LENGTH_DEPENDENT_ROPE:
                raise ValueError(
                    f"{name or type(layer).__name__} uses rope_type={kind!r}, which picks its frequencies from "
                    "max(position_ids) + 1: under context parallelism each rank holds different positions, so "
                    "ranks would rotate differently. Use a RoPE with fixed frequencies (default, linear, yarn, "
                    "llama3) or train this model without context parallelism"
                )


def _sequence_length(args, kwargs):
    """(batch, length) of the full sequence: dim 1 of input_ids / inputs_embeds, else of the first 2-D+ tensor."""
    for key in _SEQUENCE_KEYS:
        if isinstance(kwargs.get(key), paddle.Tensor):
            return kwargs[key].shape[0], kwargs[key].shape[1]
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, paddle.Tensor) and value.ndim >= 2:
            return value.shape[0], value.shape[1]
    return None, None


def _split_dim(value, seq_len):
    """The dim PrepareContextParallel splits `value` on: 1 for [batch, seq, ...], 2 for a dense
    [batch, 1|h, seq, seq] mask (this rank's query rows); None when it is not split."""
    if not isinstance(value, paddle.Tensor) or value.ndim < 2:
        return None
    if value.ndim == 4 and value.shape[2] == value.shape[3] == seq_len:
        return 2
    return 1 if value.shape[1] == seq_len else None


def _of_batch(value, batch, seq_len):
    """A [batch, ...] tensor with the sequence in some dim: what every rank of a sep group must share
    (the inputs split below, and documents' `attn_mask_startend_row_indices`)."""
    return (isinstance(value, paddle.Tensor) and value.ndim >= 2 and value.shape[0] == batch
            and seq_len in value.shape[1:])


def sep_groups_needed(backend, sep_size, ulysses_degree):
    """What ParallelDims.build makes for a context-parallel plan: sep with its pair groups, and its Ulysses
    and ring parts where both have more than one rank (attention/groups.py's resolve_groups)."""
    ulysses = ulysses_size(backend, sep_size, ulysses_degree)
    return (("pairs", "sep"),) + ((("sep_parts", ulysses),) if 1 < ulysses < sep_size else ())


class _SepPlan(Plan):
    """A context-parallel plan: a backend (with its Ulysses degree), a whole layer, the mesh's `sep` slice.
    The backend's shape over the sep ranks is checked once, at check (with the mesh), and a model's
    PrepareContextParallel and ContextParallel plans must give the same (`check_backends_agree`): the
    attention reads it from the batch PrepareContextParallel made."""

    def __init__(self, backend="p2p", ulysses_degree=None):
        ulysses_size(backend, 0, ulysses_degree)  # a known backend, with a degree iff hybrid
        self.backend, self.ulysses_degree = backend, ulysses_degree

    def check(self, layer, mesh, param_names=()):
        refuse_param_plan(self, param_names)
        mesh_lib.require_dim(mesh, "sep", type(self).__name__)
        return SequenceLayout(self.backend, mesh_lib.dim_size(mesh, "sep"), self.ulysses_degree)

    def groups_needed(self, layer, mesh):
        return sep_groups_needed(self.backend, mesh_lib.dim_size(mesh, "sep"), self.ulysses_degree)

    def _join_sep_group(self, layer, dims, param_names):
        """The SepRun this plan's hooks on `layer` run with (collective where the groups are not made yet);
        `check` ran first."""
        mesh_lib.require_dim(mesh_lib.mesh_of(dims), "sep", type(self).__name__)  # applied by hand, unchecked
        recompute.install()  # recomputed layers replay with this batch's layout and plans
        return SepRun(self, mesh_lib.dims_of(dims))


class SepRun:
    """What a context-parallel plan applied to one layer runs with: the plan's backend laid over the mesh's
    `sep` slice and its process groups. Made by apply, held by the hooks on that layer; the plan object keeps
    only its arguments, so one plan serves several models."""

    def __init__(self, plan, dims):
        self.backend, self.ulysses_degree = plan.backend, plan.ulysses_degree
        self.rotate = getattr(plan, "rotate", "planned")
        self.layout = plan_layout(plan, resolve_group(dims).ranks)
        self.groups = resolve_groups(self.layout, dims)


def plan_layout(plan, sep_ranks):
    """The SequenceLayout of `plan`'s backend and Ulysses degree over the sep group's global ranks `sep_ranks`,
    its ring's links (ring member g holds sep positions gU .. gU+U-1, one node) at `plan.links` (a
    PrepareContextParallel's) or Links' defaults."""
    layout = SequenceLayout(plan.backend, len(sep_ranks), plan.ulysses_degree)
    layout.links = LinkCost.of_ranks(list(sep_ranks)[::layout.ulysses], getattr(plan, "links", None) or Links())
    return layout


def check_backends_agree(plans):
    """One backend (and Ulysses degree) for a model's context-parallel plans: the attention runs in the layout
    PrepareContextParallel split the inputs in. Raised at check, on every rank, before any collective."""
    prepare = next((p for p in plans if isinstance(p, PrepareContextParallel)), None)
    for plan in plans:
        if (prepare is not None and isinstance(plan, _SepPlan)
                and (plan.backend, plan.ulysses_degree) != (prepare.backend, prepare.ulysses_degree)):
            raise ValueError(
                f"inputs are split by PrepareContextParallel(backend={prepare.backend!r}, ulysses_degree="
                f"{prepare.ulysses_degree}) but {type(plan).__name__} uses backend={plan.backend!r}, ulysses_degree="
                f"{plan.ulysses_degree}: give both plans the same backend and ulysses_degree")


class PrepareContextParallel(_SepPlan):
    """Forward pre-hook on the top model layer: split every [batch, seq, ...] input over `sep`.

    `p2p`: rank r keeps chunks r and 2N-1-r of 2N (balanced causal work);
    `all2all`: contiguous chunks; `hybrid`: the p2p layout over groups of
    `ulysses_degree` ranks, contiguous within a group. Any length >= N splits,
    as evenly as it can. Dense [batch, 1|h, seq, seq] masks keep their rows
    of this rank's queries. If the layer takes `position_ids` and gets none,
    it is given the global positions of the local tokens (exact RoPE); RoPE
    variants that read the length from them (dynamic NTK, longrope) are refused.
    A 2-D [batch, seq] `attention_mask` marks padding keys, which no query sees.

    `documents`: packed sequences, attention confined to each document:
    "position_ids" (documents start where the given position ids restart at 0)
    or the name of an extra input holding per-token document ids [batch, seq]
    (taken out before the layer runs). PaddleFormers' causal
    `attn_mask_startend_row_indices` is understood the same way.

    `layout`: how a batch whose documents are known is split over the ring.
    "documents" (default): each batch so that attention work (the keys each
    query sees within its document, summed over the rows) is balanced over the
    ring groups, whatever the document lengths (cost/balance.py); local
    lengths then differ by a few tokens. "chunks": the 2N chunks used without
    documents. Split other [batch, seq] tensors of the batch (labels) with
    `paddle_cp.shard_sequence(x, backend=this plan, ...)` given the same
    document inputs the model gets.

    `links`: a `paddle_cp.Links` or a dict of its fields (ranks per node, GB/s within and across nodes; a YAML
    config's `links: {ranks_per_node: 8, inter_gbps: 50}`) the documents layout prices
    each candidate's k/v exchange with, beside its tiles (cost/links.py); default `Links()`: ranks
    per node from PADDLE_LOCAL_SIZE (paddle.distributed.launch's processes per node), 300 GB/s within a
    node, 25 GB/s across. Across nodes it keeps documents whole where the bytes would cost more than the
    tiles they balance.

    `pool`: one pool over dp x sep (dynamic context parallelism). Every rank of the pool passes the
    global batch (every replica's rows, the same on every rank: checked, as a sep group's batch is);
    its rows are joined end to end into one packed sequence (a row's end ends its documents) laid out
    over all dp x sep ranks as one ring by the documents layout, priced with `links`: a short document
    stays whole on one rank, a long one spans several. Each rank's inputs are then [1, its tokens, ...];
    split labels with `shard_sequence(labels, backend=this plan, ...)` and weight each rank's mean loss
    by `loss_weight(its labelled tokens)`: gradients are then one card's on the global batch. Ring attention
    (`p2p`) with softmax attention only.
    """

    def __init__(self, backend="p2p", ulysses_degree=None, documents=None, layout="documents", links=None,
                 pool=False):
        super().__init__(backend, ulysses_degree)
        if not isinstance(pool, bool):
            raise TypeError(f"pool must be True or False, got {pool!r}")
        if pool and backend != "p2p":
            raise ValueError(f"PrepareContextParallel(pool=True) lays the global batch out over one ring of every dp x "
                             f"sep rank: use backend='p2p' (and ContextParallel('p2p')), not {backend!r}")
        if documents is not None and not isinstance(documents, str):
            raise TypeError(f"documents must be 'position_ids' or an input name, got {documents!r}")
        if isinstance(links, dict) and set(links) <= set(Links._fields):  # a YAML config's mapping
            links = Links(**links)
        if links is not None and not isinstance(links, Links):
            raise TypeError(f"links must be a paddle_cp.Links(ranks_per_node=, intra_gbps=, inter_gbps=) or a dict of "
                            f"those, got {links!r}")
        self.documents = documents
        self.layout = check_split(layout)
        self.links = (links or Links()).check()
        self.pool = pool

    def check(self, layer, mesh, param_names=()):
        super().check(layer, mesh, param_names)
        _check_rope(layer)
        vision_language.check_known(layer)
        vision_language.check_config(layer)
        keyed_inside = vision_language.language_model_rule(layer)
        if keyed_inside is not None and keyed_inside.after_language_model:
            raise ValueError(
                f"PrepareContextParallel keyed on {type(layer).__name__}, the language model of a vision-language "
                f"model whose {sorted(keyed_inside.after_language_model)} read per-token inputs it makes from the "
                "whole batch after the language model: key PrepareContextParallel on the top model ('') instead")
        if self.pool and (vision_language.merging_rule(layer) or vision_language.language_model_rule(layer)):
            raise ValueError("PrepareContextParallel(pool=True) joins the global batch's rows into one sequence, "
                             "which paddle_cp does not do for a vision-language model's merged inputs yet: drop "
                             "pool=True (each replica's rows are then laid out over its own sep ranks)")
        if self.pool and mesh_lib.dim_size(mesh, "pp") > 1:
            raise ValueError("PrepareContextParallel(pool=True) joins the global batch into one sequence, which a "
                             "pipeline's micro-batches would cut: train with pool=True without pp_config, or drop pool")

    def groups_needed(self, layer, mesh):
        pool = (("pairs", "data"),) if self.pool else ()  # the pool's ring over dp x sep
        return super().groups_needed(layer, mesh) + BATCH_CHECK_GROUPS + pool

    def apply(self, layer, dims, param_names=()):
        sep = self._join_sep_group(layer, dims, param_names)
        dims = mesh_lib.dims_of(dims)
        merging = vision_language.merging_rule(layer)
        rule = merging or vision_language.language_model_rule(layer)
        run = _PreparedRun(self, sep, dims, layer, Pool(self, dims) if self.pool else None, rule, merging is not None)
        adapters.install(layer)  # attention reached outside every ContextParallel layer then raises, not runs locally
        if merging is not None:  # the merged inputs are split when the language model gets them
            language_model = merging.language_model(layer)
            language_model.register_forward_pre_hook(run.split_merged, with_kwargs=True)
            language_model.register_forward_post_hook(run.forget_merged, always_call=True)
            for path, names in merging.after_language_model.items():
                layer.get_sublayer(path).register_forward_pre_hook(
                    functools.partial(run.split_read_after, names), with_kwargs=True)
        layer.register_forward_pre_hook(run.split_inputs, with_kwargs=True)
        return layer.register_forward_post_hook(run.forget_batch, always_call=True)

    def documents_of(self, position_ids=None, doc_ids=None, attn_mask_startend_row_indices=None):
        """The batch's Documents as this plan reads them from these inputs (None: no documents)."""
        if self.documents == "position_ids":
            if position_ids is None:
                raise ValueError("PrepareContextParallel(documents='position_ids') finds each batch's documents in "
                                 "its position_ids: pass them (to the model, and to shard_sequence with this plan)")
            return Documents.from_position_ids(position_ids)
        if self.documents is not None:
            if doc_ids is None:
                raise ValueError(f"PrepareContextParallel(documents={self.documents!r}) finds each batch's documents "
                                 f"in the input {self.documents!r}: pass it to the model (and as doc_ids= to "
                                 "shard_sequence with this plan)")
            return Documents.from_ids(doc_ids)
        if attn_mask_startend_row_indices is not None:
            return Documents.from_startend_row_indices(attn_mask_startend_row_indices)
        return None

    def batch_layout(self, layout, documents, joint=None):
        """`layout` (this plan's backend over a sep group) for a batch with `documents`; `joint`: another stage
        placed around each candidate (SequenceLayout.for_batch)."""
        return layout.for_batch(documents, self.layout, joint)

    def shard_batch(self, group, seq_len, position_ids=None, doc_ids=None, attn_mask_startend_row_indices=None):
        """The Batch shard_sequence splits a batch's tensors of `seq_len` tokens (None: unshard_sequence agrees
        on it) over the sep `group` with, given the batch's document inputs: in the layout of the last forward
        this plan split over `group` when these are its documents, else chosen here. Row indices the plan was
        not told about decide a batch's split only at the model call: a call here without them, after a
        forward they split, would split labels unlike the inputs."""
        last = batch_context.last_split(group)
        last = last if last is not None and last.plan is self else None
        if (self.documents is None and attn_mask_startend_row_indices is None and last is not None
                and last.layout.split.name == "documents"):
            raise ValueError(
                "this PrepareContextParallel's batches carry attn_mask_startend_row_indices, by whose documents each "
                "batch is split: pass them to shard_sequence too (or build the plan with layout='chunks')")
        if position_ids is not None:
            position_ids = vision_language.text_positions(position_ids)
        documents = self.documents_of(position_ids, doc_ids, attn_mask_startend_row_indices)
        if last is not None and last.same_documents(documents) and seq_len in (None, last.seq_len):
            return last
        layout = self.batch_layout(plan_layout(self, group.ranks), documents)
        return batch_context.Batch(layout, seq_len, documents, group=group, plan=self)


class Pool:
    """The dp x sep pool of a PrepareContextParallel(pool=True): one p2p ring over every dp x sep rank (mesh
    order: a replica's sep ranks adjacent, so on one node), and the global batch's layout over it
    (attention/layout/pool.py). Made at apply and by shard_sequence (collective the first time: the groups)."""

    def __init__(self, plan, dims):
        self.plan = plan
        dims = mesh_lib.dims_of(dims)
        group = dims.with_pairs("data")
        self.layout = SequenceLayout("p2p", group.size, links=LinkCost.of_ranks(list(group.ranks), plan.links))
        self.groups = resolve_groups(self.layout, group=group)
        self.replicas = mesh_lib.dim_size(dims.mesh, "dp")

    @property
    def index(self):
        return self.groups.sep.index

    def batch_layout(self, documents, batch, seq_len):
        """The layout of a [batch, seq_len] global batch with `documents` (or None) joined over the pool."""
        self.layout.check_length(batch * seq_len, what="the global batch's (rows x length)")
        made = batch_context.split_alike(self.groups.sep, self.plan, batch * seq_len,
                                         joined_documents(documents, batch, seq_len))
        if made is not None:  # shard_sequence's for the coming forward, or the last forward's
            return made.layout
        return pool_layout(self.layout, documents, batch, seq_len, self.plan.layout, self.replicas)

    def batch(self, layout, documents, valid, batch, seq_len, run=None):
        """The Batch of a [batch, seq_len] global batch laid out as `layout`: its rows joined into one."""
        return batch_context.Batch(layout, batch * seq_len, joined_documents(documents, batch, seq_len),
                                   joined_valid(valid, batch, seq_len), self.groups.sep, run, self.plan,
                                   pool_groups=self.groups)

    def shard_batch(self, batch, seq_len, documents):
        """The Batch shard_sequence splits a global batch's tensors with: the last forward's over the pool
        when these are its documents (no second layout choice), else laid out here."""
        made = batch_context.split_alike(self.groups.sep, self.plan, batch * seq_len,
                                         joined_documents(documents, batch, seq_len))
        if made is not None:
            return made
        return self.batch(self.batch_layout(documents, batch, seq_len), documents, None, batch, seq_len)

    @staticmethod
    def joined(value, batch, seq_dim=1):
        """[batch or 1, seq, ...] -> [1, batch x seq, ...]: the global batch's rows end to end."""
        if seq_dim != 1 or value.ndim < 2:
            raise ValueError("PrepareContextParallel(pool=True) splits [batch, seq, ...] tensors on dim 1: give "
                             f"shard_sequence seq_dim=1 and a tensor of the global batch, not shape {list(value.shape)}")
        if value.shape[0] not in (1, batch):
            raise ValueError(f"PrepareContextParallel(pool=True): a tensor of shape {list(value.shape)} in a global "
                             f"batch of {batch} rows; give every [batch, seq, ...] input all {batch} rows")
        if value.shape[0] != batch:
            value = value.expand([batch, *value.shape[1:]])
        return value.reshape([1, batch * value.shape[1], *value.shape[2:]])


def _refuse_dense_masks(values, seq_len):
    if any(_split_dim(value, seq_len) == 2 for value in values):
        raise ValueError("PrepareContextParallel(pool=True) joins the global batch's rows into one sequence: a dense "
                         "[batch, 1|h, seq, seq] mask cannot follow them; give documents (position_ids, document ids "
                         "or attn_mask_startend_row_indices) and padding as a 2-D attention_mask, or drop pool=True")


def _given(bound, signature):
    """{name: value} of the bound arguments, those a **kwargs parameter took included."""
    given = {}
    for name, value in bound.arguments.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            given.update(value)
        elif signature.parameters[name].kind is not inspect.Parameter.VAR_POSITIONAL:
            given[name] = value
    return given


class _PreparedRun:
    """A PrepareContextParallel applied to one model layer: its hooks, and what they keep between forwards
    (the batch check's answers, the positions of the last layout); `pool`: its Pool under pool=True.

    `rule`: the VisionLanguage rule of a vision-language model (plans/vision_language.py). On a model that merges
    image features (`merging`), the layer's pre-hook chooses the batch and splits only its loss inputs, and the
    language model's pre-hook splits the merged inputs (`merged`: the batch waiting for them); on its language
    model, the layer's inputs are split as a text model's, by the rule's rope layout and rows."""

    def __init__(self, plan, sep, dims, layer, pool=None, rule=None, merging=False):
        self.plan, self.sep, self.pool = plan, sep, pool
        self.rule, self.merging = rule, merging
        self.check_batch = BatchCheck(dims, pool=pool is not None)
        self.signature = inspect.signature(layer.forward)
        self.top = layer
        self._positions = (None, None)  # ((seq_len, index), int64 positions on the device): made once per length
        self.merged = None
        # a merging model's vision tower and the decoder's shape (what its split's joint layout prices)
        self.tower, self.merger = rule.vision_tower(layer) if merging else (None, None)
        if self.merger is not None:  # runs by the batch, as the tower it merges for (vision_split.VisionSplitRun)
            mark_fetch_unit(self.merger)
        self.language = vision_split.language_shape(rule.language_model(layer)) if merging else None

    def _feature_dtype(self):
        """What the split tower's features are exchanged in: the language model's embeddings' dtype (the merge's)."""
        return self.rule.language_model(self.top).get_input_embeddings().weight.dtype

    def _check_sharded(self, layout):
        """The model's inputs and what shard_sequence split for this batch (labels) share one layout."""
        shards = batch_context.take_shards(self.sep.groups.sep if self.pool is None else self.pool.groups.sep)
        sharded = {shard.layout.split.name for shard in shards if shard.plan is not None}
        if any(shard.plan is None for shard in shards):
            if layout.split.name != "chunks":
                raise ValueError(
                    f"shard_sequence split this batch's tensors by a backend name, in 2N chunks; the model's inputs "
                    f"are split in the {layout.split.name!r} layout (the batch's documents decide it): pass "
                    "backend=<the PrepareContextParallel plan> and the document inputs the model gets (position_ids=, "
                    "doc_ids=, attn_mask_startend_row_indices=), or build the plan with layout='chunks'")
        if sharded and layout.split.name not in sharded:
            raise ValueError(
                f"shard_sequence split this batch's tensors in the {sorted(sharded)} layout, the model's inputs are "
                f"split in the {layout.split.name!r} layout (the batch's documents decide it): give shard_sequence the "
                "document inputs the model gets (position_ids=, doc_ids=, attn_mask_startend_row_indices=)")

    def _bind(self, signature, args, kwargs):
        """(bound arguments, {name: value} of everything passed, the document-id input taken out)."""
        plan = self.plan
        named = {**{f"argument {i}": v for i, v in enumerate(args)}, **kwargs}
        extra = plan.documents if plan.documents != "position_ids" else None  # an input the layer does not take
        bound = signature.bind_partial(*args, **{k: v for k, v in kwargs.items() if k != extra})
        return bound, named, (kwargs.get(extra) if extra else None)


    def _choose(self, bound, named, doc_ids, batch, seq_len):
        """The Batch of this forward's inputs: its documents, layout and padding, checked the same over the ranks
        (every rank raises a refusal of its batch, before any other collective)."""
        plan, given = self.plan, _given(bound, self.signature)
        refusal = documents = stage = None
        try:  # checks that depend on this replica's batch: agreed over the ranks by the batch check
            positions = given.get("position_ids")
            if self.merging:
                refusal = (vision_language.documents_refusal(self.rule, self.top, given)
                           or vision_language.media_refusal(self.rule, self.top, given))
                if isinstance(positions, paddle.Tensor):
                    vision_language.position_split_dim(self.rule, positions, batch, seq_len)
            layout_of = self.rule.positions if self.rule is not None else None
            positions = vision_language.text_positions(positions, layout_of) if isinstance(positions, paddle.Tensor) else None
            documents = plan.documents_of(positions, doc_ids, given.get(_STARTEND))
            if documents is not None and documents.seq_len != seq_len:
                raise ValueError(f"the documents given cover {documents.seq_len} tokens, the input sequence {seq_len}: "
                                 "give position ids / document ids / row indices of the whole [batch, seq] input")
            split = runtime.installed.vision_splits.get(self.tower) if self.tower is not None else None
            if split is not None and self.merger is not None and split.merger is None:
                split.merge_with(self.merger)  # the family merges outside its tower (PaddleOCR-VL's projector)
            if split is not None and not isinstance(given.get("input_ids"), paddle.Tensor):
                raise ValueError(f"{type(self.top).__name__}'s vision tower is split by images, whose tokens paddle_cp "
                                 "finds in input_ids: pass input_ids (not inputs_embeds) to the model")
            pieces = vision_split.media_pieces(self.rule, self.top, given) if split and refusal is None else None
            if pieces:  # the vision tower's pieces placed with the language layout, both priced
                stage = vision_split.joint_stage(pieces, split, self.language, self.sep.layout.links,
                                                 self.sep.layout.ulysses, seq_len, self._feature_dtype())
            if self.pool is None:
                self.sep.layout.check_length(seq_len, what="input sequence")
                made = batch_context.split_alike(self.sep.groups.sep, plan, seq_len, documents)
                layout = made.layout if made is not None else plan.batch_layout(self.sep.layout, documents, stage)
            else:
                layout = self.pool.batch_layout(documents, batch, seq_len)
                _refuse_dense_masks(named.values(), seq_len)
            self._check_sharded(layout)
        except ValueError as error:
            refusal = error
        checked = {name: v for name, v in named.items() if isinstance(v, paddle.Tensor)} if self.merging else {
            name: v for name, v in named.items() if _of_batch(v, batch, seq_len)}
        self.check_batch(checked, batch, seq_len, refusal, read_now=documents is not None or self.merging)
        valid = _padding(given.get("attention_mask"), batch, seq_len)
        if self.pool is not None:
            return self.pool.batch(layout, documents, valid, batch, seq_len, run=self.sep)
        vision = None
        if stage is not None:
            groups = vision_split.layout_groups(layout, seq_len)
            ends = documents.end if documents is not None else np.full(seq_len, seq_len)
            placement = stage(groups, tile_counts(groups, ends, layout.ring))
            vision = vision_split.vision_layout(pieces, placement, groups, layout.ulysses, seq_len,
                                                self.sep.groups.sep.index, self._feature_dtype())
        return batch_context.Batch(layout, seq_len, documents, valid, self.sep.groups.sep, self.sep, plan,
                                   vision=vision)

    def split_inputs(self, layer, args, kwargs):
        batch, seq_len = _sequence_length(args, kwargs)
        if seq_len is None or runtime.state.context_parallel_paused:
            return None
        bound, named, doc_ids = self._bind(self.signature, args, kwargs)
        made = self._choose(bound, named, doc_ids, batch, seq_len)
        batch_context.record_split(made)
        if self.merging:  # the rest waits for the language model, after the merge
            self.merged = made
            batch_context.begin_merge(made)
            for name in self.rule.loss_inputs:
                if _split_dim(bound.arguments.get(name), seq_len) == 1:
                    bound.arguments[name] = made.layout.shard(bound.arguments[name], 1, made.group.index)
            return bound.args, bound.kwargs
        self._split(bound, self.signature, made, batch, seq_len)
        batch_context.publish(made)
        return bound.args, bound.kwargs

    def split_merged(self, layer, args, kwargs):
        """The language model's pre-hook on a model that merges: its inputs split in the batch chosen above."""
        made = self.merged
        if made is None or runtime.state.context_parallel_paused:
            return None
        signature = inspect.signature(layer.forward)
        bound = signature.bind_partial(*args, **kwargs)
        self._split(bound, signature, made, _sequence_length(args, kwargs)[0], made.seq_len)
        batch_context.publish(made)
        return bound.args, bound.kwargs

    def split_read_after(self, names, layer, args, kwargs):
        """Pre-hook of a sublayer the merging model calls after its language model: its inputs `names`, made
        from the whole batch, split in the batch's layout."""
        made = self.merged
        if made is None or runtime.state.context_parallel_paused:
            return None
        bound = inspect.signature(layer.forward).bind_partial(*args, **kwargs)
        for name in names:
            if _split_dim(bound.arguments.get(name), made.seq_len) == 1:
                bound.arguments[name] = made.layout.shard(bound.arguments[name], 1, made.group.index)
        return bound.args, bound.kwargs

    def _split(self, bound, signature, made, batch, seq_len):
        """Split `bound`'s arguments in `made`'s layout, in place: [batch, seq, ...] tensors on dim 1, dense masks'
        rows, a vision-language model's rope indices and rows; the global positions where none are given."""
        layout, pool, rule = made.layout, self.pool, self.rule
        index, given = made.group.index, _given(bound, signature)
        rows = {name: vision_language.local_rows(given[name], given[mask], layout, index)
                for name, mask in (rule.rows.items() if rule is not None else ()) if given.get(name) is not None}

        def split(value, name=None):
            if name == _STARTEND:
                return None  # the attention applies it, from `documents`
            if name in rows:
                return rows[name]
            if rule is not None and name in rule.shifted and _split_dim(value, seq_len + 1) == 1:
                return vision_language.local_shifted(value, layout, index)
            if rule is not None and name == "position_ids" and isinstance(value, paddle.Tensor):
                dim = vision_language.position_split_dim(rule, value, batch, seq_len)
            elif name == "cache_position" and isinstance(value, paddle.Tensor) and list(value.shape) == [seq_len]:
                dim = 0
            else:
                dim = _split_dim(value, seq_len)
            if dim is None:
                return value
            return layout.shard(value, dim, index) if pool is None else layout.shard(pool.joined(value, batch), 1, index)

        for name, value in bound.arguments.items():
            kind = signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                bound.arguments[name] = {key: split(v, key) for key, v in value.items()}
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                bound.arguments[name] = tuple(split(v) for v in value)
            else:
                bound.arguments[name] = split(value, name)
        if "position_ids" not in signature.parameters or bound.arguments.get("position_ids") is not None:
            return
        if pool is not None:  # one row: the joined sequence, each token's place in its row
            positions = row_positions(layout, batch, seq_len, index)[1]
            bound.arguments["position_ids"] = paddle.to_tensor(positions, dtype="int64").unsqueeze(0)
            return
        positions = self._positions_of(layout, seq_len, index, made.documents)
        positions = positions.unsqueeze(0).expand([batch, positions.shape[0]])  # [b, s_local]
        if rule is not None and rule.positions == "3bs":
            positions = positions.unsqueeze(0).expand([3, *positions.shape])  # [3, b, s_local]
        elif rule is not None:
            positions = positions.unsqueeze(-1).expand([*positions.shape, 3])  # [b, s_local, 3]
        bound.arguments["position_ids"] = positions

    def _positions_of(self, layout, seq_len, index, documents):
        """Global positions of this rank's tokens on the device: copied in once per length (a batch's
        documents decide its own)."""
        if documents is not None:
            return paddle.to_tensor(layout.positions(seq_len, index), dtype="int64")
        if self._positions[0] != (seq_len, index):
            self._positions = ((seq_len, index), paddle.to_tensor(layout.positions(seq_len, index), dtype="int64"))
        return self._positions[1]

    def forget_batch(self, layer, inputs, outputs):
        if runtime.state.context_parallel_paused:
            return
        if self.merging:
            if self.merged is not None:
                batch_context.end_merge()
            self.merged = None
        else:
            batch_context.retract()

    def forget_merged(self, layer, inputs, outputs):
        if self.merged is not None and not runtime.state.context_parallel_paused:
            batch_context.retract()


class ContextParallel(_SepPlan):
    """The token mixing of this layer (and its sublayers) runs across `sep`: softmax attention
    (ring for `p2p`, Ulysses for `all2all`, both for `hybrid`) through calls of
    `paddle.nn.functional.scaled_dot_product_attention` made while the layer runs and
    PaddleFormers' attention functions (any `_attn_implementation`) called for the layer or a
    sublayer (attention/dispatch/routing.py); linear attention (Gated DeltaNet: state passing, head
    all-to-all or both) and Conv1D over the sequence (halo) in the sublayers the mixer registry
    claims (attention/mixers/). A forward that ends without any of them raises.
    `rotate`: how ring members exchange k/v: 'planned' (default: only the rows each member's tiles read,
    straight from their owner, the next step's in flight during compute) or 'allgather' (whole blocks in one
    all-gather, gradients in one reduce-scatter; attention/algorithms/rotation.py says when)."""

    def __init__(self, backend="p2p", ulysses_degree=None, rotate="planned"):
        super().__init__(backend, ulysses_degree)
        self.rotate = check_rotation(rotate)

    def check(self, layer, mesh, param_names=()):
        layout = super().check(layer, mesh, param_names)
        if vision_language.tower_rule(layer) is None:  # a vision tower's attention stays inside its pieces
            mixers.check(layer, layout)

    def apply(self, layer, dims, param_names=()):
        run = self._join_sep_group(layer, dims, param_names)
        rule = vision_language.tower_rule(layer)
        if rule is not None:  # split by images: plans/vision_split.py
            vision_split.VisionSplitRun(rule.vision, layer, run)
            return None
        mixers.route(layer, run)
        layer.register_forward_pre_hook(lambda layer, inputs: routing.enter(run, layer))
        return layer.register_forward_post_hook(lambda layer, inputs, outputs: routing.leave(layer), always_call=True)


class TokenWise(Plan):
    """Declares the keyed layer (and its sublayers) free of mixing along the split sequence, so that
    parallelize does not refuse it: e.g. a Conv1D over channels, or an attention module that attends
    over something other than the sequence. Changes nothing in the layer."""

    def check(self, layer, mesh, param_names=()):
        refuse_param_plan(self, param_names)

    def apply(self, layer, dims, param_names=()):
        return None
