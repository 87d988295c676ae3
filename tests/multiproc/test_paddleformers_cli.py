"""pcp-train (PaddleFormers' CLI workflow with paddle_cp underneath) vs PaddleFormers' run_sft in one process.

Everything is built offline in the test by the example's builder (examples/sft_cli_inputs.py): a tiny
Llama (save_pretrained), a byte-level tokenizer (the `tokenizers` package), 24 SFT samples in PaddleFormers'
erniekit format (stdlib module names and the first line or so of their source). One YAML
(packing on, eager attention, fp32) serves most runs; the runs differ only in key=value overrides,
as a user's would. A second YAML is PaddleFormers' own example examples/config/sft/full_tp_pp.yaml
(bf16 by its default compute_type, amp_master_grad by the Trainer's default, tensor 2 x pipeline 2 +
sequence parallel, sharding stage1, full recompute, gradient accumulation) with the tiny inputs,
at fp16_opt_level O1 (on CPU Paddle's AMP is a no-op, so O1 trains as fp32 in both) and at its own O2, which
loads the model in bf16: CPU Paddle has no bf16 matmul, so the O2 runs, paddle_cp's and PaddleFormers' own
on one card, run in the CPU emulation of Paddle's GPU AMP (tests/workers/emulated_amp.py) and are held to
one card's distance from the fp32 run. A third YAML is a vision-language one (stage VL-SFT) on
examples/vl_sft_cli_inputs.py's tiny Qwen3-VL, its processor and 24 messages-format samples with PNG
pictures of four sizes, two samples packed into each 256-token row; both sides build its one-card class
(PaddleFormers' own choice for qwen3_vl is fleet's, which needs paddlefleet: sft_workflow.OneCardModels).
Three processes do all the work:

- the reference: PaddleFormers' own `run_tuner` in one process, per global batch (2 and 4), full
  fine-tuning and LoRA, and the example YAML on one card (global batch 2 and 4, O1 and emulated O2);
- `python -m paddle_cp.train` starting its own launch (2 CPU ranks, ring attention), saving a
  checkpoint every 2 steps;
- a 4-rank launch whose ranks run pcp-train's main in place, one run after another: ring 4,
  Ulysses 4, dp 2 x ring 2, dp 2 x tensor 2 + sequence parallel, LoRA on dp 2 x ring 2, and a
  resume of the first launch's step-2 checkpoint on ring 2 x Ulysses 2, the example YAML as it is (tensor 2 x
  pipeline 2) and on dp 2 x ring 2, at O1 and emulated O2, the VL YAML on ring 4, Ulysses 4 and dp 2 x ring 2;
  then configs it must refuse.

Each run's logged losses (PaddleFormers' `loss:` log lines, 8 digits) and the weights it saves
(safetensors in output_dir) are compared with the reference of the same global batch (1e-5).
AdamW's epsilon is 1e-3: with PaddleFormers' 1e-8 a parameter whose gradient is ~0 moves by
~lr * sign(g), so fp32 rounding in g would decide its update (as tests/multiproc/test_trainer.py).
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import yaml
from launcher import EXAMPLES, ROOT, WORKERS, launch_logged, run_tool

TOLERANCE = 1e-5
STEPS = 4
for module in ("paddleformers", "jinja2", "datasets", "binpacking", "librosa", "tokenizers", "safetensors"):
    pytest.importorskip(module)  # PaddleFormers' CLI imports its data pipeline's packages at module level

BASE = {
    "train_dataset_type": "erniekit", "train_dataset_prob": "1.0", "dataset_type": "map", "mix_strategy": "concat",
    "max_seq_len": 64, "packing": True, "template": "default",
    "_attn_implementation": "eager",  # the default, flashmask, is a GPU kernel
    "stage": "SFT", "fine_tuning": "full", "seed": 23, "do_train": True, "per_device_train_batch_size": 2,
    "max_steps": STEPS, "logging_steps": 1, "learning_rate": 1.0e-3, "adam_epsilon": 1.0e-3,
    "weight_decay": 0.1, "save_steps": 100,
    "compute_type": "float32", "amp_master_grad": False,  # what fp32 needs in PaddleFormers' CLI
    "device": "cpu", "report_to": "none", "disable_tqdm": True,
}
LORA = ["lora=true", "lora_rank=4", "fine_tuning=lora"]
# unpacked, over-long samples cut (PaddleFormers' default, delete, has its map dataset draw a replacement from an
# unseeded generator: a different sample on every process, which paddle_cp refuses within a replica)
UNPACKED = ["packing=false", "truncation_strategy=right"]
PT = ["stage=PT", "dataset_type=iterator"]
# PaddleFormers' examples/config/sft/full_tp_pp.yaml (its keys PaddleFormers 1.2.0 reads), on the tiny inputs: its
# data and finetuning keys but the sizes, steps and learning rate of these runs, eager attention, AdamW epsilon 1e-3
# (as BASE), and fp16_opt_level O1 (O2: see the module docstring); no compute_type: PaddleFormers' default, bf16
EXAMPLE = {
    **{key: BASE[key] for key in ("train_dataset_type", "train_dataset_prob", "max_seq_len", "packing", "mix_strategy",
                                  "template", "_attn_implementation", "stage", "fine_tuning", "seed", "do_train",
                                  "logging_steps", "disable_tqdm", "learning_rate", "adam_epsilon", "save_steps",
                                  "device", "report_to")},
    "per_device_train_batch_size": 1, "max_steps": STEPS, "save_strategy": "steps", "gradient_accumulation_steps": 2,
    "warmup_steps": 1,
    "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "moe_token_dispatcher_type": "deepep",
    "sequence_parallel": True, "sharding": "stage1", "recompute_granularity": "full", "recompute_method": "uniform",
    "recompute_num_layers": 1, "bf16": True, "fp16_opt_level": "O1", "unified_checkpoint": False,
    "save_checkpoint_format": "flex_checkpoint", "load_checkpoint_format": "flex_checkpoint", "weight_decay": 0.0,
    "adam_beta2": 0.999, "moe_router_bias_update_rate": 0.0, "overlap_p2p_comm": False, "batch_p2p_comm": True,
}
# the VL YAML: PaddleFormers' VL-SFT stage on messages-format lines with picture paths, its Qwen3-VL template (no
# thinking), two samples packed into each of 12 rows of 256 tokens (the rest padding: Ulysses 4's last quarter holds no
# label)
VL = {**BASE, "stage": "VL-SFT", "train_dataset_type": "messages", "template": "qwen3_vl_nothink", "max_seq_len": 256,
      "per_device_train_batch_size": 1}
ONE_CARD = ["tensor_model_parallel_size=1", "pipeline_model_parallel_size=1", "sequence_parallel=false"]
DP2_RING2 = [*ONE_CARD, "context_parallel_size=2"]  # the parallel keys a paddle_cp user changes
O2 = ["fp16_opt_level=O2"]  # the example YAML's own level
# name -> (overrides, reference, collectives that must have sent bytes); on 4 ranks: the ranks a layout leaves
# over are data parallel
LAUNCH_RUNS = {
    "ring4": (["context_parallel_size=4"], "full_b2", ["ring"]),
    "ulysses4": (["sep_parallel_size=4"], "full_b2", ["ulysses"]),
    "dp2_ring2": (["context_parallel_size=2"], "full_b4", ["ring", "grad_all_reduce"]),
    "dp2_tp2_sp": (["tensor_model_parallel_size=2", "sequence_parallel=true"], "full_b4",
                   ["tp_all_reduce", "all_gather", "grad_all_reduce"]),
    "lora_dp2_ring2": (["context_parallel_size=2", *LORA], "lora_b4", ["ring", "grad_all_reduce"]),
    "dp2_ulysses2_sharding2": (["sep_parallel_size=2", "sharding=stage2"], "full_b4",
                               ["ulysses", "grad_reduce_scatter"]),
    "pp2_ring2": (["pipeline_model_parallel_size=2", "context_parallel_size=2"], "full_b2",
                  ["pp_activation", "ring"]),
    "unpacked_ring4": (["context_parallel_size=4", *UNPACKED], "unpacked_b2", ["ring"]),
    "pt_ring4": (["context_parallel_size=4", *PT], "pt_b2", ["ring"]),
    "resume_ring2_ulysses2": (["context_parallel_size=2", "sep_parallel_size=2"], "full_b2",
                              ["checkpoint_agree", "ring", "ulysses"]),
    "example_tp2_pp2_sp": ([], "example_b2", ["pp_activation", "all_gather"]),
    "example_dp2_ring2": (DP2_RING2, "example_b4", ["ring", "grad_all_reduce"]),
    # tensor 2 + sequence parallel x ring 2 on packed rows: each ring rank's share must split over mp
    "example_tp2_sp_ring2": (["pipeline_model_parallel_size=1", "context_parallel_size=2"], "example_b2",
                             ["ring", "all_gather"]),
    "example_o2_tp2_pp2_sp": (O2, "example_o2_b2", ["pp_activation", "all_gather"]),
    "example_o2_dp2_ring2": ([*DP2_RING2, *O2], "example_o2_b4", ["ring", "grad_all_reduce"]),
    # the sequence split where the language model takes the merged image and text embeddings
    "vl_ring4": (["context_parallel_size=4"], "vl_b1", ["ring"]),
    "vl_ulysses4": (["sep_parallel_size=4"], "vl_b1", ["ulysses"]),
    "vl_dp2_ring2": (["context_parallel_size=2"], "vl_b2", ["ring", "grad_all_reduce"]),
}
REFERENCES = {"full_b2": [], "full_b4": ["per_device_train_batch_size=4"],
              "lora_b4": ["per_device_train_batch_size=4", *LORA], "unpacked_b2": UNPACKED, "pt_b2": PT,
              "example_b2": ONE_CARD, "example_b4": [*ONE_CARD, "per_device_train_batch_size=2"],
              "example_o2_b2": [*ONE_CARD, *O2], "example_o2_b4": [*ONE_CARD, "per_device_train_batch_size=2", *O2],
              "vl_b1": [], "vl_b2": ["per_device_train_batch_size=2"]}
# the O2 runs, in the CPU emulation of Paddle's GPU AMP: each -> the same layout's fp32 (O1) run
O2_RUNS = {"example_o2_b2": "example_b2", "example_o2_b4": "example_b4",
           "example_o2_tp2_pp2_sp": "example_tp2_pp2_sp", "example_o2_dp2_ring2": "example_dp2_ring2"}
REFUSED = {
    "quantized": ["compute_type=wint8"],
    "dpo": ["stage=DPO"],
    "sizes_do_not_fit": ["context_parallel_size=3"],
    "sequence_parallel_alone": ["sequence_parallel=true"],
    "misspelt_key": ["context_paralel_size=2"],
    # outside the emulation: CPU Paddle has no bf16 matmul for run_sft's bf16 model
    "o2_without_a_bf16_matmul": ["compute_type=bf16", "fp16_opt_level=O2", "amp_master_grad=true",
                                 "context_parallel_size=4"],
}
LOSS_LINE = re.compile(r"- loss: ([0-9.]+), .*global_step: (\d+),")


def runs_in_log(text):
    """{run name: {step: logged loss}} from a log where each run starts with a `PCP_RUN <name>` line."""
    runs, current = {}, None
    for line in text.splitlines():
        if line.startswith("PCP_RUN "):
            current = runs.setdefault(line.split()[1], {})
        elif current is not None and (match := LOSS_LINE.search(line)):
            current[int(match.group(2))] = float(match.group(1))
    return runs


def saved_weights(folder):
    """The weights a run wrote, as float32: safetensors (the model; PaddleFormers' LoRA adapter on one card) or the
    LoRA adapter in LoRAModel's other format, lora_model_state.pdparams (paddle_cp's export)."""
    import paddle
    from safetensors.paddle import load_file

    weights = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        weights.update({name: value.astype("float32").numpy() for name, value in load_file(str(path)).items()})
    adapter = Path(folder) / "lora_model_state.pdparams"
    if adapter.exists():
        weights.update({name: value.numpy() for name, value in paddle.load(str(adapter)).items()})
    return weights


def saved_dtypes(folder):
    """The dtypes of the tensors a run saved in safetensors, as the files name them ("F32", "BF16")."""
    from safetensors import safe_open

    dtypes = set()
    for path in Path(folder).glob("*.safetensors"):
        with safe_open(str(path), framework="np") as f:
            dtypes.update(f.get_slice(name).get_dtype() for name in f.keys())
    return dtypes


def processor_files(folder):
    """The files of a processor's configs a run saved beside its weights (what AutoProcessor.from_pretrained reads)."""
    return sorted(path.name for path in Path(folder).glob("*preprocessor_config.json"))


