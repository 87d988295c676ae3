"""The bad-input table on 2 ranks: each case must raise the same clear error on every rank
before any collective; then saves that fail to write on one rank, which must raise on every
rank and publish nothing. argv[1]: a scratch directory shared by the ranks.

After the table one all_reduce checks that no case left a rank inside a collective:
a case that had issued one on a single rank would make it mismatch or time out.
"""
import os
import shutil
import sys

import numpy as np
import paddle
import paddle.distributed as dist
from llama_models import build_llama
from report import run

import paddle_cp as pcp
from paddle_cp.checkpoint import api, export
from paddle_cp.checkpoint.format import write_state
from paddle_cp.checkpoint.safetensors_writer import StreamingFile
from paddle_cp.comm import watchdog


def sep2():
    return dist.ProcessMesh([0, 1], dim_names=["sep"])


def mp2():
    return dist.ProcessMesh([0, 1], dim_names=["mp"])


def small():
    paddle.seed(5)
    return paddle.nn.Sequential(paddle.nn.Linear(4, 6), paddle.nn.Linear(6, 3))


def adamw(model):
    return paddle.optimizer.AdamW(1e-3, parameters=model.parameters())


def parallelize_small(config, mesh=None):
    model = small()
    return pcp.parallelize(model, adamw(model), mesh if mesh is not None else sep2(), config)


def mp_plan(plan):
    return {"mp_config": {"parallelize_plan": plan}}


def parallel_cases():
    llama = build_llama("paddleformers")
    return {
        "unknown_config_key": lambda: parallelize_small({"tp_config": {}}),
        "pp_without_pp_dim": lambda: parallelize_small({"pp_config": {"split_spec": "layers"}}),
        "dp_config_type": lambda: parallelize_small({"dp_config": [1]}),
        "dp_config_key": lambda: parallelize_small({"dp_config": {"level": 1}}),
        "sharding_level": lambda: parallelize_small({"dp_config": {"sharding_level": 5}}),
        "mp_config_type": lambda: parallelize_small({"mp_config": 3}),
        "mp_config_key": lambda: parallelize_small({"mp_config": {"plan": {}}}),
        "plan_twice": lambda: parallelize_small({**mp_plan({"0": pcp.ColWiseParallel()}),
                                                 "cp_config": {"parallelize_plan": {"0": pcp.ColWiseParallel()}}}),
        "plan_not_a_plan": lambda: parallelize_small(mp_plan({"0": "ColWiseParallel"}), mp2()),
        "mesh_type": lambda: parallelize_small(mp_plan({"0": pcp.ColWiseParallel()}), mesh="mp"),
        # a mesh over ranks the launch lacks, or leaving one out: every rank raises before any group's rendezvous
        "mesh_beyond_launch": lambda: parallelize_small(
            mp_plan({"0": pcp.ColWiseParallel()}), dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])),
        "mesh_short_of_launch": lambda: parallelize_small(mp_plan({"0": pcp.ColWiseParallel()}),
                                                          dist.ProcessMesh([0], dim_names=["mp"])),
        "colwise_not_dividing": lambda: parallelize_small(mp_plan({"1": pcp.ColWiseParallel()}), mp2()),
        "colwise_no_weight": lambda: pcp.parallelize(paddle.nn.Sequential(paddle.nn.ReLU()), None, mp2(),
                                                     mp_plan({"0": pcp.ColWiseParallel()})),
        "tied_weight_half_planned": lambda: pcp.parallelize(llama, None, mp2(),
                                                           mp_plan({"model.embed_tokens": pcp.RowWiseParallel()})),
        "cp_plan_matches_nothing": lambda: pcp.parallelize(llama, None, sep2(), {"cp_config": {"parallelize_plan": {
            "llama": pcp.PrepareContextParallel("p2p"), "llama.layers.*.self_attn": pcp.ContextParallel("p2p")}}}),
        "cp_without_sep": lambda: pcp.parallelize(llama, None, mp2(), {"cp_config": {"parallelize_plan": {
            "model": pcp.PrepareContextParallel("p2p")}}}),
        "gather_output_type": lambda: pcp.ColWiseParallel(gather_output="yes"),
        "is_input_parallel_type": lambda: pcp.RowWiseParallel(is_input_parallel=1),
        "need_transpose_type": lambda: pcp.SequenceParallelBegin(need_transpose="no"),
        "layer_hook_type": lambda: pcp.PrepareLayerInput(3),
        "unknown_backend": lambda: pcp.PrepareContextParallel("ring"),
        "unknown_rotation": lambda: pcp.ContextParallel("p2p", rotate="spiral"),
        "hybrid_without_degree": lambda: pcp.ContextParallel("hybrid"),
        "documents_kind": lambda: pcp.PrepareContextParallel("p2p", documents=5),
    }


