"""Which layers run on which pipeline stage, from Paddle's `split_spec` and `global_spec`.

A *unit* is a sublayer that holds no split layer and whose parent does (or is the
root): for PaddleFormers Llama split at `model.layers`, the units are
`model.embed_tokens`, `model.layers.0`, ..., `model.norm`, `model.rotary_emb`,
`lm_head`, `criterion`. Containers (`model`, `model.layers`) run on every stage;
their code between units is cheap glue. Units take virtual stages in
registration order (Paddle's rule): units before the first split point belong
to stage 0, after the last to the last stage. `global_spec` units run everywhere.
With v chunks per rank there are p * v virtual stages; virtual stage j lives on
rank j % p.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from paddle.distributed.auto_parallel.intermediate.pipeline_parallel import SplitPoint


@dataclass(frozen=True)
class StagePlan:
    """`units`: [(name, layer, virtual stage or None for global)] in registration order."""

    units: tuple
    stages: int
    chunks: int

    @property
    def virtual_stages(self):
        return self.stages * self.chunks

    def rank_of(self, virtual):
        return virtual % self.stages

    def exit_unit(self, virtual):
        """The last unit of a virtual stage: its output is what the next one receives."""
        return [layer for _, layer, v in self.units if v == virtual][-1]


def _split_layers_from_prefix(names, prefix):
    pattern = re.compile(rf"{re.escape(prefix)}\.\d+")
    matched = [n for n in names if pattern.fullmatch(n)]
    if not matched:
        raise ValueError(f"pp_config split_spec {prefix!r} matches no layer named '{prefix}.<int>': "
                         f"use the prefix of the repeated layers, e.g. one of {_layer_lists(names)}")
    return matched


def _layer_lists(names):
    return sorted({m.group(1) for n in names for m in [re.fullmatch(r"(.+)\.\d+", n)] if m})[:5]


def _even_ends(layers, parts, chunks, stages):
    """Split points (END) cutting `layers` into `parts` virtual stages: stage s gets L // p layers plus
    one if s < L % p (Paddle's rule), and each of its `chunks` chunks an equal share of those."""
    per_stage = [len(layers) // stages + (1 if s < len(layers) % stages else 0) for s in range(stages)]
    if min(per_stage) == 0:
        raise ValueError(f"pp_config: {len(layers)} layers cannot fill {stages} pipeline stages: "
                         "use a mesh with at most as many 'pp' ranks as layers")
    if any(n % chunks for n in per_stage):
        raise ValueError(f"pp_config vpp_degree={chunks} must divide the layers of every stage {per_stage}: "
                         "choose a vpp_degree dividing each, or another number of layers")
    sizes = [per_stage[j % stages] // chunks for j in range(parts)]
    ends, at = [], -1
    for size in sizes[:-1]:
        at += size
        ends.append(layers[at])
    return ends


def _is_split_point(value, name):
    for point in (SplitPoint.END, SplitPoint.BEGINNING):
        if value is point or getattr(value, "name", None) == point.name:
            return point
    raise ValueError(f"pp_config split_spec[{name!r}] must be SplitPoint.END or SplitPoint.BEGINNING, got {value!r}")


def build_stage_plan(model, split_spec, global_spec, stages, chunks):
    """The StagePlan; ValueError (naming the fix) for specs that match nothing or leave a stage empty."""
    named = [(n, l) for n, l in model.named_sublayers()]
    names = [n for n, _ in named]
    parts = stages * chunks
    if isinstance(split_spec, str):
        split_layers = _split_layers_from_prefix(names, split_spec)
        points = {name: SplitPoint.END for name in _even_ends(split_layers, parts, chunks, stages)}
    elif isinstance(split_spec, dict):
        unknown = [k for k in split_spec if k not in names]
        if unknown:
            raise ValueError(f"pp_config split_spec names unknown layers {unknown}: use names from "
                             f"model.named_sublayers(), e.g. {names[:6]}")
        if len(split_spec) != parts - 1:
            raise ValueError(f"pp_config split_spec has {len(split_spec)} split points; {stages} stages x "
                             f"{chunks} chunks need exactly {parts - 1}")
        points = {k: _is_split_point(v, k) for k, v in split_spec.items()}
        split_layers = list(points)
    else:
        raise TypeError("pp_config split_spec must be a layer-name prefix (str) like 'model.layers' or a dict "
                        f"{{layer_name: SplitPoint.END}}, got {type(split_spec).__name__}")
    globals_ = [global_spec] if isinstance(global_spec, str) else list(global_spec or [])
    missing = [g for g in globals_ if g not in names]
    if missing:
        raise ValueError(f"pp_config global_spec names unknown layers {missing}: "
                         "use names from model.named_sublayers()")
    units = _units(named, split_layers)
    virtual, assigned = 0, []
    for name, layer in units:
        if any(name == g or name.startswith(g + ".") for g in globals_):
            assigned.append((name, layer, None))
            continue
        if points.get(name) is SplitPoint.BEGINNING and any(v is not None for _, _, v in assigned):
            virtual += 1
        assigned.append((name, layer, virtual))
        if points.get(name) is SplitPoint.END:
            virtual += 1
    used = {v for _, _, v in assigned if v is not None}
    if used != set(range(parts)):
        empty = sorted(set(range(parts)) - used)
        raise ValueError(f"pp_config split_spec leaves virtual stages {empty} of {parts} without layers: "
                         "move the split points so every stage gets at least one layer")
    return StagePlan(tuple(assigned), stages, chunks)


def _units(named, split_layers):
    """Sublayers that contain no split layer and whose parent is the root or contains one."""
    def contains_split(name):
        return any(s.startswith(name + ".") for s in split_layers)

    containers = {n for n, _ in named if contains_split(n)}
    units = []
    for name, layer in named:
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        if name not in containers and (parent == "" or parent in containers):
            units.append((name, layer))
    return units