def _env(log_dir):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(WORKERS), str(EXAMPLES),
                                                       os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", PADDLEFORMERS_DIST_LOG=str(log_dir))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


@pytest.fixture(scope="module")
def results():
    """Runs everything once (in a folder of its own: pytest's numbered tmp folders are shared by every
    pytest session of the machine, and rotated)."""
    with tempfile.TemporaryDirectory(prefix="pcp_train_") as tmp:
        yield run_all(Path(tmp))


def run_all(tmp):
    """{logged: {run: {step: loss}}, weights: {run: {name: array}}, work: each rank's records,
    refusals: each rank's errors, refused_wrote: {name: whether its output_dir exists}, spawned: pcp-train's own
    launch ({"world_size": what rank 0 logged, "logs": its workerlog files}), dtypes: {O2 run: dtypes it saved},
    processor_files: {VL run: its processor's files}}."""
    build = (f"import sft_cli_inputs, vl_sft_cli_inputs; sft_cli_inputs.build({str(tmp)!r}, samples=24, "
             f"answer_bytes=40); vl_sft_cli_inputs.build({str(tmp / 'vl')!r}, samples=24)")
    subprocess.run([sys.executable, "-c", build], env=_env(tmp / "unused"), check=True, capture_output=True)
    inputs = {"model_name_or_path": str(tmp / "model"), "train_dataset_path": str(tmp / "train.jsonl")}
    (tmp / "sft.yaml").write_text(yaml.safe_dump({**BASE, **inputs}))
    (tmp / "example.yaml").write_text(yaml.safe_dump({**EXAMPLE, **inputs}))
    (tmp / "vl.yaml").write_text(yaml.safe_dump({**VL, "model_name_or_path": str(tmp / "vl" / "model"),
                                                 "train_dataset_path": str(tmp / "vl" / "train.jsonl")}))

    def argv(name, overrides):
        config = tmp / next((f"{prefix}.yaml" for prefix in ("example", "vl") if name.startswith(prefix)), "sft.yaml")
        return [str(config), f"output_dir={tmp / name}", *overrides]

    reference = subprocess.run(
        [sys.executable, str(WORKERS / "sft_cli_reference.py"),
         json.dumps({"runs": {name: argv(name, overrides) for name, overrides in REFERENCES.items()},
                     "emulated": list(O2_RUNS)})],
        env=_env(tmp / "unused"), capture_output=True, text=True, timeout=600)
    assert reference.returncode == 0, reference.stderr[-4000:]
    logged = runs_in_log(reference.stderr)

    # pcp-train as a user starts it: its own launch, CPU ranks = the parallel sizes' product (2); rank 1 killed
    # (SIGKILL) as step 3 starts, after checkpoint-2 was committed; the same command again resumes after step 2
    command = [sys.executable, "-m", "paddle_cp.train",
               *argv("ring2", ["context_parallel_size=2", "save_steps=2",
                               f"custom_register_path={WORKERS / 'trainer_kill_once.py'}"])]
    user = dict(timeout=600, cwd=tmp, OMP_NUM_THREADS="1", PADDLEFORMERS_DIST_LOG=str(tmp / "ring2_log"),
                PCP_KILL_MARKER=str(tmp / "ring2_killed"))
    killed = run_tool(command, fresh=[tmp / "ring2", tmp / "ring2_log"], **user)
    assert killed.returncode != 0 and (tmp / "ring2_killed").exists(), killed.stdout[-3000:] + killed.stderr[-3000:]
    spawned = run_tool(command, **user)
    worker_log = (tmp / "ring2_log" / "workerlog.0").read_text() if (tmp / "ring2_log").exists() else ""
    assert spawned.returncode == 0, spawned.stdout[-3000:] + spawned.stderr[-3000:] + worker_log[-4000:]

    logged["ring2"] = runs_in_log("PCP_RUN ring2\n" + worker_log)["ring2"]
    world_size = re.search(r"\bworld_size: (\d+)", worker_log)
    own_launch = {"world_size": world_size and int(world_size.group(1)),
                  "logs": sorted(p.name for p in (tmp / "ring2_log").glob("workerlog.*")),
                  "layout_logged": re.findall(r"paddle_cp: mesh [^\x1b\n]*", worker_log),
                  "resumed_at": re.findall(r"Continuing training from global step (\d+)", worker_log)}

    # resume: a fresh output_dir holding the step-2 checkpoint, found by run_sft as it finds its own
    shutil.copytree(tmp / "ring2" / "checkpoint-2", tmp / "resume_ring2_ulysses2" / "checkpoint-2")
    spec = {"runs": {name: argv(name, overrides) for name, (overrides, _, _) in LAUNCH_RUNS.items()},
            "refused": {name: argv(f"refused_{name}", overrides) for name, overrides in REFUSED.items()},
            "emulated": list(O2_RUNS)}
    reports, logs = launch_logged("sft_cli_runs.py", 4, json.dumps(spec))
    for report in reports:
        assert "crash" not in report["values"], report["values"]["crash"]
    logged.update(runs_in_log(logs["workerlog.0"]))
    refusals = [report["errors"] for report in reports]
    return dict(logged=logged, spawned=own_launch, refusals=refusals, work=[r["values"] for r in reports],
                refused_wrote={name: (tmp / f"refused_{name}").exists() for name in REFUSED},
                weights={name: saved_weights(tmp / name) for name in [*REFERENCES, "ring2", *LAUNCH_RUNS]},
                dtypes={name: saved_dtypes(tmp / name) for name in O2_RUNS},
                processor_files={name: processor_files(tmp / name) for name in [*REFERENCES, *LAUNCH_RUNS]
                                 if name.startswith("vl")})


