"""Paddle's parallel-API Llama test (test/auto_parallel/hybrid_strategy/parallel_api.py, run by
test_parallel_api_with_llama_{1d,2d,3d,2d_sep,lora}.py) on PaddleFormers' LlamaForCausalLM, vs one card.

Its switches become each run's settings (dp / mp / pp / sep degrees, one_api, use_lazy_init,
sequence_parallel, test_share_embedding, test_position_embedding, test_lora, acc_step,
use_param_group, sharding_stage, prepare_input_output, amp / amp_level / amp_dtype / amp_master_grad);
its script shape is kept: the global mesh set with
`dist.auto_parallel.set_mesh`, Paddle's plan objects keyed for PaddleFormers (`model.`),
`dist.parallelize` or `parallelize_model` / optimizer from the parallelized model /
`parallelize_optimizer`, LinearWarmup, apply_decay_param_fun, the loss computed outside
the model, `dist.shard_dataloader(..., shard_dims="dp")` iterated as `dist_loader()`.
Two routes: "patch" runs `pcp.patch_paddle()` and then Paddle's own calls unchanged;
"pcp" calls paddle_cp's functions with Paddle's plan objects. Every run is compared
with one card doing the same (three optimizer steps, AdamW epsilon 1e-3).
test_position_embedding adds Paddle's `position_embedding` plan keys: PaddleFormers' Llama has no such
layer (RoPE), so they match nothing and paddle_cp warns, as for any such key.

Also the two seed documents' examples (paddle_parallelize.txt, paddle_PrepareContextParallel.txt),
with working forward bodies, and Paddle's ConvParallel on a conv net, through patch_paddle.
argv[1] names the group of runs.
"""
import functools
import sys
import traceback
import warnings
from functools import reduce

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from paddle import LazyGuard
from paddle.distributed.auto_parallel.intermediate.parallelize import parallelize_model, parallelize_optimizer
from paddle.io import BatchSampler, DataLoader, Dataset
from mesh_layouts import WORLDS, layouts
from report import run

import paddle_cp as pcp
from paddle_cp.params import record_of

GLOBAL_BATCH, SEQ, STEPS, EPSILON, VOCAB = 4, 16, 3, 1e-3, 128
DEFAULTS = dict(dp=1, mp=1, pp=1, sep=1, route="patch", one_api=True, use_lazy_init=False, sequence_parallel=False,
                prepare_input_output=False, amp=False, amp_level="O1", amp_dtype="float16", amp_master_grad=False,
                test_share_embedding=False, test_position_embedding=False, test_lora=False, acc_step=1,
                use_param_group=False, sharding_stage=0, cp_backend="p2p", dims=())


class RandomDataset(Dataset):
    """Paddle's test draws uniform [0, 1) ints (all zeros); here random token ids, the same on every rank."""

    def __init__(self, num_samples):
        super().__init__()
        rng = np.random.RandomState(7)
        self.ids = rng.randint(0, VOCAB, [num_samples, SEQ]).astype("int64")
        self.labels = rng.randint(0, VOCAB, [num_samples, SEQ]).astype("int64")

    def __getitem__(self, index):
        return self.ids[index], self.labels[index]

    def __len__(self):
        return len(self.ids)


def build_model(s):
    from paddleformers.peft import LoRAConfig, LoRAModel
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    paddle.seed(2024)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, fuse_rms_norm=False,  # no fused CPU kernel
                         tie_word_embeddings=s["test_share_embedding"])  # attention: the default (eager)
    if s["use_lazy_init"]:
        with LazyGuard():
            model = LlamaForCausalLM(config)
    else:
        model = LlamaForCausalLM(config)
    if s["test_lora"]:
        lora = LoRAConfig(target_modules=[".*q_proj.*", ".*k_proj.*", ".*v_proj.*", ".*o_proj.*", ".*gate_proj.*",
                                          ".*up_proj.*", ".*down_proj.*"], r=8, lora_alpha=8)
        if s["use_lazy_init"]:
            with LazyGuard():
                model = LoRAModel(model, lora)
        else:
            model = LoRAModel(model, lora)
    return model