def functional_cases():
    q = paddle.zeros([1, 4, 2, 8])
    return {
        "attention_3d": lambda: pcp.ring_attention(q[0], q[0], q[0], mesh=sep2()),
        "attention_mesh_beyond_launch": lambda: pcp.ring_attention(
            q, q, q, mesh=dist.ProcessMesh([0, 1, 2, 3], dim_names=["sep"])),
        "attention_dropout": lambda: pcp.ring_attention(q, q, q, dropout_p=0.1, mesh=sep2()),
        "attention_shapes": lambda: pcp.ring_attention(q, paddle.zeros([1, 4, 2, 4]), q, mesh=sep2()),
        "batch_not_dividing": lambda: pcp.shard_batch(paddle.zeros([3, 4]),
                                                      mesh=dist.ProcessMesh([0, 1], dim_names=["dp"])),
        "yaml_unknown_plan": lambda: pcp.load_config(
            {"mesh": {"shape": [2], "dim_names": ["sep"]}, "cp_config": {"parallelize_plan": {"model": "Nope"}}},
            world_size=2),
        "yaml_mesh_size": lambda: pcp.load_config({"mesh": {"shape": [2, 2], "dim_names": ["dp", "sep"]}},
                                                  world_size=2),
        "yaml_not_mapping": lambda: pcp.load_config(["mesh"], world_size=2),
        "timeout_negative": lambda: pcp.set_timeout(-1),
        "timeout_text": lambda: pcp.set_timeout("5"),
        "timeout_env": _bad_env_timeout,
    }


def _bad_env_timeout():
    os.environ[watchdog.ENV_VAR] = "soon"
    try:
        watchdog.get_timeout()
    finally:
        del os.environ[watchdog.ENV_VAR]


def make_checkpoints(root):
    """A good checkpoint of `small()` after one AdamW step, and damaged copies (rank 0 damages)."""
    model = small()
    optimizer = adamw(model)
    model(paddle.ones([2, 4])).sum().backward()
    optimizer.step()
    good = os.path.join(root, "good")
    pcp.save_checkpoint(good, model, optimizer, extra={"step": 1})
    if dist.get_rank() == 0:
        damage = {
            "truncated": lambda p: _truncate(os.path.join(p, "model_state", "1_0.distcp")),
            "missing_file": lambda p: os.remove(os.path.join(p, "model_state", "0_0.distcp")),
            "no_marker": lambda p: os.remove(os.path.join(p, "pcp_checkpoint.json")),
            "garbage_metadata": lambda p: _scramble(os.path.join(p, "model_state", "0.metadata")),
        }
        for name, fn in damage.items():
            shutil.copytree(good, os.path.join(root, name))
            fn(os.path.join(root, name))
    dist.barrier()
    return good


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 7)


def _scramble(path):
    with open(path, "r+b") as f:
        f.write(b"\0" * os.path.getsize(path))  # same size: only the content check can tell


def checkpoint_cases(root, good):
    def load(name, model=None, optimizer=None):
        model = model or small()
        return lambda: pcp.load_checkpoint(os.path.join(root, name), model, optimizer)

    wider = paddle.nn.Sequential(paddle.nn.Linear(4, 8), paddle.nn.Linear(8, 3))
    double = small()
    double.to(dtype="float64")  # an fp32 checkpoint loads into float16/bfloat16 (O2) models only
    model = small()
    return {
        "save_existing_path": lambda: pcp.save_checkpoint(good, model),
        "save_extra_not_json": lambda: pcp.save_checkpoint(os.path.join(root, "x"), model, extra={"t": paddle.ones([1])}),
        "save_unsupported_optimizer": lambda: pcp.save_checkpoint(
            os.path.join(root, "x"), model, paddle.optimizer.Adagrad(0.1, parameters=model.parameters())),
        "save_async_type": lambda: pcp.save_checkpoint(os.path.join(root, "x"), model, async_save="yes"),
        "save_model_type": lambda: pcp.save_checkpoint(os.path.join(root, "x"), {"w": paddle.ones([1])}),
        "load_no_such_path": load("nowhere"),
        "load_no_marker": load("no_marker"),
        "load_truncated": load("truncated"),
        "load_missing_file": load("missing_file"),
        "load_garbage_metadata": load("garbage_metadata"),
        "load_wrong_shape": load("good", wider),
        "load_wrong_dtype": load("good", double),
        "load_other_model": load("good", paddle.nn.Sequential(paddle.nn.Linear(4, 3))),
        "load_other_optimizer": load("good", model, paddle.optimizer.Momentum(0.1, parameters=model.parameters())),
        "latest_not_a_path": lambda: pcp.latest_checkpoint(5),
        "export_plain_layer": lambda: pcp.export_pretrained(small(), os.path.join(root, "export")),
    }


def _fail_to_write(*args, **kwargs):
    raise OSError("no space left on device (simulated)")


