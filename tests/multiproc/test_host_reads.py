"""A steady-state training step never waits for the host: host reads (Tensor .numpy/.item/.tolist/float/
int/bool/index, paddle.to_tensor of host data) counted in steps 3-5 of a training loop (forward, backward,
optimizer.step(), clear_grad()) on 4 gloo ranks, layout by layout (tests/workers/host_reads_step.py, one launch
for every group of layouts).

Counted by paddle_cp/tools/host_reads.py at the line that made each read. paddle_cp's own lines must read
nothing, except those of files other work owns, listed in ELSEWHERE with what remains there: the lead
empties the list as that work merges. The model's own code (PaddleFormers' mask building calls
paddle.where with Python scalars: two uploads a step, as on one card) is not paddle_cp's and is reported.
"""
from launcher import launch_once

COUNTED_STEPS = 3
# paddle_cp lines owned by other work, with their reads per step (per rank): none since that work merged
ELSEWHERE = set()
MODEL_SITES = ("paddleformers/",)
GROUPS = ("dense", "sharding", "pipelines", "experts")  # the worker's groups of layouts


def step_reads():
    reports = launch_once("host_reads_step.py", 4, *GROUPS)
    for report in reports:
        assert not report["values"].get("crash"), report["values"]["crash"]
    return reports


def ours(sites):
    """{site: calls} made by paddle_cp outside ELSEWHERE (deferred reads of the batch check are not stalls)."""
    return {site: n for site, n in sites.items() if not site.startswith("deferred")
            and not any(site.split(" at ")[1].startswith(path) for path in ELSEWHERE)
            and not site.split(" at ")[1].startswith(MODEL_SITES)}


def check_layouts(reports, group, expected_layouts):
    for report in reports:
        layouts = set(report["values"][f"{group}.layouts"])
        assert layouts == expected_layouts
        for layout in layouts:
            counts = report["values"][f"{layout}.counts"]
            assert ours(counts["sites"]) == {}, (report["rank"], layout, counts["sites"])
            losses = report["values"][f"{layout}.losses"]
            assert len(losses) == 5 and all(loss == loss for loss in losses), losses  # it trained, no nan


def test_dense_layouts_read_nothing_in_a_step():
    """Ring, Ulysses, hybrid, TP+SP (dp2 x mp2 and sep2 x mp2): no paddle_cp read; the batch check's answer
    is read one forward later, once per step on context-parallel layouts."""
    reports = step_reads()
    check_layouts(reports, "dense", {"ring", "ulysses", "hybrid", "tp_sp.dp2", "tp_sp.sep2"})
    for report in reports:
        for layout in ("ring", "ulysses", "hybrid", "tp_sp.sep2"):
            assert report["values"][f"{layout}.counts"]["deferred"] == COUNTED_STEPS


def test_sharding_levels_read_nothing_in_a_step():
    """dp2 x sep2 at sharding levels 1-3 (level 1 still has data_parallel/optimizer.py's gradient-existence
    read, 1 upload + 1 read a step: ELSEWHERE)."""
    reports = step_reads()
    check_layouts(reports, "sharding", {f"sharding{level}.dp2_sep2" for level in (1, 2, 3)})


def test_pipelines_read_nothing_in_a_step():
    """pp2 x sep2 (1F1B, VPP), dp2 x pp2 (FThenB), pp4 (1F1B): the activations' skeletons cross a stage
    boundary once per batch layout; the loss factor stays on the device, agreed a step later."""
    reports = step_reads()
    check_layouts(reports, "pipelines", {"pp2_sep2.1f1b", "pp2_sep2.vpp", "pp2_dp2.fthenb", "pp4.1f1b"})


def test_expert_parallel_reads_its_token_counts_once_per_moe_layer():
    """Qwen3-MoE (2 MoE layers) on dp2 x sep2, experts over 4 ranks: the only read is the [P, E] table of token
    counts per expert, gathered on the device, one per MoE layer and step; after it (the queue drained) one copy
    in of the received rows' order by expert, both ways. Nothing else of paddle_cp reads."""
    reports = step_reads()
    moe_layers = 2
    for report in reports:
        counts = report["values"]["qwen3_moe.dp2_sep2.counts"]
        experts = {site: n for site, n in ours(counts["sites"]).items() if "paddle_cp/experts/dispatch.py" in site}
        assert {site.split(" at ")[0]: n for site, n in experts.items()} == {
            "reads": COUNTED_STEPS * moe_layers, "uploads": COUNTED_STEPS * moe_layers}, experts
        assert {site: n for site, n in ours(counts["sites"]).items() if site not in experts} == {}, counts["sites"]


def test_one_plan_dict_serves_two_models_and_reset_leaves_a_third_exact():
    """tests/workers/two_models.py: one plan dict for Llama on sep4 and Phi-3 on dp2 x sep2 trained in turn,
    then runtime.reset() and Llama under tensor + sequence parallel: each vs one card (fp32, 1e-5); the plan
    objects keep no run state; once both models are released, Paddle's own SDPA is back."""
    reports = launch_once("two_models.py", 4)
    for report in reports:
        assert not report["values"].get("crash"), report["values"]["crash"]
        runs = {name.split(".state.")[0].rsplit(".loss", 1)[0] for name in report["max_abs"]}
        assert runs == {"one_plan.llama_sep4", "one_plan.phi3_dp2_sep2", "after_reset.llama_dp2_mp2_sp"}
        worst = {name: err for name, err in report["max_abs"].items() if not err <= 1e-5}
        assert not worst, worst
        assert all(report["values"][f"{run}.state_keys_match"] for run in runs)
        assert report["values"]["plan_state"] == []
        assert report["values"]["sdpa_restored_after_release"]