def create_optimizer(model, lr_scheduler, s):
    """Paddle's test's optimizer (decay by name, global-norm clip, maybe in a parameter group), epsilon 1e-3."""
    decay_parameters = [p.name for n, p in model.named_parameters() if not any(nd in n for nd in ["bias", "norm"])]

    def apply_decay_param_fun(x):
        return x in decay_parameters

    if s["use_param_group"]:
        group = {"params": list(model.parameters()), "weight_decay": 0.01,
                 "grad_clip": paddle.nn.ClipGradByGlobalNorm(1.0)}
        return paddle.optimizer.AdamW(learning_rate=lr_scheduler, apply_decay_param_fun=apply_decay_param_fun,
                                      parameters=[group], epsilon=EPSILON)
    return paddle.optimizer.AdamW(learning_rate=lr_scheduler, apply_decay_param_fun=apply_decay_param_fun,
                                  parameters=model.parameters(), weight_decay=0.01,
                                  grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0), epsilon=EPSILON)


def tensor_plan(s):
    """Paddle's test's mp plan, `llama.` spelled `model.` (LoRA adds another `model.`)."""
    p = "model.model." if s["test_lora"] else "model."
    head = "model.lm_head" if s["test_lora"] else "lm_head"
    position = {f"{p}position_embedding": dist.ColWiseParallel()} if s["test_position_embedding"] else {}
    if not s["sequence_parallel"]:
        return {
            f"{p}embed_tokens": dist.ColWiseParallel(gather_output=True), **position,
            f"{p}layers.*.self_attn.q_proj": dist.ColWiseParallel(gather_output=True),
            f"{p}layers.*.self_attn.q_proj.lora_B": dist.ColWiseParallel(),
            f"{p}layers.*.self_attn.k_proj": dist.ColWiseParallel(gather_output=True),
            f"{p}layers.*.self_attn.k_proj.lora_B": dist.ColWiseParallel(),
            f"{p}layers.*.self_attn.v_proj": dist.ColWiseParallel(gather_output=True),
            f"{p}layers.*.self_attn.v_proj.lora_B": dist.ColWiseParallel(),
            f"{p}layers.*.self_attn.o_proj": dist.RowWiseParallel(is_input_parallel=False),
            f"{p}layers.*.self_attn.o_proj.lora_A": dist.RowWiseParallel(),
            f"{p}layers.*.mlp.gate_proj": dist.ColWiseParallel(),
            f"{p}layers.*.mlp.gate_proj.lora_B": dist.ColWiseParallel(),
            f"{p}layers.*.mlp.up_proj": dist.ColWiseParallel(),
            f"{p}layers.*.mlp.up_proj.lora_B": dist.ColWiseParallel(),
            f"{p}layers.*.mlp.down_proj": dist.RowWiseParallel(),
            f"{p}layers.*.mlp.down_proj.lora_A": dist.RowWiseParallel(),
            f"{head}.weight": dist.ColWiseParallel(),
        }
    if s["prepare_input_output"]:  # sequence parallel by SequenceParallelEnable on the norms
        return {
            f"{p}embed_tokens": dist.ColWiseParallel(), **position,
            f"{p}layers.*.self_attn.q_proj": dist.ColWiseParallel(),
            f"{p}layers.*.self_attn.k_proj": dist.ColWiseParallel(),
            f"{p}layers.*.self_attn.v_proj": dist.ColWiseParallel(),
            f"{p}layers.*.self_attn.o_proj": dist.RowWiseParallel(),
            f"{p}layers.*.mlp.gate_proj": dist.ColWiseParallel(),
            f"{p}layers.*.mlp.up_proj": dist.ColWiseParallel(),
            f"{p}layers.*.mlp.down_proj": dist.RowWiseParallel(),
            f"{head}.weight": dist.ColWiseParallel(),
            f"{p}layers.*.input_layernorm": dist.SequenceParallelEnable(),
            f"{p}layers.*.post_attention_layernorm": dist.SequenceParallelEnable(),
            f"{p}norm": dist.SequenceParallelEnable(),
        }
    return {
        f"{p}embed_tokens": [dist.ColWiseParallel(), dist.SequenceParallelBegin()],
        **{k: [v, dist.SequenceParallelBegin()] for k, v in position.items()},
        f"{p}layers.*.self_attn.q_proj": dist.ColWiseParallel(),
        f"{p}layers.*.self_attn.k_proj": dist.ColWiseParallel(),
        f"{p}layers.*.self_attn.v_proj": dist.ColWiseParallel(),
        f"{p}layers.*.self_attn.o_proj": dist.RowWiseParallel(),
        f"{p}layers.*.self_attn": dist.SequenceParallelDisable(),
        f"{p}layers.*.mlp.gate_proj": dist.ColWiseParallel(),
        f"{p}layers.*.mlp.up_proj": dist.ColWiseParallel(),
        f"{p}layers.*.mlp.down_proj": dist.RowWiseParallel(),
        f"{p}layers.*.mlp": dist.SequenceParallelDisable(need_transpose=False),
        f"{head}.weight": dist.ColWiseParallel(),
        head: dist.SequenceParallelEnd(),
    }


