"""Every mesh users write: dims dp, mp, pp and sep of size 1 or 2 (up to 8 ranks), in Paddle's order and others,
and meshes leaving dims out, each with every config that applies to its dims (tests/workers/mesh_layouts.py),
Paddle's parallel-API Llama vs one card. One launch per world size (4 ranks: test_paddle_compat.py's launch)."""
import pytest
from launcher import launch_once
from test_paddle_compat import FOUR_RANK_GROUPS, _check
from workers.mesh_layouts import WORLDS, layouts

CASES = [(world, name) for world in WORLDS for name, _ in layouts(world)]


@pytest.mark.parametrize("world,run", CASES, ids=[name for _, name in CASES])
def test_every_mesh_matches_one_card(world, run):
    pytest.importorskip("paddleformers")
    groups = FOUR_RANK_GROUPS if world == 4 else (f"sweep{world}",)
    _check(launch_once("paddle_parallel_api.py", world, *groups), run)
