"""The vision tower split by images: `"<vision tower>": ContextParallel(backend)` on a vision-language model.

Every rank runs the tower on its own pieces only (a piece: one temporal patch of an image or video, whose
attention, windows and merge windows stay inside it: every PaddleFormers family attends within one), and each
piece's merged features go, in one all-to-all, only to the ranks that hold its tokens in the language model's
layout; a rank computing features of its own tokens keeps them. The batch's layout is chosen for both stages at
once (cost/vision_layout.py): where its PrepareContextParallel chooses the language layout, each candidate is
priced with the vision pieces placed around it, the slowest rank of vision + language + the exchange.

The tower is called as on one card (its own code, on this rank's patch rows and their grids: `VisionTower`
names the inputs), then its output is rebuilt whole-sized for the model's merge: the features of this rank's
tokens at their rows, zeros at the others' (which the language model's split drops, so nothing reads them and
no gradient reaches them). A rank with no piece does not run the tower (its parameters get no gradient, which
the gradient reduction takes as zeros) and still takes part in the exchange. Backward sends each feature's
gradient back to the rank that computed it, the same way. A frozen tower (no gradient) works the same.

Costs, per call of the tower: the host computes the pieces from `input_ids` and the grids (read once a batch
for the media checks) and the placement (numpy); the device: one index_select of the patch rows, the tower on
them, one index_select of the rows to send, one all-to-all (variable sizes; bytes = exactly the features whose
tokens another rank holds, the minimum for the layout chosen; NCCL's one call, gloo N-1 ordered rounds), one
gather into the whole-sized buffer. Memory: this rank's pieces' activations, its features, and the transient
whole-sized buffer (zeros but for its tokens' rows, freed with the whole `inputs_embeds` once the language model
splits them).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace

import numpy as np
import paddle

from .. import runtime
from ..attention.dispatch import batch as batch_context
from ..comm import autograd as comm_autograd
from ..params import mark_fetch_unit, record_of
from ..cost.vision_layout import Pieces, StageShape, feature_row_ms, joint_placement, piece_ms, rank_of_positions

TAG = "vision_features"  # the exchange's bytes in paddle_cp.bytes_sent()
OUTPUTS = ("tensor", "with_deepstack", "pooler", "patches")


@dataclass(frozen=True)
class VisionTower:
    """A family's vision tower as the split calls it: its `classes` (names under the rule's package), the names
    of its patch-row input (`pixels`, its patches on dim `pixels_axis`) and grid input (`grid`, [n, 3]);
    `per_patch`: other inputs with a row per patch; `local_inputs(arguments, grids)`: sets the inputs the model
    derived from the whole grid for this rank's `grids` (numpy [k, 3]); `outputs`: what it returns ("tensor": the
    merged features; "with_deepstack": those and a list of deepstack features; "pooler": a model output whose
    `pooler_output` holds them; "patches": unmerged patch features, which the module of class `merger`, called
    next with them and the grid, merges); `windowed`: its blocks attend within windows of its config's
    `window_size` pixels but those in `fullatt_block_indexes` (Qwen2.5-VL), else every block within a piece."""

    classes: tuple
    pixels: str = "hidden_states"
    grid: str = "grid_thw"
    outputs: str = "tensor"
    windowed: bool = False
    pixels_axis: int = 0
    per_patch: tuple = ()
    local_inputs: object = None
    merger: tuple = ()

    def __post_init__(self):
        if self.outputs not in OUTPUTS:
            raise ValueError(f"VisionTower outputs={self.outputs!r}: use one of {list(OUTPUTS)}")
        if (self.outputs == "patches") != bool(self.merger):
            raise ValueError("VisionTower: outputs='patches' (unmerged features) goes with the merger that merges them")

    def documents(self, config, blocks, height, width):
        """The document lengths one h x w piece's attention sees in each of the tower's `blocks` (its `config`)."""
        whole = [height * width]
        if not self.windowed:
            return [whole] * blocks
        merge = config.spatial_merge_size
        side = config.window_size // merge // config.patch_size * merge  # a window's side, in patches
        rows = np.diff(np.minimum(np.arange(0, height + side, side), height))
        cols = np.diff(np.minimum(np.arange(0, width + side, side), width))
        windows = [int(r * c) for r in rows[rows > 0] for c in cols[cols > 0]]
        return [whole if block in config.fullatt_block_indexes else windows for block in range(blocks)]

    def features(self, output):
        """The feature tensors of the tower's (or its merger's) `output`, each [tokens, width]."""
        if self.outputs in ("tensor", "patches"):
            return [output]
        if self.outputs == "with_deepstack":
            return [output[0], *output[1]]
        return [output.pooler_output]

    def rebuilt(self, output, tensors):
        """`output` with its features replaced by `tensors` (None: the tower did not run here)."""
        if self.outputs in ("tensor", "patches"):
            return tensors[0]
        if self.outputs == "with_deepstack":
            return tensors[0], list(tensors[1:])
        output.pooler_output = tensors[0]
        return output


def tower_layers(tower):
    """The tower's blocks (the largest LayerList in it)."""
    lists = [layer for layer in tower.sublayers() if isinstance(layer, paddle.nn.LayerList)]
    return max(lists, key=len) if lists else []


