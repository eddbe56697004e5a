"""The result tables of ``benchmarks.gpu``: the engine's ratios over each transformers system,
and the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: The systems in the order the plot shows them.
SYSTEMS = ("engine", "hf-compile", "hf-static", "hf")


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Engine tok/s over each transformers system's, per shape and batch."""
    out = []
    engine = {(r["shape"], r["batch"]): r for r in rows if r["system"] == "engine"}
    for r in rows:
        mine = engine.get((r["shape"], r["batch"]))
        if r["system"] != "engine" and mine is not None:
            out.append(
                {
                    "shape": r["shape"],
                    "batch": r["batch"],
                    "versus": r["system"],
                    "tok_s_ratio": mine["tok_s"] / r["tok_s"],
                    "decode_step_ratio": r["decode_step_ms"] / mine["decode_step_ms"],
                }
            )
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    """tok/s and decode step (beside the floor) per shape, batch and system; False (with a
    message) when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: plot skipped", flush=True)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({str(r["shape"]) for r in rows})
    fig, axes = plt.subplots(2, len(shapes), figsize=(6 * len(shapes), 8), squeeze=False)
    for col, shape in enumerate(shapes):
        mine = [r for r in rows if r["shape"] == shape]
        batches = sorted({int(r["batch"]) for r in mine})
        systems = [s for s in SYSTEMS if any(r["system"] == s for r in mine)]
        for ax, key, label in (
            (axes[0][col], "tok_s", "output tok/s"),
            (axes[1][col], "decode_step_ms", "decode step (ms)"),
        ):
            series = [
                (s, {int(r["batch"]): r.get(key) for r in mine if r["system"] == s})
                for s in systems
            ]
            if key == "decode_step_ms":  # the floor is the same for every system
                series.append(
                    ("bandwidth floor", {int(r["batch"]): r["bandwidth_floor_ms"] for r in mine})
                )
            width = 0.8 / max(1, len(series))
            for i, (name, by_batch) in enumerate(series):
                xs = [j + i * width for j in range(len(batches))]
                ax.bar(xs, [float(by_batch.get(b) or 0.0) for b in batches], width, label=name)
            ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(batches))])
            ax.set_xticklabels([str(b) for b in batches])
            ax.set_xlabel("batch")
            ax.set_ylabel(label)
            ax.set_title(f"llama {shape}")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
