"""Models built under paddle.LazyGuard(), parallelized, then initialized by the script's own loop,
against one card that builds the same model lazily and initializes it in the same order.

Per layout: every parameter still uninitialized after parallelize; after the loop each rank's
local tensor equals its boxes of one card's values exactly (a part this rank does not keep is
empty) and the random state is where one card's is; the allocator peak over build + parallelize +
initialization (Paddle's `Allocated` statistics) against the final share; then three AdamW steps
(epsilon 1e-3) against one card. Also: the eager path's peak for comparison, a forward with a
parameter left uninitialized, ranks seeded differently.
"""
import gc
import math
import pickle
import zlib

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.base import core
from checkpoint_resume import parallel_step
from report import run
from tensor_parallel import CP_PLAN, fused_plan, paddle_plan

import paddle_cp as pcp
from paddle_cp.params import local_boxes
from paddle_cp.tools.memory.io_phases import largest_parameter_bytes

SEED, BATCH, SEQ, STEPS = 2024, 4, 16, 3
VOCAB = 4096


def llama():
    """Big enough that the memory bound means something: 8.3M parameters, the tied embedding 6 MiB."""
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=384, intermediate_size=1024,
                                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                        fuse_rms_norm=False))  # the fused norm has no CPU kernel


def phi3():
    """Fused projections: qkv_proj (q|k|v) and gate_up_proj (gate|up)."""
    from paddleformers.transformers import Phi3Config, Phi3ForCausalLM
    return Phi3ForCausalLM(Phi3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, fuse_rms_norm=False))


MODELS = {"llama": llama, "phi3": phi3}
PIPELINE_CP = {"": pcp.PrepareContextParallel("p2p"), "model.layers.*.self_attn": pcp.ContextParallel("p2p")}
PIPELINE = {"split_spec": "model.layers", "global_spec": "model.rotary_emb", "accumulate_steps": 2,
            "schedule_mode": "1F1B"}
DP2_MP2_L3 = lambda m: {"mp_config": {"parallelize_plan": paddle_plan(m)}, "dp_config": {"sharding_level": 3}}  # noqa: E731
LAYOUTS = {  # name: (model, mesh dims, config builder, labels split over sep by the script, memory asserted)
    "dp2xmp2_l3": ("llama", [("dp", 2), ("mp", 2)], DP2_MP2_L3, False, True),
    # Paddle's two steps: parallelize_model, the initialization loop, the optimizer, parallelize_optimizer
    "dp2xmp2_l3_two_step": ("llama", [("dp", 2), ("mp", 2)], DP2_MP2_L3, False, True),
    "pp2xsep2": ("llama", [("pp", 2), ("sep", 2)],
                 lambda m: {"cp_config": {"parallelize_plan": PIPELINE_CP}, "pp_config": PIPELINE}, False, True),
    "dp2xmp2_l1_fused": ("phi3", [("dp", 2), ("mp", 2)],
                         lambda m: {"mp_config": {"parallelize_plan": fused_plan()},
                                    "dp_config": {"sharding_level": 1}}, False, False),
    "mp2xsep2_l0": ("llama", [("mp", 2), ("sep", 2)],
                    lambda m: {"mp_config": {"parallelize_plan": paddle_plan(m)},
                               "cp_config": {"parallelize_plan": CP_PLAN}}, True, False),
    # sharded over all four ranks holding replicas (dp x sep)
    "dp2xsep2_l3": ("llama", [("dp", 2), ("sep", 2)],
                    lambda m: {"cp_config": {"parallelize_plan": CP_PLAN}, "dp_config": {"sharding_level": 3}},
                    True, False),
}


def lazily_built(make):
    paddle.seed(SEED)
    with paddle.LazyGuard():
        return make()


def adamw(model):
    return paddle.optimizer.AdamW(learning_rate=1e-3, weight_decay=0.1, epsilon=1e-3, parameters=model.parameters())


def random_state():
    return zlib.crc32(pickle.dumps(paddle.get_rng_state()))


def batches():
    rng = np.random.RandomState(7)
    for _ in range(STEPS):
        yield (paddle.to_tensor(rng.randint(0, VOCAB, [BATCH, SEQ]), dtype="int64"),
               paddle.to_tensor(rng.randint(0, VOCAB, [BATCH, SEQ]), dtype="int64"))


def reference(make):
    """One card: initial values, random state after the loop, losses and final state."""
    model = lazily_built(make)
    for p in model.parameters():
        p.initialize()
    initial, state = {n: p.numpy() for n, p in model.named_parameters()}, random_state()
    optimizer, losses = adamw(model), []
    for ids, labels in batches():
        loss = model(input_ids=ids, labels=labels)[0]
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(float(loss))
    return initial, state, np.array(losses), {k: v.numpy() for k, v in model.state_dict().items()}


def _allocated():
    return core.host_memory_stat_current_value("Allocated", 0)


