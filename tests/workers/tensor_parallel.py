"""PaddleFormers models (and a small model for the remaining plan variants) under tensor /
sequence / context / data parallel vs one card.

Every run builds the model from one seed, trains three AdamW steps (two parameter
groups with their own lr and weight decay, ClipGradByGlobalNorm) on its part of
a global batch, and compares the global loss of each step and the final
full_state_dict with a single-card run on the whole batch, done here too.
argv[1] names the group of runs (one launch each).
"""
import contextlib
import sys

import numpy as np
import paddle
import paddle.distributed as dist
from plan_variants import VOCAB as SMALL_VOCAB
from paddleformers_models import build as build_family
from plan_variants import add_reference_hooks, small_model, variants_plan
from report import run

import paddle_cp as pcp
from paddle_cp.comm import collectives
from paddle_cp.data_parallel.parameter_fetch import full_nbytes
from paddle_cp.params import record_of

BATCH, SEQ, STEPS, CLIP = 4, 16, 3, 0.5
# Adam's step lr * m / (sqrt(v) + eps) turns fp32 rounding noise into steps of up to lr
# wherever a gradient entry is near zero: with Paddle's default eps (1e-8) no two runs that
# differ only in summation order agree to 1e-5 (see rounding_spread). eps=1e-3 makes the
# update well conditioned, so parameters are held to 1e-5; DEFAULT_EPSILON runs check
# the default against the spread instead.
WELL_CONDITIONED_EPSILON, DEFAULT_EPSILON = 1e-3, 1e-8
JITTER_SEEDS = range(4)


def llama():
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(**_tiny_config()))


def llama_chunked_loss():
    """PaddleFormers' fused lm_head + chunked loss: its lm_head hands (hidden states, weight, ...) to the loss."""
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(**_tiny_config(), use_fused_head_and_loss_fn=True,
                                        loss_subbatch_sequence_length=4))


def phi3():
    """Fused projections: qkv_proj, gate_up_proj."""
    from paddleformers.transformers import Phi3Config, Phi3ForCausalLM
    return Phi3ForCausalLM(Phi3Config(**_tiny_config()))


def _tiny_config():
    """As users build them: PaddleFormers' default (eager) attention."""
    return dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, fuse_rms_norm=False)


MODELS = {"llama": llama, "llama_chunked_loss": llama_chunked_loss, "phi3": phi3, "small": small_model}


def build(model_name, epsilon):
    paddle.seed(2024)
    model = MODELS[model_name]()
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    rest = [p for n, p in model.named_parameters() if "norm" not in n]
    optimizer = paddle.optimizer.AdamW(
        learning_rate=1e-2, weight_decay=0.1, epsilon=epsilon, grad_clip=paddle.nn.ClipGradByGlobalNorm(CLIP),
        parameters=[{"params": rest}, {"params": norms, "weight_decay": 0.0, "learning_rate": 3.0}])
    return model, optimizer


def ids_range(model_name):
    return SMALL_VOCAB if model_name == "small" else _tiny_config()["vocab_size"]


def batches(model_name):
    rng = np.random.RandomState(7)
    for _ in range(STEPS):
        ids = paddle.to_tensor(rng.randint(0, ids_range(model_name), [BATCH, SEQ]), dtype="int64")
        labels = paddle.to_tensor(rng.randint(0, ids_range(model_name), [BATCH, SEQ]), dtype="int64")
        yield ids, labels


def positions(batch):
    return paddle.arange(SEQ, dtype="int64").unsqueeze(0).expand([batch, SEQ])


def _jitter(model, seed):
    """Move every initial weight by one fp32 ulp, up or down at random: a rounding-level change."""
    rng = np.random.RandomState(seed)
    for p in model.parameters():
        value = p.numpy()
        p.set_value(np.nextafter(value, np.where(rng.rand(*value.shape) < 0.5, -np.inf, np.inf).astype(value.dtype)))