REFERENCE_OF = {"ring2": "full_b2", **{name: ref for name, (_, ref, _) in LAUNCH_RUNS.items() if name not in O2_RUNS}}


@pytest.mark.parametrize("run", list(LAUNCH_RUNS))
def test_pcp_train_runs_the_layout_asked_for(results, run):
    """What paddle_cp did: the layout's collectives sent bytes (pp_activation: the first stage's ranks), and
    every rank split the batches by their documents (packed, and unpacked ones too: PaddleFormers' collator
    gives both row indices)."""
    sent = [values[f"{run}.bytes"] for values in results["work"]]
    assert all(sum(rank.get(tag, 0) for rank in sent) > 0 for tag in LAUNCH_RUNS[run][2]), (run, sent)
    if any(tag in ("ring", "ulysses") for tag in LAUNCH_RUNS[run][2]):
        assert all(values[f"{run}.document_batches"] > 0 for values in results["work"]), run


@pytest.mark.parametrize("run", ["ulysses4", "vl_ulysses4"])
def test_a_rank_holding_no_label_trains_as_one_card(results, run):
    """Ulysses' contiguous quarters of rows padded to max_seq_len: the last rank's quarter of some batches is
    all padding (no label; the model's token mean would be 0/0). The run's parity above covers those steps."""
    assert sum(values[f"{run}.empty_shares"] for values in results["work"]) > 0