def _matrices(layer):
    """The one-card shapes of `layer`'s 2-D weights (sharding level 3 leaves placeholders in the layer)."""
    return [shape for shape in (record_of(p).full_shape for p in layer.parameters()) if len(shape) == 2]


def _matmul_flops(layer):
    """Forward + backward FLOPs one token costs `layer`'s 2-D weights (6 x their elements)."""
    return 6.0 * sum(int(np.prod(shape)) for shape in _matrices(layer))


def feature_widths(tower, merger=None):
    """The widths of the features exchanged: the merger's output (its last weight's), else the tower's merged
    features and Qwen3-VL's deepstack ones."""
    if merger is not None:
        return [_matrices(merger)[-1][1]]
    config = tower.config
    return [config.out_hidden_size] * (1 + len(getattr(config, "deepstack_visual_indexes", None) or []))


def feature_row_bytes(widths, dtype):
    """The bytes one token's features take in the exchange: every width (feature_widths) in `dtype`."""
    return sum(widths) * paddle.empty([0], dtype=dtype).element_size()


def tower_shape(tower):
    """The tower's StageShape: its blocks, width and matmul FLOPs a patch."""
    blocks = tower_layers(tower)
    return StageShape(len(blocks), tower.config.hidden_size, _matmul_flops(blocks[0]) if len(blocks) else 0.0)


def language_shape(language_model):
    """The decoder's StageShape: its layers, attention width and matmul FLOPs a token."""
    layers = getattr(language_model, "layers", [])
    config = language_model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return StageShape(len(layers), heads * head_dim, _matmul_flops(layers[0]) if len(layers) else 0.0)


@dataclass
class MediaPieces:
    """One media kind's pieces in a batch: `grids[k]` (1, h, w) of piece k, `rows` [K + 1] its patch rows among
    the kind's pixel rows, `features` [K + 1] its feature rows, `positions[i]` the flat position (row x seq +
    column) feature i lands at (the kind's placeholders in row-major order, as the model's merge fills them)."""

    kind: str
    grids: np.ndarray
    rows: np.ndarray
    features: np.ndarray
    positions: np.ndarray