def uses(s, dim):
    """Whether the run's mesh has `dim` (a named mesh, `dims`, has it at any size; else only at size > 1)."""
    return dim in s["dims"] if s["dims"] else s[dim] > 1


def parallel_config(s):
    p = "model.model." if s["test_lora"] else "model."
    config = {"dp_config": None, "mp_config": None, "pp_config": None}
    if uses(s, "pp"):
        config["pp_config"] = {"split_spec": f"{p}layers", "global_spec": f"{p}rotary_emb"}
    if uses(s, "dp") or s["dims"]:
        config["dp_config"] = {"sharding_level": s["sharding_stage"]}
    if uses(s, "mp"):
        config["mp_config"] = {"parallelize_plan": tensor_plan(s)}
    if uses(s, "sep"):
        config["cp_config"] = {"parallelize_plan": {
            p.rstrip("."): dist.PrepareContextParallel(s["cp_backend"]),
            f"{p}layers.*.self_attn": dist.ContextParallel(s["cp_backend"])}}
    return config


def set_global_mesh(s):
    names = s["dims"] or [name for name in ("dp", "pp", "mp", "sep") if name == "dp" or s[name] > 1]
    shape = [s[name] for name in names]
    mesh = dist.ProcessMesh(np.arange(reduce(lambda x, y: x * y, shape, 1)).reshape(shape).tolist(), list(names))
    dist.auto_parallel.set_mesh(mesh)
    return mesh


def stage_meshes(mesh, s):
    """Paddle's test's `meshes` for shard_dataloader: the first and last stage's under pp."""
    if "pp" not in mesh.dim_names:
        return [mesh]
    return [mesh.get_mesh_with_dim("pp")[0], mesh.get_mesh_with_dim("pp")[-1]]


def criterion(logits, labels):
    """The loss outside the model, as Paddle's test does (its LlamaPretrainingCriterion: mean token CE)."""
    return F.cross_entropy(logits.reshape([-1, logits.shape[-1]]), labels.reshape([-1, 1])).mean()


def parallelize(model, lr_scheduler, s):
    config = parallel_config(s)
    if s["route"] == "patch":  # Paddle's own calls, patched
        if s["one_api"]:
            return dist.parallelize(model, create_optimizer(model, lr_scheduler, s), config=config)
        model = parallelize_model(model, config=config)
        return model, parallelize_optimizer(create_optimizer(model, lr_scheduler, s), config=config)
    if s["one_api"]:
        return pcp.parallelize(model, create_optimizer(model, lr_scheduler, s), config=config)
    model = pcp.parallelize_model(model, config=config)
    return model, pcp.parallelize_optimizer(create_optimizer(model, lr_scheduler, s), config=config)


