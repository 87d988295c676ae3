"""Checkpoints, failures and bad inputs: multi-rank launches of PaddleFormers Llama vs one card."""
import re
import sys

import numpy as np
import paddle.distributed as dist
from launcher import EXAMPLES, WORKERS, launch, launch_failing, launch_script

import paddle_cp as pcp

sys.path.insert(0, str(WORKERS))
from one_card import trained  # noqa: E402
from tensor_parallel import WELL_CONDITIONED_EPSILON, build  # noqa: E402

TOL = 1e-5
RESUMES = [  # (layout, ranks, load from, save to, flags)
    ("dp2xmp2_l3", 4, "-", "checkpoint-1", []),
    ("sep2_l3", 2, "checkpoint-1", "checkpoint-2", ["async"]),
    ("dp2xmp2_l1", 4, "checkpoint-2", "-", ["export"]),
    ("pp2", 2, "checkpoint-2", "checkpoint-3", []),
]


def assert_close(reports, min_checks):
    for report in reports:
        assert not report["values"].get("crash"), report["values"]["crash"]
        assert len(report["max_abs"]) >= min_checks, report["max_abs"]
        worst = {name: err for name, err in report["max_abs"].items() if not err <= TOL}
        assert not worst, f"rank {report['rank']} beyond {TOL}: {worst}"
        assert all(v for k, v in report["values"].items() if k.endswith("keys_match"))


def test_resume_on_other_layouts_matches_one_card(tmp_path):
    """Save on dp2 x mp2 (level 3), resume on sep2 (level 3: sharded over sep) and in one process; save on
    sep2 (async), resume on
    dp2 x mp2 (level 1), on 2 pipeline stages and in one process: each next step's loss and state
    equal one card's. The dp2 x mp2 run exports its weights for PaddleFormers' from_pretrained; what
    the pipeline saves loads in one process with every optimizer accumulator equal to one card's."""
    for layout, ranks, load_from, save_to, flags in RESUMES:
        reports = launch("checkpoint_resume.py", ranks, layout, tmp_path, load_from, 1, save_to, *flags)
        assert_close(reports, 4 if load_from != "-" else 2)
        print(f"{load_from} -> {layout}: max abs errors {reports[0]['max_abs']}")
        if save_to != "-":
            assert reports[0]["values"]["latest"] == str(tmp_path / save_to)
            if "async" in flags:  # published only by wait_checkpoint
                assert reports[0]["values"]["latest_before_wait"] == str(tmp_path / load_from)
    # Paddle's own single-process reader merges what 4 ranks wrote
    merged = dist.load_merged_state_dict(str(tmp_path / "checkpoint-1" / "model_state"))
    want, _ = trained(1)
    for key, value in want.state_dict().items():
        np.testing.assert_allclose(merged[key].numpy(), value.numpy(), atol=TOL, rtol=0)
    from paddleformers.transformers import LlamaForCausalLM

    exported = LlamaForCausalLM.from_pretrained(str(tmp_path / "export")).state_dict()
    want, want_optimizer = trained(3)
    for key, value in want.state_dict().items():
        np.testing.assert_allclose(exported[key].numpy(), value.numpy(), atol=TOL, rtol=0)
    # what the pipeline stages saved: the model and every accumulator of one card after 3 steps
    model, optimizer = build("llama", WELL_CONDITIONED_EPSILON)
    assert pcp.load_checkpoint(str(tmp_path / "checkpoint-3"), model, optimizer) == {"step": 3}
    for key, value in want.state_dict().items():
        np.testing.assert_allclose(model.state_dict()[key].numpy(), value.numpy(), atol=TOL, rtol=0)
    names = {id(p): n for n, p in want.named_parameters()}
    loaded = dict(model.named_parameters())
    for accumulator, per_param in want_optimizer._accumulators.items():
        for param in want.parameters():
            got = optimizer._accumulators[accumulator][loaded[names[id(param)]].name]
            np.testing.assert_allclose(got.numpy(), per_param[param.name].numpy(), atol=TOL, rtol=0)