def clipped_gradients(model, optimizer):
    """{name: gradient} as ClipGradByGlobalNorm hands it to AdamW: each parameter group by its own norm."""
    names = {id(p): n for n, p in model.named_parameters()}
    clipped = {}
    for group in optimizer._param_groups:
        grads = [p.grad.numpy() for p in group["params"]]
        norm = np.sqrt(sum(float(np.square(g.astype(np.float64)).sum()) for g in grads))
        clipped.update({names[id(p)]: g * min(1.0, CLIP / norm) for p, g in zip(group["params"], grads)})
    return clipped


_references = {}


def reference(model_name, epsilon, jitter_seed=None):
    """Losses, first-step clipped gradients and final state dict of one card on the global batch."""
    key = (model_name, epsilon, jitter_seed)
    if key not in _references:
        model, optimizer = build(model_name, epsilon)
        if model_name == "small":
            add_reference_hooks(model)
        if jitter_seed is not None:
            _jitter(model, jitter_seed)
        losses, first_grads = [], None
        for ids, labels in batches(model_name):
            loss = model(input_ids=ids, labels=labels, **({} if model_name == "small" else
                                                           {"position_ids": positions(BATCH)}))[0]
            loss.backward()
            first_grads = first_grads or clipped_gradients(model, optimizer)
            optimizer.step()
            optimizer.clear_grad()
            losses.append(float(loss))
        _references[key] = (np.array(losses), first_grads, {k: v.numpy() for k, v in model.state_dict().items()})
    return _references[key]


def rounding_spread(model_name, epsilon):
    """Largest loss and state differences between one card and the same card started from weights
    one ulp away (JITTER_SEEDS): what fp32 rounding alone does to three AdamW steps."""
    losses, _, state = reference(model_name, epsilon)
    spread = {"loss": 0.0, "state": 0.0}
    for seed in JITTER_SEEDS:
        other_losses, _, other_state = reference(model_name, epsilon, seed)
        spread["loss"] = max(spread["loss"], float(np.abs(other_losses - losses).max()))
        spread["state"] = max(spread["state"], max(float(np.abs(other_state[k] - v).max()) for k, v in state.items()))
    return spread


def full_gradients(model):
    """{name: full gradient} from this rank's tensor-parallel slices (sharding level 0); frozen parameters
    (no gradient on any rank) are left out."""
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        shards = record_of(p).shards()
        grads[name] = p.grad.numpy() if not shards else shards[0].assemble(
            [g.numpy() for g in collectives.all_gather(shards[0].group, p.grad, tag="test_gradients")])
    return grads


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


def fetched_per_forward(model):
    """Level 3: bytes of the full copies one forward fetches (each layer's parameters, at full size):
    what would be held until backward if the copies were not freed after forward."""
    return sum(full_nbytes(p) for layer in model.sublayers(include_self=True)
               for p in layer._parameters.values() if p is not None)


