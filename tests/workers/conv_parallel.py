"""ConvParallel on a small conv net (3 Conv2D + ReLU, pooling, Linear head, cross-entropy) vs one card.

4 ranks; meshes mp=4 and dp=2 x mp=2, NCHW and NHWC. Each run: first-step logits,
input gradients and (reduced) parameter gradients, then the losses of 3 AdamW steps
and the final parameters, all against one card on the global batch, computed here.
Also: the halo bytes of one forward, and a width mp does not divide refused on every rank.
"""
import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from report import run

import paddle_cp as pcp
from paddle_cp.comm.counters import bytes_sent, reset

BATCH, HEIGHT, WIDTH, CLASSES, STEPS = 4, 8, 16, 5, 3
MESHES = {"mp4": [("mp", 4)], "dp2xmp2": [("dp", 2), ("mp", 2)]}


class ConvNet(paddle.nn.Layer):
    """conv1: H stride 2, 'same' on W (halo 1|1); conv2: groups, H dilation, asymmetric W padding
    (halo 1|2); conv3: W stride = kernel, no padding (no halo)."""

    def __init__(self, data_format):
        super().__init__()
        self.data_format = data_format
        self.conv1 = paddle.nn.Conv2D(3, 8, 3, stride=[2, 1], padding=1, data_format=data_format)
        self.conv2 = paddle.nn.Conv2D(8, 8, [3, 4], padding=[2, 2, 1, 2], dilation=[2, 1], groups=2,
                                      data_format=data_format)
        self.conv3 = paddle.nn.Conv2D(8, 8, 2, stride=2, data_format=data_format)
        self.head = paddle.nn.Linear(8, CLASSES)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.relu(self.conv3(x))
        x = F.adaptive_avg_pool2d(x, 1, data_format=self.data_format)  # [N, 8, 1, 1] or [N, 1, 1, 8]
        return self.head(x.reshape([x.shape[0], -1]))


PLAN = {"conv1": pcp.ConvParallel(), "conv2": pcp.ConvParallel(), "conv3": pcp.ConvParallel()}


def build(data_format):
    paddle.seed(2024)
    model = ConvNet(data_format)
    optimizer = paddle.optimizer.AdamW(learning_rate=1e-2, weight_decay=0.01, epsilon=1e-3,
                                       parameters=model.parameters())
    return model, optimizer


def batches(data_format):
    rng = np.random.RandomState(3)
    shape = [BATCH, 3, HEIGHT, WIDTH] if data_format == "NCHW" else [BATCH, HEIGHT, WIDTH, 3]
    return [(rng.randn(*shape).astype("float32"), rng.randint(0, CLASSES, [BATCH, 1]).astype("int64"))
            for _ in range(STEPS)]


def train(model, optimizer, data, rows, scale):
    """Losses of each step; the first step's logits, input gradient and parameter gradients (as the
    optimizer steps with them, i.e. reduced over mp and dp); final parameters. `rows`: this rank's
    samples; `scale`: its share of the global mean (the input gradient is of its local mean)."""
    losses, first = [], None
    for images, labels in data:
        x = paddle.to_tensor(images[rows], stop_gradient=False)
        logits = model(x)
        loss = F.cross_entropy(logits, paddle.to_tensor(labels[rows]))
        loss.backward()
        optimizer.step()
        if first is None:
            first = {"logits": logits.numpy(), "x_grad": x.grad.numpy() * scale,
                     **{f"grad.{k}": p.grad.numpy() for k, p in model.named_parameters()}}
        optimizer.clear_grad()
        losses.append(loss)
    return losses, first, {k: v.numpy() for k, v in model.state_dict().items()}


def one_card(data_format):
    model, optimizer = build(data_format)
    losses, first, state = train(model, optimizer, batches(data_format), slice(None), 1.0)
    return [float(loss) for loss in losses], first, state


def parallel_run(report, name, dims, data_format):
    world = dist.get_world_size()
    mesh = dist.ProcessMesh(np.arange(world).reshape([d for _, d in dims]).tolist(), dim_names=[n for n, _ in dims])
    model, optimizer = build(data_format)
    model, optimizer = pcp.parallelize(model, optimizer, mesh=mesh, config={"mp_config": {"parallelize_plan": PLAN}})
    dp = dict(dims).get("dp", 1)
    per_rank = BATCH // dp
    dp_index = int(np.argwhere(np.array(mesh.mesh) == dist.get_rank())[0][0]) if dp > 1 else 0  # dims [dp, mp]
    rows = slice(dp_index * per_rank, (dp_index + 1) * per_rank)
    data = batches(data_format)

    reset()
    model(paddle.to_tensor(data[0][0][rows]))  # one forward without input gradient: halos of conv1 and conv2
    report.value(f"{name}.halo_bytes_one_forward", bytes_sent("conv_halo"))

    losses, first, state = train(model, optimizer, data, rows, 1.0 / dp)
    want_losses, want_first, want_state = one_card(data_format)
    means = []
    for loss in losses:
        total = loss.detach().clone()
        dist.all_reduce(total)  # mp copies are equal: the world mean is the dp mean
        means.append(float(total) / world)
    report.diff(f"{name}.loss", np.array(means), np.array(want_losses))
    for key, value in want_first.items():
        report.diff(f"{name}.{key}", first[key], value[rows] if key in ("logits", "x_grad") else value)
    report.value(f"{name}.state_keys_match", sorted(state) == sorted(want_state))
    for key, value in want_state.items():
        report.diff(f"{name}.state.{key}", state[key], value)
    if name.startswith("mp4"):  # 18 columns do not split over 4 ranks: every rank refuses, none waits
        bad = paddle.to_tensor(np.zeros([1, 3, HEIGHT, 18] if data_format == "NCHW" else [1, HEIGHT, 18, 3],
                                        "float32"))
        report.expect_error(f"{name}.width_not_divisible", lambda: model(bad))


def main(report):
    for mesh_name, dims in MESHES.items():
        for data_format in ("NCHW", "NHWC"):
            parallel_run(report, f"{mesh_name}_{data_format}", dims, data_format)


if __name__ == "__main__":
    run(main)