def test_rank_killed_while_saving_leaves_previous_checkpoint(tmp_path):
    code, logs, written = launch_failing("checkpoint_failures.py", 2, "kill", tmp_path)
    assert code != 0 and "killed" in written and "survived0" not in written, logs
    print(f"launch ended {written['ended_at'] - written['killed']['time']:.1f} s after the kill")
    assert pcp.latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-1")
    assert not (tmp_path / "checkpoint-2").exists()
    model, optimizer = build("llama", WELL_CONDITIONED_EPSILON)
    for p in model.parameters():
        p.set_value(p * 0 + 1)
    assert pcp.load_checkpoint(str(tmp_path / "checkpoint-1"), model, optimizer) == {"step": 1}
    want, _ = trained(1)
    for key, value in want.state_dict().items():
        np.testing.assert_allclose(model.state_dict()[key].numpy(), value.numpy(), atol=TOL, rtol=0)


def test_stalled_rank_makes_the_others_exit(tmp_path):
    timeout = 4
    code, logs, written = launch_failing("checkpoint_failures.py", 2, "stall", tmp_path, timeout)
    assert code != 0 and "stall_start" in written and "survived0" not in written, logs
    assert written["stall_start"]["timeout"] == timeout
    message = [line for line in logs["workerlog.0"].splitlines() if line.startswith("paddle_cp: rank 0 waited")]
    assert message, logs["workerlog.0"][-3000:]
    assert f"timeout {timeout} s" in message[0] and "over group [0, 1]" in message[0]
    assert "waiting for ranks [1]" in message[0]
    print(f"job ended {written['ended_at'] - written['stall_start']['time']:.1f} s after rank 1 stalled "
          f"(timeout {timeout} s): {message[0]}")


EXPECTED_ERRORS = {  # case -> (error type, what the message must say)
    "unknown_config_key": ("ValueError", "unknown parallelize config keys"),
    "pp_without_pp_dim": ("ValueError", "needs a mesh dim named 'pp'"),
    "dp_config_type": ("TypeError", "dp_config must be a dict"),
    "dp_config_key": ("ValueError", "it takes only 'sharding_level'"),
    "sharding_level": ("ValueError", "sharding_level must be one of"),
    "mp_config_type": ("TypeError", "mp_config must be a dict"),
    "mp_config_key": ("ValueError", "it takes only 'parallelize_plan'"),
    "plan_twice": ("ValueError", "give each plan once"),
    "plan_not_a_plan": ("TypeError", "must be a paddle_cp plan"),
    "mesh_type": ("TypeError", "ProcessMesh"),
    "mesh_beyond_launch": ("ValueError", "ranks [2, 3] are not launched"),
    "mesh_short_of_launch": ("ValueError", "launched ranks [1] are not in it"),
    "colwise_not_dividing": ("ValueError", "not divisible by mp=2"),
    "colwise_no_weight": ("ValueError", "needs a layer with a 2-D weight"),
    "tied_weight_half_planned": ("ValueError", "plan it too"),
    "cp_plan_matches_nothing": ("ValueError", "no context-parallel plan applies to LlamaForCausalLM"),
    "cp_without_sep": ("ValueError", "needs a mesh dim named 'sep'"),
    "gather_output_type": ("TypeError", "gather_output must be a bool"),
    "is_input_parallel_type": ("TypeError", "is_input_parallel must be a bool"),
    "need_transpose_type": ("TypeError", "need_transpose must be a bool"),
    "layer_hook_type": ("TypeError", "needs a callable"),
    "unknown_backend": ("ValueError", "use one of"),
    "unknown_rotation": ("ValueError", "use one of ['planned', 'allgather']"),
    "hybrid_without_degree": ("ValueError", "needs ulysses_degree"),
    "documents_kind": ("TypeError", "documents must be"),
    "attention_3d": ("ValueError", "[batch, seq, heads, head_dim]"),
    "attention_dropout": ("ValueError", "dropout to 0"),
    "attention_shapes": ("ValueError", "shapes disagree"),
    "batch_not_dividing": ("ValueError", "divisible by dp"),
    "yaml_unknown_plan": ("ValueError", "unknown plan 'Nope'"),
    "yaml_mesh_size": ("ValueError", "4 ranks but 2"),
    "attention_mesh_beyond_launch": ("ValueError", "--nproc_per_node 4"),
    "yaml_not_mapping": ("TypeError", "path or a dict"),
    "timeout_negative": ("ValueError", "positive number of seconds"),
    "timeout_text": ("ValueError", "positive number of seconds"),
    "timeout_env": ("ValueError", "PCP_TIMEOUT"),
    "labels_whole_inner_prepare": ("ValueError", "key PrepareContextParallel by '' (the model itself)"),
    "batch_differs": ("ValueError", "passed different values of ['input_ids'] (ranks [1] differ"),
    "labels_differ": ("ValueError", "passed different values of ['labels']"),
    "batch_shapes_differ": ("ValueError", "rank 0: batch 2 x 13 tokens, rank 1: batch 2 x 14 tokens"),
    "save_existing_path": ("ValueError", "exists already"),
    "save_extra_not_json": ("TypeError", "JSON-serializable"),
    "save_unsupported_optimizer": ("TypeError", "Adam, AdamW and Momentum"),
    "save_async_type": ("TypeError", "async_save must be True or False"),
    "save_model_type": ("TypeError", "paddle.nn.Layer"),
    "load_no_such_path": ("ValueError", "it does not exist"),
    "load_no_marker": ("ValueError", "an unfinished save"),
    "load_truncated": ("ValueError", "were written (truncated"),
    "load_missing_file": ("ValueError", "is missing model_state/0_0.distcp"),
    "load_garbage_metadata": ("ValueError", "is unreadable"),
    "load_wrong_shape": ("ValueError", "needs float32[8]"),
    "load_wrong_dtype": ("ValueError", "needs float64[6]"),
    "load_other_model": ("ValueError", "keys only in the checkpoint ['1.bias', '1.weight']"),
    "load_other_optimizer": ("ValueError", "does not fit this optimizer"),
    "latest_not_a_path": ("TypeError", "takes a directory path"),
    "export_plain_layer": ("TypeError", "PretrainedModel"),
    "ranks_disagree_save": ("ValueError", "ranks disagree on the checkpoint call"),
    "ranks_disagree_load": ("ValueError", "ranks disagree on the checkpoint call"),
    "save_write_fails": ("RuntimeError", "failed on 1 rank(s)"),
    "async_save_write_fails": ("RuntimeError", "failed on 1 rank(s)"),
    "export_write_fails": ("RuntimeError", "failed on rank 0"),
}


