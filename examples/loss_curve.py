"""Write two loss curves (a parallel run and its one-process replay) as CSV, and as PNG with matplotlib."""
from __future__ import annotations

import csv
import importlib.util
import os


def write_csv(path, losses, reference):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "loss", "one_process_loss", "abs_difference"])
        for step, (loss, ref) in enumerate(zip(losses, reference), start=1):
            writer.writerow([step, f"{loss:.8f}", f"{ref:.8f}", f"{abs(loss - ref):.3e}"])
    return path


def write_png(path, losses, reference, title):
    """The PNG's path, or None (and a note) without matplotlib, which is an optional extra."""
    if importlib.util.find_spec("matplotlib") is None:
        print(f"no {path}: matplotlib is not installed (pip install -e \".[examples]\")", flush=True)
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = range(1, len(losses) + 1)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot(steps, reference, color="tab:gray", linewidth=3, alpha=0.6, label="one process")
    ax.plot(steps, losses, "o", color="tab:blue", markersize=4, label="context parallel")
    ax.set(xlabel="step", ylabel="loss (nats per byte)", title=title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
