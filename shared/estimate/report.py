"""The planner's outputs: the terminal table, markdown, the sweep plot (matplotlib, lazily) and JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from shared.estimate.model import Estimate

# -------------------------------------------------------------------------------------------- outputs


def _align(rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell; the first column left-aligned, the rest right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        pairs = enumerate(zip(row, widths, strict=True))
        cells = [cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in pairs]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


TABLE_COLUMNS = ("res", "samples", "img/s/GPU", "scaling", "cluster img/s", "days", "GPU-hours", "USD")


def _row(label: str, **cells: str) -> list[str]:
    """A table row: `label`, then each column's cell by its TABLE_COLUMNS name (spaces/slashes -> _)."""
    keys = [c.replace(" ", "_").replace("/", "_").replace("-", "_").lower() for c in TABLE_COLUMNS]
    return [label, *(cells.get(k, "") for k in keys)]


def _table_rows(est: Estimate) -> list[list[str]]:
    rows = [["", *TABLE_COLUMNS]]
    for p in est.phases:
        rows.append(
            _row(
                p.name,
                res=str(p.resolution),
                samples=f"{p.samples:,}",
                img_s_gpu=f"{p.images_per_s_per_gpu:,.2f}",
                scaling=f"{p.scaling_efficiency:.3f}",
                cluster_img_s=f"{p.cluster_images_per_s:,.0f}",
                days=f"{p.days:,.2f}",
                gpu_hours=f"{p.gpu_hours:,.0f}",
                usd=f"${p.dollars:,.0f}",
            )
        )
    train = {"days": f"{est.train_days:,.2f}", "gpu_hours": f"{est.train_gpu_hours:,.0f}"}
    rows.append(_row("train total", **train, usd=f"${est.train_dollars:,.0f}"))
    enc, st = est.encode, est.storage
    rows.append(
        _row(
            f"encode ({enc.gpus} x {enc.gpu_type}, once)",
            samples=f"{enc.samples:,}",
            img_s_gpu=f"{enc.images_per_s_per_gpu:,.2f}",
            days=f"{enc.days:,.2f}",
            gpu_hours=f"{enc.gpu_hours:,.0f}",
            usd=f"${enc.dollars:,.0f}",
        )
    )
    rows.append(_row(f"storage ({st.gib / 1024:,.1f} TiB x {st.months:g} months)", usd=f"${st.dollars:,.0f}"))
    rows.append(_row("total", days=f"{est.total_days:,.2f}", usd=f"${est.total_dollars:,.0f}"))
    return rows


def render_table(est: Estimate) -> str:
    """The plain-text table `make estimate` prints."""
    head = (
        f"{est.gpus} x {est.gpu_type} ({est.cluster_peak_bf16_pflops:,.1f} PFLOP/s peak bf16), "
        f"{est.pricing_mode.replace('_', '-')} ${est.price_per_gpu_hour:.3f}/GPU-hour"
    )
    notes = "".join(f"\nnote: {n}" for n in est.notes)
    return f"{head}\n{_align(_table_rows(est))}{text_store_block(est)}{memory_block(est)}{notes}"


def memory_block(est: Estimate) -> str:
    """One line per schedule resolution: the recipe's batch per GPU against the GPU's memory."""
    return "".join(f"\nmemory: {m if isinstance(m, str) else m.line()}" for m in est.memory)


def text_store_block(est: Estimate) -> str:
    """Embeddings vs tokens (text.store): storage, reads, tower compute, the cheaper one (or nothing)."""
    cmp = est.text_store
    if cmp is None:
        return ""
    rows = [["text.store", "TiB", "text share", "$/month", "read MB/s/GPU", "MB/s/node", "GB/s cluster",
             "+GPU-hours", "+USD"]]  # fmt: skip
    for cost in (cmp.embeddings, cmp.tokens):
        res = sorted(cost.read_mb_s_per_gpu)
        rows.append([
            cost.mode, f"{cost.storage_tib:,.1f}", f"{cost.text_share:.0%}",
            f"${cost.storage_dollars_per_month:,.0f}",
            " / ".join(f"{cost.read_mb_s_per_gpu[r]:,.1f}" for r in res),
            " / ".join(f"{cost.read_mb_s_per_node[r]:,.0f}" for r in res),
            " / ".join(f"{cost.read_gb_s_cluster[r]:,.2f}" for r in res),
            f"{cost.extra_gpu_hours:,.0f}", f"${cost.extra_dollars:,.0f}",
        ])  # fmt: skip
    ratios = ", ".join(
        f"{r} px x{cmp.step_ratio[r]:.3f} (FLOP-ideal x{cmp.flop_ideal_ratio[r]:.3f})"
        for r in sorted(cmp.step_ratio)
    )
    reads = "reads per phase (" + " / ".join(f"{r} px" for r in sorted(cmp.step_ratio)) + ")"
    step = f"step time with the text tower ({cmp.ratio_source}): {ratios}; {reads}"
    return f"\n\n{_align(rows)}\n{step}\n{cmp.line()}"