def train(s, mesh=None):
    """Paddle's test's loop; one card when `mesh` is None. Returns (losses, state dict as numpy)."""
    model = build_model(s)
    # Paddle's test warms up from 0 to 1e-4: parameters would hardly move in three steps; 1e-3 -> 1e-2 makes them
    lr_scheduler = paddle.optimizer.lr.LinearWarmup(learning_rate=1e-2, warmup_steps=2, start_lr=1e-3, end_lr=1e-2)
    if mesh is None:
        optimizer = create_optimizer(model, lr_scheduler, s)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. the position_embedding key, which names no layer here
            model, optimizer = parallelize(model, lr_scheduler, s)
    if s["use_lazy_init"]:
        for param in model.parameters():
            assert not param._is_initialized()
            param.initialize()
    scaler = None
    if s["amp"]:  # AMP as Paddle's test calls it (CPU builds run it as fp32: decorate and auto_cast do nothing)
        model, optimizer = paddle.amp.decorate(models=model, optimizers=optimizer, level=s["amp_level"],
                                               dtype=s["amp_dtype"], master_grad=s["amp_master_grad"])
        if s["amp_dtype"] == "float16":
            scaler = paddle.amp.GradScaler(init_loss_scaling=1024)
            if mesh is not None:
                scaler = dist.shard_scaler(scaler) if s["route"] == "patch" else pcp.shard_scaler(scaler)
    dataset = RandomDataset(GLOBAL_BATCH * s["acc_step"] * STEPS)
    loader = DataLoader(dataset, batch_sampler=BatchSampler(dataset, batch_size=GLOBAL_BATCH, shuffle=False,
                                                            drop_last=True), num_workers=0)
    shard = dist.shard_dataloader if s["route"] == "patch" else pcp.shard_dataloader
    dist_loader = loader if mesh is None else shard(dataloader=loader, meshes=stage_meshes(mesh, s), shard_dims="dp")
    model.train()
    losses, tr_loss, global_step = [], 0.0, 1
    for inputs in dist_loader():
        input_ids, labels = inputs
        if mesh is not None and uses(s, "sep"):  # the one line a context-parallel script adds
            labels = pcp.shard_sequence(labels, backend=s["cp_backend"], mesh=mesh)
        with paddle.amp.auto_cast(s["amp"], custom_black_list={"reduce_sum", "c_softmax_with_cross_entropy"},
                                  level=s["amp_level"], dtype=s["amp_dtype"]):
            logits = model(input_ids=input_ids)[0]
            tr_loss_step = criterion(logits, labels)
        if s["acc_step"] > 1:
            tr_loss_step /= s["acc_step"]
        (scaler.scale(tr_loss_step) if scaler is not None else tr_loss_step).backward()
        tr_loss += float(tr_loss_step)
        if global_step % s["acc_step"] == 0:
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.clear_grad()
            lr_scheduler.step()
            losses.append(tr_loss)
            tr_loss = 0.0
        global_step += 1
    state = pcp.full_state_dict(model) if mesh is not None else {k: v.numpy() for k, v in model.state_dict().items()}
    return np.array(losses), state, model


# Paddle's test's check_mp: the dim each planned parameter is split on (its Shard(d) over mp)
SPLITS = {"q_proj": (1, "lora_B"), "k_proj": (1, "lora_B"), "v_proj": (1, "lora_B"), "gate_proj": (1, "lora_B"),
          "up_proj": (1, "lora_B"), "o_proj": (0, "lora_A"), "down_proj": (0, "lora_A")}