def train(report, name, dims, plan=None, explicit_positions=False, cp=False, level=0, model="llama",
          epsilon=WELL_CONDITIONED_EPSILON, shard_dims=None):
    model_name, world = model, dist.get_world_size()
    shape = [d for _, d in dims]
    mesh = dist.ProcessMesh(np.arange(world).reshape(shape).tolist(), dim_names=[n for n, _ in dims])
    model, optimizer = build(model_name, epsilon)
    config = {"dp_config": {"sharding_level": level, "sharding_mesh_dim": shard_dims}}
    if plan is not None:
        config["mp_config"] = {"parallelize_plan": plan(model) if callable(plan) else plan}
    if cp:
        config["cp_config"] = {"parallelize_plan": CP_PLAN}
    model, optimizer = pcp.parallelize(model, optimizer, mesh=mesh, config=config)
    want_losses, want_grads, want_state = reference(model_name, epsilon)
    losses = []
    for ids, whole_labels in batches(model_name):
        ids, whole_labels = pcp.shard_batch((ids, whole_labels), mesh=mesh)
        labels = pcp.shard_sequence(whole_labels, mesh=mesh) if cp else whole_labels
        kwargs = {"position_ids": positions(ids.shape[0])} if explicit_positions else {}
        loss = model(input_ids=ids, labels=labels, **kwargs)[0]
        loss.backward()
        optimizer.step()
        if len(losses) == STEPS - 1:
            report.value(f"{name}.bytes", local_bytes(model, optimizer))
            report.value(f"{name}.largest_param_bytes", max(full_nbytes(p) for p in model.parameters()))
            if level == 3:
                report.value(f"{name}.gathered", {"peak": optimizer._sharding.gathered.peak,
                                                  "held_now": optimizer._sharding.gathered.held,
                                                  "one_forward": fetched_per_forward(model)})
        if not losses and epsilon == DEFAULT_EPSILON:  # before Adam has amplified anything: exact
            for key, grad in full_gradients(model).items():
                report.diff(f"{name}.step1.grad.{key}", grad, want_grads[key])
        optimizer.clear_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # mp copies are equal: the world mean is the dp x sep mean
        losses.append(float(total) / world)
    report.diff(f"{name}.loss", np.array(losses), want_losses)
    state = pcp.full_state_dict(model)
    report.value(f"{name}.state_keys_match", sorted(state) == sorted(want_state))
    for key, value in want_state.items():
        report.diff(f"{name}.state.{key}", state.get(key, np.zeros([0])), value)
    if epsilon == DEFAULT_EPSILON:
        report.diff(f"{name}.step1.loss", losses[0], want_losses[0])
        report.value(f"{name}.rounding_spread", rounding_spread(model_name, epsilon))
    if cp:  # the whole labels: check_parity splits them for the inner model's PrepareContextParallel
        report.value(f"{name}.check_parity", pcp.check_parity(model, input_ids=ids, labels=whole_labels, **kwargs))
    if level == 3:
        report.value(f"{name}.restored_after_error",
                     placeholders_restored_after_error(model, optimizer, model.model.embed_tokens))


def placeholders_restored_after_error(model, optimizer, layer):
    """Level 3: a layer whose forward raises gets its placeholder parameters back (no full copy left)."""
    held = [(sub, dict(sub._parameters)) for sub in model.sublayers(include_self=True)]
    try:
        layer(paddle.ones([2, 2], "float32"))  # an embedding refuses float ids, after the fetch
    except Exception:  # noqa: BLE001 - any error in the forward will do
        pass
    restored = all(sub._parameters[k] is v for sub, params in held for k, v in params.items())
    return restored and optimizer._sharding.gathered.held == 0


MP2_SEP2 = [("mp", 2), ("sep", 2)]
DP2_MP2 = [("dp", 2), ("mp", 2)]
RUNS = {
    "hybrid": [
        dict(name="dp2xmp2", dims=DP2_MP2, plan=paddle_plan),
        dict(name="dp2xmp2_default_eps", dims=DP2_MP2, plan=paddle_plan, epsilon=DEFAULT_EPSILON),
        dict(name="dp2xmp2_sp", dims=DP2_MP2, plan=sequence_parallel_plan()),  # no position_ids given
        dict(name="mp2xsep2", dims=MP2_SEP2, plan=paddle_plan, cp=True),
        dict(name="mp2xsep2_chunked_loss", dims=MP2_SEP2, plan=paddle_plan, cp=True, model="llama_chunked_loss"),
        dict(name="mp2xsep2_sp", dims=MP2_SEP2, plan=sequence_parallel_plan(), explicit_positions=True, cp=True),
        dict(name="dp2xsep2_l2", dims=[("dp", 2), ("sep", 2)], cp=True, level=2),
        dict(name="dp2xmp2_fused", dims=DP2_MP2, plan=fused_plan(), model="phi3"),
        dict(name="dp2xmp2_variants", dims=DP2_MP2, plan=variants_plan(), model="small"),
    ],
    "sharding": [dict(name=f"dp4_l{level}", dims=[("dp", 4)], level=level) for level in range(4)]
    + [dict(name="dp2xmp2_sp_l3", dims=DP2_MP2, plan=sequence_parallel_plan(), explicit_positions=True, level=3)]
    # sharded over every rank holding a replica: the context-parallel ranks too (dp2xsep2_l2 is in "hybrid")
    + [dict(name=f"sep4_l{level}", dims=[("sep", 4)], cp=True, level=level) for level in (1, 2, 3)]
    + [dict(name=f"dp2xsep2_l{level}", dims=[("dp", 2), ("sep", 2)], cp=True, level=level) for level in (1, 3)]
    + [dict(name="dp2xsep2_l3_dp_only", dims=[("dp", 2), ("sep", 2)], cp=True, level=3, shard_dims="dp"),
       dict(name="mp2xsep2_sp_l3", dims=MP2_SEP2, plan=sequence_parallel_plan(), explicit_positions=True, cp=True,
            level=3)],
}