def media_pieces(rule, layer, given):
    """{kind: MediaPieces} of the media the batch holds (host reads of `input_ids` and the grids)."""
    ids = given["input_ids"].numpy().reshape(-1)
    merge = rule.config_value(layer, rule.merge) or 1
    found = {}
    for media in rule.media:
        if given.get(media.pixels) is None:
            continue
        grid = np.asarray(given[media.grids].numpy(), np.int64).reshape(-1, 3)
        frames = np.repeat(grid[:, 1:], grid[:, 0], axis=0)  # [K, 2]: each temporal patch's h, w
        patches = frames.prod(axis=1)
        token = rule.config_value(layer, media.token)
        found[media.kind] = MediaPieces(
            media.kind, np.concatenate([np.ones((len(frames), 1), np.int64), frames], axis=1),
            np.concatenate([[0], np.cumsum(patches)]), np.concatenate([[0], np.cumsum(patches // (merge * merge))]),
            np.flatnonzero(ids == token))
    return found


@dataclass
class VisionLayout:
    """A batch's vision split: its pieces of each kind and the rank each runs on, over the language layout's
    owner of each position; `index`: this rank. Made where the batch is chosen, read by the tower's calls (each
    media kind's, once)."""

    pieces: dict  # kind -> MediaPieces
    rank: dict  # kind -> int [K]
    owner: np.ndarray  # [seq_len] the rank holding each position
    seq_len: int
    index: int
    dtype: object  # what the features are exchanged in: the language model's embeddings' (the merge's)
    called: set = field(default_factory=set)
    merging: tuple = None  # (kind, this rank's pieces) between a tower call and its merger's (VisionTower.merger)

    def kind_of_call(self, rows):
        """The media kind a tower call on `rows` patch rows is for: the first not yet called whose pixels have as
        many rows (the model calls each kind once, in its media order)."""
        for kind, pieces in self.pieces.items():
            if kind not in self.called and pieces.rows[-1] == rows:
                self.called.add(kind)
                return kind
        raise ValueError(f"the vision tower was called on {rows} patch rows, which no media kind of this batch "
                         f"holds ({ {k: int(p.rows[-1]) for k, p in self.pieces.items()} }): paddle_cp splits the "
                         "tower's calls the model makes on the batch's own pixel values")

    def destinations(self, kind):
        """int [features]: the rank that holds each feature's token."""
        return self.owner[self.pieces[kind].positions % self.seq_len]

    def feature_ranks(self, kind):
        """int [features]: the rank computing each feature."""
        pieces = self.pieces[kind]
        return np.repeat(self.rank[kind], np.diff(pieces.features))


class VisionSplitRun:
    """The split of one vision tower: its forward replaced by one on this rank's pieces, then the exchange (after
    its `merger`'s forward, replaced too, where the family merges outside the tower)."""

    def __init__(self, tower_spec, layer, sep_run):
        self.spec, self.layer, self.sep = tower_spec, layer, sep_run
        self.merger = None
        self.original, self.signature = layer.forward, inspect.signature(layer.forward)
        self.widths = feature_widths(layer) if not tower_spec.merger else None
        self.shape = tower_shape(layer)
        runtime.installed.vision_splits[layer] = self
        # whether it runs on a rank depends on the batch: sharding level 3 fetches its parameters around the tower
        # (whose hooks run on every rank), and its gradients are reduced in step(), not during backward
        mark_fetch_unit(layer)
        layer.forward = self.forward

    def merge_with(self, merger):
        """The family's merger (`VisionTower.merger`), found under the model that merges."""
        self.merger, self.merge_original = merger, merger.forward
        self.widths = feature_widths(self.layer, merger)
        merger.forward = self.merge

    def forward(self, *args, **kwargs):
        vision = _vision_split()
        if vision is None:
            return self.original(*args, **kwargs)
        bound = self.signature.bind(*args, **kwargs)
        arguments, spec = bound.arguments, self.spec
        kind = vision.kind_of_call(arguments[spec.pixels].shape[spec.pixels_axis])
        pieces, mine = vision.pieces[kind], np.flatnonzero(vision.rank[kind] == vision.index)
        output = None
        if len(mine):
            rows = paddle.to_tensor(np.concatenate([np.arange(pieces.rows[k], pieces.rows[k + 1]) for k in mine]))
            arguments[spec.pixels] = paddle.index_select(arguments[spec.pixels], rows, axis=spec.pixels_axis)
            arguments[spec.grid] = paddle.to_tensor(pieces.grids[mine], dtype=arguments[spec.grid].dtype)
            for name in spec.per_patch:
                if isinstance(arguments.get(name), paddle.Tensor):
                    arguments[name] = paddle.index_select(arguments[name], rows, axis=0)
            if spec.local_inputs is not None:
                spec.local_inputs(arguments, pieces.grids[mine])
            output = self.original(*bound.args, **bound.kwargs)
        if spec.merger:  # its merger merges this rank's patch features next, then exchanges
            vision.merging = (kind, mine)
            return output if output is not None else _NotRun()
        return self._exchanged(output, vision, kind, mine)

    def merge(self, features, grid):
        vision = _vision_split()
        if vision is None or vision.merging is None:
            return self.merge_original(features, grid)
        (kind, mine), vision.merging = vision.merging, None
        output = None
        if len(mine):
            features = getattr(features, "last_hidden_state", features)
            output = self.merge_original(features, paddle.to_tensor(vision.pieces[kind].grids[mine], dtype=grid.dtype))
        return self._exchanged(output, vision, kind, mine)

    def _exchanged(self, output, vision, kind, mine):
        """The whole-sized output of this rank's `output` (None: no piece ran here) after the exchange."""
        if output is not None:
            local = self.spec.features(output)
        else:  # no piece here: nothing to run, but its exchange joins the others' backward as theirs joins its own
            trained = self.layer.parameters() + (self.merger.parameters() if self.merger is not None else [])
            frozen = all(p.stop_gradient for p in trained)  # then no rank's exchange has a backward
            local = [paddle.zeros([0, width], dtype=vision.dtype) for width in self.widths]
            for empty in local:
                empty.stop_gradient = frozen
        whole = exchanged(local, vision, kind, self.sep.groups.sep)
        if output is not None or self.spec.outputs != "pooler":
            return self.spec.rebuilt(output, whole)
        return _NotRun(pooler_output=whole[0])


class _NotRun:
    """What a tower call gives on a rank with no piece, where the model reads its output's fields."""

    def __init__(self, pooler_output=None):
        self.pooler_output, self.last_hidden_state = pooler_output, None


def _vision_split():
    """The VisionLayout of the batch merging now, or None (no split, or check_parity's one-card forward)."""
    batch = batch_context.merging()
    if batch is None or runtime.state.context_parallel_paused:
        return None
    return batch.vision


def exchanged(local, vision, kind, group):
    """The whole-sized features of `kind` from this rank's `local` ones ([its pieces' features, width] each, in
    feature order): each sent, in one all-to-all, to the rank holding its token; rows of tokens other ranks hold
    are zeros here."""
    widths = [t.shape[1] for t in local]
    packed = paddle.concat(local, axis=1) if len(local) > 1 else local[0]  # [mine, sum of widths]
    if packed.dtype != vision.dtype:  # one dtype on every rank (autocast's features, a rank with none)
        packed = packed.astype(vision.dtype)
    destinations, computed_by = vision.destinations(kind), vision.feature_ranks(kind)
    mine = np.flatnonzero(computed_by == vision.index)  # ascending feature order: the tower's output order
    send_to = destinations[mine]
    order = np.argsort(send_to, kind="stable")
    sizes = np.bincount(send_to, minlength=group.size)
    here = destinations == vision.index
    received = np.concatenate([np.flatnonzero(here & (computed_by == source)) for source in range(group.size)])
    receive_sizes = [int((here & (computed_by == source)).sum()) for source in range(group.size)]
    rows = paddle.index_select(packed, paddle.to_tensor(order), axis=0) if len(order) else packed
    rows = comm_autograd.all_to_all(rows, group, 0, 0, sizes.tolist(), receive_sizes, tag=TAG)  # [held here, W]
    # [features, W]: each feature's row among those received, or a zero row; a gather even where none arrived, so
    # that every rank's backward runs the exchange's (a rank leaving it out would leave the others waiting there)
    source = np.full(len(destinations), len(received), np.int64)
    source[received] = np.arange(len(received))
    padded = paddle.concat([rows, paddle.zeros([1, packed.shape[1]], dtype=packed.dtype)])
    whole = paddle.index_select(padded, paddle.to_tensor(source), axis=0)
    return paddle.split(whole, widths, axis=1) if len(widths) > 1 else [whole]


def layout_groups(layout, seq_len):
    """int [seq_len]: the ring group holding each position under `layout` (a SequenceLayout)."""
    groups = np.empty(seq_len, np.int64)
    for group in range(layout.ring):
        groups[layout.group_positions(seq_len, group)] = group
    return groups


def joint_stage(pieces, split, language, links, ulysses, seq_len, dtype):
    """packed_layout.choose's `joint` for a batch's vision `pieces` ({kind: MediaPieces}) of the tower `split` (a
    VisionSplitRun): `(groups, counts)` of a language candidate -> the pieces' VisionPlacement around it
    (cost/vision_layout.py), every kind's pieces in `pieces`' order; `language`: the decoder's StageShape, `links`
    the ring's LinkCost, `dtype` the features' in the exchange."""
    vision = replace(split.shape, row_bytes=feature_row_bytes(split.widths, dtype))
    grids = np.concatenate([p.grids for p in pieces.values()])
    costs = np.array([piece_ms(split.spec.documents(split.layer.config, vision.layers, int(h), int(w)), int(h * w),
                               vision) for _, h, w in grids])
    sizes = np.concatenate([np.diff(p.features) for p in pieces.values()])
    positions = np.concatenate([p.positions for p in pieces.values()])
    stacked = Pieces(costs, np.concatenate([[0], np.cumsum(sizes)]), positions, seq_len)
    row_ms = feature_row_ms(links, ulysses, vision.row_bytes)
    return lambda groups, counts: joint_placement(stacked, groups, counts, ulysses, language, row_ms)


def vision_layout(pieces, placement, groups, ulysses, seq_len, index, dtype):
    """The VisionLayout of `pieces` placed by `placement` (a VisionPlacement, kinds in `pieces`' order) under the
    language layout whose ring group of each position is `groups`; features exchanged in `dtype`."""
    rank, start = {}, 0
    for kind, kind_pieces in pieces.items():
        rank[kind] = placement.rank[start:start + len(kind_pieces.grids)]
        start += len(kind_pieces.grids)
    return VisionLayout(pieces, rank, rank_of_positions(groups, ulysses), seq_len, index, dtype)
