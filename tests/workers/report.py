"""What a worker rank records: named measurements, written as JSON for the pytest side to judge."""
import faulthandler
import json
import os
import sys
import traceback

import numpy as np


class Report:
    def __init__(self):
        import paddle.distributed as dist

        self.rank = dist.get_rank()
        self.data = {"rank": self.rank, "errors": {}, "max_abs": {}, "values": {}}

    def diff(self, name, got, want):
        """Largest absolute difference between two tensors/arrays."""
        got = got.numpy() if hasattr(got, "numpy") else np.asarray(got)
        want = want.numpy() if hasattr(want, "numpy") else np.asarray(want)
        if got.shape != want.shape:
            self.data["max_abs"][name] = float("inf")
            self.data["values"][name + ".shape"] = [list(got.shape), list(want.shape)]
            return
        largest = float(np.abs(got - want).max()) if got.size else 0.0
        largest = largest if np.isfinite(largest) else float("inf")  # a NaN is no match (max() would drop it)
        self.data["max_abs"][name] = max(self.data["max_abs"].get(name, 0.0), largest)

    def training(self, name, got, want):
        """A training run's (losses, first-step gradients, final parameters) against a reference's."""
        (losses, grads, params), (ref_losses, ref_grads, ref_params) = got, want
        losses, ref_losses = [float(x) for x in losses], [float(x) for x in ref_losses]  # tensors or floats
        self.value(f"{name}.losses", losses)
        self.diff(f"{name}.loss", np.array(losses), np.array(ref_losses))
        for param, value in ref_grads.items():
            self.diff(f"{name}.grad", grads[param], value)
        for param, value in ref_params.items():
            self.diff(f"{name}.param", params[param], value)

    def value(self, name, value):
        self.data["values"][name] = value

    def expect_error(self, name, fn):
        """Run fn; record the error type and message (or 'no error')."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the report says what was raised
            self.data["errors"][name] = [type(exc).__name__, str(exc)]
        else:
            self.data["errors"][name] = ["no error", ""]

    def save(self):
        path = os.path.join(os.environ["PCP_REPORT_DIR"], f"rank{self.rank}.json")
        with open(path, "w") as f:
            json.dump(self.data, f)


def mean_over_ranks(losses, mesh):
    """Each step's loss averaged over the mesh's ranks: the sep ranks hold weighted shares of the mean, the ranks
    along any other dim (mp) copies of it."""
    import paddle.distributed as dist

    world = int(np.prod(mesh.shape))
    means = []
    for loss in losses:
        total = loss.detach().clone()
        dist.all_reduce(total)
        means.append(float(total) / world)
    return means


def train(model, opt, step_losses):
    """One optimizer step for each loss `step_losses` yields (a generator computes each step's loss when asked,
    after the step before): (losses, first-step gradients, final parameters), what Report.training compares.
    Gradients are read after the step, where a parallel optimizer has reduced them (a pipeline stage's others
    are None)."""
    losses, grads = [], None
    for loss in step_losses:
        loss.backward()
        opt.step()
        if grads is None:
            grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
        opt.clear_grad()
        losses.append(loss)
    return losses, grads, {n: p.numpy() for n, p in model.named_parameters()}


def train_steps(model, opt, batches, loss_fn, steps):
    """`steps` optimizer steps, each one backward of the summed losses of `batches` (every forward before it)."""
    return train(model, opt, (sum(loss_fn(model, batch) for batch in batches) for _ in range(steps)))


def run(main):
    report = Report()
    # after Paddle's own handler (installed when it is imported): a fatal signal, an abort at exit included, prints
    # every thread's Python stack in the rank's log, then Paddle's summary
    faulthandler.enable(all_threads=True)
    try:
        main(report)
    except Exception:  # noqa: BLE001 - surface the traceback in the report
        report.value("crash", traceback.format_exc())
    report.save()
    # Every check is in the report: leave without Paddle 3.3.1's CPU teardown, which now and then kills a rank
    # whose work is done (SIGABRT or SIGSEGV, no Python error; the launcher would run the launch once more).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
