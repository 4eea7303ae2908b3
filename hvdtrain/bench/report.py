"""What the bench prints and draws from its results: a table per section, min/median/max of the
interleaved rounds (one figure hides how noisy a shared machine is), and the scaling plot."""
from __future__ import annotations

from pathlib import Path

from . import sync_vs_async

def seconds(values) -> str:
    return ", ".join(f"{x * 1000:.0f} ms" for x in values)


def spread(values, fmt="{:.3f}") -> str:
    """min / median / max: one figure hides how noisy a shared machine is."""
    import numpy as np

    return "/".join(fmt.format(v) for v in (min(values), float(np.median(values)), max(values)))



def pyplot():
    """matplotlib's pyplot drawing to files, or None: the plots are an extra (`pip install matplotlib`),
    since Keras 3 imports pyplot in every process wherever it is installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(results: dict, path: Path, plt):
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for controller in {r["controller"] for r in results["scaling"]["rows"]}:
        rows = [r for r in results["scaling"]["rows"] if r["controller"] == controller]
        axes[0].plot([r["workers"] for r in rows], [r["samples_per_sec_total"] for r in rows], "o-",
                     label=controller)
    if results["scaling"]["rows"]:
        one = results["scaling"]["rows"][0]["samples_per_sec_total"]
        ws = sorted({r["workers"] for r in results["scaling"]["rows"]})
        axes[0].plot(ws, [one * w for w in ws], "k--", label="linear")
    axes[0].set(xlabel="workers", ylabel="samples/s", title="throughput")
    for run in results.get("allreduce", []):
        rows = run["rows"]
        for key in ("horovod", "mpi4py", "memcpy"):
            if f"{key}_busbw_GBps" in rows[0]:
                axes[1].plot([r["bytes"] for r in rows], [r[f"{key}_busbw_GBps"] for r in rows], "o-",
                             label=f"{key} ({run['controller']})" if key == "horovod" else key)
    axes[1].set(xscale="log", yscale="log", xlabel="bytes", ylabel="GB/s (busbw)", title="allreduce")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return str(path)


def report(results: dict) -> str:
    lines = [f"== throughput: {results['scaling']['model']} {results['scaling']['image_size']}px, batch "
             f"{results['scaling']['batch_size_per_worker']}/worker, {results['scaling']['threads_per_worker']} "
             f"thread(s)/worker"] if results["scaling"]["rows"] else []
    for r in results["scaling"]["rows"]:
        line = f"  {r['controller']:7} {r['workers']} worker(s): {spread(r['samples_per_sec_runs'], '{:.1f}')} samples/s"
        if r["workers"] > 1 and "efficiency_runs" in r:
            line += f"  efficiency {spread(r['efficiency_runs'], '{:.1%}')}"
        if "limit_no_overlap" in r:
            line += (f"  (compute {r['compute_s'] * 1000:.0f} ms a step, allreduce of "
                     f"{results['scaling']['gradient_bytes'] / 1e6:.0f} MB at {r['allreduce_GBps']:.2f} GB/s "
                     f"{r['allreduce_s'] * 1000:.0f} ms: limit {r['limit_no_overlap']:.1%} with no overlap)")
        lines.append(line)
    if "levers" in results:
        lv = results["levers"]
        lines.append(f"== levers at {lv['workers']} workers ({lv['controller']}; min/median/max of "
                     f"{len(lv['rows'][0]['efficiency'])} rounds): efficiency, and samples/s against the defaults")
        for r in lv["rows"]:
            lines.append(f"  {r['model']:9} {r['lever']:12} {spread(r['efficiency'], '{:.1%}')}  "
                         f"x{spread(r['vs_defaults'])}")
    for run in results.get("allreduce", []):
        lines.append(f"== allreduce busbw GB/s ({run['workers']} workers, {run['controller']})")
        lines.append(f"  {'bytes':>10} {'horovod':>8} {'mpi4py':>8} {'memcpy':>8}  horovod/mpi4py")
        for r in run["rows"]:
            ratio = r["horovod_busbw_GBps"] / r["mpi4py_busbw_GBps"] if "mpi4py_busbw_GBps" in r else None
            lines.append(f"  {r['bytes']:>10} {r['horovod_busbw_GBps']:8.2f} {r.get('mpi4py_busbw_GBps', 0):8.2f}"
                         f" {r['memcpy_busbw_GBps']:8.2f}  {f'{ratio:.0%}' if ratio else '-'}")
    if "baseline" in results:
        b = results["baseline"]
        lines.append(f"== 1 worker: hvdtrain {spread(b['hvdtrain_1_worker'], '{:.1f}')} vs plain Keras "
                     f"{spread(b['plain_keras_fit'], '{:.1f}')} samples/s (ratio {spread(b['ratios'])})")
    if "step" in results:
        lines += _step_lines(results["step"])
    if "startup" in results:
        st = results["startup"]
        lines.append(f"== start-up, {st['records']} records at {st['workers']} workers (median of "
                     f"{len(st['startup_s']['tfrecord'])}): own pipeline {st['median_s']['own_pipeline']:.2f} s, "
                     f"tfrecord: {st['median_s']['tfrecord']:.2f} s (ratio {st['ratio']:.2f})")
    if "recipe" in results:
        r = results["recipe"]
        lines.append(f"== hvdtrain / Horovod's recipe by hand ({r['workers']} workers, {r['controller']}, batch "
                     f"{r['batch_size_per_worker']}/worker; min/median/max of "
                     f"{len(r['rows'][0]['ratios'])} interleaved pairs)")
        for row in r["rows"]:
            lines.append(f"  {row['model']:9} {spread(row['ratios'])}  first epoch: recipe / hvdtrain "
                         f"{spread(row['first_epoch_ratios'])}")
    if "stacks" in results:
        st = results["stacks"]
        for row in st["rows"]:
            this, other = (f"{row['stacks'][k]['stack']} (TensorFlow {row['stacks'][k]['tensorflow']}, Keras "
                           f"{row['stacks'][k]['keras']})" for k in ("this", "other"))
            lines.append(f"== {this} / {other}, {st['workers']} workers, {st['controller']}: {row['model']:9} "
                         f"{spread(row['ratios'])} (min/median/max of {len(row['ratios'])} interleaved pairs)")
    if "checkpoint" in results:
        c = results["checkpoint"]
        lines.append(f"== checkpoint every {c['every']} steps ({c['workers']} workers): the per-step hook "
                     f"{c['hook_s'] * 1e6:.1f} us; throughput with it / without (min/median/max of "
                     f"{len(c['rows'][0]['on_off_ratios'])} pairs); one save; cost at {c['every']}")
        for r in c["rows"]:
            lines.append(f"  {r['model']:9} hook {spread(r['on_off_ratios'])}  step {r['step_s'] * 1000:.1f} ms"
                         f"  save {r['save_s_median'] * 1000:.0f} ms  cost {r['cost_at_default']:.2%}"
                         f" (hook {r['hook_cost']:.2%}, saves {r['save_cost']:.2%})")
    if "callbacks" in results:
        cb = results["callbacks"]
        lines.append(f"== a no-op per-batch callback ({cb['workers']} workers, {cb['controller']}): throughput against "
                     f"the defaults, min/median/max of {len(cb['rows'][0]['hook_alone'])} interleaved rounds")
        for r in cb["rows"]:
            lines.append(f"  {r['model']:9} 1 step per call {spread(r['ratios_to_default']['spe-1'])}  the callback "
                         f"{spread(r['ratios_to_default']['per-batch'])}  (its hook alone {spread(r['hook_alone'])})")
    if "preemption" in results:
        pr = results["preemption"]
        lines.append(f"== SIGTERM handled / not ({pr['workers']} workers, {pr['controller']}): the stop flag in every "
                     f"allreduce, min/median/max of {len(pr['rows'][0]['ratios_to_default']['off'])} interleaved rounds")
        for r in pr["rows"]:
            lines.append(f"  {r['model']:9} {spread([1 / x for x in r['ratios_to_default']['off']])}")
    if "scale" in results:
        sc = results["scale"]
        lines.append(f"== scale: {sc['model']} {sc['image_size']}px, {sc['gradient_bytes']} gradient bytes, 1 thread a "
                     f"rank, on {sc['hosts'] or 'this host'} (medians of {len(sc['rows'][0]['startup_s'])} round(s))")
        lines.append(f"  {'':7} {'ranks':>5} {'start-up':>9} {'broadcast':>10} {'allreduce':>10} {'ring bound':>11} {'ratio':>6}")
        for r in sc["rows"]:
            bound = f"{r['ring_bound_s'] * 1000:9.2f}ms" if "ring_bound_s" in r else f"{'-':>11}"
            ratio = f"{r['allreduce_over_ring_bound']:6.2f}" if "ring_bound_s" in r else f"{'-':>6}"
            lines.append(f"  {r['controller']:7} {r['ranks']:>5} {r['startup_s_median']:8.1f}s "
                         f"{r['broadcast_s_median'] * 1000:8.0f}ms {r['allreduce_s_median'] * 1000:8.2f}ms {bound} {ratio}")
    if "sync_vs_async" in results:
        lines.append(sync_vs_async.table(results["sync_vs_async"]))
    return "\n".join(lines)


def _step_lines(st: dict) -> list:
    n = st["workers"]
    lines = [f"== the step's cost ({st['controller']}, batch {st['batch_size_per_worker']}/worker, "
             f"{st['threads_per_worker']} thread(s)/worker; min/median/max of {len(st['rows'][0]['ratios']['1_worker_vs_plain'])} rounds)"]
    for r in st["rows"]:
        ratios, ms = r["ratios"], r["step_ms"]
        lines.append(f"  {r['model']:9} 1 worker / plain Keras {spread(ratios['1_worker_vs_plain'])}  "
                     f"{n} workers / 1 worker {spread(ratios['n_workers_vs_1_worker'])}  "
                     f"{n} workers / plain Keras {spread(ratios['n_workers_vs_plain'])}  "
                     f"{n} workers / {n} x plain side by side {spread(ratios['n_workers_vs_side_by_side'])}")
        lines.append(f"  {'':9} step ms (median): compute {r['median']['compute']:.3f}, hvdtrain's own "
                     f"{r['median']['hvdtrain_own']:+.3f}, sharing the cores {r['median']['sharing_the_cores']:+.3f}, "
                     f"the allreduce {r['median']['allreduce']:+.3f}; spreads "
                     + ", ".join(f"{k} {spread(v, '{:+.3f}')}" for k, v in ms.items() if k != "compute"))
    return lines