def measured_start(make, mesh, config, lazy=True, two_step=False):
    """Build, parallelize, initialize (lazy): (model, optimizer, whether every parameter was uninitialized
    after parallelize, {peak, share, largest} in bytes over the three, from the allocator statistics).
    `two_step`: Paddle's parallelize_model, then the loop, then the optimizer and parallelize_optimizer."""
    gc.collect()
    base = _allocated()
    core.host_memory_stat_reset_peak_value("Allocated", 0)
    if lazy:
        model = lazily_built(make)
    else:
        paddle.seed(SEED)
        model = make()
    config = config(model)
    if two_step:
        model = pcp.parallelize_model(model, mesh, config)
    else:
        model, optimizer = pcp.parallelize(model, adamw(model), mesh, config)
    uninitialized = all(not p._is_initialized() for p in model.parameters())
    if lazy:
        for p in model.parameters():
            p.initialize()
    if two_step:
        optimizer = pcp.parallelize_optimizer(adamw(model), mesh, config)
    memory = {"peak": core.host_memory_stat_peak_value("Allocated", 0) - base, "share": _allocated() - base,
              "largest": largest_parameter_bytes(model)}
    return model, optimizer, uninitialized, memory


def compare_initial(report, name, model, initial):
    """Each local tensor against its boxes of one card's values (exact); nothing where this rank holds none."""
    empty_elsewhere, boxes_compared = True, 0
    for key, p in model.named_parameters():
        boxes = local_boxes(p)
        if not boxes:
            empty_elsewhere &= not p._is_initialized() or math.prod(p.shape) == 0
            continue
        local = p.numpy()
        for box in boxes:
            want = initial[key][tuple(slice(o, o + n) for o, n in zip(box.global_offset, box.local_shape))]
            report.diff(f"{name}.initial", local[box.local_slice], want)
            boxes_compared += 1
    report.value(f"{name}.empty_elsewhere", empty_elsewhere)
    report.value(f"{name}.boxes_compared", boxes_compared)


def train(model, optimizer, mesh, shard_labels):
    return np.array([parallel_step(model, optimizer, mesh, shard_labels, ids, labels) for ids, labels in batches()])


def mesh_of(dims):
    return dist.ProcessMesh(np.arange(dist.get_world_size()).reshape([d for _, d in dims]).tolist(),
                            dim_names=[n for n, _ in dims])


def check_layout(report, name, references):
    model_name, dims, config, shard_labels, memory_bound = LAYOUTS[name]
    initial, state_after, want_losses, want_state = references[model_name]
    mesh = mesh_of(dims)
    model, optimizer, uninitialized, memory = measured_start(MODELS[model_name], mesh, config,
                                                             two_step=name.endswith("two_step"))
    report.value(f"{name}.uninitialized_after_parallelize", uninitialized)
    report.value(f"{name}.random_state_as_one_card", random_state() == state_after)
    report.value(f"{name}.memory", {**memory, "asserted": memory_bound})
    compare_initial(report, name, model, initial)
    report.diff(f"{name}.loss", train(model, optimizer, mesh, shard_labels), want_losses)
    state = pcp.full_state_dict(model)
    report.value(f"{name}.state_keys_match", sorted(state) == sorted(want_state))
    for key, value in want_state.items():
        report.diff(f"{name}.state", state[key], value)


def check_uninitialized_forward(report):
    """One parameter left uninitialized: the forward refuses on every rank, before any collective."""
    mesh = mesh_of(LAYOUTS["dp2xmp2_l3"][1])
    model = lazily_built(llama)
    model, _ = pcp.parallelize(model, adamw(model), mesh, LAYOUTS["dp2xmp2_l3"][2](model))
    params = model.parameters()
    for p in params[:-1]:
        p.initialize()
    ids = paddle.zeros([2, SEQ], "int64")
    report.expect_error("uninitialized_forward", lambda: model(input_ids=ids, labels=ids))
    params[-1].initialize()
    report.expect_error("initialized_forward", lambda: model(input_ids=ids, labels=ids))


def check_differently_seeded(report):
    """Ranks seeded differently would draw different replicas: parallelize goes through (a model filled by a
    loader draws nothing), the first initialize() refuses on every rank."""
    paddle.seed(SEED + dist.get_rank())
    with paddle.LazyGuard():
        model = llama()
    model, _ = pcp.parallelize(model, None, mesh_of([("dp", 4)]), {"dp_config": {"sharding_level": 0}})
    report.expect_error("differently_seeded", lambda: model.parameters()[0].initialize())


def main(report):
    references = {name: reference(make) for name, make in MODELS.items()}
    gc.collect()
    for name in LAYOUTS:
        check_layout(report, name, references)
        gc.collect()
    mesh = mesh_of(LAYOUTS["dp2xmp2_l3"][1])
    *_, eager = measured_start(llama, mesh, LAYOUTS["dp2xmp2_l3"][2], lazy=False)
    report.value("eager_dp2xmp2_l3.memory", eager)
    check_uninitialized_forward(report)
    check_differently_seeded(report)


if __name__ == "__main__":
    run(main)
