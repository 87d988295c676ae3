"""The planner's pipeline terms: memory per stage, the schedules' bubbles, and the config it writes runs."""
import yaml

from paddle_cp.api.config import load_config
from paddle_cp.cost import search
from paddle_cp.cost.memory import in_flight, memory, stage_memory
from paddle_cp.cost.model_shape import ModelShape
from paddle_cp.tools.plan.config import parallelize_config
from paddle_cp.cost.candidate import Cluster, Layout

MODEL = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, vocab=32000, intermediate=11008)
CLUSTER = Cluster(devices=8, memory=80e9, flops=300e12, intra_bandwidth=200e9, inter_bandwidth=25e9,
                  devices_per_node=8)


def test_stages_divide_parameter_state_and_hold_their_in_flight_micro_batches():
    one = memory(MODEL, Layout(), 4096, 8, 2)
    layout = Layout(pp=4, micro=8)
    first = stage_memory(MODEL, layout, 4096, 8, 2, stage=0)
    assert first["optimizer"] < one["optimizer"] / 3.5  # a quarter of the layers, plus the embedding
    assert in_flight(layout, 0) == 4 and in_flight(layout, 3) == 1  # 1F1B: p - stage micro-batches
    assert in_flight(Layout(pp=4, micro=8, vpp=2), 0) == (2 * 3 + 4 + 1) / 2  # interleaved warm-up, in chunks
    # 1/pp of the layers, 4 of the 8 micro-batches (the whole model's activations include the final norm)
    assert first["activations"] < one["activations"] / 4 * 4 / 8
    assert first["activations"] > one["activations"] / 4 * 4 / 8 * 0.95


def test_bubble_stretches_compute_and_shrinks_with_micro_batches_and_chunks():
    few = search.estimate(MODEL, Layout(tp=2, pp=4, micro=4), CLUSTER, 4096, 4)
    many = search.estimate(MODEL, Layout(tp=2, pp=4, micro=16), CLUSTER, 4096, 16)
    assert Layout(pp=4, micro=4).bubble == 3 / 7 and Layout(pp=4, micro=4, vpp=2).bubble == 3 / 11
    assert few["time"]["pipeline_p2p"] > 0
    assert many["tokens_per_second"] > few["tokens_per_second"]


def test_search_includes_pipelines_and_their_config_loads():
    found = search.rank_layouts(MODEL, CLUSTER, 4096, batch=8)
    pipelined = [e for e in found if e["layout"]["pp"] > 1]
    assert pipelined and all(e["layout"]["micro"] == 8 for e in pipelined)
    assert any(e["layout"]["vpp"] == 2 for e in pipelined)
    assert not any(e["layout"]["recompute"] != "none" for e in pipelined)  # PaddleFormers' recompute fails on stages
    layout = Layout(**next(e for e in pipelined if e["layout"]["vpp"] == 2)["layout"])
    mesh, config = load_config(yaml.safe_load(yaml.safe_dump(parallelize_config(layout))), world_size=8)
    assert mesh.dim_names[0] == "pp" and config["pp_config"]["accumulate_steps"] == 8
    assert config["pp_config"]["schedule_mode"] == "VPP" and config["pp_config"]["vpp_degree"] == 2
