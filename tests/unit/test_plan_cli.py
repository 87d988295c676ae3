"""pcp-plan in the user's units: lengths with K/M suffixes, --help with defaults and a legend of the table's
labels, the "no layout fits" line only when none does, and a memory reserve every fit leaves free."""
import argparse
import dataclasses
import json

import pytest

from paddle_cp.cost import search
from paddle_cp.tools.plan import cli as plan
from paddle_cp.cost.model_shape import ModelShape
from paddle_cp.cost.candidate import DEFAULT_RESERVE, Cluster
from paddle_cp.tools.units import format_tokens, tokens

QWEN25_7B = ["--layers", "28", "--hidden", "3584", "--heads", "28", "--kv-heads", "4", "--intermediate", "18944",
             "--vocab", "152064"]


@pytest.mark.parametrize("text, count", [("131072", 131072), ("128K", 131072), ("128k", 131072), ("4M", 4 << 20),
                                         ("1.5M", 1572864), ("64K", 65536), ("0", 0)])
def test_lengths_read_with_k_and_m_suffixes(text, count):
    assert tokens(text) == count


@pytest.mark.parametrize("text", ["128KB", "1.3K", "-4K", "K", "12G", ""])
def test_lengths_that_are_not_whole_token_counts_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="K = 1024"):
        tokens(text)


def test_lengths_print_in_the_same_units():
    assert [format_tokens(n) for n in (512, 131072, 4063232, 4 << 20)] == ["512", "128K", "3.88M", "4M"]


def test_every_length_flag_takes_suffixes():
    args = plan.parse_args([*QWEN25_7B, "--seq", "128K", "--devices", "8", "--loss-chunk", "8K", "--mlp-tile", "2K"])
    assert (args.seq, args.loss_chunk, args.mlp_tile) == (131072, 8192, 2048)
    args = plan.parse_args([*QWEN25_7B, "--max-seq", "--granularity", "32K", "--devices", "8"])
    assert args.granularity == 32768 and args.reserve_gb == DEFAULT_RESERVE / 1e9


def test_help_prints_defaults_and_a_legend(capsys):
    with pytest.raises(SystemExit):
        plan.parse_args(["--help"])
    text = capsys.readouterr().out
    for shown in ("--reserve-gb", "(default: 80.0)", "(default: 5.0)", "(default: 65536)", "K = 1024, M = 1024^2",
                  "l1/l2/l3", "uly<N>", "ring<N>", "chunk<N>", "tile<N>", "offload:", "host-optimizer:", "ring_exposed",
                  "fits"):
        assert shown in text, shown


def test_no_fit_message_only_when_nothing_fits(capsys):
    plan.main([*QWEN25_7B, "--seq", "128K", "--devices", "8", "--configs", "0"])
    out = capsys.readouterr().out
    assert " yes " in out and "no layout fits" not in out and "resembles" not in out
    plan.main([*QWEN25_7B, "--seq", "64M", "--devices", "8", "--no-offload", "--no-host-optimizer"])
    assert "no layout fits in 75 GB per device" in capsys.readouterr().out


def test_max_seq_of_qwen25_7b_keeps_the_reserve_free(tmp_path, capsys):
    """Without a reserve this shape's longest sequence fills 79.2 of 80 GB; every fit now leaves the reserve."""
    out = tmp_path / "plan.json"
    plan.main([*QWEN25_7B, "--max-seq", "--devices", "8", "--memory-gb", "80", "--json", str(out)])
    assert "75 of 80 GB per device" in capsys.readouterr().out
    result = json.loads(out.read_text())
    fits = [e for e in result["estimates"] if e["fits"]]
    assert fits and max(e["memory_total"] for e in fits) <= 80e9 - DEFAULT_RESERVE
    assert result["cluster"]["reserve"] == DEFAULT_RESERVE
    unreserved = tmp_path / "unreserved.json"
    plan.main([*QWEN25_7B, "--max-seq", "--devices", "8", "--memory-gb", "80", "--reserve-gb", "0", "--json",
               str(unreserved)])
    longest = json.loads(unreserved.read_text())
    assert longest["seq"] > result["seq"] and longest["best"]["memory_total"] > 80e9 - DEFAULT_RESERVE


@pytest.mark.parametrize("reserve", [0.0, DEFAULT_RESERVE, 12e9])
def test_no_fit_uses_more_than_memory_less_the_reserve(reserve):
    model = ModelShape(layers=28, hidden=3584, heads=28, kv_heads=4, vocab=152064, intermediate=18944)
    cluster = Cluster(8, 80e9, 700e12, 300e9, 25e9, 8, 300e12, reserve=reserve)
    seq, ranked = search.longest_sequence(model, cluster, 65536)
    fits = [e for e in ranked if e["fits"]]
    assert seq and fits and all(e["memory_total"] <= 80e9 - reserve for e in fits)
    assert any(e["memory_total"] > 80e9 - reserve for e in search.rank_layouts(model, cluster, seq + 65536))


