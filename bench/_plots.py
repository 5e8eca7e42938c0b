"""Plots for the benchmarks whose scripts do not draw their own (kvmap, transfer).

`run_all.py` asks each script for machine-readable results (`--json PATH`, written under the
git-ignored `bench/.work/`) and calls `plot_for(name)` after the script finished; the proxy
overhead and multi-turn scripts draw their own PNG, so for them this only reports its path.
Every plot is a matplotlib PNG (Agg backend) next to RESULTS.md, linked from the README.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from bench import _common as c

OWN_PLOTS = {
    "proxy_overhead": c.BENCH_DIR / "proxy_overhead.png",
    "multiturn": c.BENCH_DIR / "multiturn.png",
    "multiturn_policies": c.BENCH_DIR / "multiturn_policies.png",
}


def json_path(name: str) -> Path:
    """Where run_all asks script `name` to write its JSON results."""
    return c.WORK_DIR / f"{name}.json"


def plot_for(name: str) -> Path | None:
    """Draw (or find) the plot of benchmark `name`; None when there is nothing to plot."""
    if name in OWN_PLOTS:
        path = OWN_PLOTS[name]
        return path if path.exists() else None
    source = json_path(name)
    if not source.exists():
        return None
    data = json.loads(source.read_text())
    drawer = {"kvmap": plot_kvmap, "transfer": plot_transfer}.get(name)
    if drawer is None:
        return None
    out = c.BENCH_DIR / f"{name}.png"
    drawer(data, out)
    return out


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def plot_kvmap(data: Any, out: Path) -> None:
    """Map speed: put+take pairs/s per backend and client count; take latency p50/p99."""
    plt = _pyplot()
    results = [r for r in data.get("results", []) if isinstance(r, dict)]
    backends = sorted({str(r["backend"]) for r in results})
    clients = sorted({int(r["clients"]) for r in results})
    aims = data.get("aims", {})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(len(backends), 1)
    for i, backend in enumerate(backends):
        rows = {int(r["clients"]): r for r in results if r["backend"] == backend}
        xs = [j + i * width for j in range(len(clients))]
        bars = ax1.bar(xs, [_num(rows.get(n, {}).get("pairs_per_s")) for n in clients], width,
                       label=f"{backend} (wall)")  # fmt: skip
        if any("pairs_per_cpu_s" in r for r in rows.values()):
            # The map's aim is per CPU-second of the client; shown as a marker on each bar.
            ax1.plot(xs, [_num(rows.get(n, {}).get("pairs_per_cpu_s")) for n in clients], "_",
                     markersize=14, color=bars.patches[0].get_facecolor(),
                     label=f"{backend} per CPU-s")  # fmt: skip
        for key, style in (("take_p50_s", "o-"), ("take_p99_s", "s--")):
            ax2.plot(
                clients,
                [_num(rows.get(n, {}).get(key)) * 1000 for n in clients],
                style,
                label=f"{backend} take {key.split('_')[1]}",
            )
    if "memory_pairs_per_s" in aims:
        ax1.axhline(_num(aims["memory_pairs_per_s"]), color="grey", ls="--", lw=1,
                    label="aim (memory, per CPU-s)")  # fmt: skip
    if "redis_take_p99_s" in aims:
        ax2.axhline(_num(aims["redis_take_p99_s"]) * 1000, color="grey", ls="--", lw=1,
                    label="aim (Redis take p99)")  # fmt: skip
    ax1.set_xticks([j + width * (len(backends) - 1) / 2 for j in range(len(clients))])
    ax1.set_xticklabels([f"{n} clients" for n in clients])
    ax1.set_yscale("log")
    ax1.set_ylabel("put+take pairs / s")
    ax1.set_title("conversation map throughput")
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(clients, [str(n) for n in clients])
    ax2.set_yscale("log")
    ax2.set_xlabel("concurrent clients")
    ax2.set_ylabel("ms")
    ax2.set_title("take latency")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, out, "kvcache_map: memory vs Redis (one run)")


def plot_transfer(data: Any, out: Path) -> None:
    """NIXL READ bandwidth vs a memory copy by block size; rejection-to-free times."""
    plt = _pyplot()
    rows = [r for r in data.get("bandwidth", []) if isinstance(r, dict)]
    rejections = [_num(x) * 1000 for x in data.get("rejection_to_free_s", [])]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    sizes = sorted({int(r["block_kib"]) for r in rows})
    for coalesce in (True, False):
        pts = {int(r["block_kib"]): r for r in rows if bool(r.get("coalesce")) is coalesce}
        if pts:
            label = "NIXL READ, runs coalesced" if coalesce else "NIXL READ, one desc per block"
            ax1.plot(sizes, [_num(pts.get(k, {}).get("nixl_gbps")) for k in sizes], "o-",
                     label=label)  # fmt: skip
    copy = {int(r["block_kib"]): _num(r.get("copy_gbps")) for r in rows}
    ax1.plot(sizes, [copy.get(k, math.nan) for k in sizes], "k--", label="memory copy (numpy)")
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(sizes, [str(k) for k in sizes])
    ax1.set_xlabel("block size (KiB)")
    ax1.set_ylabel("GB/s")
    ax1.set_title(f"bandwidth, {data.get('total_mib', '?')} MiB per measurement")
    ax1.grid(True, alpha=0.3)
    ax1.legend(fontsize=8)
    if rejections:
        ax2.plot(range(1, len(rejections) + 1), sorted(rejections), "o")
        ax2.set_xlabel("sample (sorted)")
    ax2.set_ylabel("ms")
    ax2.set_title("rejection to blocks free")
    ax2.grid(True, alpha=0.3)
    save_figure(fig, out, "KV transfer over NIXL (UCX, loopback, CPU memory; one run)")


def save_figure(fig: Any, path: Path, title: str | None = None, dpi: int = 90) -> None:
    """Title, lay out, write (making the folder) and close a figure."""
    if title is not None:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    _pyplot().close(fig)
