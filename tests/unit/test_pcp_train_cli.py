"""pcp-train's command line: the YAML and overrides as PaddleFormers' CLI reads them, the ranks it starts
(the launch command, CPU rank count, multi-node flags), and the stages it refuses before building anything.
Training itself: tests/multiproc/test_paddleformers_cli.py."""
import sys
import types
from pathlib import Path

import pytest
import yaml

pytest.importorskip("paddleformers")
pytest.importorskip("omegaconf")

from paddle_cp.integrations.paddleformers import cli  # noqa: E402


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump({"stage": "SFT", "context_parallel_size": 2, "tensor_model_parallel_size": 2,
                                    "learning_rate": 1.0e-5, "output_dir": "out"}))
    return str(path)


def test_reads_the_yaml_and_overrides_as_paddleformers_cli(config):
    args = cli.read_config([config, "learning_rate=3e-4", "max_steps=7", "packing=true"])
    assert args["learning_rate"] == 3e-4 and args["max_steps"] == 7 and args["packing"] is True
    assert args["context_parallel_size"] == 2 and args["output_dir"] == "out"
    with pytest.raises(SystemExit, match="YAML or JSON config"):
        cli.read_config(["--learning_rate", "1"])


def test_cpu_ranks_are_one_replica_unless_asked(config, monkeypatch):
    monkeypatch.delenv("PCP_NPROC_PER_NODE", raising=False)
    args = cli.read_config([config])
    assert cli.cpu_ranks(args) == 4  # context 2 x tensor 2
    monkeypatch.setenv("PCP_NPROC_PER_NODE", "8")
    assert cli.cpu_ranks(args) == 8


def test_launch_command(config, monkeypatch):
    for key in ("PCP_NPROC_PER_NODE", "NNODES", "MASTER_ADDR", "MASTER_PORT", "RANK", "PADDLEFORMERS_DIST_LOG"):
        monkeypatch.delenv(key, raising=False)
    argv = [config, "max_steps=3"]
    command = cli.launch_command(argv, cli.read_config(argv))
    assert command[:3] == [sys.executable, "-m", "paddle.distributed.launch"]
    assert command[command.index("--log_dir") + 1] == "paddleformers_dist_log"
    assert command[command.index("--nproc_per_node") + 1] == "4" and "--master" not in command
    assert command[-5:] == [sys.executable, "-m", "paddle_cp.train", config, "max_steps=3"]
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("RANK", "1")
    command = cli.launch_command(argv, cli.read_config(argv))
    assert command[command.index("--master") + 1] == "10.0.0.1:8080"  # PaddleFormers' default port
    assert command[command.index("--nnodes") + 1] == "2" and command[command.index("--rank") + 1] == "1"


def test_other_stages_are_refused_by_name():
    from paddle_cp.integrations.paddleformers.sft_workflow import check_stage

    check_stage({"stage": "PT"})
    check_stage({"stage": "VL-SFT"})
    with pytest.raises(ValueError, match="stage 'DPO' is not supported by pcp-train.*paddleformers-cli"):
        check_stage({"stage": "DPO"})


def test_a_vl_model_is_built_as_its_one_card_class():
    """PaddleFormers' AutoModelForConditionalGeneration names fleet's Qwen3-VL class (paddlefleet, GPU-only), whose
    layers paddle_cp does not split; a family with one class keeps the auto class's choice."""
    from paddleformers.transformers import AutoModelForConditionalGeneration, Qwen3VLConfig

    from paddle_cp.integrations.paddleformers.sft_workflow import OneCardModels

    models = OneCardModels(AutoModelForConditionalGeneration)
    assert models.model_class(Qwen3VLConfig()).__name__ == "Qwen3VLForConditionalGenerationDeprecated"
    assert models.model_class(types.SimpleNamespace(model_type="glm4v_moe")) is AutoModelForConditionalGeneration


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_model_loaded_on_every_rank_has_from_pretrained_s_weights(tmp_path, dtype):
    """What pcp-train loads on more than one rank (PaddleFormers' own loader needs one process there) is what
    from_pretrained loads: Qwen3-VL's files hold q/k/v and gate/up apart, its model fused; at O2 run_sft asks bf16."""
    import vl_sft_cli_inputs
    from paddleformers.transformers import AutoConfig
    from paddleformers.transformers.qwen3_vl.modeling import Qwen3VLForConditionalGenerationDeprecated as Qwen3VL

    from paddle_cp.integrations.paddleformers.sft_workflow import loaded_as_on_one_card

    vl_sft_cli_inputs.write_model(str(tmp_path), vocab_size=263)
    want = Qwen3VL.from_pretrained(str(tmp_path), config=AutoConfig.from_pretrained(str(tmp_path), dtype=dtype))
    got = loaded_as_on_one_card(Qwen3VL, str(tmp_path), AutoConfig.from_pretrained(str(tmp_path), dtype=dtype))
    want, got = want.state_dict(), got.state_dict()
    assert sorted(got) == sorted(want) and any(name.endswith("qkv_proj.weight") for name in got)
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        assert (got[name].astype("float32") == value.astype("float32")).all(), name


def test_help_needs_no_config(capsys):
    assert cli.main(["--help"]) == 0
    assert "pcp-train config.yaml" in capsys.readouterr().out


def test_a_misspelt_key_is_refused_before_any_rank_starts(config, monkeypatch):
    """PaddleFormers' parser refuses it only on the ranks, after the launch, naming no key it meant."""
    monkeypatch.delenv("PADDLE_TRAINER_ID", raising=False)
    monkeypatch.setattr(cli, "launch", lambda argv, config: pytest.fail("launched"))
    with pytest.raises(ValueError, match=r"unknown keys \['context_paralel_size'\].*did you mean context_parallel_size"):
        cli.main([config, "context_paralel_size=4"])
    from paddle_cp.integrations.paddleformers.sft_workflow import check_keys

    example = str(Path(__file__).resolve().parents[2] / "examples" / "sft_cli.yaml")
    check_keys(cli.read_config([example, "paddle_cp_config=cp.yaml", "custom_register_path=x"]))  # all known


def test_an_o2_model_no_matmul_here_takes_is_refused_before_any_rank_starts(config, monkeypatch):
    """Paddle's CPU builds have no bf16 matmul, which run_sft's O2 model needs."""
    from paddle_cp.dtypes import matmul_takes

    monkeypatch.delenv("PADDLE_TRAINER_ID", raising=False)
    monkeypatch.setattr(cli, "launch", lambda argv, config: "launched")
    if matmul_takes("bfloat16"):
        pytest.skip("this device multiplies bf16")
    with pytest.raises(ValueError, match="fp16_opt_level O2 with compute_type 'bf16' .* set fp16_opt_level=O1"):
        cli.main([config, "fp16_opt_level=O2"])  # compute_type: PaddleFormers' default, bf16
    assert cli.main([config, "fp16_opt_level=O2", "compute_type=float32"]) == "launched"
