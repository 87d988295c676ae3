"""paddle_cp's PaddleFormers Trainer on 4 ranks vs PaddleFormers' own Trainer in one process.

argv[1] names a group of runs (one launch each). Every run trains a tiny PaddleFormers
model through `paddle_cp.integrations.paddleformers.Trainer` with the parallel flags of
the run, collects each logged loss (`TrainerCallback.on_log`; PaddleFormers empties
`state.log_history` at every log) and the final full state. Afterwards rank 0 trains
the same model with PaddleFormers' own Trainer and TrainingArguments (the same
arguments minus the parallel sizes, a per-device batch giving the same global batch)
with the world size hidden, so it runs as one card, and records the differences.
"""
import contextlib
import io
import os
import sys

import numpy as np
import paddle
import paddle.distributed as dist
from amp_emulation import emulated as amp_emulated
from amp_emulation import widened
import vl_models
from paddleformers_models import build, rechunked
from report import run

import paddle_cp as pcp
from paddle_cp.api.float64_truth import float64_math, float64_model

ADAMW = paddle._C_ops.adamw_  # Paddle's kernel (PaddleFormers' tensorwise offload would patch it process-wide)

SAMPLES, SEQ, VOCAB = 16, 22, 128
COMMON = dict(max_steps=3, learning_rate=1e-2, adam_epsilon=1e-3, weight_decay=0.1, max_grad_norm=1.0,
              logging_steps=1, seed=42, save_strategy="no", report_to="none", disable_tqdm=True,
              dataloader_shuffle=True, use_cache=False, amp_master_grad=False)


def dataset(packed, seq=SEQ):
    """Random tokens; a fifth of the labels ignored. `packed`: documents of 3-9 tokens back to back with
    restarting position_ids, PaddleFormers' causal attn_mask_startend_row_indices, each document's
    last label ignored."""
    rng = np.random.RandomState(11)
    samples = []
    for _ in range(SAMPLES):
        ids = rng.randint(0, VOCAB, seq).astype("int64")
        labels = rng.randint(0, VOCAB, seq).astype("int64")
        labels[rng.rand(seq) < 0.2] = -100
        sample = {"input_ids": ids, "labels": labels}
        if packed:
            starts, start = [], 0
            while start < seq:
                starts.append(start)
                start += rng.randint(3, 10)
            ends = starts[1:] + [seq]
            positions = np.concatenate([np.arange(e - s) for s, e in zip(starts, ends)])
            row_end = np.concatenate([np.full(e - s, e) for s, e in zip(starts, ends)])
            labels[np.array(ends) - 1] = -100
            # a Tensor: the default collator stacks it as it is (lists of arrays become int64, eager wants int32)
            row_end = paddle.to_tensor(row_end[None, :], dtype="int32")
            sample.update(position_ids=positions, attn_mask_startend_row_indices=row_end)
        samples.append(sample)
    return samples


def vision_dataset(family):
    """Conversations with a picture each, of different sizes, through the family's own image processor."""
    rng = np.random.RandomState(5)
    sizes = [(48, 24), (16, 16), (24, 32), (32, 16)]
    return [vl_models.conversation(family, rng, text=(3 + i % 3, 4 + i % 4), images=(sizes[i % 4],), seed=i)
            for i in range(8)]


def model_of(family, vision=None, **overrides):
    paddle.seed(2024)
    return vl_models.build(vision, **overrides) if vision else build(family, **overrides)


class BadSample(ValueError):
    """A step that fails on every attempt (`fail_at`)."""