def misplaced(model, s):
    """Parameters split on another dim than Paddle's test asserts (read from paddle_cp's records)."""
    if s["mp"] == 1:
        return []
    want = {}
    for name, _ in model.named_sublayers():
        last = name.rpartition(".")[2]
        if last in SPLITS:
            axis, factor = SPLITS[last]
            want[f"{name}.weight"] = axis
            if s["test_lora"]:
                want[f"{name}.{factor}"] = axis
        if last in ("embed_tokens", "lm_head") and not s["test_share_embedding"]:
            want[f"{name}.weight"] = 1
    params = dict(model.named_parameters())
    split_on = {key: [s.axis for s in record_of(params[key]).shards()] for key in want}
    return [f"{key}: split on {split_on[key]}, Paddle's test wants {axis}"
            for key, axis in want.items() if split_on[key] != [axis]]


def global_losses(losses, mesh):
    """Each step's loss over the global batch: the mean over the ranks holding the logits (the last pipeline
    stage's) of each rank's mean over its samples and tokens (mp copies agree)."""
    holders = mesh.get_mesh_with_dim("pp")[-1].process_ids if "pp" in mesh.dim_names else mesh.process_ids
    total = paddle.to_tensor(losses if dist.get_rank() in holders else np.zeros(len(losses)), dtype="float32")
    if dist.get_world_size() > 1:  # one process has no global group to reduce over
        dist.all_reduce(total)
    return total.numpy() / len(holders)


# the settings a one-card run depends on: runs that agree on them share one reference
ONE_CARD = ("test_lora", "test_share_embedding", "acc_step", "use_param_group", "amp", "amp_level", "amp_dtype",
            "amp_master_grad", "use_lazy_init")


@functools.lru_cache(maxsize=None)
def one_card(key):
    losses, state, _ = train({**DEFAULTS, **dict(key)})
    return losses, state


def compare(report, name, settings):
    s = {**DEFAULTS, **settings}
    s["sequence_parallel"] |= s["prepare_input_output"]  # as Paddle's test sets it
    want_losses, want_state = one_card(tuple((k, s[k]) for k in ONE_CARD))
    mesh = set_global_mesh(s)
    if s["route"] == "patch":
        pcp.patch_paddle()
    try:
        if s["route"] == "patch":
            report.value(f"{name}.patched", parallelize_model is pcp.parallelize_model)
        losses, state, model = train(s, mesh)
    finally:
        pcp.unpatch_paddle()
    report.value(f"{name}.misplaced", misplaced(model, s))
    report.diff(f"{name}.loss", global_losses(losses, mesh), want_losses)
    report.value(f"{name}.state_keys_match", sorted(state) == sorted(want_state))
    for key, value in want_state.items():
        report.diff(f"{name}.param", state.get(key, np.zeros([0])), value)


def _adamw(model):
    return paddle.optimizer.AdamW(parameters=model.parameters(), epsilon=EPSILON, learning_rate=1e-2)


def _token_batches(shape, inputs=None):
    """STEPS [inputs, labels] pairs: token ids (or the float inputs `inputs(rng)`) and labels of `shape`."""
    rng = np.random.RandomState(3)
    return [[paddle.to_tensor(inputs(rng) if inputs else rng.randint(0, 32, shape).astype("int64")),
             paddle.to_tensor(rng.randint(0, 32, shape).astype("int64"))] for _ in range(STEPS)]