def distance(results, run, reference, first=1):
    """(largest logged-loss difference, largest saved-weight difference) of `run` from `reference`."""
    want, got = results["logged"][reference], results["logged"][run]
    assert sorted(want) == list(range(1, STEPS + 1)), want
    assert sorted(got) == list(range(first, STEPS + 1)), got
    want_weights, got_weights = results["weights"][reference], results["weights"][run]
    assert sorted(got_weights) == sorted(want_weights) and want_weights
    return (max(abs(got[step] - want[step]) for step in got),
            max(float(np.abs(got_weights[k] - want_weights[k]).max()) for k in want_weights))


@pytest.mark.parametrize("run", list(REFERENCE_OF))
def test_pcp_train_matches_run_sft(results, run):
    first = 3 if run.startswith("resume") else 1  # resumed after step 2
    loss_error, weight_error = distance(results, run, REFERENCE_OF[run], first)
    print(f"{run}: loss {loss_error:.1e}, weights {weight_error:.1e}")
    assert loss_error < TOLERANCE and weight_error < TOLERANCE, (run, loss_error, weight_error)


def test_a_vl_run_saves_the_processor_beside_its_weights(results):
    """As PaddleFormers' save_model: the output_dir of a VL run is one AutoProcessor.from_pretrained loads."""
    want = results["processor_files"]["vl_b1"]
    assert want == ["preprocessor_config.json", "video_preprocessor_config.json"], want
    assert all(files == want for files in results["processor_files"].values()), results["processor_files"]