class LoggedLosses:
    """Collects every logged loss; with `stop_at`, ends training after that step (as if the job died
    after its checkpoint), keeping the schedule of the full run; with `fail_at`, that step raises on every rank."""

    def __init__(self, stop_at=None, fail_at=None):
        from paddleformers.trainer import TrainerCallback

        class Collect(TrainerCallback):
            def on_log(cb, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    self.losses.append(logs["loss"])

            def on_step_begin(cb, args, state, control, **kwargs):
                if fail_at is not None and state.global_step + 1 == fail_at:
                    raise BadSample(f"a bad sample in step {fail_at}")

            def on_step_end(cb, args, state, control, **kwargs):
                if stop_at is not None and state.global_step >= stop_at:
                    control.should_training_stop = True

        self.losses, self.callback = [], Collect()


@contextlib.contextmanager
def one_card():
    """PaddleFormers asks paddle.distributed for the world size (at call time): hide the launch. Its
    gradient accumulation calls paddle.device.synchronize(), which raises on CPU builds."""
    real_world, real_sync = dist.get_world_size, paddle.device.synchronize
    dist.get_world_size = lambda group=None: 1
    paddle.device.synchronize = lambda device=None: None
    try:
        yield
    finally:
        dist.get_world_size, paddle.device.synchronize = real_world, real_sync


def train_with(trainer_cls, args_cls, run_spec, output_dir, parallel, resume=None, stop_at=None, model=None,
               fail_at=None):
    args = dict(COMMON, **run_spec.get("args", {}))
    if parallel:
        args.update(run_spec["parallel"])
        args["per_device_eval_batch_size"] = args["per_device_train_batch_size"]
    else:
        args["per_device_train_batch_size"] = args["per_device_eval_batch_size"] = run_spec["global_batch"]
    if args.get("save_steps"):
        args["save_strategy"] = "steps"
    training_args = args_cls(output_dir=output_dir, **args)
    vision = run_spec.get("vision")
    model = model or model_of(run_spec.get("family", "llama"), vision, **run_spec.get("model", {}))
    log = LoggedLosses(stop_at, fail_at)
    data = vision_dataset(vision) if vision else dataset(run_spec.get("packed", False), run_spec.get("seq", SEQ))
    trainer = trainer_cls(model=model, args=training_args, train_dataset=data, callbacks=[log.callback],
                          data_collator=vl_models.rows if vision else None)
    trainer.train(resume_from_checkpoint=resume)
    if run_spec.get("evaluate"):
        log.losses.append(trainer.evaluate(eval_dataset=data[:8])["eval_loss"])  # compared like a logged loss
    return log.losses, trainer


def leave_unfinished_saves(directory):
    """What killed saves leave: `checkpoint-9` with the Trainer's state but no commit marker (PaddleFormers'
    get_last_checkpoint takes the highest-numbered folder) and a `checkpoint-3.partial`."""
    if dist.get_rank() == 0:
        for folder in ("checkpoint-9", "checkpoint-3.partial"):
            os.makedirs(os.path.join(directory, folder))
            with open(os.path.join(directory, folder, "trainer_state.json"), "w") as f:
                f.write('{"global_step": 9}')
    dist.barrier()


def parallel_run(report, name, spec, root):
    from paddle_cp.integrations.paddleformers import Trainer, TrainingArguments

    directory = os.path.join(root, name)
    if "resume" in spec:  # first train up to the save on one mesh, then resume on this one
        first = dict(spec, parallel=spec["resume"]["parallel"], args={**spec.get("args", {}), "save_steps": 2})
        train_with(Trainer, TrainingArguments, first, directory, parallel=True, stop_at=2)
        leave_unfinished_saves(directory)
        # resume_from_checkpoint left at its default: the newest committed checkpoint, not the unfinished ones
        losses, trainer = train_with(Trainer, TrainingArguments, spec, directory, parallel=True)
    else:
        with amp_emulated(spec.get("emulated")):
            losses, trainer = train_with(Trainer, TrainingArguments, spec, directory, parallel=True)
            if spec.get("emulated"):
                report.value(f"{name}.param_dtypes", sorted({str(p.dtype) for p in trainer.model.parameters()}))
    if spec.get("export"):
        trainer.save_model(os.path.join(directory, "export"))
    if trainer.args.bf16:
        report.value(f"{name}.amp", amp_set_up(trainer))
    if spec["parallel"].get("tensorwise_offload_optimizer"):
        host = trainer.optimizer.host_optimizer
        report.value(f"{name}.offload", {"host_state": host is not None and host.host_bytes() > 0,
                                         "flag_reads": trainer.args.tensorwise_offload_optimizer,
                                         "adamw_is_paddles": paddle._C_ops.adamw_ is ADAMW})
    return losses, widened(pcp.full_state_dict(trainer.model))


def amp_set_up(trainer):
    """What the Trainer made of PaddleFormers' mixed-precision arguments."""
    return {"paddle_cp_master_grad": trainer.args.paddle_cp_master_grad, "amp_master_grad": trainer.args.amp_master_grad,
            "scaler_sharded": getattr(trainer.scaler, "_pcp_sharded", False), "amp_dtype": trainer.amp_dtype,
            "autocast": trainer.enable_autocast_context_manager, "grad_scaling": trainer.do_grad_scaling}


def exported_state(root, name):
    """What from_pretrained loads from the parallel run's save_model()."""
    from paddleformers.transformers import LlamaForCausalLM

    with one_card():  # rank 0 alone, after the others finished: no collective loading
        model = LlamaForCausalLM.from_pretrained(os.path.join(root, name, "export"))
    return {k: v.numpy() for k, v in model.state_dict().items()}


def reference_run(spec, root, name, evaluation=None):
    """PaddleFormers' Trainer on one card; `evaluation`: "rechunked" (its second fp32 evaluation) or "float64" (its
    truth: the same model, data and steps in float64), see paddle_cp/api/float64_truth.py."""
    from paddleformers.trainer import Trainer, TrainingArguments

    model = model_of(spec.get("family", "llama"), spec.get("vision"), **spec.get("model", {}))
    model = {"rechunked": rechunked, "float64": float64_model}.get(evaluation, lambda m: m)(model)
    with one_card(), float64_math() if evaluation == "float64" else contextlib.nullcontext(), \
            amp_emulated(spec.get("emulated")):
        losses, trainer = train_with(Trainer, TrainingArguments, spec, os.path.join(root, name + ".ref"),
                                     parallel=False, model=model)
    return losses, widened({k: v.numpy() for k, v in trainer.model.state_dict().items()})


def truth_distances(runs, truth):
    """{who: {"loss": largest logged-loss difference, "state": largest state difference}} from the truth."""
    t_losses, t_state = truth
    return {who: {"loss": float(np.abs(np.array(losses) - t_losses).max()),
                  "state": max(float(np.abs(state[k] - v).max()) for k, v in t_state.items())}
            for who, (losses, state) in runs.items()}


CP2 = dict(context_parallel_size=2)
RUNS = {
    "core": {
        # 4 ranks = dp2 x sep2 (ring) unless the flags fill them otherwise
        "dp2_cp2": dict(parallel=dict(CP2, per_device_train_batch_size=2), global_batch=4, evaluate=True),
        "dp2_ulysses2": dict(parallel=dict(sep_parallel_size=2, per_device_train_batch_size=2), global_batch=4),
        "hybrid_ring2_ulysses2": dict(parallel=dict(CP2, sep_parallel_size=2, per_device_train_batch_size=4),
                                      global_batch=4),
        "dp2_cp2_packed_accum": dict(parallel=dict(CP2, per_device_train_batch_size=1), global_batch=2,
                                     packed=True,  # unclipped: gradients k times too large would show
                                     args=dict(gradient_accumulation_steps=2, max_grad_norm=0.0)),
        # the user's own mesh and plans (what a paddle_cp YAML file holds) instead of the flags
        "user_config_dp2_ulysses2": dict(parallel=dict(per_device_train_batch_size=2, paddle_cp_config={
            "mesh": {"shape": [2, 2], "dim_names": ["dp", "sep"]},
            "cp_config": {"parallelize_plan": {
                "": {"PrepareContextParallel": {"backend": "all2all"}},
                "model.layers.*.self_attn": {"ContextParallel": {"backend": "all2all"}}}},
        }), global_batch=4),
        # fused qkv_proj / gate_up_proj split per part
        "phi3_dp2_mp2": dict(family="phi3", global_batch=4,
                             parallel=dict(tensor_model_parallel_size=2, per_device_train_batch_size=2)),
        # ERNIE 4.5: q/k/v fused by k/v head (PaddleFormers' fused_qkv), tied embeddings; ring x Ulysses, and
        # tensor + sequence parallel on the default eager build
        "ernie_ring2_ulysses2": dict(family="ernie4_5", parallel=dict(CP2, sep_parallel_size=2,
                                                                      per_device_train_batch_size=4), global_batch=4),
        "ernie_dp2_mp2_sp": dict(family="ernie4_5", global_batch=4, parallel=dict(
            tensor_model_parallel_size=2, sequence_parallel=True, per_device_train_batch_size=2)),
        # Qwen3-Next: ContextParallel on its attention and its Gated DeltaNet layers (state passing). It amplifies
        # fp32 rounding (one card is ~1e-4 from its float64 truth after 3 steps): `truth` holds paddle_cp to
        # one card's distance from the truth instead of 1e-5 (tests/multiproc/test_hybrid_models.py)
        "qwen3_next_dp2_cp2": dict(family="qwen3_next", parallel=dict(CP2, per_device_train_batch_size=2),
                                   global_batch=4, truth=True),
        # vision-language models: conversations with a picture each (of four sizes), padded into rows by the
        # collator; the plan the flags write splits the sequence after the merge
        "qwen3_vl_dp2_cp2": dict(vision="qwen3_vl", parallel=dict(CP2, per_device_train_batch_size=1),
                                 global_batch=2),
        "glm4v_moe_ulysses4": dict(vision="glm4v_moe", parallel=dict(sep_parallel_size=4, per_device_train_batch_size=2),
                                   global_batch=2),
        # tensor parallel alone (default eager attention) with sharding stage 3
        "dp2_mp2_sharding3": dict(parallel=dict(tensor_model_parallel_size=2, sharding="stage3",
                                                per_device_train_batch_size=1), global_batch=2),
    },
    "composed": {
        # sequence parallel needs a length that splits evenly over mp after the context-parallel split
        "mp2_sp_cp2": dict(parallel=dict(CP2, tensor_model_parallel_size=2, sequence_parallel=True,
                                         per_device_train_batch_size=2), global_batch=2, seq=24),
        # sharding stage 2 over all four ranks holding replicas (dp 2 x ring 2)
        "dp2_sharding2_cp2": dict(parallel=dict(CP2, sharding="stage2", sharding_parallel_size=4,
                                                per_device_train_batch_size=2), global_batch=4, export=True),
        # recomputed layers fetch their sharded parameters again (stage 3 over dp 2 x ring 2)
        "cp2_recompute_chunked_loss_sharding3": dict(
            parallel=dict(CP2, sharding="stage3", per_device_train_batch_size=2), global_batch=4,
            args=dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
            model=dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                       use_fused_head_and_loss_fn=True, loss_subbatch_sequence_length=4)),
        # sliding-window and full layers, query_pre_attn_scalar, fused qkv and up_gate projections
        "gemma3_dp2_cp2": dict(family="gemma3", parallel=dict(CP2, per_device_train_batch_size=2),
                                  global_batch=4),
        # two stages split at the decoder layers, ring attention inside each; micro-batches of one sample
        "pp2_cp2_accum": dict(parallel=dict(CP2, pipeline_model_parallel_size=2, per_device_train_batch_size=2),
                              global_batch=2, args=dict(gradient_accumulation_steps=2)),
        # Qwen3-MoE's routed experts over expert groups of 4 folded onto dp 2 x ring 2 (use_expert_parallel)
        "qwen3_moe_ep4_dp2_cp2": dict(family="qwen3_moe", global_batch=4, parallel=dict(
            CP2, use_expert_parallel=True, expert_model_parallel_size=4, per_device_train_batch_size=2)),
        # Qwen3-Next's Gated DeltaNet by head all-to-all
        "qwen3_next_dp2_ulysses2": dict(family="qwen3_next", global_batch=4, truth=True,
                                        parallel=dict(sep_parallel_size=2, per_device_train_batch_size=2)),
        # per-head q/k norms of split attention heads (gradients summed over mp), MoE, sequence parallel
        "qwen3_moe_dp2_mp2_sp": dict(family="qwen3_moe", global_batch=4, parallel=dict(
            tensor_model_parallel_size=2, sequence_parallel=True, per_device_train_batch_size=2)),
        # a later stage builds the eager causal mask from a stand-in of the whole embeddings
        "pp2_mp2_sp": dict(parallel=dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
                                         sequence_parallel=True, per_device_train_batch_size=2), global_batch=2),
        # saved at step 2 on ring 2 x Ulysses 2 (one replica), resumed on dp 2 x Ulysses 2
        "resume_hybrid_to_dp2_ulysses2": dict(
            resume=dict(parallel=dict(CP2, sep_parallel_size=2, per_device_train_batch_size=4)),
            parallel=dict(sep_parallel_size=2, per_device_train_batch_size=2), global_batch=4),
    },
    "memory": {
        # offload_recompute_inputs and mlp_tile_tokens (paddle_cp's flags, on the parallel run only) on dp2 x ring2
        "dp2_cp2_recompute_offload_tiled": dict(
            parallel=dict(CP2, per_device_train_batch_size=2, offload_recompute_inputs=True, mlp_tile_tokens=3),
            global_batch=4, args=dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
            model=dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)),
        # tensorwise_offload_optimizer (the state on the host: dp_config offload_optimizer) with sharding stage 1
        "dp2_cp2_sharding1_offload_optimizer": dict(
            parallel=dict(CP2, per_device_train_batch_size=2, sharding="stage1", tensorwise_offload_optimizer=True),
            global_batch=4),
        # PaddleFormers' mixed precision (a no-op on CPU for both Trainers: these check that paddle_cp's Trainer
        # takes it as PaddleFormers does): bf16 O2 with its default master gradients over dp x ring with sharding
        # stage 2 and accumulation, and bf16 O1 without them over tensor + sequence parallel (fp16 cannot train
        # on CPU in PaddleFormers' own Trainer: Paddle's disabled GradScaler sets no found-inf flag it reads)
        "bf16_o2_master_grad_dp2_sharding2_cp2_accum": dict(
            parallel=dict(CP2, sharding="stage2", per_device_train_batch_size=1), global_batch=2,
            args=dict(bf16=True, fp16_opt_level="O2", amp_master_grad=True, gradient_accumulation_steps=2)),
        "bf16_o1_dp2_mp2_sp": dict(
            parallel=dict(tensor_model_parallel_size=2, sequence_parallel=True, per_device_train_batch_size=2),
            global_batch=4, args=dict(bf16=True, fp16_opt_level="O1", amp_master_grad=False)),
        # bf16 O2 with master gradients in the CPU emulation of Paddle's GPU AMP (real bf16 parameters, activations
        # and gradients; `emulated`): held to one card's own distance from its fp32 run, as `truth` is
        "emulated_bf16_o2_dp2_cp2": dict(
            parallel=dict(CP2, per_device_train_batch_size=2), global_batch=4, emulated=True,
            args=dict(bf16=True, fp16_opt_level="O2", amp_master_grad=True)),
    },
}