def seed_parallelize(report):
    """paddle_parallelize.txt's config as written (Paddle's objects, `llama.position_embedding` naming no layer of
    its model), through patch_paddle and `dist.parallelize` with the global mesh; dp1 x mp2 x pp2 on four ranks."""
    from doc_llama import LlamaForCausalLM, cross_entropy

    def build():
        paddle.seed(2024)
        model = LlamaForCausalLM(num_layers=2)
        return model, _adamw(model)

    parallel_config = {
        "dp_config": {"sharding_level": 1},
        "mp_config": {"parallelize_plan": {
            "llama.embed_tokens": [dist.ColWiseParallel(), dist.SequenceParallelBegin()],
            "llama.position_embedding": [dist.ColWiseParallel(), dist.SequenceParallelBegin()],
            "llama.layers.*.self_attn.qkv_proj": dist.ColWiseParallel(),
            "llama.layers.*.self_attn.o_proj": dist.RowWiseParallel(),
            "llama.layers.*.self_attn": dist.SequenceParallelDisable(),
            "llama.layers.*.mlp.gate_up_proj": dist.ColWiseParallel(),
            "llama.layers.*.mlp.down_proj": dist.RowWiseParallel(),
            "llama.layers.*.mlp": dist.SequenceParallelDisable(need_transpose=False),
            "lm_head.weight": dist.ColWiseParallel(),
            "lm_head": dist.SequenceParallelEnd(),
        }},
        "pp_config": {"split_spec": "llama.layers"},
    }
    mesh = dist.ProcessMesh([[[0, 1], [2, 3]]], dim_names=["dp", "mp", "pp"])
    run_seed(report, "seed_parallelize", build, parallel_config, mesh, _token_batches([32, 8]),
             lambda model, ids, labels: cross_entropy(model(ids), labels))


def seed_prepare_context_parallel(report):
    """paddle_PrepareContextParallel.txt's model with working bodies (smaller sizes; its 'sdpa' key spelled by
    the layer's full name, which Paddle's matching needs too), dp2 x sep2, both backends."""
    from seed_context_model import HIDDEN, LlamaForCausalLayer

    def build():
        paddle.seed(2024)
        model = LlamaForCausalLayer()
        return model, _adamw(model)

    def step_loss(model, inputs, labels):  # the doc's layer takes (input, label) and returns the logits
        return model.loss_func(model(inputs, labels), labels)

    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "sep"])
    batches = _token_batches([16, 8], lambda rng: rng.rand(16, 8, HIDDEN).astype("float32"))
    for backend in ("p2p", "all2all"):
        config = {"dp_config": {"sharding_level": 0}, "cp_config": {"parallelize_plan": {
            "llama": dist.PrepareContextParallel(backend), "llama.attention.sdpa": dist.ContextParallel(backend)}}}
        run_seed(report, f"seed_prepare_cp_{backend}", build, config, mesh, batches, step_loss, backend)


def paddle_conv_parallel(report):
    """Paddle's ConvParallel on the conv net of tests/workers/conv_parallel.py, through patch_paddle, dp2 x mp2."""
    from conv_parallel import ConvNet

    def build():
        paddle.seed(2024)
        model = ConvNet("NCHW")
        return model, _adamw(model)

    rng = np.random.RandomState(3)
    batches = [[paddle.to_tensor(rng.randn(8, 3, 8, 16).astype("float32")),
                paddle.to_tensor(rng.randint(0, 5, [8, 1]).astype("int64"))] for _ in range(STEPS)]
    config = {"mp_config": {"parallelize_plan": {f"conv{i}": dist.ConvParallel() for i in (1, 2, 3)}}}
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    run_seed(report, "paddle_conv_parallel", build, config, mesh, batches,
             lambda model, images, labels: F.cross_entropy(model(images), labels).mean())


def run_seed(report, name, build, config, mesh, batches, step_loss, sequence_backend=None):
    """Three steps of `build()`'s model under `config` (patch_paddle, dist.parallelize, dist.shard_dataloader
    over dp) vs one card on the same batches."""
    model, optimizer = build()
    want = []
    for inputs, labels in batches:
        loss = step_loss(model, inputs, labels)
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        want.append(float(loss))
    want_state = {k: v.numpy() for k, v in model.state_dict().items()}
    model, optimizer = build()
    dist.auto_parallel.set_mesh(mesh)
    pcp.patch_paddle()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, optimizer = dist.parallelize(model, optimizer, config=config)
        losses = []
        for inputs, labels in dist.shard_dataloader(batches, [mesh], shard_dims="dp")():
            if sequence_backend:  # the one line a context-parallel script adds: the labels of this rank's tokens
                labels = pcp.shard_sequence(labels, backend=sequence_backend, mesh=mesh)
            loss = step_loss(model, inputs, labels)
            loss.backward()
            optimizer.step()
            optimizer.clear_grad()
            losses.append(float(loss))
    finally:
        pcp.unpatch_paddle()
    report.diff(f"{name}.loss", global_losses(losses, mesh), np.array(want))
    state = pcp.full_state_dict(model)
    for key, value in want_state.items():
        report.diff(f"{name}.param", state[key], value)