def test_config_takes_a_model_name_a_folder_or_a_file(tmp_path, capsys):
    """The docs' commands run as written: `--config llama3-70b` is Meta's config.json; a folder holding a
    config.json reads it; a path that is not there is a usage error naming what --config takes."""
    from paddle_cp.tools.plan.models import NAMED

    (tmp_path / "config.json").write_text(json.dumps(NAMED["qwen2.5-7b"]))
    named = plan.parse_args(["--config", "qwen2.5-7b", "--seq", "128K", "--devices", "8"])
    folder = plan.parse_args(["--config", str(tmp_path), "--seq", "128K", "--devices", "8"])
    flags = plan.parse_args([*QWEN25_7B, "--seq", "128K", "--devices", "8"])
    assert plan.model_shape(named) == plan.model_shape(folder)
    assert plan.model_shape(named) == dataclasses.replace(plan.model_shape(flags), family="qwen2")
    with pytest.raises(SystemExit):
        plan.parse_args(["--config", str(tmp_path / "llama3_70b.json"), "--seq", "128K", "--devices", "8"])
    error = capsys.readouterr().err
    assert "llama3_70b.json: no such file" in error and "'llama3-70b'" in error, error


def test_qwen25_vl_7b_with_a_minute_of_video_plans_the_tower_whole_and_split(tmp_path, capsys):
    """One minute at 2 fps, 448 x 448: both modes ranked, the same layouts side by side term by term (ring8 among
    them: the split holds an eighth of the tower's activations, sends features, fits without recomputation), and
    configs that load, the split's with ContextParallel on the tower."""
    from paddle_cp.api.config import load_config
    from paddle_cp.cost.candidate import Layout

    out = tmp_path / "plan.json"
    plan.main(["--config", "qwen2.5-vl-7b", "--video-seconds", "60", "--fps", "2", "--frame-size", "448x448",
               "--devices", "8", "--configs", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "grid 60 x 32 x 32 = 61440 patches, 15360 tokens" in printed and "sequence: 15362 tokens" in printed
    assert "vision tower whole:" in printed and "vision tower split:" in printed and "vision act" in printed
    result = json.loads(out.read_text())["vision"]
    assert result["whole"]["seq"] == result["split"]["seq"] == 15362
    assert result["whole"]["media"] == [{"kind": "video", "t": 60, "h": 32, "w": 32}]
    side_by_side = [line.split()[5] for line in printed.splitlines() if line.startswith("dp1 ring8 uly1 tp1 l2  ")]
    assert side_by_side == ["whole", "split"]  # the best layout on all 8 sep ranks, in both modes
    by_name = {e["name"]: e for e in result["split"]["estimates"]}
    whole = {e["name"]: e for e in result["whole"]["estimates"]}["dp1 ring8 uly1 tp1 l2"]
    split_ring = by_name["dp1 ring8 uly1 tp1 l2"]
    ratio = whole["memory"]["vision_activations"] / split_ring["memory"]["vision_activations"]
    assert 60 / 9 <= ratio <= 60 / 7.5  # 60 temporal patches over 8 ranks: 7.5 each, placed around the decoder's work
    assert split_ring["fits"] and split_ring["memory"]["exchange_bytes"] and not whole["fits"]
    assert all(e["layout"]["tp"] == e["layout"]["pp"] == 1 for e in result["split"]["estimates"])  # dp x sep alone
    model = plan.model_shape(plan.parse_args(["--config", "qwen2.5-vl-7b", "--seq", "1K", "--devices", "8"]))
    split = plan.plan_of(by_name["dp1 ring8 uly1 tp1 l2"], model, 15362, "model.language_model",
                         vision_tower="model.visual")
    assert split["config"]["cp_config"]["parallelize_plan"]["model.visual"] == {"ContextParallel": {"backend": "p2p"}}
    path = tmp_path / "split.yaml"
    path.write_text(split["yaml"])
    mesh, _ = load_config(str(path), world_size=8)
    assert list(mesh.shape) == [8]
    assert plan.plan_of(by_name["dp1 ring8 uly1 tp1 l2"], model, 15362, "model")["model_config"] == {}
    assert "vision_config" in plan.plan_of({**by_name["dp1 ring8 uly1 tp1 l2"],
                                            "layout": dataclasses.asdict(Layout(ring=8, recompute="full"))},
                                           model, 15362, "model")["model_config"]


@pytest.mark.parametrize("flags, refusal", [
    (["--config", "qwen2.5-7b", "--video-frames", "8"], "qwen2 has no vision tower"),
    (["--config", "qwen2.5-vl-7b", "--video-frames", "8", "--seq", "4K"], "drop --seq"),
    (["--config", "qwen2.5-vl-7b", "--video-frames", "8", "--video-seconds", "4"], "not both"),
    (["--config", "qwen2.5-vl-7b", "--text-tokens", "4K"], "give the media"),
])
def test_vision_language_flags_that_cannot_plan_are_refused(flags, refusal):
    with pytest.raises(SystemExit, match=refusal):
        plan.main([*flags, "--devices", "8"])
