"""The bench's sections, one function each (`section(args, out) -> its results for bench.json`), and
the workers two of them start on every rank (`python -m hvdtrain bench --worker allreduce|keras`).
Every timed comparison is interleaved, A B A B, and keeps each round's figure beside the median."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from pathlib import Path

from ..config import UserError
from . import launch

# ---------------------------------------------------------------- throughput scaling

def train_flags(args, steps: int):
    shape = [str(args.image_size)] * 2 + ["3"]
    return ["--model", args.model, "--data", "synthetic", "--synthetic-shape", *shape,
            "--synthetic-samples", str(args.batch_size * steps * args.max_workers * 2),
            "--val-split", "0.01", "--batch-size", str(args.batch_size), "--epochs", "2",
            "--steps-per-epoch", str(steps), "--optimizer", "momentum", "--threads", str(args.threads),
            "--checkpoint-every", "0", "--no-keep-best", "--no-tensorboard", "--no-save-model",
            "--no-worker-logs", "--verbose", "0"]


def scaling(args, out: Path, allreduce_runs=()) -> dict:
    """Every worker count and controller once per round, rounds interleaved; efficiency per round.
    The limit at N workers: one worker's step (compute) against the step's gradient bytes over the
    allreduce bandwidth measured at N workers (the allreduce section), with no overlap."""
    import numpy as np

    runs: dict = {}
    gradient_bytes: int | None = None
    for rep in range(args.repeats):
        for controller in args.controllers:
            for n in args.workers:
                s = launch.train(launch.python(n, controller, args.hosts), out / f"scaling-{controller}-{n}-{rep}",
                           train_flags(args, args.steps), args.timeout)
                runs.setdefault((controller, n), []).append(s["samples_per_sec_total"])
                gradient_bytes = s["model"]["gradient_bytes"]
                launch.say(f"scaling {controller} {n} worker(s): {s['samples_per_sec_total']:.1f} samples/s")
    rows = []
    for (controller, n), samples in runs.items():
        row = {"controller": controller, "workers": n, "samples_per_sec_runs": samples,
               "samples_per_sec_total": float(np.median(samples))}
        one = runs.get((controller, 1))
        if one:
            row["efficiency_runs"] = [t / (n * o) for t, o in zip(samples, one)]
            row["efficiency"] = float(np.median(row["efficiency_runs"]))
            bandwidth = _allreduce_GBps(allreduce_runs, controller, n, gradient_bytes)
            if n > 1 and bandwidth:
                compute = args.batch_size / float(np.median(one))
                row.update(compute_s=compute, allreduce_GBps=bandwidth,
                           allreduce_s=gradient_bytes / bandwidth / 1e9)
                row["limit_no_overlap"] = compute / (compute + row["allreduce_s"])
        rows.append(row)
    return {"model": args.model, "image_size": args.image_size, "batch_size_per_worker": args.batch_size,
            "threads_per_worker": args.threads, "gradient_bytes": gradient_bytes, "rows": rows}


def _allreduce_GBps(allreduce_runs, controller: str, n: int, size: int | None):
    """hvd.allreduce's algorithm bandwidth (bytes / time) at the measured size nearest `size`."""
    import math

    for run in allreduce_runs:
        if run["controller"] == controller and run["workers"] == n and size:
            row = min(run["rows"], key=lambda r: abs(math.log(r["bytes"] / size)))
            return row["horovod_algbw_GBps"]
    return None


# ---------------------------------------------------------------- scale: 2..32 ranks