def memory_bad_configs(report, root):
    from paddle_cp.integrations.paddleformers import Trainer, TrainingArguments

    report.expect_error("offload_without_recompute", lambda: TrainingArguments(
        output_dir=os.path.join(root, "bad"), **dict(COMMON, context_parallel_size=2, offload_recompute_inputs=True)))
    report.expect_error("negative_tile", lambda: TrainingArguments(
        output_dir=os.path.join(root, "bad"), **dict(COMMON, context_parallel_size=2, mlp_tile_tokens=-4)))
    # fp16 O2 with a loss scale and master gradients, set up (not trained: see the bf16 runs)
    fp16 = TrainingArguments(output_dir=os.path.join(root, "fp16"), **dict(
        COMMON, context_parallel_size=2, fp16=True, fp16_opt_level="O2", amp_master_grad=True, scale_loss=1024.0))
    report.value("fp16_o2_set_up", amp_set_up(Trainer(model=model_of("llama"), args=fp16)))


def bad_configs(report, root):
    """Each raises on every rank before any collective (the runs after it prove no rank was left waiting)."""
    from paddle_cp.integrations.paddleformers import Trainer, TrainingArguments

    def args(**flags):
        return TrainingArguments(output_dir=os.path.join(root, "bad"), **dict(COMMON, **flags))

    report.expect_error("degrees_do_not_fit", lambda: args(context_parallel_size=3))
    report.expect_error("sharding_size", lambda: args(context_parallel_size=2, sharding="stage2",
                                                      sharding_parallel_size=3))
    report.expect_error("sequence_parallel_alone", lambda: args(sequence_parallel=True))
    report.expect_error("config_and_flags", lambda: args(context_parallel_size=2, paddle_cp_config={
        "mesh": {"shape": [4], "dim_names": ["sep"]}}))
    report.expect_error("expert_size_alone", lambda: args(expert_model_parallel_size=2))
    report.expect_error("expert_size_not_dividing", lambda: args(tensor_model_parallel_size=2, use_expert_parallel=True,
                                                                 expert_model_parallel_size=4))
    report.expect_error("stage3_accumulation", lambda: args(sharding="stage3", gradient_accumulation_steps=2))
    report.expect_error("uncovered_model", lambda: Trainer(model=paddle.nn.Linear(4, 4),
                                                           args=args(context_parallel_size=2)))


