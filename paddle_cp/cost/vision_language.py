"""What a vision-language batch adds to a layout's per-rank cost (pure functions, no Paddle): the vision tower run
whole on every rank (`whole`: PrepareContextParallel alone) or split over the sep ranks by images (`split`:
ContextParallel on the tower too, plans/vision_split.py, laid out as cost/vision_split.py reads it), and the merge
of its features into the language model's embeddings, which runs on the whole sequence in both.

Per sequence of a micro-batch, on one rank (the busiest: the most patches; `exchange_bytes` the busiest sender or
receiver):
- vision_activations: the tower's held bytes (vision_tower.tower_bytes) over every patch (whole) or the rank's
  pieces (split), the tower recomputed under the layout's full recomputation (its vision_config must say so too:
  plan/config.py writes it);
- features: the merged features [tokens, out_hidden] in the language model's dtype, transient in the forward and
  their gradients in the tower's backward: every one (whole); the rank's pieces', those it receives, and the
  whole-sized buffer the split rebuilds for the model's merge (split);
- merge: what the merge keeps for its backward, measured: masked_scatter's int64 index and its bool placeholder mask
  over the whole [seq, hidden] embeddings, per kind of media present (images, videos), on every rank;
- inputs_embeds: the merged [seq, hidden] embeddings, whole on every rank, alive during the language model's
  forward, and the size of their gradient in the tower's backward;
- pixel_values: the batch's patches in fp32 as the processor makes them, every rank passing the whole batch;
- batch_check: PrepareContextParallel's check that every rank passed the same batch, at the top model's forward
  (plans/same_batch.py), fingerprints the pixel values (comm/fingerprint.py) a chunk of FINGERPRINT_CHUNK elements
  at a time: the chunk's bits as int64 and FINGERPRINT_TEMPORARIES int64 temporaries of it (measured: 10 int64
  tensors of the values' size on a video below the chunk, within 1%), transient, before the tower;
- exchange_bytes (split): the features of positions a rank holds that another computed, in the language model's
  dtype, forward, and their gradients back the same size, backward (one all-to-all each way).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .attention import FP32
from .vision_split import split_layout
from .vision_tower import KERNELS, tower_bytes

MODES = ("whole", "split")
MERGE_BYTES = 8 + 1  # per embedding element and kind of media: masked_scatter's int64 index, the bool mask
FINGERPRINT_CHUNK = 1 << 20  # elements comm/fingerprint.py walks at a time (its _CHUNK)
FINGERPRINT_TEMPORARIES = 9  # int64 chunk-sized tensors alive at once as it does (measured)
INT64 = 8


@dataclass(frozen=True)
class VisionBatch:
    """Each sequence's media (vision_shape.Media, in the sequence's order), the tower's mode (MODES) and the kernel
    its attention runs (vision_tower.KERNELS: flash on a GPU, eager as PaddleFormers runs it on CPU)."""

    media: tuple = field(default=())
    mode: str = "whole"
    kernel: str = "flash"
    # what it computed for a layout, kept: the planner asks again for every layout of one shape
    _memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "media", tuple(self.media))
        if self.mode not in MODES:
            raise ValueError(f"vision mode {self.mode!r}: use one of {MODES}")
        if self.kernel not in KERNELS:
            raise ValueError(f"vision attention kernel {self.kernel!r}: use one of {KERNELS}")

    def with_mode(self, mode):
        return VisionBatch(self.media, mode, self.kernel)

    def split(self, model, layout, seq, elem):
        """The VisionSplit (cost/vision_split.py) of one sequence over the layout's sep ranks; None when the tower
        runs whole (or on one rank)."""
        if self.mode == "whole" or layout.cp == 1 or not self.media:
            return None
        key = ("split", model, seq, layout.ring, layout.ulysses, elem)
        if key not in self._memo:
            self._memo[key] = split_layout(model, self.media, seq, layout.ring, layout.ulysses, elem)
        return self._memo[key]

    def tower(self, vision, computed, elem, fused_norm, recompute, split):
        """vision_tower.tower_bytes of the media `computed`, under this batch's kernel; the tower reads a copy of
        the pixel rows below fp32 (the model's cast) and under the `split` (a rank's rows selected)."""
        key = ("tower", vision, computed, elem, fused_norm, recompute, split)
        if key not in self._memo:
            self._memo[key] = tower_bytes(vision, computed, elem, fused_norm, self.kernel, recompute,
                                          own_pixels=split or elem < FP32)
        return self._memo[key]

    def computed(self, model, layout, seq, elem):
        """The media the busiest rank's tower computes: every one (whole), or its pieces (split)."""
        split = self.split(model, layout, seq, elem)
        return self.media if split is None else split.busiest()


def batch_check_bytes(pixel_bytes):
    """The batch check's transient over `pixel_bytes` of fp32 pixel values (a whole batch's: the module docstring)."""
    return INT64 * (1 + FINGERPRINT_TEMPORARIES) * min(pixel_bytes // FP32, FINGERPRINT_CHUNK)


def exchange_bytes(model, layout, seq, elem, batch):
    """Bytes the busiest rank moves for one sequence's features: forward, and their gradients back in backward."""
    split = batch.split(model, layout, seq, elem)
    most = max(max(split.received), max(split.sent)) if split is not None else 0
    return 2 * most * model.vision.out_hidden * elem


def vision_terms(model, layout, seq, elem, fused_norm, batch, recompute):
    """{term: bytes} per rank of one sequence of `seq` tokens carrying `batch.media` (the module docstring), the
    tower's `vision_rebuilt` (what its recomputation rebuilds at once) and `patches` (those it computes)."""
    vision = model.vision
    split = batch.split(model, layout, seq, elem)
    computed = batch.computed(model, layout, seq, elem)
    tower = batch.tower(vision, computed, elem, fused_norm, recompute, split is not None)
    kinds = len({item.kind for item in batch.media})
    features = sum(item.tokens(vision) for item in computed)
    if split is not None:  # what it receives, and the whole-sized buffer the model's merge takes
        features += max(split.received) + sum(item.tokens(vision) for item in batch.media)
    return {
        "vision_activations": tower["held"], "vision_rebuilt": tower["rebuilt"],
        "features": features * vision.out_hidden * elem,
        "merge": kinds * seq * model.hidden * MERGE_BYTES,
        "inputs_embeds": seq * model.hidden * elem,
        "pixel_values": sum(item.patches for item in batch.media) * vision.patch_pixels * FP32,
        "exchange_bytes": exchange_bytes(model, layout, seq, elem, batch),
        "patches": sum(item.patches for item in computed),
    }


NO_VISION = dict.fromkeys(("vision_activations", "vision_rebuilt", "features", "merge", "inputs_embeds",
                           "pixel_values", "exchange_bytes", "patches"), 0)