def scale(args, out: Path) -> dict:
    """Each rank count once per round, rounds interleaved: a short hvdtrain run (1 thread a rank) for its
    start-up (the bench's launch to the wall-clock time every rank began training) and its initial
    broadcast (summary.json), then hvd.allreduce of that model's gradient bytes at the same rank count.
    A ring moves 2(N-1)/N x bytes through each rank, so at 2 ranks it moves the bytes once: the bound at
    N is 2(N-1)/N x the 2-rank time, and their ratio says what grows faster than the ring."""
    import numpy as np

    # N ranks on a few cores reach hvd.init far apart: Gloo's rendezvous gets 120 s, not its 30 (multinode.md)
    wait = {} if "HOROVOD_GLOO_TIMEOUT_SECONDS" in os.environ else {"HOROVOD_GLOO_TIMEOUT_SECONDS": "120"}
    runs: dict = {}
    for rep in range(args.repeats):
        for controller in args.controllers:
            for n in args.ranks:
                python = launch.python(n, controller, args.hosts)
                flags = ["--model", args.model, "--data", "synthetic", "--synthetic-shape",
                         *[str(args.image_size)] * 2, "3", "--synthetic-samples", str(args.batch_size * 3 * n),
                         "--batch-size", str(args.batch_size), "--epochs", "1", "--steps-per-epoch", "3",
                         "--threads", "1", "--checkpoint-every", "0", "--no-keep-best", "--no-tensorboard",
                         "--no-save-model", "--no-worker-logs", "--verbose", "0"]
                launched = time.time()
                s = launch.train(python, out / f"scale-{controller}-{n}-{rep}", flags, args.timeout, wait)
                size = s["model"]["gradient_bytes"] // 4 * 4
                bench = launch.run(python + ["-m", "hvdtrain", "bench", "--worker", "allreduce", "--min-bytes", str(size),
                                       "--max-bytes", str(size)], args.timeout, wait)
                # the JSON object alone: under horovodrun --mpi another rank's output may follow on its line
                row = json.JSONDecoder().raw_decode(bench.split("BENCH ", 1)[1])[0]["rows"][0]
                got = runs.setdefault((controller, n), {"startup_s": [], "broadcast_s": [], "allreduce_s": []})
                got["startup_s"].append(s["training_started_at"] - launched)
                got["broadcast_s"].append(s["broadcast_s"])
                got["allreduce_s"].append(row["horovod_s"])
                launch.say(f"scale {controller} {n} ranks: start-up {got['startup_s'][-1]:.1f} s, broadcast "
                    f"{got['broadcast_s'][-1] * 1000:.0f} ms, allreduce of {size} bytes {row['horovod_s'] * 1000:.2f} ms")
    rows = []
    for (controller, n), got in runs.items():
        row = {"controller": controller, "ranks": n, **got,
               **{f"{k}_median": float(np.median(v)) for k, v in got.items()}}
        two = runs.get((controller, 2))
        if two:
            row["ring_bound_s"] = 2 * (n - 1) / n * float(np.median(two["allreduce_s"]))
            row["allreduce_over_ring_bound"] = row["allreduce_s_median"] / row["ring_bound_s"]
        rows.append(row)
    return {"model": args.model, "image_size": args.image_size, "gradient_bytes": size, "hosts": args.hosts,
            "rows": rows}


# ---------------------------------------------------------------- levers, one at a time

# name: (hvdtrain flags, MPI binding); each measured alone against hvdtrain's defaults
LEVERS = {
    "defaults": ((), None),
    "fp16": (("--compression", "fp16"), None),  # half the bytes on the wire
    "fusion-16mb": (("--fusion-threshold-mb", "16"), None),  # smaller buffers, sent sooner (Horovod: 128)
    "cycle-5ms": (("--cycle-time-ms", "5"), None),  # fewer, fuller cycles (Horovod: 1 ms)
    "cycle-1ms": (("--cycle-time-ms", "1"), None),  # Horovod's own default (hvdtrain's under MPI: 0.2 ms)
    "groups-4": (("--allreduce-groups", "4"), None),  # each quarter of the gradients sent when ready
    "bind-cores": ((), "-bind-to core -map-by core"),  # each rank on its own core (ours: unbound)
    "spe-1": (("--steps-per-execution", "1"), None),  # Keras: one step per call (the default: 10)
    # Horovod's local gradient aggregation: one allreduce every 2 micro-batches. Not the same training
    # (an update per 2 batches, of twice the batch), so it is a lever to choose, never a default.
    "bpps-2": (("--backward-passes-per-step", "2"), None),
    "side-by-side": (None, None),  # no allreduce: N one-worker runs at once (_side_by_side)
}
# each model's levers: the allreduce's for the one whose gradients are large, the per-step overhead's
# for the one whose steps take milliseconds
LEVER_SETS = {"resnet50": ["defaults", "side-by-side", "fp16", "fusion-16mb", "cycle-5ms", "groups-4",
                          "bind-cores", "bpps-2"],
              "mlp": ["defaults", "spe-1"], "cnn": ["defaults", "spe-1"]}


