"""paddle_cp plans for a PaddleFormers decoder model, derived from its layer names: the one writer of them, for
the Trainer (from a built model) and for pcp-plan (from the layer names every such model shares).

PaddleFormers' decoder models (Llama, Qwen, Gemma3, gpt-oss, DeepSeek-V3, Phi3,
...) share one layout: `model.embed_tokens`, `model.layers.<i>.self_attn` with
`q_proj/k_proj/v_proj` (or a fused `qkv_proj`) and `o_proj`,
`model.layers.<i>.mlp` with `gate_proj/up_proj` (or a fused `gate_up_proj` /
`up_gate_proj`) and `down_proj`, `model.norm`, `model.rotary_emb`, `lm_head`.
A layer the plan does not name stays whole on every rank (correct, only not
split): MLA attention (DeepSeek-V3), attention with per-head parameters of its own
(gpt-oss's sinks) and MoE routed experts (DeepSeek-V3's `experts.<i>`, gpt-oss's
fused experts) keep their weights under tensor parallel; shared experts are split
like any MLP. With `expert_model_parallel_size` the routed experts are split over
expert groups instead (ep_config, `ExpertParallel` on every decoder layer's `mlp`).

The writers (`*_plan_spec`, `pipeline_config`, `expert_config`) take the model's `DecoderNames` and return plans
in load_config's form (a name, `{Name: {argument: value}}`, or a list of those): YAML for pcp-plan, built into
plan objects for the Trainer (`parallelize_config`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ...api.config import build_plans
from ...plans import PrepareContextParallel
from ...plans.vision_language import merging_rule

# the token mixers of a decoder layer: softmax attention, and linear attention (Qwen3-Next's Gated DeltaNet)
MIXERS = ("self_attn", "linear_attn")
MIXER = re.compile(r"(?P<stack>.+)\.\d+\.(?P<mixer>" + "|".join(MIXERS) + ")")
# routed experts run on the tokens routed to them: left whole (no collective inside a data-dependent branch)
ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")
# projection leaf -> (plan, the row-parallel sibling it feeds)
COLUMN_PROJECTIONS = {"q_proj": "o_proj", "k_proj": "o_proj", "v_proj": "o_proj", "qkv_proj": "o_proj",
                      "gate_proj": "down_proj", "up_proj": "down_proj", "gate_up_proj": "down_proj",
                      "up_gate_proj": "down_proj"}


@dataclass(frozen=True)
class DecoderNames:
    """What the writers read of a model: its sublayer names, and those holding per-head parameters of their own."""

    model: str                  # the model's class name, for errors
    names: tuple                # every sublayer name, sorted
    with_own_parameters: frozenset = frozenset()
    language_model: str = ""    # a vision-language model's language model, where its decoder layers are

    @classmethod
    def of(cls, model):
        layers = dict(model.named_sublayers())
        rule = merging_rule(model)
        return cls(type(model).__name__, tuple(sorted(layers)),
                   frozenset(name for name, layer in layers.items() if _holds_per_head_parameters(layer)),
                   rule.merges[type(model).__name__] if rule is not None else "")

    @classmethod
    def standard(cls, prefix="model"):
        """The names every PaddleFormers decoder model with separate q/k/v and gate/up projections has (one layer
        shown: plans key every layer alike)."""
        layer = f"{prefix}.layers.0"
        names = [f"{prefix}.embed_tokens", f"{prefix}.layers", layer, f"{layer}.self_attn", f"{layer}.mlp",
                 *(f"{layer}.self_attn.{p}_proj" for p in "qkvo"),
                 *(f"{layer}.mlp.{p}_proj" for p in ("gate", "up", "down")), f"{prefix}.norm",
                 f"{prefix}.rotary_emb", "lm_head"]
        return cls("a decoder model", tuple(sorted(names)))


def _pattern(name):
    """`model.layers.3.mlp.up_proj` -> `model.layers.*.mlp.up_proj` (Paddle's key syntax: a full regex match)."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def decoder_stack(names):
    """The name of the decoder-layer list (`model.layers`; a vision-language model's under its language model, not
    its vision tower's); a ValueError when the model has none."""
    inside = names.language_model + "." if names.language_model else ""
    stacks = {m.group("stack") for name in names.names if name.startswith(inside) and (m := MIXER.fullmatch(name))}
    if len(stacks) != 1:
        raise ValueError(
            f"{names.model}: cannot derive paddle_cp plans, expected one list of decoder layers with "
            f"'<list>.<i>.self_attn' (or linear_attn) sublayers (PaddleFormers' decoder models), found "
            f"{sorted(stacks) or 'none'}; "
            "give your own plans in TrainingArguments(paddle_cp_config=<YAML path or dict>)")
    return stacks.pop()


def mixers(names):
    """The token mixers the decoder layers hold (`self_attn`, and `linear_attn` in hybrid models), in MIXERS order."""
    stack = decoder_stack(names)
    found = {m.group("mixer") for name in names.names if (m := MIXER.fullmatch(name)) and m.group("stack") == stack}
    return [mixer for mixer in MIXERS if mixer in found]


def context_parallel_plan_spec(names, backend, ulysses_degree=None, sequence_parallel_mp=1):
    """`PrepareContextParallel` on the model itself (splits inputs and labels) and `ContextParallel`
    on every decoder layer's token mixer (attention, and linear attention in hybrid models).
    `sequence_parallel_mp` > 1: tensor parallelism's sequence split follows, over that many ranks, and needs each
    rank's share to be a multiple of it; the documents layout shares a batch unevenly (one rank 1075 tokens of
    2048, its peer 973), 2N equal chunks give multiples of it wherever the length is one of 2 x sep x mp."""
    args = {"backend": backend, **({"ulysses_degree": ulysses_degree} if backend == "hybrid" else {})}
    stack = decoder_stack(names)
    plan = {"": {"PrepareContextParallel": {**args, **({"layout": "chunks"} if sequence_parallel_mp > 1 else {})}}}
    for mixer in mixers(names):
        plan[f"{stack}.*.{mixer}"] = {"ContextParallel": dict(args)}
    return plan


def tensor_parallel_plan_spec(names, sequence_parallel):
    """Column/row splits of the attention and MLP projections, the embedding and lm_head; with
    `sequence_parallel` the sequence is split over mp between the embedding and lm_head, the token
    mixers and MLPs seeing it whole. Linear attention (no q/k/v/o projections) stays whole."""
    stack = decoder_stack(names)
    present = set(names.names)
    plan = {}
    for name in names.names:
        parent, _, leaf = name.rpartition(".")
        row = COLUMN_PROJECTIONS.get(leaf)
        if row and f"{parent}.{row}" in present and name.startswith(stack + ".") and not ROUTED_EXPERT.search(name) \
                and parent not in names.with_own_parameters:
            plan[_pattern(name)] = "ColWiseParallel"
            plan[_pattern(f"{parent}.{row}")] = "RowWiseParallel"
    if not plan:
        raise ValueError(f"{names.model}: no q/k/v/o or gate/up/down projections to split for "
                         "tensor_model_parallel_size > 1; give your own plans in paddle_cp_config")
    embedding = f"{stack.rpartition('.')[0]}.embed_tokens".lstrip(".")
    head = "lm_head" if "lm_head" in present else None
    if embedding in present:
        plan[embedding] = ["ColWiseParallel"]
    if head:
        plan[f"{head}.weight"] = "ColWiseParallel"
    if sequence_parallel:
        if embedding not in present or not head:
            raise ValueError(f"{names.model}: sequence_parallel needs '{embedding}' and 'lm_head' layers "
                             "to begin and end the split sequence; give your own plans in paddle_cp_config")
        plan[embedding].append("SequenceParallelBegin")
        for mixer in mixers(names):  # they mix the whole sequence
            plan[f"{stack}.*.{mixer}"] = "SequenceParallelDisable"
        plan[f"{stack}.*.mlp"] = {"SequenceParallelDisable": {"need_transpose": False}}
        plan[head] = "SequenceParallelEnd"
    return plan


def _holds_per_head_parameters(layer):
    """An attention with parameters of its own, one per head (gpt-oss's sinks): its heads cannot be split by
    splitting its projections, so it stays whole."""
    return any(p is not None for p in layer._parameters.values())


def pipeline_config(names, schedule_mode, micro_batches, vpp_degree=None):
    """Split at the decoder layers; the rotary layer (tables computed before the layer loop) runs on every stage."""
    config = {"split_spec": decoder_stack(names), "schedule_mode": schedule_mode, "accumulate_steps": micro_batches}
    rotary = [name for name in names.names if name.endswith("rotary_emb") and "layers." not in name]
    if rotary:
        config["global_spec"] = rotary[0] if len(rotary) == 1 else rotary
    if vpp_degree:
        config["vpp_degree"] = vpp_degree
    return config


def expert_config(names, degree):
    """ep_config: the key matches every layer's mlp; ExpertParallel takes the MoE blocks among them."""
    return {"degree": degree, "parallelize_plan": {f"{decoder_stack(names)}.*.mlp": "ExpertParallel"}}


def memory_plan_spec(names, offload_recompute_inputs, mlp_tile_tokens):
    """The decoder layers' activation-memory plans: their recompute inputs in host memory, their MLPs over the
    sequence in tiles."""
    plans = {}
    if mlp_tile_tokens:
        plans[f"{decoder_stack(names)}.*.mlp"] = {"SequenceTiled": {"tokens": mlp_tile_tokens}}
    if offload_recompute_inputs:
        plans[f"{decoder_stack(names)}.*"] = "OffloadRecomputeInputs"
    return plans


def built(plan):
    """A plan spec's plan objects (load_config's builder)."""
    return {key: build_plans(key, spec) for key, spec in plan.items()}


def tensor_parallel_plan(model, sequence_parallel):
    return built(tensor_parallel_plan_spec(DecoderNames.of(model), sequence_parallel))


def parallelize_config(model, degrees, schedule_mode="1F1B", micro_batches=1):
    """paddle_cp.parallelize's config for `model` on `degrees`."""
    names = DecoderNames.of(model)
    config = {}
    if names.language_model and (degrees.mp > 1 or degrees.pp > 1 or degrees.ep > 1):
        raise ValueError(f"{names.model} is a vision-language model: paddle_cp trains it with context parallel, data "
                         "parallel and sharding (context_parallel_size, sep_parallel_size, sharding); tensor, pipeline "
                         "and expert parallel of it are not supported yet: set tensor_model_parallel_size, "
                         "pipeline_model_parallel_size and expert_model_parallel_size to 1")
    if degrees.sep > 1:
        config["cp_config"] = {"parallelize_plan": built(context_parallel_plan_spec(
            names, degrees.backend, degrees.ulysses, degrees.mp if degrees.sequence_parallel else 1))}
    if degrees.mp > 1:
        config["mp_config"] = {"parallelize_plan": built(tensor_parallel_plan_spec(names, degrees.sequence_parallel))}
    if degrees.pp > 1:
        config["pp_config"] = pipeline_config(names, schedule_mode, micro_batches)
    if degrees.ep > 1:
        ep_config = expert_config(names, degrees.ep)
        config["ep_config"] = {**ep_config, "parallelize_plan": built(ep_config["parallelize_plan"])}
    config["dp_config"] = {"sharding_level": degrees.sharding_level}
    if degrees.sharding_mesh_dim is not None:
        config["dp_config"]["sharding_mesh_dim"] = degrees.sharding_mesh_dim
    return config


def with_memory_plans(config, model, offload_recompute_inputs, mlp_tile_tokens):
    """`config` with the decoder layers' activation-memory plans added to its cp_config."""
    plans = built(memory_plan_spec(DecoderNames.of(model), offload_recompute_inputs, mlp_tile_tokens))
    if not plans:
        return config
    section = dict(config.get("cp_config") or {})
    section["parallelize_plan"] = {**(section.get("parallelize_plan") or {}), **plans}
    return {**config, "cp_config": section}


def with_offload_optimizer(config, offload_optimizer):
    """`config` with its dp_config's `offload_optimizer` set when asked (the optimizer state on the host)."""
    if not offload_optimizer:
        return config
    return {**config, "dp_config": {**(config.get("dp_config") or {}), "offload_optimizer": True}}


def prepare_plan(config):
    """The config's PrepareContextParallel (how labels are split over sep), or None."""
    for section in ("cp_config", "mp_config"):
        for plans in ((config.get(section) or {}).get("parallelize_plan") or {}).values():
            for plan in plans if isinstance(plans, (list, tuple)) else [plans]:
                if isinstance(plan, PrepareContextParallel):
                    return plan
    return None


BACKEND_NAMES = {"p2p": "ring (p2p)", "all2all": "Ulysses (all2all)", "hybrid": "Ulysses x ring (hybrid)"}


def layout_summary(mesh, config):
    """One line for the Trainer's log: the mesh, and what runs over it."""
    dims = " x ".join(f"{name} {size}" for name, size in zip(mesh.dim_names, mesh.shape))
    parts = []
    prepare = prepare_plan(config)
    if prepare is not None:
        parts.append(f"context parallel {BACKEND_NAMES[prepare.backend]}, batches in the {prepare.layout} layout")
    if config.get("mp_config"):
        sequence = any(type(plan).__name__ == "SequenceParallelBegin"
                       for plans in config["mp_config"]["parallelize_plan"].values()
                       for plan in (plans if isinstance(plans, (list, tuple)) else [plans]))
        parts.append("tensor parallel" + (" + sequence parallel" if sequence else ""))
    if config.get("pp_config"):
        parts.append(f"pipeline {config['pp_config'].get('schedule_mode', '1F1B')}")
    if config.get("ep_config"):
        parts.append(f"expert parallel over {config['ep_config']['degree']} ranks")
    level = (config.get("dp_config") or {}).get("sharding_level", 0)
    if level:
        parts.append(f"sharding level {level}")
    return f"paddle_cp: mesh {dims}: " + (", ".join(parts) or "data parallel")
