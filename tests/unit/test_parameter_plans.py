"""Plans keyed on one parameter (`"...q_proj.lora_B": ColWiseParallel()`): Paddle's placement for it, never
applied to another parameter; LoRA linears composed exactly with their layer's plan; everything else refused
(before any collective) or, for a key naming no tensor, warned about as Paddle ignores it."""
import warnings

import paddle
import paddle.distributed as dist
import pytest

import paddle_cp as pcp
from paddle_cp.params import Partial, find_record

lora_layers = pytest.importorskip("paddleformers.peft.lora.lora_layers")


class Scaled(paddle.nn.Layer):
    """A layer with a tensor parameter besides its weight, used by its own forward."""

    def __init__(self):
        super().__init__()
        self.weight = self.create_parameter([4, 4])
        self.scale = self.create_parameter([4, 4])
        self.cube = self.create_parameter([2, 2, 2])


def _lora(bias=False):
    paddle.seed(0)
    return paddle.nn.Sequential(lora_layers.LoRALinear(8, 8, r=2, lora_alpha=4, bias_attr=None if bias else False))


def _mp_plan(plan):
    return {"mp_config": {"parallelize_plan": plan}}


def _mp2():
    return dist.ProcessMesh([0, 1], dim_names=["mp"])


@pytest.mark.parametrize("plan, name, axis", [
    (pcp.ColWiseParallel(), "lora_B", 1),  # 2-D: Shard(1)
    (pcp.ColWiseParallel(), "bias", 0),    # 1-D: Shard(0)
    (pcp.RowWiseParallel(), "lora_A", 0),  # 2-D: Shard(0)
])
def test_named_parameter_is_placed_as_paddle_places_it(plan, name, axis):
    assert plan.param_axis(_lora(bias=True)[0], name) == axis


@pytest.mark.parametrize("plan, layer, name, message", [
    (pcp.RowWiseParallel(), _lora(bias=True)[0], "bias", "splits a 2-D parameter"),
    (pcp.ColWiseParallel(), Scaled(), "cube", "is 3-D"),
    (pcp.ColWiseParallel(), _lora()[0], "scaling", "not a tensor"),
])
def test_named_parameter_of_another_rank_is_refused(plan, layer, name, message):
    with pytest.raises(ValueError, match=message):
        plan.param_axis(layer, name)


@pytest.mark.parametrize("named", [True, False], ids=["factor_named", "factor_implied"])
@pytest.mark.parametrize("layer_plan, factor_plan, split, summed", [
    (pcp.ColWiseParallel(), "lora_B", {"weight": 1, "lora_B": 1, "lora_A": None}, "lora_A"),
    (pcp.RowWiseParallel(), "lora_A", {"weight": 0, "lora_A": 0, "lora_B": None}, "lora_B"),
])
def test_lora_factor_plan_splits_that_factor_only(layer_plan, factor_plan, split, summed, named):
    """On a one-rank mp mesh: the records say which tensor each key split (the weight by the layer's key,
    the factor by its own key or, when the plan leaves it out, as the layer's forward needs), and which
    factor's gradient is summed over mp; the output is unchanged."""
    model = _lora()
    x = paddle.rand([3, 8])
    want = model(x).numpy()
    plan = {"0": layer_plan, **({f"0.{factor_plan}": type(layer_plan)()} if named else {})}
    pcp.parallelize(model, None, dist.ProcessMesh([0], dim_names=["mp"]), _mp_plan(plan))
    layer = model[0]
    for name, axis in split.items():
        assert [s.axis for s in find_record(getattr(layer, name)).shards()] == ([] if axis is None else [axis]), name
    assert [n for n in ("lora_A", "lora_B")
            if any(p.reduce == "sum" for p in find_record(getattr(layer, n)).find(Partial))] == [summed]
    assert paddle.allclose(model(x), paddle.to_tensor(want)).item()


REFUSED = [
    ("colwise_layer_with_lora_B_split_on_rows", {"0": pcp.ColWiseParallel(), "0.lora_B": pcp.RowWiseParallel()},
     "lora_B must be split on dim 1 to match, not 0"),
    ("colwise_layer_with_lora_A_split", {"0": pcp.ColWiseParallel(), "0.lora_B": pcp.ColWiseParallel(),
                                         "0.lora_A": pcp.ColWiseParallel()}, "lora_A must stay whole"),
    ("lora_B_split_without_layer_plan", {"0.lora_B": pcp.ColWiseParallel()}, "no tensor-parallel plan"),
    ("rowwise_on_a_bias", {"0": pcp.RowWiseParallel(), "0.lora_A": pcp.RowWiseParallel(),
                           "0.bias": pcp.RowWiseParallel()}, "splits a 2-D parameter"),
    ("one_factor_two_splits", {"0": pcp.RowWiseParallel(), "0.lora_A": [pcp.RowWiseParallel(),
                                                                        pcp.ColWiseParallel()]}, "give it one plan"),
]


@pytest.mark.parametrize("plan, message", [case[1:] for case in REFUSED], ids=[case[0] for case in REFUSED])
def test_lora_plans_that_cannot_be_exact_are_refused(plan, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pcp.parallelize(_lora(bias=True), None, _mp2(), _mp_plan(plan))


def test_plan_on_a_parameter_whose_use_is_unknown_is_refused():
    model = paddle.nn.Sequential(Scaled())
    with pytest.raises(ValueError, match="must know how Scaled's forward uses a split scale"):
        pcp.parallelize(model, None, _mp2(), _mp_plan({"0": pcp.ColWiseParallel(), "0.scale": pcp.ColWiseParallel()}))


@pytest.mark.parametrize("key, message", [
    ("0.scaling", "holds a float, not a tensor, in 'scaling'"),
    ("0.bias", "holds a NoneType, not a tensor, in 'bias'"),
    ("0.lora_C", "has no attribute 'lora_C'"),
    ("1.lora_B", "matches no sublayer"),
])
def test_key_naming_no_tensor_is_warned_about_and_applies_nowhere(key, message):
    model = _lora()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="no tensor-parallel plan"):  # the key did not stand in for the layer
            pcp.parallelize(model, None, _mp2(), _mp_plan({"0.lora_A": pcp.RowWiseParallel(),
                                                           key: pcp.ColWiseParallel()}))
    assert any(message in str(w.message) and key in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert all(find_record(p) is None or not find_record(p).shards() for p in model.parameters())
