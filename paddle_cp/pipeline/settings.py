"""`pp_config`, checked: Paddle's `split_spec`/`global_spec` plus the schedule options of its
static `Strategy().pipeline` (`schedule_mode`, `accumulate_steps`, `vpp_degree`) and `loss_fn`."""
from __future__ import annotations

from dataclasses import dataclass

from .schedule import SCHEDULES

KEYS = ("split_spec", "global_spec", "schedule_mode", "accumulate_steps", "vpp_degree", "loss_fn")


@dataclass(frozen=True)
class PipelineSettings:
    split_spec: object
    global_spec: object = None
    schedule_mode: str = "1F1B"
    accumulate_steps: int = 1
    vpp_degree: int = 1
    loss_fn: object = None


def _positive_int(config, key):
    value = config.get(key, 1)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"pp_config {key} must be a positive int, got {value!r}")
    return value


def check_settings(config):
    """PipelineSettings from a pp_config dict; ValueError/TypeError naming the fix."""
    if not isinstance(config, dict):
        raise TypeError(f"pp_config must be a dict like {{'split_spec': 'model.layers'}}, got {type(config).__name__}")
    unknown = set(config) - set(KEYS)
    if unknown:
        raise ValueError(f"pp_config has unknown keys {sorted(unknown)}: it takes {list(KEYS)}")
    if config.get("split_spec") is None:
        raise ValueError("pp_config needs split_spec: a layer prefix like 'model.layers' or "
                         "{layer_name: SplitPoint.END}")
    schedule = config.get("schedule_mode", "1F1B")
    if schedule not in SCHEDULES:
        raise ValueError(f"pp_config schedule_mode {schedule!r} is not supported: use one of {list(SCHEDULES)}")
    chunks = _positive_int(config, "vpp_degree")
    if schedule == "VPP" and chunks < 2:
        raise ValueError("pp_config schedule_mode 'VPP' interleaves stages: set vpp_degree >= 2")
    loss_fn = config.get("loss_fn")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"pp_config loss_fn must be callable as loss_fn(output, labels), got {type(loss_fn).__name__}")
    return PipelineSettings(config["split_spec"], config.get("global_spec"), schedule,
                            _positive_int(config, "accumulate_steps"), chunks, loss_fn)
