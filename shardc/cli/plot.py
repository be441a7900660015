"""`explain --plot` — a PaRO Figure 5-style chart (matplotlib, Agg backend).

Input: an `Explained` report and the model spec. Output: a PNG placing the strategy
among the named strategies of `examples/strategies/` on the same mesh and model:
memory per rank (model states) against the bytes each rank sends per step over the
inter-level (outermost) links and over the intra-level links.
"""
from __future__ import annotations

from pathlib import Path

from shardc.dsl.errors import ShardcError
from shardc.lowering.optimizers import DEFAULT_OPTIMIZER

NAMED_DIR = Path(__file__).resolve().parents[2] / "examples" / "strategies"


def named_points(mesh, units_of, accumulate: int, optimizer: str, optimizer_kwargs) -> list[tuple]:
    """`(name, memory, inter, intra)` for every named strategy that loads on `mesh`."""
    from shardc.dsl import load_strategy
    from shardc.analysis.costmodel.report import explain

    out = []
    for path in sorted(NAMED_DIR.glob("*.shard")):
        try:
            s = load_strategy(str(path), mesh=mesh)
        except ShardcError:
            continue   # e.g. zero_topo names a level this mesh does not have
        e = explain(s, units_of(s), micro_batches=accumulate, optimizer=optimizer,
                    optimizer_kwargs=optimizer_kwargs)
        out.append((s.name, e.memory["total"], e.inter, e.intra))
    return out


def plot_among_named(e, model_spec: str, out: str, *, optimizer: str = DEFAULT_OPTIMIZER, optimizer_kwargs=None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from shardc.analysis.costmodel.report import model_units
    from shardc.cli.loader import build_model

    model = build_model(model_spec, device="meta")
    pts = named_points(e.strategy.mesh, lambda s: model_units(s, model), e.micro_batches,
                       optimizer, optimizer_kwargs)
    gib = 2.0 ** 30
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, idx, label in ((axes[0], 2, "inter-level (outermost) bytes per rank per step [GiB]"),
                           (axes[1], 3, "intra-level bytes per rank per step [GiB]")):
        for p in pts:
            ax.scatter(p[idx] / gib, p[1] / gib, color="tab:blue")
            ax.annotate(p[0], (p[idx] / gib, p[1] / gib), fontsize=8, xytext=(3, 3), textcoords="offset points")
        mine = (e.inter, e.intra)[idx - 2]
        ax.scatter(mine / gib, e.memory["total"] / gib, color="tab:red", marker="*", s=220, zorder=3,
                   label=f"{e.strategy.name} (this file)")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("model-state memory per rank [GiB]")
    axes[0].legend(loc="upper right")
    fig.suptitle(f"{model_spec} on {e.strategy.mesh}, {e.micro_batches} micro-batches per step")
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=110)
    except OSError as err:
        raise ShardcError(f"cannot write plot {out}: {err.strerror or err}") from None
    finally:
        plt.close(fig)
