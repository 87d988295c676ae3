"""The mesh sweep's layouts (no Paddle import: the pytest side names the runs from here too).

Every mesh with the dims dp, mp, pp and sep, each of size 1 or 2, up to 8 ranks, plus meshes that leave
some dims out (Paddle's documentation writes dp, mp, pp). Each mesh runs Paddle's parallel-API Llama
(paddle_parallel_api.py) with every config that applies to a dim it has, whatever that dim's size:
dp_config (a sharding level), the mp plan (sequence parallel on or off), pp_config's split and cp_config
(ring or Ulysses). Levels, backends, sequence parallel and the order of the dim names rotate over the
meshes of one world size, so each launch covers levels 0-3, both backends and several orders.
"""
import itertools
import math
import os

DIMS = ("dp", "mp", "pp", "sep")
ORDERS = (("dp", "pp", "mp", "sep"),   # Paddle's parallel-API test
          ("dp", "mp", "pp", "sep"),   # Paddle's parallelize documentation (sep last)
          ("sep", "mp", "pp", "dp"),
          ("pp", "sep", "dp", "mp"))
# meshes without some dims: (dim names in mesh order, their sizes)
PARTIAL = (
    (("dp", "mp", "pp"), (1, 1, 2)),  # the documentation's example on two cards: the reported regression
    (("dp", "mp", "pp"), (1, 2, 1)),
    (("dp", "sep"), (1, 2)),
    (("mp", "sep"), (2, 1)),
    (("pp", "dp"), (1, 2)),
    (("dp", "mp", "pp"), (2, 1, 2)),
    (("sep", "dp"), (2, 2)),
    (("mp", "pp", "sep"), (1, 2, 2)),
)


def _name(dims, sizes, level, backend, sequence_parallel):
    mesh = "x".join(f"{d}{n}" for d, n in zip(dims, sizes))
    return f"{mesh}_l{level}" + (f"_{backend}" if "sep" in dims else "") + ("_sp" if sequence_parallel else "")


def layouts(world):
    """[(run name, settings for paddle_parallel_api.compare)] of the meshes of `world` ranks."""
    meshes = []
    for sizes in itertools.product((1, 2), repeat=len(DIMS)):
        if math.prod(sizes) == world:
            order = ORDERS[len(meshes) % len(ORDERS)]
            meshes.append((order, tuple(dict(zip(DIMS, sizes))[d] for d in order)))
    if world == 1:  # one card with a template's config: the all-ones mesh in every order
        meshes = [(order, (1,) * len(order)) for order in ORDERS]
    meshes += [(dims, sizes) for dims, sizes in PARTIAL if math.prod(sizes) == world]
    runs = []
    for i, (dims, sizes) in enumerate(meshes):
        level, backend, sequence_parallel = i % 4, ("p2p", "all2all")[i % 2], "mp" in dims and (i // 2) % 2 == 0
        settings = dict(zip(dims, sizes), dims=dims, sharding_stage=level, cp_backend=backend,
                        sequence_parallel=sequence_parallel, route=("patch", "pcp")[i % 2])
        runs.append((_name(dims, sizes, level, backend, sequence_parallel), settings))
    return runs


# The suite's launches. 8 ranks run on demand (PCP_MESH_SWEEP_WORLDS=1,2,4,8): Paddle 3.3.1's gloo rendezvous of a
# 4-rank group in an 8-rank world fails about half the time on 2 loaded cores (a truncated address read from the
# store, "sizeof(impl_) == bytes.size()"; reproduced with dist.new_group alone, no paddle_cp), which would make
# the suite flaky (of the 8-rank layouts, dp1 x pp2 x mp2 x sep2 has passed; the others have not got past that
# rendezvous here).
WORLDS = tuple(int(w) for w in os.environ.get("PCP_MESH_SWEEP_WORLDS", "1,2,4").split(","))