class JobStopped(Exception):
    """What the crash-loop rule's exit becomes here: the launch's next runs still need these processes."""


def crash_loop(report, root):
    """A step that raises on every attempt of a Trainer job (2 tries a step): the third call of train() stops the job
    at its start, with the step and the first error; the attempts in between resumed from the last checkpoint."""
    from paddle_cp.integrations.paddleformers import Trainer, TrainingArguments
    from paddle_cp.recovery import attempts

    directory = os.path.join(root, "crash_loop")
    spec = dict(parallel=dict(CP2, per_device_train_batch_size=2), global_batch=4,
                args=dict(save_steps=2, tries_per_step=2))
    outcomes, printed = [], io.StringIO()

    def stop():
        raise JobStopped()

    exit_cleanly, attempts._exit_cleanly = attempts._exit_cleanly, stop
    try:
        for _ in range(3):
            try:
                with contextlib.redirect_stdout(printed):
                    train_with(Trainer, TrainingArguments, spec, directory, parallel=True, fail_at=3)
                outcomes.append("trained")
            except (BadSample, JobStopped) as exc:
                outcomes.append(type(exc).__name__)
    finally:
        attempts._exit_cleanly = exit_cleanly
    history = attempts.read_history(directory)
    report.value("crash_loop", {
        "outcomes": outcomes, "printed": printed.getvalue().strip().splitlines()[-1:],
        "resumed": [attempt.resumed_step for attempt in history], "stopped": [a.number for a in history if a.stopped],
        "failed_at": [sorted({f["step"] for f in attempt.failures}) for attempt in history],
        "failed_ranks": [len(attempt.failures) for attempt in history]})