def test_bad_inputs_raise_the_same_clear_error_on_every_rank(tmp_path):
    reports = launch("bad_inputs.py", 2, tmp_path)
    for report in reports:
        assert not report["values"].get("crash"), report["values"]["crash"]
        assert report["values"]["ranks_in_step"] == 2  # no case left a rank inside a collective
        assert report["values"]["good_loads"] == {"step": 1}
        assert report["values"]["latest_after_failures"] == str(tmp_path / "failures" / "w0")
        assert report["values"]["saved"] == ["w0"]  # failed saves are cleared, never published
        assert set(report["errors"]) == set(EXPECTED_ERRORS)
        for case, (kind, words) in EXPECTED_ERRORS.items():
            assert report["errors"][case][0] == kind and words in report["errors"][case][1], (case, report["errors"][case])
    assert reports[0]["errors"] == reports[1]["errors"]
    # the replicas' input check: one all-gather of 9 int64 per forward, not repeated by a recompute replay
    assert all(report["values"]["batch_check_bytes"] == {"plain": 72, "whole_model_recompute": 72}
               for report in reports), [report["values"]["batch_check_bytes"] for report in reports]
    assert len(EXPECTED_ERRORS) - 3 >= 30  # three are failed writes, not bad inputs


def test_training_example_saves_and_resumes(tmp_path):
    """--save-every 2 over 3 steps (a checkpoint after steps 2 and 3), then the same command for 4 steps: it resumes
    after step 3 by itself, and its step 4 matches one uninterrupted process."""
    config = EXAMPLES / "configs" / "cp4_p2p.yaml"
    common = ("--config", config, "--checkpoint-dir", tmp_path, "--save-every", "2")
    launch_script(EXAMPLES / "train_llama_cp.py", 4, *common, "--steps", "3")
    assert pcp.latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-3")
    out = launch_script(EXAMPLES / "train_llama_cp.py", 4, *common, "--steps", "4")
    assert f"resumed from {tmp_path / 'checkpoint-3'} after step 3" in out, out[-3000:]
    assert re.findall(r"step +(\d+) +loss", out) == ["3"], out[-3000:]
    gap = float(re.search(r"max \|loss - single-process loss\| over 1 steps: ([0-9.e+-]+)", out).group(1))
    assert gap < TOL