MASTER_GRADIENT_TAGS = ("grad_all_reduce", "grad_sum_all_reduce")  # the gradient buckets' all-reduces (mean, sum)
HALF_TAGS = ("all_gather", "tp_all_reduce", "pp_activation", "pp_gradient", "param_broadcast")


@pytest.mark.parametrize("run", [name for name in LAUNCH_RUNS if name in O2_RUNS])
def test_pcp_train_at_o2_is_as_close_to_fp32_as_run_sft(results, run):
    """The example YAML at its own O2 (bf16 parameters, fp32 masters in AdamW, amp_master_grad: master gradients
    accumulated over the 2 micro-batches and reduced in fp32) in the CPU emulation of Paddle's GPU AMP: paddle_cp's
    logged losses and saved weights are no farther from one card's fp32 run than twice PaddleFormers' own O2 run on
    one card in the same emulation is. Both trained and saved bf16 weights; paddle_cp's collectives carried the
    master gradients in fp32 (as many bytes as its fp32 run), the activations and parameters in bf16 (half the
    bytes; the ring fewer: keys and values in bf16, their gradient blocks in fp32)."""
    one_card = LAUNCH_RUNS[run][1]
    fp32_one_card = O2_RUNS[one_card]
    own = distance(results, one_card, fp32_one_card)
    ours = distance(results, run, fp32_one_card)
    print(f"{run}: from fp32 loss {ours[0]:.1e}, weights {ours[1]:.1e}; one card's O2 {own[0]:.1e}, {own[1]:.1e}")
    for kind, (own_distance, our_distance) in zip(("loss", "weights"), zip(own, ours)):
        assert 1e-4 < own_distance < 0.1, (kind, own, ours)  # bf16 visibly not fp32: the emulation ran
        assert our_distance <= 2 * own_distance, (kind, own, ours)
    assert results["dtypes"][run] == results["dtypes"][one_card] == {"BF16"}, results["dtypes"]
    for values in results["work"]:
        o2, fp32 = values[f"{run}.bytes"], values[f"{O2_RUNS[run]}.bytes"]
        gradients, halved = [t for t in MASTER_GRADIENT_TAGS if t in fp32], [t for t in HALF_TAGS if t in fp32]
        assert gradients and [o2.get(tag) for tag in gradients] == [fp32[tag] for tag in gradients], (o2, fp32)
        assert halved and [2 * o2.get(tag, 0) for tag in halved] == [fp32[tag] for tag in halved], (o2, fp32)
        assert "ring" not in fp32 or 0 < o2.get("ring", 0) < fp32["ring"], (o2, fp32)


