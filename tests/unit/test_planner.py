"""pcp-plan on real sizes: the three large cases (70B at 128K and 8B at 1M on 64 GPUs, 8B at 128K on 8) fit, with configs that load; sharding over dp x sep,
recomputation, chunked loss, experts and layout names, each against its arithmetic."""
import json
import math

import pytest
import yaml

from paddle_cp.api.config import load_config
from paddle_cp.cost import search
from paddle_cp.tools.plan import cli as plan
from paddle_cp.cost.memory import activations, logits, memory, stage_params
from paddle_cp.cost.model_shape import ModelShape
from paddle_cp.tools.plan.config import model_config, parallelize_config
from paddle_cp.cost.candidate import DEFAULT_RESERVE, Cluster, Layout
from paddle_cp.cost.step_time import step_time

# Meta's published config.json values
LLAMA3_8B = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
             "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False}
LLAMA3_70B = {**LLAMA3_8B, "num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
              "intermediate_size": 28672}
QWEN3_MOE = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
             "num_key_value_heads": 4, "head_dim": 32, "intermediate_size": 768, "moe_intermediate_size": 128,
             "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [0],
             "vocab_size": 1000}
SMALL = ModelShape(layers=4, hidden=512, heads=8, kv_heads=4, vocab=1000, intermediate=1024)


@pytest.mark.parametrize("config, seq, devices", [(LLAMA3_70B, 131072, 64), (LLAMA3_8B, 1 << 20, 64),
                                                  (LLAMA3_8B, 131072, 8)], ids=["70b-128k-64", "8b-1m-64", "8b-128k-8"])
