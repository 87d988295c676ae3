"""What a step depends on that only this rank holds: its random generators (Python's, numpy's, Paddle's on every
device) and the state of the objects a run names (an LR scheduler, a GradScaler, a sampler: anything with
`state_dict()` / `set_state_dict()`), one file per rank inside each checkpoint (`rank_state/<rank>.pdstate`).

Resumed on as many ranks as saved it, each rank takes back its own; on another number of ranks each takes rank 0's
(the ranks of paddle_cp's runs draw from one seed, as one card does; a rank-specific stream has no owner left).
"""
from __future__ import annotations

import os
import pickle
import random

import numpy as np
import paddle

FOLDER = "rank_state"


def _path(directory, rank):
    return os.path.join(directory, FOLDER, f"{rank}.pdstate")


def _generators():
    return {"python": random.getstate(), "numpy": np.random.get_state(), "paddle": paddle.get_rng_state(),
            "paddle_cpu": paddle.framework.core.default_cpu_generator().get_state()}


def write(directory, rank, world, objects):
    """This rank's state into the checkpoint being written in `directory`."""
    os.makedirs(os.path.join(directory, FOLDER), exist_ok=True)
    state = {"world": world, "generators": _generators(),
             "objects": {name: obj.state_dict() for name, obj in objects.items()}}
    with open(_path(directory, rank), "wb") as f:
        pickle.dump(state, f)


def restore(checkpoint, rank, world, objects, optional=()):
    """This rank's saved state (or rank 0's, on another number of ranks) back into the generators and `objects`
    (those named in `optional` only where the checkpoint holds theirs); returns the rank whose state it took."""
    source = rank
    with open(_path(checkpoint, 0), "rb") as f:
        state = pickle.load(f)
    if state["world"] == world and rank != 0:
        with open(_path(checkpoint, rank), "rb") as f:
            state = pickle.load(f)
    elif state["world"] != world:
        source = 0
    missing = sorted(set(objects) - set(state["objects"]) - set(optional))
    if missing:
        raise ValueError(f"checkpoint {checkpoint} holds no state of {missing} (it has {sorted(state['objects'])}): "
                         "resume with the objects the run saved")
    generators = state["generators"]
    random.setstate(generators["python"])
    np.random.set_state(generators["numpy"])
    paddle.set_rng_state(generators["paddle"])
    paddle.framework.core.default_cpu_generator().set_state(generators["paddle_cpu"])
    for name, obj in objects.items():
        if name in state["objects"]:
            obj.set_state_dict(state["objects"][name])
    return source
