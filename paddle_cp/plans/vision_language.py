"""Vision-language models under PrepareContextParallel: the sequence is split where the merged embeddings enter
the language model, not at the top model's inputs.

A vision-language model runs its vision tower over every image's patches, scatters the features into the token
embeddings at the image and video placeholder positions of the whole sequence, computes 3-D rope indices over the
whole sequence, then calls its language model with `inputs_embeds`. Splitting `input_ids` first would separate
the placeholders from their features, so PrepareContextParallel on such a model (keyed on the top model, or on the
inner model that merges) chooses the batch's layout from the top's inputs and splits there only what is read
after the language model (the labels); the language model's own inputs (the merged embeddings, the rope indices
in the family's layout, padding, per-token side inputs and rows kept for the image tokens) are split when it is
called. Keyed on the language model itself, its inputs are split as a text model's, rope indices included.

A family is one `VisionLanguage` rule, registered by its library's integration (`register_vision_language`):
where its language model sits, the layout of its rope indices, which inputs hold rows per image token, and how
its placeholders are counted, which the top's inputs are checked against before any collective. A model whose
forward takes pixel values and that no rule claims is refused: its merge is unknown.

Costs: one host read per batch of `input_ids` and the grids (the checks; the model's own rope index and merge
read them too), and one of each rows input's mask where a family has one (Qwen3-VL's deepstack rows).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import numpy as np
import paddle

from .. import runtime

POSITION_LAYOUTS = {
    "3bs": "[3, batch, seq] (or [4, batch, seq], text positions first)",
    "bs3": "[batch, seq, 3]",
}
MEDIA_INPUTS = ("pixel_values", "pixel_values_videos", "images")  # what a vision-language forward takes


@dataclass(frozen=True)
class Media:
    """One kind of media a family's top model takes: its patches, their grids, and its placeholder token."""

    kind: str  # "image" or "video"
    pixels: str  # the input of its patch rows ([patches, ...])
    grids: str  # the input of its [n, 3] grids (t, h, w patches each)
    token: str  # the config attribute naming its placeholder id
    frames: str = None  # the config attribute of how many frames merge into one token (rounded up); None: one


IMAGES = Media("image", "pixel_values", "image_grid_thw", "image_token_id")
VIDEOS = Media("video", "pixel_values_videos", "video_grid_thw", "video_token_id")


@dataclass(frozen=True)
class VisionLanguage:
    """A vision-language family as PrepareContextParallel splits it.

    `package`: the module prefix of its classes; `merges`: {class name: the sublayer name of its language model
    under it} for each class whose forward merges the features (the top model, and the inner model Paddle's
    spelling keys); `language_models`: its language model classes; `positions`: the layout of its rope indices
    (POSITION_LAYOUTS); `loss_inputs`: top-model inputs read after the language model (split where the batch is
    chosen); `rows`: {language-model input: the [batch, seq] bool input whose True positions, row-major, its rows
    ([n, ...], or a list of such) belong to}; `media`: the media its top model takes; `merge`: the config path of
    how many patches a side merge into one token; `shifted`: language-model inputs [batch, seq + 1] holding each
    token's value then one more (ERNIE-VL's token types, the last its last label's), split by `local_shifted`;
    `after_language_model`: {sublayer path under the merging model: its [batch, seq] inputs} that the merging
    model makes from its whole inputs and hands, after the language model, to those sublayers with this rank's
    hidden states (ERNIE-VL's head and loss get the labels' token types), split in the batch's layout when
    called; `documents`: whether its top model hands `attn_mask_startend_row_indices` on (a model that drops
    them attends across packed documents on one card: refused, not confined); `refused`: {config attribute: (the
    value the split reproduces one card with, why another is refused)}, checked at parallelize; `vision`: its
    vision tower (a plans/vision_split.py VisionTower), which ContextParallel splits by images, called on the media
    in `media`'s order."""

    package: str
    merges: dict
    language_models: tuple
    positions: str = "3bs"
    loss_inputs: tuple = ("labels",)
    rows: dict = field(default_factory=dict)
    media: tuple = (IMAGES, VIDEOS)
    merge: str = "vision_config.spatial_merge_size"
    shifted: tuple = ()
    after_language_model: dict = field(default_factory=dict)
    documents: bool = True
    refused: dict = field(default_factory=dict)
    vision: object = None

    def __post_init__(self):
        if self.positions not in POSITION_LAYOUTS:
            raise ValueError(f"VisionLanguage positions={self.positions!r}: use one of {sorted(POSITION_LAYOUTS)}")

    def claims(self, layer, names):
        cls = type(layer)
        return cls.__module__.startswith(self.package) and cls.__name__ in names

    def language_model(self, layer):
        """The language model under `layer`, a class of `merges`."""
        return layer.get_sublayer(self.merges[type(layer).__name__])

    def vision_tower(self, layer):
        """The vision tower under `layer`, a class of `merges`, and its merger where the family merges outside it
        (None: the rule names none)."""
        if self.vision is None:
            return None, None
        tower = next((sub for sub in layer.sublayers() if self.claims(sub, self.vision.classes)), None)
        merger = next((sub for sub in layer.sublayers() if self.claims(sub, self.vision.merger)), None)
        return tower, merger

    def config_value(self, layer, path):
        value = getattr(layer, "config", None)
        for part in path.split("."):
            value = getattr(value, part, None)
        return value