def test_issue_cases_fit_with_configs_that_load(tmp_path, capsys, config, seq, devices):
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "plan.json"
    plan.main(["--config", str(tmp_path / "config.json"), "--seq", str(seq), "--devices", str(devices),
               "--memory-gb", "80", "--configs", "3", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "resembles" in printed and "node MB" in printed and "net MB" in printed
    result = json.loads(out.read_text())
    links = [plan.link_bytes(e["attention_bytes"]) for e in result["estimates"]]
    assert any(node for node, _ in links) and (any(net for _, net in links) == (devices > 8))  # 8 GPUs a node
    assert len(result["plans"]) == 3 and result["best"]["memory_total"] <= 80e9 - DEFAULT_RESERVE
    for plan_ in result["plans"]:
        path = tmp_path / "layout.yaml"
        path.write_text(plan_["yaml"])
        assert yaml.safe_load(plan_["yaml"]) == plan_["config"]  # the YAML is the dict
        mesh, _ = load_config(str(path), world_size=devices)
        assert math.prod(mesh.shape) == devices
        assert plan_["resembles"]["recipe"] and plan_["resembles"]["source"]
    assert result["best"]["layout"]["ring"] * result["best"]["layout"]["ulysses"] > 1  # context parallel each time


def test_sharding_levels_divide_state_over_dp_and_sep():
    # bf16 gradients: SMALL's whole gradients fit one bucket, so every level holds them all before the step
    whole = memory(SMALL, Layout(dp=2, ring=2), 4096, 1, 2, master_grad=False)
    by_level = {level: memory(SMALL, Layout(dp=2, ring=2, sharding=level), 4096, 1, 2, master_grad=False)
                for level in (1, 2, 3)}
    quarter = pytest.approx(0.25)
    assert by_level[1]["optimizer"] / whole["optimizer"] == quarter
    assert by_level[1]["gradients"] == whole["gradients"] and by_level[1]["weights"] == whole["weights"]
    assert by_level[2]["gradients"] / whole["gradients"] == quarter and by_level[2]["weights"] == whole["weights"]
    assert by_level[3]["weights"] / whole["weights"] == quarter
    over_dp = memory(SMALL, Layout(dp=2, ring=2, sharding=3, shard_dims=("dp",)), 4096, 1, 2, master_grad=False)
    assert over_dp["weights"] / whole["weights"] == pytest.approx(0.5)
    # paddle_cp holds whole gradients until the step reduces them: the step phase is the same at every level
    assert len({m["phases"]["step"] - m["weights"] - m["optimizer"] for m in (whole, *by_level.values())}) == 1
    assert "sharding_mesh_dim" not in parallelize_config(Layout(dp=2, ring=2, sharding=3))["dp_config"]
    assert parallelize_config(Layout(dp=2, ring=2, sharding=3, shard_dims=("dp",)))["dp_config"] == {
        "sharding_level": 3, "sharding_mesh_dim": "dp"}


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_master_gradients_are_fp32_and_masters_sharded_from_level_1(level):
    """bf16 O2 (elem 2): weights and activations 2 bytes an element, AdamW's moments and the fp32 master 12 on the
    owners (sharded from level 1), gradients 4 with master gradients and 2 without (sharded from level 2); fp32
    training has no master and its gradients are 4 bytes either way. The reduction moves 4-byte gradients."""
    layout = Layout(dp=2, ring=2, sharding=level)
    master, bf16 = (memory(SMALL, layout, 4096, 1, 2, master_grad=flag) for flag in (True, False))
    fp32 = memory(SMALL, layout, 4096, 1, 4)
    dense, _ = stage_params(SMALL, layout, 0)
    share = 0.25 if level else 1
    assert master["optimizer"] == bf16["optimizer"] == pytest.approx(dense * share * 12)
    assert fp32["optimizer"] == pytest.approx(dense * share * 8)
    assert master["weights"] == bf16["weights"] == pytest.approx(dense * (0.25 if level == 3 else 1) * 2)
    grad_share = 0.25 if level >= 2 else 1
    assert master["gradients"] == pytest.approx(dense * grad_share * 4) == 2 * bf16["gradients"]
    assert master["gradients"] == fp32["gradients"] and master["activations"] == bf16["activations"]
    assert master["phases"]["step"] > bf16["phases"]["step"]  # the step holds the gradients and their buckets
    cluster = Cluster(4, 80e9, 700e12, 300e9, 25e9, 8, 300e12)
    seconds = {flag: step_time(SMALL, layout, cluster, 4096, 1, 2, master_grad=flag)["gradients"]
               for flag in (True, False)}
    # gradient passes (all-reduce 2, reduce-scatter 1) at 4 bytes instead of 2; the values' passes stay 2 bytes
    passes = {0: (2, 0), 1: (2, 1), 2: (1, 1), 3: (1, 2)}[level]
    assert seconds[True] / seconds[False] == pytest.approx((4 * passes[0] + 2 * passes[1]) / (2 * sum(passes)))
    plain = plan.parse_args(["--layers", "2", "--hidden", "8", "--heads", "2", "--vocab", "8", "--intermediate", "8",
                             "--devices", "2", "--seq", "8"])
    assert plain.dtype_bytes == 2 and not plain.no_master_grad  # pcp-plan prices PaddleFormers' bf16 O2 by default


def test_recomputation_keeps_layer_inputs_and_selective_modules_follow_the_family():
    plain = memory(SMALL, Layout(ring=2), 8192, 1, 2)
    full = memory(SMALL, Layout(ring=2, recompute="full"), 8192, 1, 2)
    tokens = 8192 / 2
    final_norm = tokens * SMALL.hidden * (4 + 2) + tokens * SMALL.hidden * 2
    kept = tokens * SMALL.hidden * 2 + tokens * 2 * SMALL.head_dim * 4  # input, rotary tables (fp32)
    assert full["activations"] == pytest.approx(SMALL.layers * kept + final_norm)
    assert full["activations"] < plain["activations"] / 5
    assert model_config(Layout(recompute="full")) == {"recompute_granularity": "full", "recompute_method": "uniform",
                                                      "recompute_num_layers": 1}
    moe = ModelShape.from_config(QWEN3_MOE)
    assert search.recompute_options(SMALL, 1) == ["none", "full"]  # PaddleFormers' Llama: full layers only
    assert {"core_attn", "mlp", "full_attn+mlp"} <= set(search.recompute_options(moe, 1))
    assert search.recompute_options(moe, 2) == ["none"]  # its recompute refuses a pipeline stage's inputs
    mlp = memory(moe, Layout(ring=2, recompute="mlp"), 8192, 1, 2)
    assert mlp["activations"] < memory(moe, Layout(ring=2), 8192, 1, 2)["activations"]
    assert model_config(Layout(recompute="core_attn+mlp"))["recompute_modules"] == ["core_attn", "mlp"]


def test_chunked_loss_holds_a_chunk_and_runs_without_tensor_parallel_only():
    held, backward = logits(SMALL, Layout(ring=2), 8192, 1, 0)
    assert held == 4096 * SMALL.vocab * 4 and backward == 2 * held
    chunked_held, chunked_backward = logits(SMALL, Layout(ring=2, loss_chunk=512), 8192, 1, 0)
    assert chunked_held == 0 and chunked_backward < backward
    assert logits(SMALL, Layout(ring=2, loss_chunk=4096), 8192, 1, 0) == (held, backward)  # not longer than the chunk
    found = list(search.candidates(SMALL, 8, 8192, 8, loss_chunk=512))
    assert any(c.loss_chunk for c in found) and not any(c.loss_chunk and c.tp > 1 for c in found)


def test_experts_divide_over_ep_and_their_replicas():
    moe = ModelShape.from_config(QWEN3_MOE)
    assert (moe.experts, moe.experts_per_token, moe.moe_layers, moe.expert_intermediate) == (8, 2, 3, 128)
    assert moe.params == (4 * moe.attention_params + 1 * moe.dense_mlp_params + 3 * (moe.expert_params
                          + moe.moe_replicated_params) + 2 * moe.embedding_params + moe.norm_params)
    _, one = stage_params(moe, Layout(dp=2, ring=2), 0)
    _, four = stage_params(moe, Layout(dp=2, ring=2, ep=4), 0)
    assert four == pytest.approx(one / 4)
    level1 = memory(moe, Layout(dp=2, ring=2, ep=2, sharding=1), 4096, 1, 2)["optimizer"]
    dense, experts = stage_params(moe, Layout(dp=2, ring=2, ep=2), 0)
    assert level1 == pytest.approx((dense / 4 + experts / 2) * 12)  # experts' replicas: dp x sep / ep
    config = parallelize_config(Layout(dp=2, ring=2, ep=4))
    assert config["ep_config"] == {"degree": 4, "parallelize_plan": {"model.layers.*.mlp": "ExpertParallel"}}
    cluster = Cluster(8, 80e9, 400e12, 300e9, 25e9, 8)
    assert step_time(moe, Layout(dp=2, ring=2, ep=4), cluster, 4096, 1, 2)["expert_all_to_all"] > 0
    assert {c.ep for c in search.candidates(moe, 8, 4096, 8)} == {1, 2, 4, 8}
    with pytest.raises(ValueError, match="multi-head latent attention"):
        ModelShape.from_config({**QWEN3_MOE, "kv_lora_rank": 512})


def test_cli_refuses_a_model_it_cannot_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_MOE, "model_type": "deepseek_v3", "kv_lora_rank": 512}))
    with pytest.raises(SystemExit, match="pcp-plan: deepseek_v3 uses multi-head latent attention"):
        plan.main(["--config", str(tmp_path / "config.json"), "--seq", "4096", "--devices", "8"])


