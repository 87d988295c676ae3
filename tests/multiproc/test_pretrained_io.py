"""load_pretrained, export_pretrained and checkpoints on dp2 x mp2 (sharding level 3) and pp2 x sep2:
values equal PaddleFormers' from_pretrained on one card and train like it; every phase keeps each
rank within its share + 2 x the largest parameter; each rank reads about its share."""
import shutil
import sys

import numpy as np

from launcher import WORKERS, launch

from paddle_cp.tools.memory.io_phases import MIB, bound

sys.path.insert(0, str(WORKERS))
from pretrained_io import CASES, SIZES, load_reference, model_class, save_reference  # noqa: E402

TOL = 1e-5
SLACK = 2 ** 20  # 1 MiB (the bound's "few MiB"): the model is 6.5 MiB, its largest parameter 1 MiB
EXPECTED_ERRORS = {
    "pretrained_no_directory": ("ValueError", "is not a directory"),
    "pretrained_index_lists_missing_file": ("ValueError", "lists files that are missing"),
    "pretrained_no_weights": ("ValueError", "holds neither model.safetensors.index.json nor model.safetensors"),
    "pretrained_other_shapes": ("ValueError", "this model needs float32[1024, 128]"),
    "pretrained_fewer_layers": ("ValueError", "keys only in the files ['model.layers.1."),
    "pretrained_more_layers": ("ValueError", "keys it lacks ['model.layers.2."),
    "pretrained_other_dtype": ("ValueError", "this model needs float16"),
    "pretrained_not_a_layer": ("TypeError", "takes a paddle.nn.Layer"),
    "export_shard_size": ("ValueError", "max_shard_size must be"),
}


def save_pretrained_directories(root):
    """What users load: PaddleFormers' save_pretrained, default (one file and its index), the unified
    format (model.safetensors alone) and sharded into many files (Phi3: fused q/k/v and gate/up)."""
    import paddle
    import paddleformers.transformers as pf

    paddle.seed(7)
    llama = pf.LlamaForCausalLM(pf.LlamaConfig(**SIZES))
    llama.save_pretrained(str(root / "llama_one"))
    llama.save_pretrained(str(root / "llama_unified"), save_checkpoint_format="unified", safe_serialization=True)
    phi3 = pf.Phi3ForCausalLM(pf.Phi3Config(**SIZES))
    phi3.save_pretrained(str(root / "phi3_sharded"), max_shard_size="300KB")
    shutil.copytree(root / "phi3_sharded", root / "phi3_missing_file")
    sorted((root / "phi3_missing_file").glob("*.safetensors"))[1].unlink()
    (root / "empty").mkdir()
    assert (root / "llama_unified" / "model.safetensors").exists()
    assert len(list((root / "phi3_sharded").glob("*.safetensors"))) > 5
    for directory_name in CASES:
        save_reference(str(root), directory_name)


def check_export(root, layout):
    """What export_pretrained wrote loads with from_pretrained on one card, equal to one card after its step."""
    exported = model_class("phi3").from_pretrained(str(root / f"export_{layout}")).state_dict()
    _, _, want = load_reference(str(root), "phi3_sharded")
    for key, value in want.items():
        np.testing.assert_allclose(exported[key].numpy(), value, atol=TOL, rtol=0)


def check_layout(reports, layout):
    for report in reports:
        assert not report["values"].get("crash"), report["values"]["crash"]
        worst = {name: err for name, err in report["max_abs"].items() if not err <= TOL}
        assert not worst, f"{layout} rank {report['rank']} beyond {TOL}: {worst}"
        cases = {case for case in CASES if f"{layout}.{case}.loss" in report["max_abs"]}
        assert len(cases) >= 2 and "phi3_sharded" in cases, report["max_abs"]
        wanted = {f"{layout}.{case}.{check}" for case in cases for check in ("local", "loss", "after_step.local")}
        assert wanted | {f"{layout}.phi3_sharded.checkpoint.local"} <= set(report["max_abs"]), report["max_abs"]
    for report in reports:
        for row in report["values"][f"{layout}.phases"]:
            limit = bound(row) + SLACK
            assert row["peak"] <= limit, f"{layout} rank {report['rank']} {row}: peak above {limit}"
            if row["phase"] in ("load_pretrained", "load"):
                # about its share: each piece it holds once (plus the small replicated ones), never the model
                assert row["read"] <= 1.5 * row["share"] + SLACK, row
    print(f"\n{layout}: rank phase case (* built lazily) peak/share/bound MiB, read/written MiB")
    for report in reports:
        for row in report["values"][f"{layout}.phases"]:
            print(f"  {report['rank']} {row['phase']:15} {row['case'] + ('*' if row.get('lazy') else ''):14} "
                  f"{row['peak'] / MIB:6.2f} "
                  f"{row['share'] / MIB:6.2f} {bound(row) / MIB:6.2f}  {row['read'] / MIB:6.2f} {row['written'] / MIB:6.2f}")
        print(f"  {report['rank']} async: {report['values'][f'{layout}.phi3_sharded.async_step_seconds']}")


def test_pretrained_export_and_checkpoints_within_each_ranks_share(tmp_path):
    save_pretrained_directories(tmp_path)
    reports = launch("pretrained_io.py", 4, tmp_path)  # both layouts in one launch
    check_layout(reports, "dp2xmp2_l3")
    check_layout(reports, "pp2xsep2_l3")
    for report in reports:
        for case, (kind, text) in EXPECTED_ERRORS.items():
            got = report["errors"][case]
            assert got[0] == kind and text in got[1], f"rank {report['rank']} {case}: {got}"
        assert report["values"]["ranks_after_bad_inputs"] == 4
    assert reports[0]["values"]["dp2xmp2_l3.phi3_sharded.export_files"][-1] == "model.safetensors.index.json"
    check_export(tmp_path, "dp2xmp2_l3")
    check_export(tmp_path, "pp2xsep2_l3")
