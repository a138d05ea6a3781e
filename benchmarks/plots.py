"""PNG plots of the suite's results (matplotlib, the optional `bench` extra). Without
matplotlib the suite still writes JSON and markdown and says how to get plots."""
from __future__ import annotations

from pathlib import Path

INSTALL_HINT = "pip install 'commfold[bench]' (or: pip install matplotlib)"


def plot_all(results: dict, out: Path) -> tuple[list[Path], str | None]:
    """([written PNG paths], None) or ([], why plots were skipped)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], f"matplotlib is not installed; {INSTALL_HINT}"
    written = []
    for name, fig in results["figures"].items():
        draw = PLOTS.get(name)
        if draw is None or not fig["rows"]:
            continue
        f, ax = plt.subplots(figsize=(7, 4.2))
        draw(ax, fig["rows"])
        ax.set_title(fig["title"], fontsize=9)
        ax.grid(True, alpha=0.3)
        f.tight_layout()
        path = out / f"{name}.png"
        f.savefig(path, dpi=110)
        plt.close(f)
        written.append(path)
    return written, None


def _bars(ax, labels, series: dict, ylabel: str):
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(labels))])
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)


def _local_argmax(ax, rows):
    for (world, vocab) in sorted({(r["world"], r["V"]) for r in rows}):
        sel = sorted((r for r in rows if r["world"] == world and r["V"] == vocab),
                     key=lambda r: r["B"])
        b = [r["B"] for r in sel]
        line, = ax.plot(b, [r["inductor_s"] * 1e3 for r in sel], "o--",
                        label=f"Inductor, TP={world}, V={vocab}")
        ax.plot(b, [r["commfold_s"] * 1e3 for r in sel], "s-", color=line.get_color(),
                label=f"commfold, TP={world}, V={vocab}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch rows B")
    ax.set_ylabel("ms per call (median)")
    ax.legend(fontsize=7)


def _sampling(ax, rows):
    labels = [f"{r['case']}\nB={r['B']}" for r in rows]
    _bars(ax, labels, {"Inductor": [r["inductor_s"] * 1e3 for r in rows],
                       "commfold": [r["commfold_s"] * 1e3 for r in rows]}, "ms per call (median)")


def _allreduce_rmsnorm(ax, rows):
    labels = [f"TP={r['world']} T={r['T']}\nH={r['H']}" for r in rows]
    series = {"unfused / fused": "fused", "A/A control: unfused / unfused": "control"}
    series = {k: v for k, v in series.items() if all(v in r["ratio"] for r in rows)}
    _bars(ax, labels, {k: [r["ratio"][v]["median"] for r in rows] for k, v in series.items()},
          "median of paired rounds (>1: faster than unfused)")
    width = 0.8 / len(series)
    for i, v in enumerate(series.values()):
        q = [r["ratio"][v] for r in rows]
        ax.errorbar([x + i * width for x in range(len(rows))], [e["median"] for e in q],
                    yerr=[[e["median"] - e["q1"] for e in q], [e["q3"] - e["median"] for e in q]],
                    fmt="none", ecolor="k", lw=0.6)
    ax.axhline(1.0, color="k", lw=0.8)


def _replicate(ax, rows):
    labels = [f"{r['layer']} r={r['r']}" for r in rows]
    _bars(ax, labels, {"sharded": [r["sharded_s"] * 1e3 for r in rows],
                       "replicated": [r["replicated_s"] * 1e3 for r in rows]},
          "ms per step (median)")


def _decode(ax, rows):
    labels = [f"TP={r['world']} B={r['B']}" for r in rows]
    _bars(ax, labels, {"Inductor": [r["inductor_tok_s"] for r in rows],
                       "commfold": [r["commfold_tok_s"] for r in rows]}, "tokens / s")


def _compile_cost(ax, rows):
    nodes = [r["nodes"] for r in rows]
    ax.plot(nodes, [r["commfold_s"] * 1e3 for r in rows], "o--", label="wall (ms)")
    ax.plot(nodes, [r["commfold_cpu_s"] * 1e3 for r in rows], "s:", label="CPU (ms)")
    ax.plot(nodes, [(r["commfold_cpu_s"] - r["commfold_gc_s"]) * 1e3 for r in rows], "^-",
            label="CPU less garbage collection (ms)")
    for x, r in zip(nodes, rows):
        cpu_ms = (r["commfold_cpu_s"] - r["commfold_gc_s"]) * 1e3
        ax.annotate(f"{r['layers']} layers\n{100 * r['commfold_s'] / r['compile_s']:.2f}% of "
                    f"compile, {cpu_ms / max(1, r['rewrites']):.2f} ms/rewrite",
                    (x, cpu_ms), fontsize=7, xytext=(5, -20), textcoords="offset points")
    ax.set_xlim(0, max(nodes) * 1.3)
    ax.set_ylim(0, max(r["commfold_s"] * 1e3 for r in rows) * 1.25)
    ax.set_xlabel("post-grad graph nodes")
    ax.set_ylabel("time inside commfold per compile (ms)")
    ax.legend(fontsize=8, loc="upper left")


PLOTS = {"local_argmax": _local_argmax, "sampling": _sampling,
         "allreduce_rmsnorm": _allreduce_rmsnorm,
         "replicate": _replicate, "decode": _decode, "compile_cost": _compile_cost}