@pytest.mark.parametrize("layout", [Layout(), Layout(dp=2, ring=4, tp=8, pp=2, micro=8, vpp=2, sharding=3),
                                    Layout(ring=2, ulysses=2, ep=4, sharding=2, shard_dims=("dp",), loss_chunk=1024),
                                    Layout(dp=4, recompute="full_attn+mlp"), Layout(ring=8, recompute="full")])
def test_layout_names_read_back(layout):
    assert Layout.parse(layout.name) == layout
    assert Layout.parse(layout.name.replace(" ", ",")) == layout


def test_bad_layout_names_say_which_token():
    with pytest.raises(ValueError, match="'dq2'.*tokens are"):
        Layout.parse("dq2 ring2")
    with pytest.raises(ValueError, match="'dp', 'sep' or both"):
        Layout.parse("dp2 l3@mp")


def test_packed_documents_price_attention_by_the_gpu_tile_model():
    """With packed documents the step's attention is the tile model's slowest rank in the layout paddle_cp
    chooses (its tiles scaled from the fit's 32 heads of 128 to the model's), not FLOPs: short documents cost
    less than one document of the row's length, and one document costs what its 2N chunks' tiles say."""
    import numpy as np

    from paddle_cp.cost.tiles import tile_counts
    from paddle_cp.tools import packing
    from paddle_cp.cost.attention import attention_flops

    cluster = Cluster(8, 80e9, 400e12, 300e9, 25e9, 8)
    layout = Layout(dp=2, ring=4, ulysses=1, tp=1, pp=1)
    seq = 32768
    one = plan.packed_row(np.arange(seq))
    short = plan.packed_row(packing.batches("lognormal", seq, 1, 1)[0][0])
    times = {name: step_time(SMALL, layout, cluster, seq, 1, 2, packed=row) for name, row in (("one", one),
                                                                                             ("short", short))}
    plain = step_time(SMALL, layout, cluster, seq, 1, 2)
    assert times["short"]["compute"] < times["one"]["compute"]
    chunks = tile_counts(np.where(np.arange(seq) * 8 // seq < 4, np.arange(seq) * 8 // seq,
                                  7 - np.arange(seq) * 8 // seq), np.full(seq, seq), 4)
    attention = SMALL.layers * chunks.slowest_ms(1, SMALL.heads * SMALL.head_dim / (32 * 128)) / 1e3
    flops_attention = SMALL.layers * attention_flops(1, seq, SMALL.heads, SMALL.head_dim, True) / (4 * cluster.flops)
    assert times["one"]["compute"] == pytest.approx(plain["compute"] - flops_attention + attention)



def test_tiled_mlp_and_offload_terms_and_separate_compute_rates():
    model = ModelShape.from_config(LLAMA3_8B)
    seq, tokens = 1 << 20, (1 << 20) / 8
    full = memory(model, Layout(ring=8, recompute="full"), seq, 1, 2, fused=True)
    tiled = memory(model, Layout(ring=8, recompute="full", mlp_tile=4096), seq, 1, 2, fused=True)
    # the rebuilt layer's gate, up, activation and product, and two of their gradients in its backward
    intermediates = 6 * tokens * model.intermediate * 2
    tile_work = (4096 * 6 * model.intermediate + tokens * model.hidden) * 2
    removed = full["phases"]["layer_backward"] - tiled["phases"]["layer_backward"]
    assert removed == pytest.approx(intermediates - tile_work) and removed > 0.8 * intermediates
    offload = memory(model, Layout(ring=8, recompute="full", offload=True), seq, 1, 2, fused=True)
    inputs = tokens * model.hidden * 2 + tokens * 2 * model.head_dim * 4  # hidden states, rotary tables (fp32)
    assert offload["host"] == pytest.approx(model.layers * inputs) and full["host"] == 0
    assert full["activations"] - offload["activations"] == pytest.approx(model.layers * inputs)
    # a layer's backward holds its own inputs back and the next layer's, prefetched
    working = {flag: activations(model, Layout(ring=8, recompute="full", offload=flag), seq, 1, 2, 0, fused=True)[1]
               for flag in (False, True)}
    assert working[True] == pytest.approx(working[False] + 2 * inputs)
    with pytest.raises(ValueError, match="add 'full'"):
        Layout.parse("ring8 offload")
    assert Layout.parse("ring8 full tile4096 offload") == Layout(ring=8, recompute="full", mlp_tile=4096, offload=True)
    config = parallelize_config(Layout(ring=8, recompute="full", mlp_tile=4096, offload=True))["cp_config"]
    assert config["parallelize_plan"]["model.layers.*.mlp"] == {"SequenceTiled": {"tokens": 4096}}
    assert config["parallelize_plan"]["model.layers.*"] == "OffloadRecomputeInputs"
    # matmuls at the GEMM rate, attention at its own: doubling the attention rate halves attention's share
    slow = Cluster(8, 80e9, 700e12, 300e9, 25e9, 8, attention_flops=300e12)
    fast = Cluster(8, 80e9, 700e12, 300e9, 25e9, 8, attention_flops=600e12)
    layout = Layout(ring=8)
    dense = 6 * tokens * model.active_matmul_params / 700e12
    attention = step_time(model, layout, slow, seq, 1, 2)["compute"] - dense
    assert step_time(model, layout, fast, seq, 1, 2)["compute"] - dense == pytest.approx(attention / 2)
    # offload copies hide behind a layer's compute at 1M tokens, not with a slow link
    assert step_time(model, Layout(ring=8, recompute="full", offload=True), slow, seq, 1, 2)["host_offload_exposed"] == 0
    crawl = Cluster(8, 80e9, 700e12, 300e9, 25e9, 8, attention_flops=300e12, pcie_bandwidth=1e8)
    assert step_time(model, Layout(ring=8, recompute="full", offload=True), crawl, seq, 1, 2)["host_offload_exposed"] > 0


def test_max_seq_plans_llama3_8b_beyond_alst_on_8_gpus_of_80_gb(tmp_path, capsys):
    """ALST: 3.7M tokens for Llama-3-8B on 8 x H100 80 GB; paddle_cp's planner finds a longer one it can run."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    out = tmp_path / "plan.json"
    plan.main(["--config", str(tmp_path / "config.json"), "--max-seq", "--devices", "8", "--memory-gb", "80",
               "--kernels", "fused", "--json", str(out)])
    assert "longest sequence that fits" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["seq"] >= 3_800_000 and result["seq"] % 65536 == 0
    best = result["best"]
    assert best["fits"] and best["memory_total"] <= 80e9 and best["host_per_node"] <= 2000e9
    assert best["layout"]["offload"] and best["layout"]["mlp_tile"] and best["layout"]["recompute"] == "full"
    longer = search.rank_layouts(ModelShape.from_config(LLAMA3_8B), Cluster(8, 80e9, 700e12, 300e9, 25e9, 8, 300e12),
                                  result["seq"] + 65536, fused=True)
    assert not longer[0]["fits"]  # one step longer fits no layout
    path = tmp_path / "layout.yaml"
    path.write_text(result["plans"][0]["yaml"])
    _, config = load_config(str(path), world_size=8)
    plans = config["cp_config"]["parallelize_plan"]
    assert type(plans["model.layers.*.mlp"]).__name__ == "SequenceTiled"
    assert type(plans["model.layers.*"]).__name__ == "OffloadRecomputeInputs"


def _exchange_of_one_document(seq, ring, kv_row_bytes, grad_row_bytes, causal=True):
    """exchange_plan's counts and ExchangeBytes for one document in the layout paddle_cp runs (2R chunks)."""
    from paddle_cp.attention.layout.exchange_plan import ExchangePlan, exchange_bytes
    from paddle_cp.attention.layout.sequence_layout import SequenceLayout

    plan_ = ExchangePlan(SequenceLayout("p2p", ring).ring_positions(seq), causal)
    return plan_, exchange_bytes(plan_, kv_row_bytes, grad_row_bytes)


def test_ring_bytes_are_the_planned_exchange_a_quarter_below_whole_blocks_on_one_causal_document():
    """bf16 k/v, fp32 gradients: on one causal document in 2R chunks member r reads g's whole block for g > r and
    its first chunk for g < r, so every rank sends and receives 3/4 of the whole-block ring's forward + backward
    (exchange_plan's numbers); full attention reads every block whole."""
    from paddle_cp.cost.attention import attention_traffic
    from paddle_cp.cost.exchange import chunk_reads
    from paddle_cp.cost.step_time import attention_bytes

    cluster = Cluster(8, 80e9, 400e12, 300e9, 25e9, 8)
    seq, ring = 32768, 8
    row = SMALL.kv_heads * 2 * SMALL.head_dim  # one token's k and v heads on a rank (batch 1)
    plan_, sent = _exchange_of_one_document(seq, ring, row * 2, row * 4)
    assert (sent.planned * 4 == sent.whole_blocks * 3).all()  # every rank: exactly 0.75
    assert (chunk_reads(seq, ring) == plan_.counts).all()
    for odd in (50001, 4099):  # chunks that are not whole tiles: the tiles straddling them are read whole
        assert (chunk_reads(odd, 3) == _exchange_of_one_document(odd, 3, 1, 1)[0].counts).all()
    got = attention_bytes(SMALL, Layout(ring=ring), cluster, seq, 1, 2)
    assert got == {"ring_within_node": int(sent.planned.max()), "ring_across_nodes": 0, "ulysses_within_node": 0,
                   "ulysses_across_nodes": 0}
    assert got["ring_within_node"] * 4 == 3 * int(sent.whole_blocks.max())
    full = attention_bytes(SMALL, Layout(ring=ring), cluster, seq, 1, 2, causal=False)
    assert full["ring_within_node"] == int(_exchange_of_one_document(seq, ring, row * 2, row * 4, False)[1]
                                           .whole_blocks.max())
    # hybrid: the ring part over N/U groups of the head-split k/v (SMALL's 4 k/v heads, 2 a rank under U = 2)
    hybrid = attention_bytes(SMALL, Layout(ring=4, ulysses=2), cluster, seq, 1, 2)
    assert hybrid["ring_within_node"] * 2 == attention_bytes(SMALL, Layout(dp=2, ring=4), cluster, seq, 1, 2)[
        "ring_within_node"]
    assert hybrid["ulysses_within_node"] == attention_traffic(1, seq, 8, 4, 64, 4, 2, 2)[0] > 0


def test_packed_short_documents_send_next_to_nothing():
    """Short documents kept whole on a rank: their layout's ring reads no other rank's k/v."""
    import numpy as np

    from paddle_cp.cost.step_time import attention_bytes
    from paddle_cp.tools import packing

    cluster = Cluster(8, 80e9, 400e12, 300e9, 25e9, 8)
    seq = 32768
    one = attention_bytes(SMALL, Layout(dp=2, ring=4), cluster, seq, 1, 2, packed=plan.packed_row(np.arange(seq)))
    assert one == attention_bytes(SMALL, Layout(dp=2, ring=4), cluster, seq, 1, 2)  # one document: the chunks
    short = plan.packed_row(packing.batches("lognormal", seq, 1, 1)[0][0])
    got = attention_bytes(SMALL, Layout(dp=2, ring=4), cluster, seq, 1, 2, packed=short)
    assert sum(got.values()) <= 0.02 * one["ring_within_node"]


def test_a_ring_across_two_nodes_pays_the_network_rate_for_the_rows_from_the_other_node():
    """Ring members 0-3 on one node, 4-7 on the other: what a member receives from the other node comes at the
    network's rate, the rest at NVLink's; the busiest member's sum shows where attention cannot hide it."""
    from paddle_cp.cost.step_time import attention_bytes, ring_exchange

    seq, ring = 32768, 8
    row = SMALL.kv_heads * 2 * SMALL.head_dim
    plan_, _ = _exchange_of_one_document(seq, ring, row * 2, row * 4)
    read = plan_.counts
    received = 2 * read * row * 2 + read.T * row * 4  # [r, g]: k/v forward and again backward, gradients home
    node = [g // 4 for g in range(ring)]
    # no compute to hide behind: ring_exposed is the exchange itself
    cluster = Cluster(8, 80e9, 400e12, 300e9, 25e9, 4, attention_flops=1e30)
    seconds = [sum(received[r, g] / (300e9 if node[g] == node[r] else 25e9) for g in range(ring))
               for r in range(ring)]
    busiest = max(range(ring), key=seconds.__getitem__)
    got = attention_bytes(SMALL, Layout(ring=ring), cluster, seq, 1, 2)
    within = sum(received[busiest, g] for g in range(ring) if node[g] == node[busiest])
    assert (got["ring_within_node"], got["ring_across_nodes"]) == (within, received[busiest].sum() - within)
    assert got["ring_across_nodes"] > 0
    exchange = ring_exchange(SMALL, Layout(ring=ring), cluster, seq, 1, 2)
    assert exchange.seconds == pytest.approx(seconds[busiest])
    assert step_time(SMALL, Layout(ring=ring), cluster, seq, 1, 2)["ring_exposed"] == pytest.approx(
        SMALL.layers * seconds[busiest])
    one_node = Cluster(8, 80e9, 400e12, 300e9, 25e9, 8, attention_flops=1e30)
    assert step_time(SMALL, Layout(ring=ring), one_node, seq, 1, 2)["ring_exposed"] == pytest.approx(
        SMALL.layers * received.sum(axis=1).max() / 300e9)


def test_recomputed_attention_moves_the_same_ring_bytes_and_hides_them_behind_its_replay_too():
    """Under recomputation the ring's backward reads the k/v its replay received: the same bytes a layer as without
    (k/v twice, gradients once), and the replayed forward's attention (a third of forward + backward) hides them
    too; recomputing the MLP alone replays no attention, and the backward fetches k/v again."""
    from paddle_cp.cost.step_time import attention_bytes

    seq, ring = 32768, 8
    cluster = Cluster(8, 80e9, 400e12, 300e9, 25e9, 4)
    plain = step_time(SMALL, Layout(ring=ring), cluster, seq, 1, 2)
    attention_seconds = plain["compute"] - step_time(SMALL, Layout(ring=ring), Cluster(
        8, 80e9, 400e12, 300e9, 25e9, 4, attention_flops=1e30), seq, 1, 2)["compute"]
    exchange = plain["ring_exposed"] + attention_seconds
    assert plain["ring_exposed"] > 0
    for recompute, hidden in (("full", 4 / 3), ("core_attn", 4 / 3), ("mlp", 1)):
        layout = Layout(ring=ring, recompute=recompute)
        assert attention_bytes(SMALL, layout, cluster, seq, 1, 2) == attention_bytes(SMALL, Layout(ring=ring), cluster,
                                                                                     seq, 1, 2)
        got = step_time(SMALL, layout, cluster, seq, 1, 2)["ring_exposed"]
        assert got == pytest.approx(max(0.0, exchange - hidden * attention_seconds)), recompute


def test_a_replayed_ring_holds_its_received_kv_up_to_the_limit_and_fetches_them_again_past_it(monkeypatch):
    """Llama-3-8B, one causal document over ring8, bf16 k/v: under full recomputation the replay holds the k/v its
    busiest member received (member 0 reads 7 whole blocks of 64 MiB at 128K) in the rebuilt layer's phase; past
    exchange.REPLAY_HOLD_LIMIT it holds none and the backward fetches them again: a third k/v pass on the links."""
    from paddle_cp.cost import exchange
    from paddle_cp.cost.memory import ring_replay_held
    from paddle_cp.cost.step_time import attention_bytes

    llama, seq = ModelShape.from_config(LLAMA3_8B), 128 * 1024
    cluster = Cluster(8, 80e9, 700e12, 300e9, 25e9, 8, 300e12)
    full, plain = Layout(ring=8, recompute="full"), Layout(ring=8)
    assert ring_replay_held(llama, full, seq, 1, 2) == 7 * 64 * 2 ** 20
    assert ring_replay_held(llama, Layout(ring=8, recompute="mlp"), seq, 1, 2) == 0  # attention not replayed
    assert ring_replay_held(llama, plain, seq, 1, 2) == 0
    assert ring_replay_held(llama, full, 8 * seq, 1, 2) == 0  # 3.5 GiB: past the limit
    kept = memory(llama, full, seq, 1, 2)["phases"]["layer_backward"]
    kv_pass = 7 * 64 * 2 ** 20  # member 0 receives 7 whole blocks a pass (causal: it reads every earlier block)
    assert attention_bytes(llama, full, cluster, seq, 1, 2) == attention_bytes(llama, plain, cluster, seq, 1, 2)

    monkeypatch.setattr(exchange, "REPLAY_HOLD_LIMIT", 0)
    assert memory(llama, full, seq, 1, 2)["phases"]["layer_backward"] == kept - kv_pass
    refetched = attention_bytes(llama, full, cluster, seq, 1, 2)
    assert refetched["ring_within_node"] == attention_bytes(llama, plain, cluster, seq, 1, 2)["ring_within_node"] + kv_pass