class TokenMixer(paddle.nn.Layer):
    """A model paddle_cp never saw: `running_sum` mixes tokens along the sequence without any attention
    call (each rank would sum its own tokens only); without it every token is computed alone."""

    def __init__(self, running_sum):
        super().__init__()
        self.running_sum = running_sum
        self.embed = paddle.nn.Embedding(128, 16)
        self.proj = paddle.nn.Linear(16, 16)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        return self.proj(paddle.cumsum(x, axis=1) if self.running_sum else x)


def parity_checks(report):
    """check_parity on dp2 x sep2 (each dp replica its own batch, uneven 13-token sequences): PaddleFormers'
    Llama returning a ModelOutput (PrepareContextParallel on the model itself, labels split by it), and
    models returning a Tensor: token-wise (exact) and mixing tokens outside any attention (caught); Qwen3-Next
    with its attention and Gated DeltaNet layers under ContextParallel."""
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "sep"])
    paddle.seed(3)
    ids, labels = pcp.shard_batch((paddle.randint(0, 128, [4, 13]), paddle.randint(0, 128, [4, 13])), mesh=mesh)
    labels[0, :5] = -100  # ranks hold different numbers of labelled tokens
    model, _ = build("llama", WELL_CONDITIONED_EPSILON)
    plan = {"": pcp.PrepareContextParallel("all2all"), "model.layers.*.self_attn": pcp.ContextParallel("all2all")}
    pcp.parallelize(model, None, mesh, {"cp_config": {"parallelize_plan": plan}})
    report.value("parity.model_output", pcp.check_parity(model, input_ids=ids, labels=labels, return_dict=True))
    # the second replica's sep ranks disagree: every rank of both replicas raises (none left waiting for it)
    differing = (ids + int(dist.get_rank() == 3)) % 128
    report.expect_error("replica_batch_differs", lambda: model(input_ids=differing, labels=labels))
    # a batch only the second replica's ranks refuse (1 token over 2 sep ranks): every rank stops
    cut = 1 if dist.get_rank() >= 2 else 13
    report.expect_error("replica_batch_refused", lambda: model(input_ids=ids[:, :cut], labels=labels[:, :cut]))
    with paddle.no_grad():  # the first replica evaluates alone: its check gathers over its own ranks
        if dist.get_rank() < 2:
            model(input_ids=ids, labels=labels)
    report.value("replica_evaluated_alone", float(model(input_ids=ids, labels=labels)[0]))
    for running_sum in (False, True):
        report.value(f"parity.running_sum_{running_sum}", pcp.check_parity(mixer_of(mesh, running_sum), input_ids=ids))
    report.expect_error("parity.not_parallelized", lambda: pcp.check_parity(TokenMixer(False), input_ids=ids))
    for backend in ("p2p", "all2all"):
        hybrid = qwen3_next(mesh, backend)
        parity = pcp.check_parity(hybrid, input_ids=ids, labels=labels)
        if backend == "p2p":
            report.value("parity.qwen3_next", parity)
        report.value(f"parity.qwen3_next.{backend}", parity.as_dict())
        report.value(f"parity.qwen3_next.{backend}.printed", str(parity))
        with planted_fault(backend):
            report.value(f"parity.qwen3_next.{backend}.fault", pcp.check_parity(hybrid, input_ids=ids,
                                                                                  labels=labels).as_dict())
    exact = pcp.check_parity(mixer_of(mesh, running_sum=False), reference="float64", input_ids=ids)
    report.value("parity.float64_asked", exact.as_dict())
    report.expect_error("parity.bad_reference", lambda: pcp.check_parity(hybrid, reference="fp64", input_ids=ids))
    low_precision_parity(report, mesh, ids, labels)