def write_failures(report, root):
    """Rank 1 cannot write its files: every rank raises, at once or at wait_checkpoint (async)."""
    model = small()
    optimizer = adamw(model)
    pcp.save_checkpoint(os.path.join(root, "w0"), model, optimizer)
    if dist.get_rank() == 1:
        api.write_state = _fail_to_write
    report.expect_error("save_write_fails", lambda: pcp.save_checkpoint(os.path.join(root, "w1"), model, optimizer))
    pcp.save_checkpoint(os.path.join(root, "w2"), model, optimizer, async_save=True)  # returns at once
    report.expect_error("async_save_write_fails", pcp.wait_checkpoint)
    api.write_state = write_state
    report.value("latest_after_failures", pcp.latest_checkpoint(root))
    report.value("saved", sorted(os.listdir(root)))


def export_failure(report, root):
    """Rank 0 cannot write the export: every rank raises the same error (none waits for rank 0)."""
    model = build_llama("paddleformers")
    if dist.get_rank() == 0:
        def fail(*args, **kwargs):
            raise OSError("disk full")
        export.StreamingFile = fail
    report.expect_error("export_write_fails", lambda: pcp.export_pretrained(model, os.path.join(root, "export")))
    export.StreamingFile = StreamingFile


def disagreeing_ranks(report, root, good):
    """Rank 1 builds a wider model than rank 0: both ranks raise the same error, at the first step."""
    model = small() if dist.get_rank() == 0 else paddle.nn.Sequential(paddle.nn.Linear(4, 8), paddle.nn.Linear(8, 3))
    report.expect_error("ranks_disagree_save", lambda: pcp.save_checkpoint(os.path.join(root, "d"), model))
    report.expect_error("ranks_disagree_load", lambda: pcp.load_checkpoint(good, model))


def context_parallel_llama():
    paddle.seed(5)
    model = build_llama("paddleformers")
    plan = {"": pcp.PrepareContextParallel("p2p"), "model.layers.*.self_attn": pcp.ContextParallel("p2p")}
    return pcp.parallelize(model, None, sep2(), {"cp_config": {"parallelize_plan": plan}})[0]


def differing_batches(report):
    """Ranks of one sep group passing different batches (a data-parallel habit): the same error on every
    rank, at the first forward. Then the check's traffic: one gather per forward, none again when a
    recompute of the whole model replays it in backward."""
    from paddle.distributed.fleet.utils import recompute

    model, rank = context_parallel_llama(), dist.get_rank()
    paddle.seed(11)
    ids, labels = paddle.randint(0, 128, [2, 13]), paddle.randint(0, 128, [2, 13])
    report.expect_error("batch_differs", lambda: model(input_ids=(ids + rank) % 128, labels=labels))
    report.expect_error("labels_differ", lambda: model(input_ids=ids, labels=(labels + rank) % 128))
    report.expect_error("batch_shapes_differ", lambda: model(input_ids=paddle.randint(0, 128, [2, 13 + rank])))
    gathered = {}
    for name, forward in {"plain": lambda: model(input_ids=ids, labels=labels)[0],
                          "whole_model_recompute": lambda: recompute(model, ids, None, None, None, None, labels,
                                                                     use_reentrant=False)[0]}.items():
        pcp.reset_counters()
        forward().backward()
        gathered[name] = pcp.bytes_sent().get("cp_batch_check", 0)
    report.value("batch_check_bytes", gathered)


def whole_labels_with_an_inner_prepare(report):
    """Paddle's spelling, PrepareContextParallel on the inner model, with the labels passed whole to the outer one:
    the same error on every rank at the first forward, naming the fix (not Paddle's logits/labels shape error)."""
    paddle.seed(5)
    plan = {"model": pcp.PrepareContextParallel("p2p"), "model.layers.*.self_attn": pcp.ContextParallel("p2p")}
    model = pcp.parallelize(build_llama("paddleformers"), None, sep2(), {"cp_config": {"parallelize_plan": plan}})[0]
    ids = paddle.randint(0, 128, [2, 13])
    report.expect_error("labels_whole_inner_prepare", lambda: model(input_ids=ids, labels=ids))


def main(report):
    pcp.set_mesh(sep2())
    differing_batches(report)
    whole_labels_with_an_inner_prepare(report)
    good = make_checkpoints(sys.argv[1])
    cases = {**parallel_cases(), **functional_cases(), **checkpoint_cases(sys.argv[1], good)}
    for name, fn in cases.items():
        report.expect_error(name, fn)
    disagreeing_ranks(report, sys.argv[1], good)
    write_failures(report, os.path.join(sys.argv[1], "failures"))
    export_failure(report, sys.argv[1])
    flag = paddle.to_tensor(np.array([1], dtype="int32"))
    dist.all_reduce(flag)
    report.value("ranks_in_step", int(flag.numpy()[0]))
    report.value("good_loads", pcp.load_checkpoint(good, small(), adamw(small())))


run(main)
