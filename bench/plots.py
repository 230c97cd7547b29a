"""PNG figures for `docs/benchmarks.md` (matplotlib, from the `bench` extra)."""


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def bar_chart(path, values, title, ylabel):
    """`values`: {label: number}; one bar each, the number written on it."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar(list(values), list(values.values()), color=["#1f77b4", "#ff7f0e", "#2ca02c",
                                                             "#d62728"][:len(values)])
    for bar, value in zip(bars, values.values()):
        ax.annotate(f"{value:,.0f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=9)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def scaling_chart(path, rows, title):
    """`rows`: dicts with workers, ps, examples_per_s, efficiency; one line per ps count, and
    single-process Keras 3 on as many cores as workers (keras_examples_per_s) dashed."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for ps in sorted({r["ps"] for r in rows}):
        mine = sorted((r for r in rows if r["ps"] == ps), key=lambda r: r["workers"])
        workers = [r["workers"] for r in mine]
        left.plot(workers, [r["examples_per_s"] for r in mine], marker="o", label=f"{ps} ps")
        right.plot(workers, [r["efficiency"] for r in mine], marker="o", label=f"{ps} ps")
    keras = sorted({(r["workers"], r["keras_examples_per_s"]) for r in rows
                    if "keras_examples_per_s" in r})
    if keras:
        left.plot(*zip(*keras), linestyle="--", color="gray", marker="x",
                  label="Keras 3, one process,\nas many cores")
    left.set_xlabel("workers")
    left.set_ylabel("examples/s")
    right.set_xlabel("workers")
    right.set_ylabel("efficiency (vs 1 worker, same ps)")
    right.set_ylim(0, 1.1)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def spread_chart(path, series, title, ylabel, reference=None):
    """`series`: {label: [one value per repeat]}; a bar at each median, a dot per repeat (the
    spread), and a dashed line at `reference` (a target or 1.0 for ratios) when given."""
    import statistics

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4.5, 1.6 * len(series) + 1.5), 3.5))
    labels = list(series)
    medians = [statistics.median(series[label]) for label in labels]
    ax.bar(range(len(labels)), medians, color="#9ecae1", width=0.6)
    for i, label in enumerate(labels):
        values = series[label]
        ax.scatter([i] * len(values), values, color="#08519c", s=14, zorder=3)
        ax.annotate(f"{medians[i]:,.3g}", (i, medians[i]), ha="center", va="bottom",
                    fontsize=9, xytext=(12, 2), textcoords="offset points")
    if reference is not None:
        ax.axhline(reference, color="#a50f15", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
