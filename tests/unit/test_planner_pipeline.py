"""The planner's pipeline terms: memory per stage, 1F1B's bubble, and the config it writes runs."""
import yaml

from paddle_cp.tools import planner
from paddle_cp.api.config import load_config

MODEL = planner.ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, vocab=32000, intermediate=11008)
CLUSTER = planner.Cluster(devices=8, memory=80e9, flops=300e12, intra_bandwidth=200e9, inter_bandwidth=25e9,
                          devices_per_node=8)


def test_stages_divide_parameter_state_and_hold_min_p_m_micro_batches():
    one = planner.memory(MODEL, planner.Layout(1, 1, 1, 1), 4096, 8, 2)
    four = planner.memory(MODEL, planner.Layout(1, 1, 1, 1, pp=4, micro=8), 4096, 8, 2)
    assert four["state"] < one["state"] / 3.5  # a quarter of the layers, plus the embedding
    assert four["activations"] == one["activations"] / 4 * 4 / 8  # 1/pp of the layers, pp of m micro-batches


def test_bubble_stretches_compute_and_shrinks_with_micro_batches():
    few = planner.estimate(MODEL, planner.Layout(1, 1, 1, 2, pp=4, micro=4), CLUSTER, 4096, 4)
    many = planner.estimate(MODEL, planner.Layout(1, 1, 1, 2, pp=4, micro=16), CLUSTER, 4096, 16)
    assert planner.Layout(1, 1, 1, 1, pp=4, micro=4).bubble == 3 / 7
    assert few["time"]["pipeline_p2p"] > 0
    assert many["tokens_per_second"] > few["tokens_per_second"]


def test_search_includes_pipelines_and_their_config_loads():
    found = planner.rank_layouts(MODEL, CLUSTER, 4096, batch=8)
    pipelined = [e for e in found if e["layout"]["pp"] > 1]
    assert pipelined and all(e["layout"]["micro"] == 8 for e in pipelined)
    layout = planner.Layout(**pipelined[0]["layout"])
    mesh, config = load_config(yaml.safe_load(yaml.safe_dump(planner.parallelize_config(layout))), world_size=8)
    assert mesh.dim_names[0] == "pp" and config["pp_config"]["accumulate_steps"] == 8