def register_vision_language(rule):
    """Split the sequence of `rule`'s models (a VisionLanguage) after their merge from now on."""
    if not isinstance(rule, VisionLanguage):
        raise TypeError(f"register_vision_language takes a VisionLanguage, got {type(rule).__name__}")
    if rule not in runtime.installed.vision_language:
        runtime.installed.vision_language.append(rule)


def merging_rule(layer):
    """The rule of a model whose forward merges image features into its embeddings, else None."""
    return next((rule for rule in runtime.installed.vision_language if rule.claims(layer, rule.merges)), None)


def language_model_rule(layer):
    """The rule of a vision-language model's language model, else None."""
    return next((rule for rule in runtime.installed.vision_language if rule.claims(layer, rule.language_models)),
                None)


def tower_rule(layer):
    """The rule of a vision-language model's vision tower, else None."""
    return next((rule for rule in runtime.installed.vision_language
                 if rule.vision is not None and rule.claims(layer, rule.vision.classes)), None)


def check_known(layer):
    """Refuse PrepareContextParallel on a model that takes pixel values with no rule for its merge."""
    if merging_rule(layer) is not None:
        return
    taken = [name for name in MEDIA_INPUTS if name in inspect.signature(layer.forward).parameters]
    if taken:
        raise ValueError(
            f"{type(layer).__name__} takes {taken}: a vision-language model, whose image features are merged into "
            "the token embeddings over the whole sequence, and paddle_cp has no rule for where its sequence can be "
            "split after that merge. Key PrepareContextParallel on its language model (the decoder it calls with "
            "inputs_embeds) and split the labels with pcp.shard_sequence(labels, backend=<that plan>), or register "
            "the family's rule: pcp.register_vision_language(pcp.VisionLanguage(...)) (docs/vision_language.md)")


def check_config(layer):
    """Refuse a vision-language model (or its language model) whose config sets what its rule's split does not
    reproduce one card with."""
    rule = merging_rule(layer) or language_model_rule(layer)
    for path, (supported, why) in (rule.refused.items() if rule is not None else ()):
        value = rule.config_value(layer, path)
        if value != supported:
            raise ValueError(f"{type(layer).__name__} has {path}={value!r}: {why}. Train it with {path}={supported!r} "
                             "under context parallelism")


def position_split_dim(rule, value, batch, seq_len):
    """The dim a language model's rope indices are split on, after checking their layout."""
    shape = list(value.shape)
    if value.ndim == 2 and shape == [batch, seq_len]:
        return 1
    if rule.positions == "3bs" and value.ndim == 3 and shape[0] in (3, 4) and shape[1:] == [batch, seq_len]:
        return 2
    if rule.positions == "bs3" and value.ndim == 3 and shape == [batch, seq_len, 3]:
        return 1
    raise ValueError(
        f"position_ids of shape {shape} reached a vision-language language model whose rope indices are "
        f"{POSITION_LAYOUTS[rule.positions]} for a batch of {batch} x {seq_len} tokens: pass the rope indices of "
        "the whole batch in that layout (the model's own get_rope_index makes them), or none")


def text_positions(position_ids, layout=None):
    """The [batch, seq] text positions of rope indices (documents restart them at 0) in `layout` (POSITION_LAYOUTS;
    None: as their shape tells, a [b, s, 3] batch of 3 or 4 rows read as [3 | 4, b, s])."""
    if position_ids.ndim != 3:
        return position_ids
    if layout == "bs3" or (layout is None and position_ids.shape[-1] == 3 and position_ids.shape[0] not in (3, 4)):
        return position_ids[:, :, 0]  # [b, s, 3]
    return position_ids[0]  # [3 | 4, b, s]: the temporal (or text) row