REFUSAL_FIX = {  # what each error must name: the key, and the fix
    "quantized": ("compute_type 'wint8'", "['bf16', 'fp16', 'float32']"),
    "dpo": ("stage 'DPO'", "paddleformers-cli"),
    "sizes_do_not_fit": ("context_parallel_size 3", "must divide the world size"),
    "sequence_parallel_alone": ("sequence_parallel", "tensor_model_parallel_size > 1"),
    "o2_without_a_bf16_matmul": ("fp16_opt_level O2", "set fp16_opt_level=O1"),
    "misspelt_key": ("unknown keys ['context_paralel_size']", "did you mean context_parallel_size?"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_on_every_rank_before_training(results, name):
    key, fix = REFUSAL_FIX[name]
    for errors in results["refusals"]:
        kind, message = errors[name]
        assert kind == "ValueError" and key in message and fix in message, (name, kind, message)
    assert not results["refused_wrote"][name]  # nothing trained, nothing written


def test_pcp_train_starts_its_own_launch_on_the_parallel_sizes_product(results):
    """`python -m paddle_cp.train` outside a launch starts one: CPU ranks = the parallel sizes' product (2); rank 0
    logs the layout paddle_cp built, once per run. Killed in step 3, the same command again continues after the
    committed step 2 (and its losses, test_pcp_train_matches_run_sft's ring2, are one card's)."""
    layout = ("paddle_cp: mesh sep 2: context parallel ring (p2p), batches in the documents layout, "
              "sharding level 1")  # PaddleFormers' default sharding: stage1
    assert results["spawned"] == {
        "world_size": 2, "logs": ["workerlog.0", "workerlog.1"], "layout_logged": [layout, layout],
        "resumed_at": ["2"],
    }, results["spawned"]