def levers(args, out: Path) -> dict:
    """Each lever alone at the most workers, one round at a time: one worker at the defaults, then the
    defaults and every lever at N (A B C ... A B C ...); per round, the efficiency against that
    round's one worker and the ratio to that round's defaults."""
    n, controller, rows = max(args.workers), launch.controller(args), []
    for model in args.lever_models:
        size, steps, flags = _sized(args, model)
        names = args.levers or LEVER_SETS.get(model, list(LEVERS))
        names = names if "defaults" in names else ["defaults", *names]
        one: list = []
        runs: dict = {name: [] for name in names}
        for rep in range(args.repeats):
            one.append(launch.train([launch.PY], out / f"levers-{model}-one-{rep}", flags, args.timeout)["samples_per_sec_total"])
            for name in names:
                extra, binding = LEVERS[name]
                run_dir = out / f"levers-{model}-{name}-{rep}"
                if extra is None:
                    runs[name].append(_side_by_side(n, run_dir, flags, args.timeout))
                else:
                    runs[name].append(launch.train(launch.python(n, controller, args.hosts, binding), run_dir,
                                             [*flags, *extra], args.timeout)["samples_per_sec_total"])
                launch.say(f"levers {model} {name}: {runs[name][-1]:.1f} samples/s at {n} workers "
                    f"({runs[name][-1] / (n * one[-1]):.1%} of {n} x {one[-1]:.1f})")
        for name in names:
            rows.append({"model": model, "image_size": size, "steps_per_epoch": steps, "lever": name,
                         "samples_per_sec": runs[name], "one_worker": one,
                         "efficiency": [t / (n * o) for t, o in zip(runs[name], one)],
                         "vs_defaults": [t / d for t, d in zip(runs[name], runs["defaults"])]})
    return {"workers": n, "controller": controller, "batch_size_per_worker": args.batch_size,
            "threads_per_worker": args.threads, "rows": rows}


def _side_by_side(n: int, run_dir: Path, flags, timeout) -> float:
    """N x the samples/s of one worker timed while n-1 copies of it train beside it, with no allreduce
    between them: what sharing the cores and memory costs a step before any communication. The copies
    start first, and it starts once each has ended an epoch (each prints a line per epoch to
    copy-I.out): they train throughout its timed epoch, however slowly a loaded machine starts them."""
    run_dir.mkdir(parents=True, exist_ok=True)
    outs = [(run_dir / f"copy-{i}.out").open("w") for i in range(n - 1)]
    copies = [subprocess.Popen([launch.PY, "-m", "hvdtrain", "--output-dir", str(run_dir / f"copy-{i}"), "--no-auto-resume",
                                *flags, "--epochs", "100000", "--checkpoint-every-steps", "0", "--verbose", "2"],
                               env=launch.env(), stdout=o, stderr=subprocess.STDOUT) for i, o in enumerate(outs)]
    try:
        deadline = time.monotonic() + timeout
        while not all("hvdtrain: epoch 1/" in (run_dir / f"copy-{i}.out").read_text() for i in range(n - 1)):
            if any(c.poll() is not None for c in copies) or time.monotonic() > deadline:
                raise UserError(f"bench: side-by-side: a copy did not train (see {run_dir}/copy-*.out)")
            time.sleep(0.5)
        return n * launch.train([launch.PY], run_dir, flags, timeout)["samples_per_sec_total"]
    finally:
        for copy, o in zip(copies, outs):
            copy.kill()
            copy.wait()
            o.close()


# ---------------------------------------------------------------- allreduce bandwidth

def allreduce_sizes(lo: int, hi: int):
    size = lo
    while size <= hi:
        yield size
        size *= 4