def main(report):
    root = os.path.join(os.environ["PCP_REPORT_DIR"], "trainer")  # one directory for all ranks: checkpoints are shared
    runs = RUNS[sys.argv[1]]
    if sys.argv[1] == "core":
        bad_configs(report, root)
        crash_loop(report, root)
    if sys.argv[1] == "memory":
        memory_bad_configs(report, root)
    results = {name: parallel_run(report, name, spec, root) for name, spec in runs.items()}
    if dist.get_rank() != 0:
        return
    for name, spec in runs.items():
        losses, state = results[name]
        want_losses, want_state = reference_run(spec, root, name)
        if "resume" in spec:  # the resumed run logs the steps after the checkpoint
            want_losses = want_losses[2:]
        report.value(f"{name}.losses", [losses, want_losses])
        if spec.get("emulated"):  # one card in the emulation, and one card in fp32 (no AMP flags) as the truth
            fp32 = dict(spec, emulated=False, args={})
            report.value(f"{name}.emulated", truth_distances(
                {"paddle_cp": (losses, state), "one_card": (want_losses, want_state)},
                reference_run(fp32, root, name + ".fp32")))
        if spec.get("truth"):
            report.value(f"{name}.truth", truth_distances(
                {"paddle_cp": (losses, state), "one_card": (want_losses, want_state),
                 "rechunked": reference_run(spec, root, name + ".rechunked", "rechunked")},
                reference_run(spec, root, name + ".float64", "float64")))
        report.diff(f"{name}.loss", np.array(losses), np.array(want_losses))
        report.value(f"{name}.state_keys_match", sorted(state) == sorted(want_state))
        for key, value in want_state.items():
            report.diff(f"{name}.state", state.get(key, np.zeros([0])), value)
        if spec.get("export"):
            exported = exported_state(root, name)
            report.value(f"{name}.export_keys_match", sorted(exported) == sorted(want_state))
            for key, value in want_state.items():
                report.diff(f"{name}.export", exported.get(key, np.zeros([0])), value)


if __name__ == "__main__":
    run(main)