def low_precision_parity(report, mesh, ids, labels):
    """check_parity on a bf16 O2 Llama (dp2 x sep2, ring attention) under the emulated AMP (tests/workers/
    emulated_amp.py, installed for the rest of the process: run last): a correct run is as close to the
    model's fp32 run as one card (within 2x); with a planted fault it is not."""
    import emulated_amp

    from paddle_cp.attention.algorithms import ring
    emulated_amp.install()
    model, _ = build("llama", WELL_CONDITIONED_EPSILON)
    plan = {"": pcp.PrepareContextParallel("p2p"), "model.layers.*.self_attn": pcp.ContextParallel("p2p")}
    pcp.parallelize(model, None, mesh, {"cp_config": {"parallelize_plan": plan}})
    paddle.amp.decorate(models=model, level="O2", dtype="bfloat16")
    exact = ring.merge
    faults = {"": exact,  # planted: each ring block's log-sum-exp 20% off; every ring block after the first left out
              ".lse_off": lambda out, lse, block_out, block_lse: exact(out, lse, block_out, block_lse * 1.2),
              ".dropped": lambda out, lse, block_out, block_lse: (block_out, block_lse) if out is None else (out, lse)}
    for name, merge in faults.items():
        ring.merge = merge
        try:
            with paddle.amp.auto_cast(level="O2", dtype="bfloat16"):
                parity = pcp.check_parity(model, input_ids=ids, labels=labels)
        finally:
            ring.merge = exact
        report.value(f"parity.bf16{name}", parity.as_dict())
        report.value(f"parity.bf16{name}.printed", str(parity))


def qwen3_next(mesh, backend):
    """Qwen3-Next (Gated DeltaNet layers, state passing on p2p, and attention) with ContextParallel on both."""
    paddle.seed(3)
    model = build_family("qwen3_next")
    plan = {"": pcp.PrepareContextParallel(backend), "model.layers.*.self_attn": pcp.ContextParallel(backend),
            "model.layers.*.linear_attn": pcp.ContextParallel(backend)}
    return pcp.parallelize(model, None, mesh, {"cp_config": {"parallelize_plan": plan}})[0]


def mixer_of(mesh, running_sum):
    paddle.seed(3)
    mixer = TokenMixer(running_sum)
    return pcp.parallelize(mixer, None, mesh, {"cp_config": {"parallelize_plan": {"": pcp.PrepareContextParallel()}}})[0]


@contextlib.contextmanager
def planted_fault(backend):
    """A fault as small as rounding, which only the float64 verdict tells from it: the ranks exchange in
    bfloat16 what the backend exchanges in fp32. p2p: the Gated DeltaNet state entering each rank's runs
    (docs/hybrid_models.md measured 16-530x one card's distance); all2all: every all-to-all's payload."""
    from paddle_cp.attention.algorithms import state_passing
    from paddle_cp.comm import collectives as comm

    def rounded(x):
        return x.astype("bfloat16").astype(x.dtype)

    module, name = (state_passing, "entering_states") if backend == "p2p" else (comm, "all_to_all")
    exact = getattr(module, name)
    if backend == "p2p":
        faulty = lambda *args, **kwargs: {run: rounded(state) for run, state in exact(*args, **kwargs).items()}
    else:
        faulty = lambda group, chunks, *args, **kwargs: exact(group, [rounded(c) for c in chunks], *args, **kwargs)
    setattr(module, name, faulty)
    try:
        yield
    finally:
        setattr(module, name, exact)


def main(report):
    groups = sys.argv[1:]
    for spec in (spec for group in groups for spec in RUNS[group]):
        train(report, **spec)
    if "hybrid" in groups:
        parity_checks(report)


if __name__ == "__main__":
    run(main)