def allreduce_worker(args) -> int:
    """Runs on every rank under mpirun/horovodrun; rank 0 prints one JSON line. Started as
    `python -m hvdtrain bench --worker allreduce`, so it runs with hvdtrain's environment defaults."""
    import numpy as np

    from mpi4py import MPI  # first, so that Horovod's MPI controller shares MPI with it (a dependency)
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    n = hvd.size()
    use_mpi4py = hvd.mpi_enabled() and MPI.COMM_WORLD.Get_size() == n
    rows = []
    for size in allreduce_sizes(args.min_bytes, args.max_bytes):
        count = size // 4
        reps = max(3, min(50, (64 << 20) // size))
        row = {"bytes": size}
        x = tf.ones([count], tf.float32)
        for _ in range(2):
            hvd.allreduce(x, op=hvd.Sum, name=f"bench.{size}")
        t0 = time.perf_counter()
        for _ in range(reps):
            hvd.allreduce(x, op=hvd.Sum, name=f"bench.{size}").numpy()
        row["horovod_s"] = (time.perf_counter() - t0) / reps
        if use_mpi4py:
            a, b = np.ones(count, np.float32), np.empty(count, np.float32)
            MPI.COMM_WORLD.Allreduce(a, b, op=MPI.SUM)
            MPI.COMM_WORLD.Barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                MPI.COMM_WORLD.Allreduce(a, b, op=MPI.SUM)
            row["mpi4py_s"] = (time.perf_counter() - t0) / reps
        src, dst = np.ones(count, np.float32), np.empty(count, np.float32)
        np.copyto(dst, src)  # touch the pages first: the first copy into fresh memory pays page faults
        t0 = time.perf_counter()
        for _ in range(reps):
            np.copyto(dst, src)
        row["memcpy_s"] = (time.perf_counter() - t0) / reps
        for key in ("horovod", "mpi4py", "memcpy"):
            if f"{key}_s" in row:
                algbw = size / row[f"{key}_s"] / 1e9
                row[f"{key}_algbw_GBps"] = algbw
                # memcpy moves the bytes once: its bandwidth is the ceiling for one pass, not a bus figure
                row[f"{key}_busbw_GBps"] = algbw * (2 * (n - 1) / n if key != "memcpy" else 1)
        rows.append(row)
    if hvd.rank() == 0:
        print("BENCH " + json.dumps({"workers": n, "controller": "mpi" if hvd.mpi_enabled() else "gloo",
                                     "rows": rows}), flush=True)
    return 0


def allreduce(args) -> list:
    results = []
    for controller in args.controllers:
        n = max(args.workers)
        if n < 2:
            continue
        python = launch.python(n, "mpirun" if controller == "mpi" else controller, args.hosts)
        out = launch.run(python + ["-m", "hvdtrain", "bench", "--worker", "allreduce",
                               "--min-bytes", str(args.min_bytes), "--max-bytes", str(args.max_bytes)],
                   timeout=args.timeout)
        line = next(l for l in out.splitlines() if "BENCH " in l)
        results.append(json.loads(line.split("BENCH ", 1)[1]))
        top = results[-1]["rows"][-1]
        launch.say(f"allreduce {controller} {n} workers: {top['horovod_busbw_GBps']:.2f} GB/s busbw at {top['bytes']} bytes")
    return results


# ---------------------------------------------------------------- 1 worker against plain Keras

def keras_baseline(args, out: Path) -> dict:
    """hvdtrain at one worker, then plain Keras, in interleaved pairs; the ratio of each pair."""
    import numpy as np

    ours, keras = [], []
    for rep in range(args.repeats):
        ours.append(launch.train([launch.PY], out / f"baseline-hvdtrain-{rep}", train_flags(args, args.steps),
                           args.timeout)["samples_per_sec_total"])
        plain = launch.run([launch.PY, "-m", "hvdtrain", "bench", "--worker", "keras", "--model", args.model,
                      "--image-size", str(args.image_size), "--batch-size", str(args.batch_size),
                      "--steps", str(args.steps), "--threads", str(args.threads)], timeout=args.timeout)
        keras.append(json.loads(plain.split("BENCH ", 1)[1].splitlines()[0])["samples_per_sec"])
        launch.say(f"1 worker: hvdtrain {ours[-1]:.1f}, plain Keras {keras[-1]:.1f} samples/s")
    ratios = [a / b for a, b in zip(ours, keras)]
    return {"hvdtrain_1_worker": ours, "plain_keras_fit": keras, "ratios": ratios,
            "ratio": float(np.median(ratios))}


def keras_worker(args) -> int:
    """A plain Keras model.fit, no Horovod: what a user would write without us."""
    import numpy as np
    import tensorflow as tf

    from .. import models

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(min(2, args.threads))
    shape = (args.image_size, args.image_size, 3)
    n = args.batch_size * (args.steps * 2 + 1)
    x = np.random.default_rng(0).standard_normal((n, *shape), dtype=np.float32)
    y = np.random.default_rng(1).integers(0, 10, n)
    model = models.BUILDERS[args.model](shape, 10)
    model.compile(tf.keras.optimizers.SGD(0.01, momentum=0.9),
                  tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch_size, drop_remainder=True).repeat()
    model.fit(ds, epochs=1, steps_per_epoch=1, verbose=0)  # tracing, as hvdtrain's first step
    t0 = time.perf_counter()
    model.fit(ds, epochs=2, steps_per_epoch=args.steps, verbose=0)
    print("BENCH " + json.dumps({"samples_per_sec": 2 * args.steps * args.batch_size
                                 / (time.perf_counter() - t0)}), flush=True)
    return 0


# ---------------------------------------------------------------- against Horovod's recipe by hand

# per built-in model: (image size, steps per epoch in units of --steps), so that a run of each takes
# about as long: the MLP on 8x8 inputs and the CNN on 16x16 (digits-like), ResNet-50 on 32x32
MODEL_SIZES = {"mlp": (8, 50), "cnn": (16, 5), "resnet50": (32, 0.5)}


def _sized(args, model: str):
    """(image size, steps per epoch, hvdtrain's flags) of a model at its MODEL_SIZES (its --epoch-steps)."""
    size, per = MODEL_SIZES.get(model, (args.image_size, 1))
    steps = getattr(args, "epoch_steps", {}).get(model) or max(1, round(per * args.steps))
    return size, steps, train_flags(argparse.Namespace(**{**vars(args), "model": model, "image_size": size}), steps)


def recipe(args, out: Path) -> dict:
    """hvdtrain against bench/horovod_recipe.py (Horovod's Keras example, by hand), the same model,
    synthetic data, batch, optimizer (Adam, lr 0.001 x workers after a 1-epoch warm-up) and thread
    budget, at the most workers; interleaved A B A B, the ratio of each pair."""
    import numpy as np

    n, rows = max(args.workers), []
    python = launch.python(n, launch.controller(args), args.hosts)
    for model in args.checkpoint_models:
        size, steps, flags = _sized(args, model)
        runs: dict = {"hvdtrain": [], "recipe": []}
        first: dict = {"hvdtrain": [], "recipe": []}
        for rep in range(args.repeats):
            s = launch.train(python, out / f"recipe-{model}-hvdtrain-{rep}",
                       [*flags, "--optimizer", "adam", "--lr", "0.001"], args.timeout)
            runs["hvdtrain"].append(s["samples_per_sec_total"])
            first["hvdtrain"].append(s["history"]["epoch_seconds"][0])  # rank 0's
            text = launch.run(python + ["-m", "hvdtrain.bench.horovod_recipe", "--model", model, "--image-size", str(size),
                                  "--batch-size", str(args.batch_size), "--steps", str(steps),
                                  "--threads", str(args.threads)], timeout=args.timeout)
            # rank 0's Keras progress bar (verbose=1, as in the recipe) may share the line
            ranks = [json.loads(m) for m in re.findall(r"RECIPE (\{[^}]*\})", text)]
            if len(ranks) != n:
                raise UserError(f"bench: the recipe printed {len(ranks)} of {n} ranks' figures:\n{text[-2000:]}")
            runs["recipe"].append(sum(r["samples_per_sec"] for r in ranks))
            first["recipe"].append(next(r["first_epoch_s"] for r in ranks if r["rank"] == 0))
            launch.say(f"recipe {model} {n} workers: hvdtrain {runs['hvdtrain'][-1]:.1f}, "
                f"recipe {runs['recipe'][-1]:.1f} samples/s; first epoch {first['hvdtrain'][-1]:.2f} "
                f"and {first['recipe'][-1]:.2f} s")
        ratios = [a / b for a, b in zip(runs["hvdtrain"], runs["recipe"])]
        rows.append({"model": model, "image_size": size, "steps_per_epoch": steps, "samples_per_sec": runs,
                     "ratios": ratios, "ratio_median": float(np.median(ratios)),
                     # the epoch that traces the step: recipe / hvdtrain (above 1: hvdtrain's is shorter)
                     "first_epoch_s": first,
                     "first_epoch_ratios": [b / a for a, b in zip(first["hvdtrain"], first["recipe"])]})
    return {"workers": n, "controller": launch.controller(args), "batch_size_per_worker": args.batch_size,
            "rows": rows}


def stacks(args, out: Path) -> dict:
    """hvdtrain on this stack against the same run on another venv's stack (--other-python), the same
    model, synthetic data, flags and thread budget at the most workers; interleaved A B A B, the ratio
    of each pair (this / other)."""
    import numpy as np

    n, rows = max(args.workers), []
    pythons = {"this": launch.python(n, launch.controller(args), args.hosts),
               "other": launch.python(n, launch.controller(args), args.hosts, py=args.other_python)}
    for model in args.checkpoint_models:
        size, steps, flags = _sized(args, model)
        runs: dict = {"this": [], "other": []}
        named: dict = {}
        for rep in range(args.repeats):
            for key, python in pythons.items():
                s = launch.train(python, out / f"stacks-{model}-{key}-{rep}", flags, args.timeout)
                runs[key].append(s["samples_per_sec_total"])
                named[key] = s["stack"]
            launch.say(f"stacks {model} {n} workers: {named['this']['stack']} {runs['this'][-1]:.1f}, "
                f"{named['other']['stack']} {runs['other'][-1]:.1f} samples/s")
        ratios = [a / b for a, b in zip(runs["this"], runs["other"])]
        rows.append({"model": model, "image_size": size, "steps_per_epoch": steps, "samples_per_sec": runs,
                     "stacks": named, "ratios": ratios, "ratio_median": float(np.median(ratios))})
    return {"workers": n, "controller": launch.controller(args), "rows": rows}


# ---------------------------------------------------------------- a user's per-batch callback

def noop_per_batch_callback():
    """--callbacks hvdtrain.bench.sections:noop_per_batch_callback: a Keras callback whose per-batch hook does nothing."""
    import tensorflow as tf

    class NoOp(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pass

    return [NoOp()]


CALLBACK_RUNS = {  # what each run adds to the section's flags
    "default": [],
    "spe-1": ["--steps-per-execution", "1"],  # the steps per call a per-batch callback brings, alone
    "per-batch": ["--callbacks", "hvdtrain.bench.sections:noop_per_batch_callback"],
}
PREEMPTION_RUNS = {
    "default": [],  # SIGTERM handled: the stop flag rides with every allreduce of the gradients
    "off": ["--preemption-signals"],
}


def _against_default(args, out: Path, section: str, kinds: dict) -> dict:
    """The same run with each kind's flags, interleaved round by round at the most workers; every kind's
    throughput against the default run of its round."""
    import numpy as np

    n, rows = max(args.workers), []
    for model in args.checkpoint_models:
        size, steps, flags = _sized(args, model)
        runs: dict = {k: [] for k in kinds}
        for rep in range(args.repeats):
            for kind, extra in kinds.items():
                s = launch.train(launch.python(n, launch.controller(args), args.hosts), out / f"{section}-{model}-{kind}-{rep}",
                           [*flags, *extra], args.timeout)
                runs[kind].append(s["samples_per_sec_total"])
                launch.say(f"{section} {model} {kind}: {runs[kind][-1]:.1f} samples/s ({s['steps_per_execution']} step(s) "
                    f"per call)")
        ratios = {k: [a / b for a, b in zip(runs[k], runs["default"])] for k in kinds if k != "default"}
        rows.append({"model": model, "image_size": size, "steps_per_epoch": steps, "samples_per_sec": runs,
                     "ratios_to_default": ratios, "median": {k: float(np.median(v)) for k, v in ratios.items()}})
    return {"workers": n, "controller": launch.controller(args), "rows": rows}


def callbacks_cost(args, out: Path) -> dict:
    """What a user's no-op per-batch callback costs: hvdtrain then runs 1 step per call, so that Keras
    calls it at every step as plain Keras does. Three runs interleaved (default, 1 step per call
    alone, the callback); their ratios say how much is the steps per call and how much the hook."""
    result = _against_default(args, out, "callbacks", CALLBACK_RUNS)
    for r in result["rows"]:
        r["hook_alone"] = [a / b for a, b in zip(r["samples_per_sec"]["per-batch"], r["samples_per_sec"]["spe-1"])]
    return result


def preemption_cost(args, out: Path) -> dict:
    """What handling SIGTERM costs: the stop flag, one scalar more in every allreduce of the gradients,
    against the same run with --preemption-signals left empty."""
    return _against_default(args, out, "preemption", PREEMPTION_RUNS)
