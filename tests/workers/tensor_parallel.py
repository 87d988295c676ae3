"""PaddleFormers models under tensor / sequence / context / data parallel vs one card.

Every run builds the model from one seed, trains three AdamW steps (two parameter
groups with their own lr and weight decay, ClipGradByGlobalNorm) on its part of
a global batch, and compares the global loss of each step and the final
full_state_dict with a single-card run on the whole batch, done here too.
argv[1] names the group of runs (one launch each).
"""
import sys

import numpy as np
import paddle
import paddle.distributed as dist
from report import run

import paddle_cp as pcp

BATCH, SEQ, STEPS = 4, 16, 3


def llama(fused=False):
    if fused:
        from paddleformers.transformers import Phi3Config, Phi3ForCausalLM
        cfg = Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, fuse_rms_norm=False,
                         _attn_implementation="sdpa")
        return Phi3ForCausalLM(cfg)
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, fuse_rms_norm=False,
                      _attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def build(fused):
    paddle.seed(2024)
    model = llama(fused)
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    rest = [p for n, p in model.named_parameters() if "norm" not in n]
    optimizer = paddle.optimizer.AdamW(
        learning_rate=1e-2, weight_decay=0.1, epsilon=1e-3, grad_clip=paddle.nn.ClipGradByGlobalNorm(0.5),
        parameters=[{"params": rest}, {"params": norms, "weight_decay": 0.0, "learning_rate": 3.0}])
    return model, optimizer


def batches():
    rng = np.random.RandomState(7)
    for _ in range(STEPS):
        ids = paddle.to_tensor(rng.randint(0, 128, [BATCH, SEQ]), dtype="int64")
        labels = paddle.to_tensor(rng.randint(0, 128, [BATCH, SEQ]), dtype="int64")
        yield ids, labels


def positions(batch):
    return paddle.arange(SEQ, dtype="int64").unsqueeze(0).expand([batch, SEQ])


_references = {}


def reference(fused):
    """Losses and state dict of one card on the global batch (computed once per model)."""
    if fused not in _references:
        model, optimizer = build(fused)
        losses = []
        for ids, labels in batches():
            loss = model(input_ids=ids, labels=labels, position_ids=positions(BATCH))[0]
            loss.backward()
            optimizer.step()
            optimizer.clear_grad()
            losses.append(float(loss))
        _references[fused] = (losses, {k: v.numpy() for k, v in model.state_dict().items()})
    return _references[fused]


def paddle_plan(model):
    """PaddleFormers' own tensor-parallel plan (what auto_dist_config returns), keys respelled `model.`,
    Paddle's plan objects swapped for paddle_cp's of the same name and arguments."""
    from paddleformers.transformers.llama.auto_dist_config import get_dist_config  # auto_dist_config() asserts a flag

    plan = get_dist_config(model)["mp_config"]["parallelize_plan"]
    ours = {}
    for key, value in plan.items():
        args = {a: getattr(value, a) for a in ("gather_output", "is_input_parallel") if hasattr(value, a)}
        ours[key.replace("llama.", "model.")] = getattr(pcp, type(value).__name__)(**args)
    return ours


def sequence_parallel_plan():
    """Paddle's documented sequence-parallel layout for Llama (seed example), unfused projections."""
    return {
        "model.embed_tokens": [pcp.ColWiseParallel(), pcp.SequenceParallelBegin()],
        "model.layers.*.self_attn.q_proj": pcp.ColWiseParallel(),
        "model.layers.*.self_attn.k_proj": pcp.ColWiseParallel(),
        "model.layers.*.self_attn.v_proj": pcp.ColWiseParallel(),
        "model.layers.*.self_attn.o_proj": pcp.RowWiseParallel(),
        "model.layers.*.self_attn": pcp.SequenceParallelDisable(),
        "model.layers.*.mlp.gate_proj": pcp.ColWiseParallel(),
        "model.layers.*.mlp.up_proj": pcp.ColWiseParallel(),
        "model.layers.*.mlp.down_proj": pcp.RowWiseParallel(),
        "model.layers.*.mlp": pcp.SequenceParallelDisable(need_transpose=False),
        "lm_head.weight": pcp.ColWiseParallel(),
        "lm_head": pcp.SequenceParallelEnd(),
    }


