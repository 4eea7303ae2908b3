"""Two sections of what hvdtrain's own machinery costs a user: start-up on their own files (`startup`),
and step checkpoints (`checkpoint`). Interleaved A B A B, as every timed comparison of the bench."""
from __future__ import annotations

import time
from pathlib import Path

from . import launch, report
from .sections import _sized


# ---------------------------------------------------------------- start-up on a user's own files

def startup(args, out: Path) -> dict:
    """Launch to first step at the most workers, on the same records in two forms: a user's own schema
    read by their own pipeline (bench/own_records.py, which hvdtrain shards by file) against
    hvdtrain's `tfrecord:` source. Interleaved A B A B; each figure is the slowest rank's start-up."""
    import numpy as np

    from .. import data as data_lib
    from . import own_records

    n, records = max(args.workers), args.records
    rng = np.random.default_rng(0)
    x, y = rng.random((records, 8, 8, 1), dtype=np.float32), rng.integers(0, 10, records)
    own, ours = out / "startup-records-own", out / "startup-records-tfrecord"
    if not own.exists():
        own_records.write(str(own), x, y)
        own.mkdir(exist_ok=True)
    if not ours.exists():
        ours.mkdir()
        data_lib.write_tfrecords(x, y, str(ours / "part"), 8)
    sources = {"own_pipeline": "hvdtrain.bench.own_records:dataset", "tfrecord": f"tfrecord:{ours}/*.tfrecord"}
    times: dict = {k: [] for k in sources}
    for rep in range(args.repeats):
        for kind, source in sources.items():
            flags = ["--model", "mlp", "--data", source, "--val-split", "0", "--epochs", "1", "--steps-per-epoch",
                     "1", "--threads", str(args.threads), "--checkpoint-every", "0", "--no-keep-best",
                     "--no-tensorboard", "--no-save-model", "--no-worker-logs", "--verbose", "0"]
            times[kind].append(launch.train(launch.python(n, args.controllers[0], args.hosts), out / f"startup-{kind}-{rep}",
                                      flags, args.timeout, extra_env={"RECORDS": f"{own}/*.tfrecord"})["startup_s"])
            launch.say(f"startup {kind} ({records} records, {n} workers): {times[kind][-1]:.2f} s")
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

    from ..config import Config

    n, every = max(args.workers), Config.checkpoint_every_steps
    hook_s = _hook_seconds(Config(checkpoint_every_steps=every))
    launch.say(f"checkpoint hook: {hook_s * 1e6:.1f} us a step")
    rows = []
    for model in args.checkpoint_models:
        size, steps, flags = _sized(args, model)
        runs: dict = {"off": [], "on": []}
        saves: list = []
        for rep in range(args.repeats):
            for kind in runs:
                s = launch.train(launch.python(n, launch.controller(args), args.hosts), out / f"checkpoint-{model}-{kind}-{rep}",
                           [*flags, "--checkpoint-every", "1",
                            "--checkpoint-every-steps", str(2 * steps + 1 if kind == "on" else 0)], args.timeout)
                runs[kind].append(s["samples_per_sec_total"])
                saves += s["checkpoint_save_s"]
                launch.say(f"checkpoint {model} hook {kind}: {s['samples_per_sec_total']:.1f} samples/s, "
                    f"saves {report.seconds(s['checkpoint_save_s'])}")
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

    from .. import callbacks

    class Saves:  # the writes are timed in real runs; here only the hook's own work
        def save(self, epoch, step):
            pass

    model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
    model.build((None, 1))
    logs = {"loss": tf.constant(1.0), "accuracy": tf.constant(0.5)}
    tf.get_logger().setLevel("ERROR")  # Keras' "slow compared to the batch time": there is no batch here
    timed: dict = {}
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