RUNS = {
    # 4 ranks: the Paddle test's 1d / 2d / 2d_sep / 3d matrices cut to four ranks, both routes, one_api both ways
    "four": [
        ("dp2xmp2_two_step_acc2_group", dict(dp=2, mp=2, one_api=False, acc_step=2, use_param_group=True)),
        ("dp2xmp2_sp_pcp", dict(dp=2, mp=2, sequence_parallel=True, route="pcp")),
        ("dp2xmp2_shared_emb", dict(dp=2, mp=2, test_share_embedding=True, test_position_embedding=True)),
        ("dp2xmp2_prepare_io_amp_o2", dict(dp=2, mp=2, prepare_input_output=True, amp=True, amp_level="O2",
                                           amp_dtype="bfloat16", amp_master_grad=True)),
        ("mp2xsep2_sp_two_step", dict(mp=2, sep=2, sequence_parallel=True, one_api=False)),
        ("mp2xsep2_all2all_pcp", dict(mp=2, sep=2, cp_backend="all2all", route="pcp", one_api=False)),
        ("dp2xmp2_lora_two_step", dict(dp=2, mp=2, test_lora=True, one_api=False)),  # Paddle's LoRA plan keys
        ("dp2xsep2_l1_lora", dict(dp=2, sep=2, sharding_stage=1, test_lora=True)),
        ("dp4_l2_two_step_pcp", dict(dp=4, sharding_stage=2, one_api=False, route="pcp")),
        ("dp4_l3_acc2", dict(dp=4, sharding_stage=3, acc_step=2)),
        ("mp2xpp2", dict(mp=2, pp=2)),
        ("dp2xpp2_two_step", dict(dp=2, pp=2, one_api=False)),
    ],
    # Paddle's use_lazy_init and fp16 GradScaler switches (lazy initialization, pcp.shard_scaler)
    "lazy_and_scaler": [
        ("dp2xmp2_lazy", dict(dp=2, mp=2, use_lazy_init=True)),
        ("mp2xsep2_sp_lazy_acc2", dict(mp=2, sep=2, sequence_parallel=True, use_lazy_init=True, acc_step=2)),
        ("dp2xpp2_lazy_lora", dict(dp=2, pp=2, use_lazy_init=True, test_lora=True)),
        ("dp2xsep2_amp_fp16_scaler", dict(dp=2, sep=2, amp=True)),
        ("mp2xsep2_amp_fp16_scaler_pcp", dict(mp=2, sep=2, amp=True, route="pcp")),
    ],
}
SEEDS = {"four": [seed_parallelize, seed_prepare_context_parallel, paddle_conv_parallel], "lazy_and_scaler": []}
# the mesh sweep (mesh_layouts.py): one launch per world size
for _world in WORLDS:
    RUNS[f"sweep{_world}"], SEEDS[f"sweep{_world}"] = layouts(_world), []


def main(report):
    dist.init_parallel_env()
    groups = sys.argv[1:]
    for name, settings in (run for group in groups for run in RUNS[group]):
        try:
            compare(report, name, settings)
        except Exception as exc:  # noqa: BLE001 - one failing config must not hide the others
            report.data["errors"][name] = [type(exc).__name__, str(exc)[:2000], traceback.format_exc()[-3000:]]
    for seed in (seed for group in groups for seed in SEEDS[group]):
        seed(report)


if __name__ == "__main__":
    run(main)
