"""`hvdtrain bench`: how fast, how well it scales, and against what, measured in one run.

  scaling     the same model at 1..N workers: samples/s per worker and in total, and the scaling
              efficiency total(N) / (N x one worker), every worker at the same thread budget; beside
              it the limit with no overlap: compute / (compute + gradient bytes / allreduce bandwidth)
  levers      Horovod's and Keras' levers one at a time against hvdtrain's defaults (fp16 compression,
              fusion buffer, cycle time, grouped allreduce, MPI binding; one step per call), with one
              worker in every round: efficiency and the ratio to the defaults
  allreduce   hvd.allreduce bus bandwidth over sizes, beside mpi4py's Allreduce and a memcpy (the
              ceiling), busbw = algbw x 2(n-1)/n as nccl-tests define it
  baseline    hvdtrain at 1 worker against a plain Keras model.fit of the same model and data
  recipe      hvdtrain against Horovod's Keras recipe written by hand (hvdtrain/horovod_recipe.py)
  sync-vs-async  hvdtrain, MultiWorkerMirroredStrategy and ParameterServerStrategy (1 and 2 parameter
              servers) doing the same work: accuracy against time and samples, throughput, staleness
              (hvdtrain/sync_vs_async.py)
  startup     launch to first step on a user's own TFRecord files, against the `tfrecord:` source
  checkpoint  what --checkpoint-every-steps costs at its default N, for each built-in model
  stacks      the same hvdtrain run on this stack and on another venv's (--other-python, e.g.
              .venv-keras2/bin/python): Keras 3 against Keras 2, interleaved
  scale       2..32 ranks (--ranks, over --hosts): launch to the first step, the initial broadcast, and
              a step's allreduce (the model's gradient bytes) against the ring's bound 2(N-1)/N x
              bytes / bandwidth, the bandwidth being the 2-rank allreduce's at that size

Writes bench.json and PNG plots in --out, and prints the figures side by side.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

from . import compat, sync_vs_async
from .config import UserError

PY = sys.executable
BIN = Path(PY).parent


def _env(extra=None):
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    env.update(extra or {})
    return env


def say(line: str):
    """One line per measurement as it lands: a full bench takes minutes."""
    print(f"bench: {line}", flush=True)


def _run(cmd, timeout, env=None):
    proc = subprocess.run(cmd, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise UserError(f"bench: {' '.join(map(str, cmd[:8]))} ... failed:\n{proc.stdout[-2000:]}")
    return proc.stdout


def _python(n: int, controller: str, hosts: str | None, binding: str | None = None, py: str = PY):
    """The command that starts this python (or `py`, another venv's) on n workers (itself, for one).
    binding: MPI's process binding (horovodrun's --binding-args; its default and ours binds nothing)."""
    if n == 1:
        return [py]
    if controller == "mpirun":
        return ["mpirun", "-np", str(n), *(binding or "--bind-to none").split(), "-x", "TF_CPP_MIN_LOG_LEVEL",
                "-x", "PATH", py]
    return [str(Path(py).parent / "horovodrun"), "-np", str(n), "-H", hosts or f"localhost:{n}", f"--{controller}",
            *(["--binding-args", binding] if binding else []), py]


def _controller(args) -> str:
    """The one controller of the sections that compare at a fixed set-up: MPI where it is asked for."""
    return "mpi" if "mpi" in args.controllers else args.controllers[0]


def _train(python, run_dir: Path, flags, timeout, env=None) -> dict:
    """One hvdtrain run from scratch; its summary.json."""
    _run(python + ["-m", "hvdtrain", "--output-dir", str(run_dir), "--no-auto-resume", *flags], timeout, env)
    return json.loads((run_dir / "summary.json").read_text())


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

    runs, gradient_bytes = {}, None
    for rep in range(args.repeats):
        for controller in args.controllers:
            for n in args.workers:
                s = _train(_python(n, controller, args.hosts), out / f"scaling-{controller}-{n}-{rep}",
                           train_flags(args, args.steps), args.timeout)
                runs.setdefault((controller, n), []).append(s["samples_per_sec_total"])
                gradient_bytes = s["model"]["gradient_bytes"]
                say(f"scaling {controller} {n} worker(s): {s['samples_per_sec_total']:.1f} samples/s")
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


def _allreduce_GBps(allreduce_runs, controller: str, n: int, size: int):
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

    runs = {}
    for rep in range(args.repeats):
        for controller in args.controllers:
            for n in args.ranks:
                python = _python(n, controller, args.hosts)
                flags = ["--model", args.model, "--data", "synthetic", "--synthetic-shape",
                         *[str(args.image_size)] * 2, "3", "--synthetic-samples", str(args.batch_size * 3 * n),
                         "--batch-size", str(args.batch_size), "--epochs", "1", "--steps-per-epoch", "3",
                         "--threads", "1", "--checkpoint-every", "0", "--no-keep-best", "--no-tensorboard",
                         "--no-save-model", "--no-worker-logs", "--verbose", "0"]
                launched = time.time()
                s = _train(python, out / f"scale-{controller}-{n}-{rep}", flags, args.timeout)
                size = s["model"]["gradient_bytes"] // 4 * 4
                bench = _run(python + ["-m", "hvdtrain", "bench", "--worker", "allreduce", "--min-bytes", str(size),
                                       "--max-bytes", str(size)], timeout=args.timeout)
                # the JSON object alone: under horovodrun --mpi another rank's output may follow on its line
                row = json.JSONDecoder().raw_decode(bench.split("BENCH ", 1)[1])[0]["rows"][0]
                got = runs.setdefault((controller, n), {"startup_s": [], "broadcast_s": [], "allreduce_s": []})
                got["startup_s"].append(s["training_started_at"] - launched)
                got["broadcast_s"].append(s["broadcast_s"])
                got["allreduce_s"].append(row["horovod_s"])
                say(f"scale {controller} {n} ranks: start-up {got['startup_s'][-1]:.1f} s, broadcast "
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
    n, controller, rows = max(args.workers), _controller(args), []
    unknown = set(args.levers or ()) - set(LEVERS)
    if unknown:
        raise UserError(f"bench: unknown lever(s) {', '.join(sorted(unknown))}; choose from {', '.join(LEVERS)}")
    for model in args.lever_models:
        size, steps, flags = _sized(args, model)
        names = args.levers or LEVER_SETS.get(model, list(LEVERS))
        names = names if "defaults" in names else ["defaults", *names]
        one, runs = [], {name: [] for name in names}
        for rep in range(args.repeats):
            one.append(_train([PY], out / f"levers-{model}-one-{rep}", flags, args.timeout)["samples_per_sec_total"])
            for name in names:
                extra, binding = LEVERS[name]
                run_dir = out / f"levers-{model}-{name}-{rep}"
                if extra is None:
                    runs[name].append(_side_by_side(n, run_dir, flags, args.timeout))
                else:
                    runs[name].append(_train(_python(n, controller, args.hosts, binding), run_dir,
                                             [*flags, *extra], args.timeout)["samples_per_sec_total"])
                say(f"levers {model} {name}: {runs[name][-1]:.1f} samples/s at {n} workers "
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
    start with it and run until it ends, so they are training throughout its timed epoch (each prints a
    line per epoch to copy-I.out)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    outs = [(run_dir / f"copy-{i}.out").open("w") for i in range(n - 1)]
    copies = [subprocess.Popen([PY, "-m", "hvdtrain", "--output-dir", str(run_dir / f"copy-{i}"), "--no-auto-resume",
                                *flags, "--epochs", "100000", "--checkpoint-every-steps", "0", "--verbose", "2"],
                               env=_env(), stdout=o, stderr=subprocess.STDOUT) for i, o in enumerate(outs)]
    try:
        return n * _train([PY], run_dir, flags, timeout)["samples_per_sec_total"]
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

    try:
        from mpi4py import MPI  # first, so that Horovod's MPI controller shares MPI with it
    except ImportError:
        MPI = None
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    n = hvd.size()
    use_mpi4py = MPI is not None and hvd.mpi_enabled() and MPI.COMM_WORLD.Get_size() == n
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
        python = _python(n, "mpirun" if controller == "mpi" else controller, args.hosts)
        out = _run(python + ["-m", "hvdtrain", "bench", "--worker", "allreduce",
                               "--min-bytes", str(args.min_bytes), "--max-bytes", str(args.max_bytes)],
                   timeout=args.timeout)
        line = next(l for l in out.splitlines() if "BENCH " in l)
        results.append(json.loads(line.split("BENCH ", 1)[1]))
        top = results[-1]["rows"][-1]
        say(f"allreduce {controller} {n} workers: {top['horovod_busbw_GBps']:.2f} GB/s busbw at {top['bytes']} bytes")
    return results


# ---------------------------------------------------------------- 1 worker against plain Keras

def keras_baseline(args, out: Path) -> dict:
    """hvdtrain at one worker, then plain Keras, in interleaved pairs; the ratio of each pair."""
    import numpy as np

    ours, keras = [], []
    for rep in range(args.repeats):
        ours.append(_train([PY], out / f"baseline-hvdtrain-{rep}", train_flags(args, args.steps),
                           args.timeout)["samples_per_sec_total"])
        plain = _run([PY, "-m", "hvdtrain", "bench", "--worker", "keras", "--model", args.model,
                      "--image-size", str(args.image_size), "--batch-size", str(args.batch_size),
                      "--steps", str(args.steps), "--threads", str(args.threads)], timeout=args.timeout)
        keras.append(json.loads(plain.split("BENCH ", 1)[1].splitlines()[0])["samples_per_sec"])
        say(f"1 worker: hvdtrain {ours[-1]:.1f}, plain Keras {keras[-1]:.1f} samples/s")
    ratios = [a / b for a, b in zip(ours, keras)]
    return {"hvdtrain_1_worker": ours, "plain_keras_fit": keras, "ratios": ratios,
            "ratio": float(np.median(ratios))}


def keras_worker(args) -> int:
    """A plain Keras model.fit, no Horovod: what a user would write without us."""
    import numpy as np
    import tensorflow as tf

    from . import models

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
    """(image size, steps per epoch, hvdtrain's flags) of a model at its MODEL_SIZES."""
    size, per = MODEL_SIZES.get(model, (args.image_size, 1))
    steps = max(1, round(per * args.steps))
    return size, steps, train_flags(argparse.Namespace(**{**vars(args), "model": model, "image_size": size}), steps)


def recipe(args, out: Path) -> dict:
    """hvdtrain against hvdtrain/horovod_recipe.py (Horovod's Keras example, by hand), the same model,
    synthetic data, batch, optimizer (Adam, lr 0.001 x workers after a 1-epoch warm-up) and thread
    budget, at the most workers; interleaved A B A B, the ratio of each pair."""
    import numpy as np

    n, rows = max(args.workers), []
    python = _python(n, _controller(args), args.hosts)
    for model in args.checkpoint_models:
        size, steps, flags = _sized(args, model)
        runs, first = {"hvdtrain": [], "recipe": []}, {"hvdtrain": [], "recipe": []}
        for rep in range(args.repeats):
            s = _train(python, out / f"recipe-{model}-hvdtrain-{rep}",
                       [*flags, "--optimizer", "adam", "--lr", "0.001"], args.timeout)
            runs["hvdtrain"].append(s["samples_per_sec_total"])
            first["hvdtrain"].append(s["history"]["epoch_seconds"][0])  # rank 0's
            text = _run(python + ["-m", "hvdtrain.horovod_recipe", "--model", model, "--image-size", str(size),
                                  "--batch-size", str(args.batch_size), "--steps", str(steps),
                                  "--threads", str(args.threads)], timeout=args.timeout)
            # rank 0's Keras progress bar (verbose=1, as in the recipe) may share the line
            ranks = [json.loads(m) for m in re.findall(r"RECIPE (\{[^}]*\})", text)]
            if len(ranks) != n:
                raise UserError(f"bench: the recipe printed {len(ranks)} of {n} ranks' figures:\n{text[-2000:]}")
            runs["recipe"].append(sum(r["samples_per_sec"] for r in ranks))
            first["recipe"].append(next(r["first_epoch_s"] for r in ranks if r["rank"] == 0))
            say(f"recipe {model} {n} workers: hvdtrain {runs['hvdtrain'][-1]:.1f}, "
                f"recipe {runs['recipe'][-1]:.1f} samples/s; first epoch {first['hvdtrain'][-1]:.2f} "
                f"and {first['recipe'][-1]:.2f} s")
        ratios = [a / b for a, b in zip(runs["hvdtrain"], runs["recipe"])]
        rows.append({"model": model, "image_size": size, "steps_per_epoch": steps, "samples_per_sec": runs,
                     "ratios": ratios, "ratio_median": float(np.median(ratios)),
                     # the epoch that traces the step: recipe / hvdtrain (above 1: hvdtrain's is shorter)
                     "first_epoch_s": first,
                     "first_epoch_ratios": [b / a for a, b in zip(first["hvdtrain"], first["recipe"])]})
    return {"workers": n, "controller": _controller(args), "batch_size_per_worker": args.batch_size,
            "rows": rows}


def stacks(args, out: Path) -> dict:
    """hvdtrain on this stack against the same run on another venv's stack (--other-python), the same
    model, synthetic data, flags and thread budget at the most workers; interleaved A B A B, the ratio
    of each pair (this / other)."""
    import numpy as np

    if not args.other_python:
        raise UserError("bench: --sections stacks needs --other-python (another venv's python, e.g. "
                        ".venv-keras2/bin/python)")
    n, rows = max(args.workers), []
    pythons = {"this": _python(n, _controller(args), args.hosts),
               "other": _python(n, _controller(args), args.hosts, py=args.other_python)}
    for model in args.checkpoint_models:
        size, steps, flags = _sized(args, model)
        runs, named = {"this": [], "other": []}, {}
        for rep in range(args.repeats):
            for key, python in pythons.items():
                s = _train(python, out / f"stacks-{model}-{key}-{rep}", flags, args.timeout)
                runs[key].append(s["samples_per_sec_total"])
                named[key] = s["stack"]
            say(f"stacks {model} {n} workers: {named['this']['stack']} {runs['this'][-1]:.1f}, "
                f"{named['other']['stack']} {runs['other'][-1]:.1f} samples/s")
        ratios = [a / b for a, b in zip(runs["this"], runs["other"])]
        rows.append({"model": model, "image_size": size, "steps_per_epoch": steps, "samples_per_sec": runs,
                     "stacks": named, "ratios": ratios, "ratio_median": float(np.median(ratios))})
    return {"workers": n, "controller": _controller(args), "rows": rows}


# ---------------------------------------------------------------- a user's per-batch callback

def noop_per_batch_callback():
    """--callbacks hvdtrain.bench:noop_per_batch_callback: a Keras callback whose per-batch hook does nothing."""
    import tensorflow as tf

    class NoOp(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pass

    return [NoOp()]


CALLBACK_RUNS = {  # what each run adds to the section's flags
    "default": [],
    "spe-1": ["--steps-per-execution", "1"],  # the steps per call a per-batch callback brings, alone
    "per-batch": ["--callbacks", "hvdtrain.bench:noop_per_batch_callback"],
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
        runs = {k: [] for k in kinds}
        for rep in range(args.repeats):
            for kind, extra in kinds.items():
                s = _train(_python(n, _controller(args), args.hosts), out / f"{section}-{model}-{kind}-{rep}",
                           [*flags, *extra], args.timeout)
                runs[kind].append(s["samples_per_sec_total"])
                say(f"{section} {model} {kind}: {runs[kind][-1]:.1f} samples/s ({s['steps_per_execution']} step(s) "
                    f"per call)")
        ratios = {k: [a / b for a, b in zip(runs[k], runs["default"])] for k in kinds if k != "default"}
        rows.append({"model": model, "image_size": size, "steps_per_epoch": steps, "samples_per_sec": runs,
                     "ratios_to_default": ratios, "median": {k: float(np.median(v)) for k, v in ratios.items()}})
    return {"workers": n, "controller": _controller(args), "rows": rows}


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


# ---------------------------------------------------------------- start-up on a user's own files

def startup(args, out: Path) -> dict:
    """Launch to first step at the most workers, on the same records in two forms: a user's own schema
    read by their own pipeline (examples/records_pipeline.py, which hvdtrain shards by file) against
    hvdtrain's `tfrecord:` source. Interleaved A B A B; each figure is the slowest rank's start-up."""
    import numpy as np

    from . import data as data_lib
    from examples import records_pipeline

    n, records = max(args.workers), args.records
    rng = np.random.default_rng(0)
    x, y = rng.random((records, 8, 8, 1), dtype=np.float32), rng.integers(0, 10, records)
    own, ours = out / "startup-records-own", out / "startup-records-tfrecord"
    if not own.exists():
        records_pipeline.write(str(own), x, y)
        own.mkdir(exist_ok=True)
    if not ours.exists():
        ours.mkdir()
        data_lib.write_tfrecords(x, y, str(ours / "part"), 8)
    sources = {"own_pipeline": "examples.records_pipeline:dataset", "tfrecord": f"tfrecord:{ours}/*.tfrecord"}
    times = {k: [] for k in sources}
    for rep in range(args.repeats):
        for kind, source in sources.items():
            flags = ["--model", "mlp", "--data", source, "--val-split", "0", "--epochs", "1", "--steps-per-epoch",
                     "1", "--threads", str(args.threads), "--checkpoint-every", "0", "--no-keep-best",
                     "--no-tensorboard", "--no-save-model", "--no-worker-logs", "--verbose", "0"]
            times[kind].append(_train(_python(n, args.controllers[0], args.hosts), out / f"startup-{kind}-{rep}",
                                      flags, args.timeout, env={"RECORDS": f"{own}/*.tfrecord"})["startup_s"])
            say(f"startup {kind} ({records} records, {n} workers): {times[kind][-1]:.2f} s")
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {"records": records, "workers": n, "startup_s": times, "median_s": med,
            "ratio": med["own_pipeline"] / med["tfrecord"]}


# ---------------------------------------------------------------- the cost of step checkpoints



def checkpoint_cost(args, out: Path) -> dict:
    """--checkpoint-every-steps N costs a per-batch hook on every step and a save every N steps.

    The hook: Keras calling hvdtrain's own checkpoint callback as fit does, timed alone (microseconds,
    which no throughput comparison on a shared machine resolves); and, as a cross-check, throughput
    with it (N beyond the run's last step, so that no save lands in the timed epochs) against without
    (N = 0), interleaved A B A B at the most workers, the ratio of each pair. The save: rank 0's time
    to write one (every run writes one at each epoch's end, outside the timed epochs), the others
    waiting for it at their next step. Cost at N = (hook + save / N) / step.
    """
    import numpy as np

    from .config import Config

    n, every = max(args.workers), Config.checkpoint_every_steps
    hook_s = _hook_seconds(Config(checkpoint_every_steps=every))
    say(f"checkpoint hook: {hook_s * 1e6:.1f} us a step")
    rows = []
    for model in args.checkpoint_models:
        size, steps, flags = _sized(args, model)
        runs, saves = {"off": [], "on": []}, []
        for rep in range(args.repeats):
            for kind in runs:
                s = _train(_python(n, _controller(args), args.hosts), out / f"checkpoint-{model}-{kind}-{rep}",
                           [*flags, "--checkpoint-every", "1",
                            "--checkpoint-every-steps", str(2 * steps + 1 if kind == "on" else 0)], args.timeout)
                runs[kind].append(s["samples_per_sec_total"])
                saves += s["checkpoint_save_s"]
                say(f"checkpoint {model} hook {kind}: {s['samples_per_sec_total']:.1f} samples/s, "
                    f"saves {_fmt_s(s['checkpoint_save_s'])}")
        ratios = [on / off for on, off in zip(runs["on"], runs["off"])]
        step_s = args.batch_size * n / float(np.median(runs["off"]))
        save_s = float(np.median(saves))
        hook, save_cost = hook_s / step_s, save_s / every / step_s
        rows.append({"model": model, "image_size": size, "steps_per_epoch": steps, "samples_per_sec": runs,
                     "on_off_ratios": ratios, "step_s": step_s, "save_s": saves, "save_s_median": save_s,
                     "hook_cost": hook, "save_cost": save_cost, "cost_at_default": hook + save_cost})
    return {"workers": n, "every": every, "hook_s": hook_s, "rows": rows}


def _hook_seconds(cfg, calls=200_000) -> float:
    """Per step: Keras' CallbackList calling hvdtrain's checkpoint callback before and after a batch,
    as model.fit does (tensors in the logs, not read), against the same list without it."""
    import tensorflow as tf

    from . import callbacks

    class Saves:  # the writes are timed in real runs; here only the hook's own work
        def save(self, epoch, step):
            pass

    model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
    model.build((None, 1))
    logs = {"loss": tf.constant(1.0), "accuracy": tf.constant(0.5)}
    tf.get_logger().setLevel("ERROR")  # Keras' "slow compared to the batch time": there is no batch here
    timed = {}
    for kind in ("without", "with", "without", "with"):
        hook = callbacks.checkpoints(cfg, Saves(), calls, 0, 0) if kind == "with" else None
        cbs = tf.keras.callbacks.CallbackList([hook] if hook else [], add_history=True, model=model, epochs=1,
                                              steps=calls, verbose=0)
        cbs.on_train_begin()
        cbs.on_epoch_begin(0)
        for i in range(20):  # Keras times the first batches' hooks
            cbs.on_train_batch_begin(i)
            cbs.on_train_batch_end(i, logs)
        t0 = time.perf_counter()
        for i in range(20, calls):
            cbs.on_train_batch_begin(i)
            cbs.on_train_batch_end(i, logs)
        timed.setdefault(kind, []).append((time.perf_counter() - t0) / (calls - 20))
    return max(0.0, min(timed["with"]) - min(timed["without"]))


def _fmt_s(seconds) -> str:
    return ", ".join(f"{x * 1000:.0f} ms" for x in seconds)


def _spread(values, fmt="{:.3f}") -> str:
    """min / median / max: one figure hides how noisy a shared machine is."""
    import numpy as np

    return "/".join(fmt.format(v) for v in (min(values), float(np.median(values)), max(values)))


# ---------------------------------------------------------------- report

def plot(results: dict, path: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
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
        line = f"  {r['controller']:7} {r['workers']} worker(s): {_spread(r['samples_per_sec_runs'], '{:.1f}')} samples/s"
        if r["workers"] > 1 and "efficiency_runs" in r:
            line += f"  efficiency {_spread(r['efficiency_runs'], '{:.1%}')}"
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
            lines.append(f"  {r['model']:9} {r['lever']:12} {_spread(r['efficiency'], '{:.1%}')}  "
                         f"x{_spread(r['vs_defaults'])}")
    for run in results.get("allreduce", []):
        lines.append(f"== allreduce busbw GB/s ({run['workers']} workers, {run['controller']})")
        lines.append(f"  {'bytes':>10} {'horovod':>8} {'mpi4py':>8} {'memcpy':>8}  horovod/mpi4py")
        for r in run["rows"]:
            ratio = r["horovod_busbw_GBps"] / r["mpi4py_busbw_GBps"] if "mpi4py_busbw_GBps" in r else None
            lines.append(f"  {r['bytes']:>10} {r['horovod_busbw_GBps']:8.2f} {r.get('mpi4py_busbw_GBps', 0):8.2f}"
                         f" {r['memcpy_busbw_GBps']:8.2f}  {f'{ratio:.0%}' if ratio else '-'}")
    if "baseline" in results:
        b = results["baseline"]
        lines.append(f"== 1 worker: hvdtrain {_spread(b['hvdtrain_1_worker'], '{:.1f}')} vs plain Keras "
                     f"{_spread(b['plain_keras_fit'], '{:.1f}')} samples/s (ratio {_spread(b['ratios'])})")
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
            lines.append(f"  {row['model']:9} {_spread(row['ratios'])}  first epoch: recipe / hvdtrain "
                         f"{_spread(row['first_epoch_ratios'])}")
    if "stacks" in results:
        st = results["stacks"]
        for row in st["rows"]:
            this, other = (f"{row['stacks'][k]['stack']} (TensorFlow {row['stacks'][k]['tensorflow']}, Keras "
                           f"{row['stacks'][k]['keras']})" for k in ("this", "other"))
            lines.append(f"== {this} / {other}, {st['workers']} workers, {st['controller']}: {row['model']:9} "
                         f"{_spread(row['ratios'])} (min/median/max of {len(row['ratios'])} interleaved pairs)")
    if "checkpoint" in results:
        c = results["checkpoint"]
        lines.append(f"== checkpoint every {c['every']} steps ({c['workers']} workers): the per-step hook "
                     f"{c['hook_s'] * 1e6:.1f} us; throughput with it / without (min/median/max of "
                     f"{len(c['rows'][0]['on_off_ratios'])} pairs); one save; cost at {c['every']}")
        for r in c["rows"]:
            lines.append(f"  {r['model']:9} hook {_spread(r['on_off_ratios'])}  step {r['step_s'] * 1000:.1f} ms"
                         f"  save {r['save_s_median'] * 1000:.0f} ms  cost {r['cost_at_default']:.2%}"
                         f" (hook {r['hook_cost']:.2%}, saves {r['save_cost']:.2%})")
    if "callbacks" in results:
        cb = results["callbacks"]
        lines.append(f"== a no-op per-batch callback ({cb['workers']} workers, {cb['controller']}): throughput against "
                     f"the defaults, min/median/max of {len(cb['rows'][0]['hook_alone'])} interleaved rounds")
        for r in cb["rows"]:
            lines.append(f"  {r['model']:9} 1 step per call {_spread(r['ratios_to_default']['spe-1'])}  the callback "
                         f"{_spread(r['ratios_to_default']['per-batch'])}  (its hook alone {_spread(r['hook_alone'])})")
    if "preemption" in results:
        pr = results["preemption"]
        lines.append(f"== SIGTERM handled / not ({pr['workers']} workers, {pr['controller']}): the stop flag in every "
                     f"allreduce, min/median/max of {len(pr['rows'][0]['ratios_to_default']['off'])} interleaved rounds")
        for r in pr["rows"]:
            lines.append(f"  {r['model']:9} {_spread([1 / x for x in r['ratios_to_default']['off']])}")
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


def parser():
    p = argparse.ArgumentParser(prog="hvdtrain bench", description=__doc__.splitlines()[0])
    cores = len(os.sched_getaffinity(0))
    p.add_argument("--workers", type=lambda s: [int(v) for v in s.split(",")],
                   default=list(range(1, cores + 1)), help="worker counts, e.g. 1,2,4 (default 1..cores)")
    p.add_argument("-H", "--hosts", help="host list for horovodrun beyond this machine (host:slots,...)")
    p.add_argument("--controllers", type=lambda s: s.split(","), default=["gloo", "mpi"],
                   help="horovodrun controllers to compare: gloo,mpi")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=20, help="measured steps per epoch (2 epochs)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per worker, the same at every N")
    p.add_argument("--min-bytes", type=int, default=4 << 10)
    p.add_argument("--max-bytes", type=int, default=256 << 20)
    p.add_argument("--sections", type=lambda s: s.split(","), default=["allreduce", "scaling", "levers", "baseline", "recipe", "startup",
                                                                 "checkpoint", "callbacks", "preemption", "sync-vs-async"])
    p.add_argument("--ranks", type=lambda s: [int(v) for v in s.split(",")], default=[2, 4, 8, 16, 32],
                   help="scale: rank counts (over --hosts, or this host)")
    p.add_argument("--records", type=int, default=200_000, help="startup: records in the user's own files")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds of every timed section")
    p.add_argument("--lever-models", type=lambda s: s.split(","), default=["resnet50", "mlp"],
                   help="levers: the built-in models, each at its size (MODEL_SIZES) with its levers")
    p.add_argument("--levers", type=lambda s: s.split(","),
                   help=f"levers: these instead of each model's own ({', '.join(LEVERS)})")
    p.add_argument("--checkpoint-models", type=lambda s: s.split(","), default=["mlp", "cnn", "resnet50"],
                   help="recipe, checkpoint, callbacks, preemption, stacks: the built-in models, each at its size (MODEL_SIZES)")
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--study-tasks", type=lambda s: s.split(","), default=["cnn", "wide"],
                   help="sync-vs-async: cnn (compute bound), wide (communication bound)")
    p.add_argument("--study-workers", type=lambda s: [int(v) for v in s.split(",")], default=[2, 4])
    p.add_argument("--study-seeds", type=int, default=3)
    p.add_argument("--study-epochs", type=int, default=10)
    p.add_argument("--other-python", help="stacks: another venv's python to compare with "
                   "(e.g. .venv-keras2/bin/python)")
    p.add_argument("--study-peer", help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=["allreduce", "keras", "sync-vs-async"], help=argparse.SUPPRESS)
    return p


def main(argv) -> int:
    args = parser().parse_args(argv)
    if args.worker == "allreduce":
        return allreduce_worker(args)
    if args.worker == "keras":
        return keras_worker(args)
    if args.worker == "sync-vs-async":
        return sync_vs_async.worker(args)
    args.max_workers = max(args.workers)
    if "sync-vs-async" in args.sections and compat.keras3():
        args.sections = [s for s in args.sections if s != "sync-vs-async"]
        print("bench: sync-vs-async left out: its tf.distribute peers (MultiWorkerMirroredStrategy, "
              "ParameterServerStrategy) do not train Keras 3 models (tensorflow#72388); run it on the keras2 "
              "stack (HVDTRAIN_STACK=keras2 scripts/setup.sh)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"host": socket.gethostname(), "cores": len(os.sched_getaffinity(0)),
               "args": {k: v for k, v in vars(args).items() if k != "worker"},
               "scaling": {"model": args.model, "image_size": args.image_size,
                           "batch_size_per_worker": args.batch_size, "threads_per_worker": args.threads,
                           "rows": []}}
    if "allreduce" in args.sections:
        results["allreduce"] = allreduce(args)
    if "scaling" in args.sections:
        results["scaling"] = scaling(args, out, results.get("allreduce", ()))
    if "levers" in args.sections:
        results["levers"] = levers(args, out)
    if "baseline" in args.sections:
        results["baseline"] = keras_baseline(args, out)
    if "recipe" in args.sections:
        results["recipe"] = recipe(args, out)
    if "startup" in args.sections:
        results["startup"] = startup(args, out)
    if "checkpoint" in args.sections:
        results["checkpoint"] = checkpoint_cost(args, out)
    if "stacks" in args.sections:
        results["stacks"] = stacks(args, out)
    if "callbacks" in args.sections:
        results["callbacks"] = callbacks_cost(args, out)
    if "preemption" in args.sections:
        results["preemption"] = preemption_cost(args, out)
    if "scale" in args.sections:
        results["scale"] = scale(args, out)
    if "sync-vs-async" in args.sections:
        results["sync_vs_async"] = sync_vs_async.study(
            args, out, lambda python, run_dir, flags: _train(python, run_dir, flags, args.timeout),
            lambda n: _python(n, args.controllers[0], args.hosts), _env, say)
    (out / "bench.json").write_text(json.dumps(results, indent=2))
    results["plot"] = plot(results, out / "scaling.png")
    written = [results["plot"]] if results["plot"] else []
    if "sync_vs_async" in results:
        written += sync_vs_async.write(results["sync_vs_async"], out)
    print(report(results))
    print(f"wrote {out / 'bench.json'}" + "".join(f", {p}" for p in written))
    return 0
