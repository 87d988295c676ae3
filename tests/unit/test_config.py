"""load_config: YAML and dicts to (ProcessMesh, parallelize config), and its errors."""
from typing import NamedTuple

import pytest
import yaml

from paddle_cp.tools.plan.config import parallelize_config
from paddle_cp.cost.candidate import Layout
from paddle_cp.api.config import known_plans, load_config
from paddle_cp.plans import ContextParallel, PrepareContextParallel

EXAMPLE = {
    "mesh": {"shape": [2, 2], "dim_names": ["dp", "sep"]},
    "dp_config": {"sharding_level": 0},
    "cp_config": {"parallelize_plan": {
        "model": {"PrepareContextParallel": {"backend": "p2p"}},
        "model.layers.*.self_attn": [{"ContextParallel": {"backend": "all2all"}}],
        "model.bare": "ContextParallel",
    }},
}


def test_yaml_file_round_trip(tmp_path):
    path = tmp_path / "cp.yaml"
    path.write_text(yaml.safe_dump(EXAMPLE))
    mesh, config = load_config(str(path), world_size=4)
    assert list(mesh.shape) == [2, 2] and list(mesh.dim_names) == ["dp", "sep"]
    assert list(mesh.process_ids) == [0, 1, 2, 3]
    assert config["dp_config"] == {"sharding_level": 0}
    plan = config["cp_config"]["parallelize_plan"]
    assert isinstance(plan["model"], PrepareContextParallel) and plan["model"].backend == "p2p"
    (attention,) = plan["model.layers.*.self_attn"]
    assert isinstance(attention, ContextParallel) and attention.backend == "all2all"
    assert isinstance(plan["model.bare"], ContextParallel) and plan["model.bare"].backend == "p2p"


def test_dict_is_not_mutated_and_plan_objects_pass_through():
    given = {"mesh": {"shape": [2], "dim_names": ["sep"]},
             "cp_config": {"parallelize_plan": {"a": "ContextParallel", "b": ContextParallel("all2all")}}}
    _, config = load_config(given, world_size=2)
    assert given["cp_config"]["parallelize_plan"]["a"] == "ContextParallel"
    assert config["cp_config"]["parallelize_plan"]["b"] is given["cp_config"]["parallelize_plan"]["b"]


def test_ep_config_from_yaml(tmp_path):
    path = tmp_path / "ep.yaml"
    path.write_text("mesh: {shape: [2, 2], dim_names: [dp, sep]}\n"
                    "ep_config:\n  degree: 4\n  parallelize_plan:\n    model.layers.*.mlp: ExpertParallel\n")
    _, config = load_config(str(path), world_size=4)
    assert config["ep_config"]["degree"] == 4
    assert type(config["ep_config"]["parallelize_plan"]["model.layers.*.mlp"]).__name__ == "ExpertParallel"


def test_planner_output_loads():
    layout = Layout(dp=2, ring=1, ulysses=2, tp=1)
    mesh, config = load_config(yaml.safe_load(yaml.safe_dump(parallelize_config(layout))), world_size=4)
    assert list(mesh.dim_names) == ["dp", "sep"]
    assert config["cp_config"]["parallelize_plan"][""].backend == "all2all"
    _, config = load_config(yaml.safe_load(yaml.safe_dump(parallelize_config(Layout(dp=2, ring=2, ep=4)))),
                            world_size=4)  # a MoE layout: its ep_config loads
    assert config["ep_config"]["degree"] == 4
    assert type(config["ep_config"]["parallelize_plan"]["model.layers.*.mlp"]).__name__ == "ExpertParallel"


def _with_plan(spec):
    return {"mesh": {"shape": [2], "dim_names": ["sep"]}, "cp_config": {"parallelize_plan": {"model": spec}}}


class ConfigError(NamedTuple):
    name: str
    source: object
    error: type
    words: list  # what the message must name


CONFIG_ERRORS = [
    ConfigError("unknown_plan", _with_plan("NoSuchPlan"), ValueError, ["unknown plan 'NoSuchPlan'", "ContextParallel"]),
    ConfigError("misspelt_argument", _with_plan({"ContextParallel": {"bakend": "p2p"}}), TypeError,
                ["bakend", "backend"]),
    ConfigError("arguments_not_a_mapping", _with_plan({"ContextParallel": "p2p"}), TypeError, ["mapping"]),
    ConfigError("two_plans_in_one_mapping", _with_plan({"ContextParallel": {}, "PrepareContextParallel": {}}),
                TypeError, ["a name"]),
    ConfigError("unknown_backend", _with_plan({"ContextParallel": {"backend": "ring"}}), ValueError, ["p2p"]),
    ConfigError("base_class_as_plan", _with_plan("Plan"), ValueError, ["unknown plan"]),
    ConfigError("mesh_larger_than_world", {"mesh": {"shape": [2, 2], "dim_names": ["dp", "sep"]}}, ValueError,
                ["4 ranks but 2"]),
    ConfigError("dim_names_mismatch", {"mesh": {"shape": [2], "dim_names": ["dp", "sep"]}}, ValueError,
                ["dim_names"]),
    ConfigError("empty_mesh_dim", {"mesh": {"shape": [0], "dim_names": ["sep"]}}, ValueError, ["positive"]),
    ConfigError("no_mesh", {"dp_config": {}}, ValueError, ["mesh"]),
    ConfigError("unknown_key", {"mesh": {"shape": [2], "dim_names": ["sep"]}, "tp_config": {}}, ValueError,
                ["tp_config"]),
    ConfigError("not_a_path_or_dict", ["mesh"], TypeError, ["path or a dict"]),
]


@pytest.mark.parametrize("case", CONFIG_ERRORS, ids=lambda case: case.name)
def test_errors(case):
    with pytest.raises(case.error) as raised:
        load_config(case.source, world_size=2)
    for word in case.words:
        assert word in str(raised.value)


def test_known_plans_come_from_the_package():
    assert {"ContextParallel", "PrepareContextParallel"} <= set(known_plans())
    assert "Plan" not in known_plans()