def local_rows(rows, mask, layout, index):
    """The rows of this rank's True positions of `mask` ([batch, seq] bool, whole), in local order: `rows`
    ([n, ...] for the n True positions, row-major) or a list of such."""
    flags = mask.numpy().astype(bool)
    seq_len = flags.shape[1]
    rank_of = np.cumsum(flags.reshape(-1)).reshape(flags.shape) - 1  # each True position's row
    mine = layout.positions(seq_len, index)
    held = flags[:, mine]  # [b, local]
    keep = paddle.to_tensor(rank_of[:, mine][held].astype(np.int64))

    def select(value):
        return paddle.index_select(value, keep, axis=0)

    return [select(value) for value in rows] if isinstance(rows, (list, tuple)) else select(rows)


def local_shifted(value, layout, index):
    """This rank's part of a [batch, seq + 1] input holding each token's value then one more: its tokens' values,
    then each row's largest value over the whole row, so that what the language model decides from the whole
    tensor (ERNIE-VL's decoder layers: whether any token is an image's, which picks the experts every token may
    go to) it decides on every rank as on one card. Its `[..., 1:]` is not this rank's labels' values (chunks
    are not contiguous): a family whose language model reads that gets them split by `after_language_model`."""
    own = layout.shard(value[:, :-1], 1, index)
    return paddle.concat([own, value.max(axis=1, keepdim=True).astype(own.dtype)], axis=1)


def documents_refusal(rule, layer, inputs):
    """The ValueError that packed documents reach a top model that drops them, else None."""
    if rule.documents or inputs.get("attn_mask_startend_row_indices") is None:
        return None
    return ValueError(
        f"{type(layer).__name__} takes attn_mask_startend_row_indices in **kwargs and hands them to nothing: on "
        "one card its packed documents attend across each other, which paddle_cp would not reproduce (it confines "
        "attention to each document). Pass the documents as a dense attention_mask [batch, 1, seq, seq] (True "
        "where a query sees a key), which the model uses, or one document per row")


def _features(grid, merge, frames):
    """Tokens each [t, h, w] grid row merges into: ceil(t / frames) x h x w / merge^2."""
    return (-(-grid[:, 0] // frames)) * grid[:, 1] * grid[:, 2] // (merge * merge)


def media_refusal(rule, layer, inputs):
    """The ValueError that a batch's media disagree (grids with patch rows, placeholders with features), else
    None; one host read of the ids and the grids."""
    ids = inputs.get("input_ids")
    given = [media for media in rule.media if inputs.get(media.pixels) is not None]
    if not isinstance(ids, paddle.Tensor) or not given:
        return None
    merge = rule.config_value(layer, rule.merge) or 1
    features = {}  # placeholder id -> (features its media make, their kinds)
    for media in given:
        if inputs.get(media.grids) is None:
            return ValueError(f"{media.pixels} given without {media.grids}: pass each {media.kind}'s grid (t, h, w "
                              "patches) as the processor returns it")
        grid = np.asarray(inputs[media.grids].numpy(), np.int64).reshape(-1, 3)
        patches, rows = int(grid.prod(axis=1).sum()), inputs[media.pixels].shape[0]
        if patches != rows:
            return ValueError(
                f"{media.grids} {grid.tolist()} makes {patches} patches (t x h x w summed) but {media.pixels} holds "
                f"{rows} patch rows: pass the grids and pixel values the processor made together")
        frames = rule.config_value(layer, media.frames) if media.frames else 1
        count, kinds, _ = features.get(rule.config_value(layer, media.token), (0, (), None))
        formula = f"{'t' if frames == 1 else f'ceil(t / {frames})'} x h x w / {merge * merge}"
        features[rule.config_value(layer, media.token)] = (count + int(_features(grid, merge, frames).sum()),
                                                           kinds + (media.kind,), formula)
    ids = ids.numpy()
    for token, (expected, kinds, formula) in features.items():
        found = int((ids == token).sum())
        if found != expected:
            return ValueError(
                f"input_ids hold {found} placeholder tokens (id {token}) but the {' and '.join(kinds)} grids make "
                f"{expected} features ({formula}, summed): give each {kinds[0]} as many placeholder "
                "tokens as its grid merges into (its processor expands one placeholder per feature), or the grids of "
                "the media in this batch")
    return None