def render_markdown(est: Estimate, sweep: Sequence[Estimate]) -> str:
    """The estimate as markdown tables: the plan, then days and dollars at each swept GPU count."""
    rows = _table_rows(est)
    plan = ["| " + " | ".join(r) + " |" for r in rows[:1]]
    plan.append("|" + "---|" * len(rows[0]))
    plan += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    sweep_md = ["| GPUs | train days | GPU-hours | train USD | total USD |", "|---:|---:|---:|---:|---:|"]
    sweep_md += [
        f"| {s.gpus} | {s.train_days:,.2f} | {s.train_gpu_hours:,.0f} | ${s.train_dollars:,.0f} | "
        f"${s.total_dollars:,.0f} |"
        for s in sweep
    ]
    notes = "".join(f"\n- {n}" for n in est.notes)
    if est.text_store is not None:
        notes += f"\n\n## Text storage\n\n```{text_store_block(est)}\n```"
    if est.memory:
        notes += f"\n\n## Batch per GPU\n\n```{memory_block(est)}\n```"
    price = f"{est.pricing_mode} ${est.price_per_gpu_hour:.3f}/GPU-hour"
    title = f"# Training estimate: {est.gpus} x {est.gpu_type}, {price}"
    return f"{title}\n\n" + "\n".join(plan) + "\n\n## By GPU count\n\n" + "\n".join(sweep_md) + f"\n{notes}\n"


def plot_sweep(sweep: Sequence[Estimate], path: Path) -> Path:
    """Days and dollars vs GPU count (log2 x axis), one PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display on clusters or CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter, NullLocator

    gpus = [s.gpus for s in sweep]
    days = [s.train_days for s in sweep]
    fig, (ax_days, ax_cost) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax_days.plot(gpus, days, marker="o")
    for n, d in zip(gpus, days, strict=True):
        ax_days.annotate(f"{d:.3g}", (n, d), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax_days.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="training days", title="Wall-clock days")
    ax_days.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax_days.yaxis.set_minor_formatter(NullFormatter())  # the points carry their own labels
    ax_cost.plot(gpus, [s.train_dollars / 1000 for s in sweep], marker="o", label="train")
    ax_cost.plot(gpus, [s.total_dollars / 1000 for s in sweep], marker="s", label="train + encode + storage")
    ax_cost.set(xscale="log", xlabel="GPUs", ylabel="thousand USD", title="Cost")
    ax_cost.set_ylim(bottom=0)
    ax_cost.legend()
    for ax in (ax_days, ax_cost):
        ax.set_xticks(gpus, [str(n) for n in gpus])
        ax.xaxis.set_minor_locator(NullLocator())  # log-scale minor ticks would relabel 2^k counts
        ax.grid(alpha=0.3)
    mode = sweep[0].pricing_mode.replace("_", "-")
    fig.suptitle(f"{sweep[0].gpu_type}, {mode} ${sweep[0].price_per_gpu_hour:.2f}/GPU-hour")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(est: Estimate, sweep: Sequence[Estimate], out_dir: str | Path) -> dict[str, Path]:
    """estimate.json (plan + sweep), estimate.md and estimate.png under out_dir; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "estimate.json", "md": out / "estimate.md", "png": out / "estimate.png"}
    payload = {"estimate": est.to_json(), "sweep": [s.to_json() for s in sweep]}
    paths["json"].write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    paths["md"].write_text(render_markdown(est, sweep))
    plot_sweep(sweep, paths["png"])
    return paths