def fused_plan():
    return {
        "model.embed_tokens": pcp.ColWiseParallel(),
        "model.layers.*.self_attn.qkv_proj": pcp.ColWiseParallel(),
        "model.layers.*.self_attn.o_proj": pcp.RowWiseParallel(),
        "model.layers.*.mlp.gate_up_proj": pcp.ColWiseParallel(),
        "model.layers.*.mlp.down_proj": pcp.RowWiseParallel(),
        "lm_head.weight": pcp.ColWiseParallel(),
    }


CP_PLAN = {"model": pcp.PrepareContextParallel("p2p"), "model.layers.*.self_attn": pcp.ContextParallel("p2p")}


def local_bytes(model, optimizer):
    params = sum(int(p.numel()) * p.element_size() for p in model.parameters())
    grads = sum(int(p.grad.numel()) * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    state = sum(int(t.numel()) * t.element_size()
                for per_param in optimizer.inner._accumulators.values() for t in per_param.values())
    return {"params": params, "grads": grads, "optimizer_state": state}


def train(report, name, dims, plan=None, sp=False, cp=False, level=0, fused=False):
    world = dist.get_world_size()
    shape = [d for _, d in dims]
    mesh = dist.ProcessMesh(np.arange(world).reshape(shape).tolist(), dim_names=[n for n, _ in dims])
    model, optimizer = build(fused)
    config = {"dp_config": {"sharding_level": level}}
    if plan is not None:
        config["mp_config"] = {"parallelize_plan": plan(model) if callable(plan) else plan}
    if cp:
        config["cp_config"] = {"parallelize_plan": CP_PLAN}
    model, optimizer = pcp.parallelize(model, optimizer, mesh=mesh, config=config)
    losses = []
    for ids, labels in batches():
        ids, labels = pcp.shard_batch((ids, labels), mesh=mesh)
        if cp:
            labels = pcp.shard_sequence(labels, mesh=mesh)
        kwargs = {"position_ids": positions(ids.shape[0])} if sp else {}
        loss = model(input_ids=ids, labels=labels, **kwargs)[0]
        loss.backward()
        optimizer.step()
        if len(losses) == STEPS - 1:
            report.value(f"{name}.bytes", local_bytes(model, optimizer))
        optimizer.clear_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # mp copies are equal: the world mean is the dp x sep mean
        losses.append(float(total) / world)
    want_losses, want_state = reference(fused)
    report.diff(f"{name}.loss", np.array(losses), np.array(want_losses))
    state = pcp.full_state_dict(model)
    report.value(f"{name}.state_keys_match", sorted(state) == sorted(want_state))
    for key, value in want_state.items():
        report.diff(f"{name}.state.{key}", state.get(key, np.zeros([0])), value)


RUNS = {
    "hybrid": [
        dict(name="dp2xmp2", dims=[("dp", 2), ("mp", 2)], plan=paddle_plan),
        dict(name="dp2xmp2_sp", dims=[("dp", 2), ("mp", 2)], plan=sequence_parallel_plan(), sp=True),
        dict(name="mp2xsep2", dims=[("mp", 2), ("sep", 2)], plan=paddle_plan, cp=True),
        dict(name="dp2xsep2_l2", dims=[("dp", 2), ("sep", 2)], cp=True, level=2),
        dict(name="dp2xmp2_fused", dims=[("dp", 2), ("mp", 2)], plan=fused_plan(), fused=True),
    ],
    "sharding": [dict(name=f"dp4_l{level}", dims=[("dp", 4)], level=level) for level in range(4)]
    + [dict(name="dp2xmp2_sp_l3", dims=[("dp", 2), ("mp", 2)], plan=sequence_parallel_plan(), sp=True, level=3)],
}


def main(report):
    for spec in RUNS[sys.argv[1]]:
        train(report, **spec)


if __name__ == "__main__":
    run(main)
