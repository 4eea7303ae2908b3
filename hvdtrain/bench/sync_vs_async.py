"""Synchronous or asynchronous updates? `hvdtrain bench --sections sync-vs-async` runs it.

The same work (model, digits split, per-worker batch 32, SGD with momentum, samples per epoch) under:

  horovod   hvdtrain itself: Horovod ring-allreduce, one update per step of all workers, lr x N
  mwms      tf.distribute.MultiWorkerMirroredStrategy: synchronous too (collective all-reduce), lr x N
  ps1, ps2  tf.distribute.ParameterServerStrategy with 1 and 2 parameter servers: asynchronous, each
            worker applies its own batch's gradient whenever it is ready, lr x 1 (an update is one
            worker's batch)
  ps1-lrxN  the same with lr x N: the articles' worry, N workers each taking the synchronous step

at every worker count, over several seeds, on two tasks: `cnn` (digits with the built-in CNN, compute
bound) and `wide` (digits with a 1.1M-parameter MLP, 4.4 MB of gradients a step: communication bound).
Every run records, after each epoch, validation loss and accuracy against training time (validation
left out) and samples seen; asynchronous runs also count, for every applied gradient, how many
updates reached the parameter servers between reading the weights it was computed on and applying it
(its staleness, in updates).
Its results go into bench.json; it writes sync-vs-async.txt (the table) and one PNG per (task, workers).
"""
from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..config import UserError

BATCH = 32  # per worker, and per asynchronous update
LR = 0.01  # per batch of 32, both tasks; synchronous peers scale it by N
PEERS = ("horovod", "mwms", "ps1", "ps2", "ps1-lrxN")
MAX_LAG = 64  # staleness histogram: 0..63, the last bin counting 63 and more


def wide_mlp(input_shape, num_classes):
    """Big enough that communication matters: 64 -> 1024 -> 1024 -> classes, 1.1M parameters."""
    from tensorflow.keras import layers, Sequential

    return Sequential([layers.Input(input_shape), layers.Flatten(), layers.Dense(1024, activation="relu"),
                       layers.Dense(1024, activation="relu"), layers.Dense(num_classes)], name="wide_mlp")


def _builder(task):
    from .. import models

    return models.BUILDERS["cnn"] if task == "cnn" else wide_mlp


# ---------------------------------------------------------------- the driver (in `hvdtrain bench`)

def study(args, out: Path, train, launcher, env, say) -> dict:
    """Every (task, workers, peer): one launch; hvdtrain one per seed (it is run as users run it).
    train(python, run_dir, flags) -> summary, launcher(n) (horovodrun ... python), env(extra) and
    say(line) are the bench's."""
    results = {"epochs": args.study_epochs, "seeds": args.study_seeds, "batch_per_worker": BATCH,
               "lr_per_batch": LR, "runs": []}
    for task in args.study_tasks:
        for n in args.study_workers:
            for peer in PEERS:
                t0 = time.perf_counter()
                if peer == "horovod":
                    curves = [_horovod(args, out / f"sva-{task}-{n}-{seed}", task, n, seed, train, launcher)
                              for seed in range(args.study_seeds)]
                else:
                    curves = _tf_distribute(args, task, n, peer, env)
                row = {"task": task, "workers": n, "peer": peer, "curves": curves, **_summary(curves)}
                results["runs"].append(row)
                say(f"sync-vs-async {task} {n} workers {peer}: {row['samples_per_sec']:.0f} samples/s, "
                    f"val_accuracy {row['final_val_accuracy']:.3f}, staleness {_lag_text(row)} "
                    f"({time.perf_counter() - t0:.0f} s)")
    return results


def _horovod(args, run_dir, task, n, seed, train, launcher) -> dict:
    model = "cnn" if task == "cnn" else "hvdtrain.bench.sync_vs_async:wide_mlp"
    flags = ["--model", model, "--data", "digits", "--epochs", str(args.study_epochs), "--batch-size",
             str(BATCH), "--optimizer", "momentum", "--lr", str(LR), "--warmup-epochs", "0",
             "--seed", str(seed), "--threads", "1", "--checkpoint-every", "0", "--checkpoint-every-steps", "0",
             "--steps-per-execution", "1",  # as its peers: the study compares update rules, not call overhead
             "--no-keep-best", "--no-tensorboard", "--no-save-model", "--no-worker-logs", "--verbose", "0"]
    s = train(launcher(n), run_dir, flags)
    h, samples = s["history"], s["steps_per_epoch"] * s["global_batch_size"]
    seconds = list(itertools.accumulate(h["epoch_seconds"]))
    return {"seed": seed, "samples_per_epoch": samples, "seconds": seconds,
            "samples": [samples * (e + 1) for e in range(len(seconds))],
            "val_loss": h["val_loss"], "val_accuracy": h["val_accuracy"], "staleness": None}


def _tf_distribute(args, task, n, peer, env) -> list:
    """A local tf.distribute cluster (gRPC on 127.0.0.1); its chief (MWMS: worker 0) runs every seed."""
    servers = int(peer[2]) if peer.startswith("ps") else 0
    ports = _free_ports(n + servers + 1)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports[:n]]}
    roles = [("worker", i) for i in range(n)]
    if servers:
        cluster["ps"] = [f"127.0.0.1:{p}" for p in ports[n:n + servers]]
        cluster["chief"] = [f"127.0.0.1:{ports[-1]}"]
        roles += [("ps", i) for i in range(servers)] + [("chief", 0)]
    procs = []
    for job, i in roles:
        tf_config = {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": job, "index": i}})}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "hvdtrain", "bench", "--worker", "sync-vs-async", "--study-peer", peer,
             "--study-tasks", task, "--study-epochs", str(args.study_epochs), "--study-seeds",
             str(args.study_seeds)], env=env(tf_config), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True))
    reporter = procs[-1] if servers else procs[0]
    try:
        text, _ = reporter.communicate(timeout=args.timeout)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    if "RESULT " not in text:
        raise UserError(f"sync-vs-async {peer} at {n} workers failed: {text[-2000:]}")
    return json.loads(text.split("RESULT ", 1)[1].splitlines()[0])


def _free_ports(k):
    socks = [socket.socket() for _ in range(k)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _summary(curves) -> dict:
    """Throughput (epochs after the first, which traces), final accuracy (mean and range over seeds),
    staleness (all seeds' histograms added)."""
    import numpy as np

    rates = [c["samples_per_epoch"] * (len(c["seconds"]) - 1) / (c["seconds"][-1] - c["seconds"][0])
             if len(c["seconds"]) > 1 else c["samples"][-1] / c["seconds"][-1] for c in curves]
    final = [c["val_accuracy"][-1] for c in curves]
    row = {"samples_per_sec": float(np.median(rates)), "samples_per_sec_runs": rates,
           "final_val_accuracy": float(np.mean(final)), "final_val_accuracy_range": [min(final), max(final)],
           "final_val_loss": float(np.mean([c["val_loss"][-1] for c in curves])),
           "train_seconds": float(np.mean([c["seconds"][-1] for c in curves])), "staleness": None}
    hists = [c["staleness"] for c in curves if c["staleness"] is not None]
    if hists:
        hist = np.sum(hists, axis=0)
        lags = np.arange(len(hist))
        row["staleness"] = {"histogram": hist.tolist(), "mean": float((hist * lags).sum() / hist.sum()),
                            "p90": int(lags[np.searchsorted(np.cumsum(hist), 0.9 * hist.sum())]),
                            "max": int(lags[hist > 0].max())}
    return row


def _lag_text(row) -> str:
    s = row["staleness"]
    return "0 (synchronous)" if s is None else f"mean {s['mean']:.2f}, p90 {s['p90']}, max {s['max']}"


# ---------------------------------------------------------------- one tf.distribute process

def worker(args) -> int:
    """A process of a tf.distribute cluster: parameter servers and PS workers serve until killed; the
    chief (or every MWMS worker) trains every seed and reports curves on a RESULT line."""
    import tensorflow as tf

    peer, task = args.study_peer, args.study_tasks[0]
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    role = json.loads(os.environ["TF_CONFIG"])["task"]
    if peer.startswith("ps") and role["type"] in ("worker", "ps"):
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        tf.distribute.Server(resolver.cluster_spec(), job_name=role["type"], task_index=role["index"],
                             protocol="grpc", start=True).join()
        return 0
    if peer == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        n = strategy.num_replicas_in_sync
    else:
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        strategy = tf.distribute.ParameterServerStrategy(resolver)
        n = len(resolver.cluster_spec().as_dict()["worker"])
    curves = [_train(strategy, peer, task, n, seed, args.study_epochs) for seed in range(args.study_seeds)]
    if peer != "mwms" or role["index"] == 0:
        print("RESULT " + json.dumps(curves), flush=True)
    return 0


def _train(strategy, peer, task, n, seed, epochs) -> dict:
    import numpy as np
    import tensorflow as tf

    from .. import config
    from ..data import arrays

    tf.keras.utils.set_random_seed(seed)
    x, y, xv, yv = arrays.digits(config.Config(), None, True)
    sync = peer == "mwms"
    lr = LR * (n if sync or peer.endswith("lrxN") else 1)
    # the same samples per epoch as the synchronous peers: whole global batches of N x 32
    steps = len(x) // (BATCH * n) * (1 if sync else n)
    build = _builder(task)
    with strategy.scope():
        lags = None if sync else tf.Variable(tf.zeros(MAX_LAG), trainable=False, name="lags")
        model = _with_staleness(build(x.shape[1:], 10), lags)
        model.compile(tf.keras.optimizers.SGD(lr, momentum=0.9),
                      tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    def dataset(input_context=None):
        batch = BATCH if input_context is not None else BATCH * n  # MWMS splits the global batch
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=seed).repeat().batch(
            batch, drop_remainder=True)

    source = dataset() if sync else tf.keras.utils.experimental.DatasetCreator(dataset)
    local = build(x.shape[1:], 10)  # validation outside the strategy, on the whole held-out split
    curve = {"seed": seed, "samples_per_epoch": steps * BATCH * (n if sync else 1), "seconds": [],
             "samples": [], "val_loss": [], "val_accuracy": []}

    class Curve(tf.keras.callbacks.Callback):
        """After every epoch (Keras has waited for its steps, on every worker for PS): the time it
        took, then the validation figures, outside the timing, as hvdtrain's own."""

        def on_epoch_begin(self, epoch, logs=None):
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            seconds = time.perf_counter() - self.t0 + (curve["seconds"][-1] if curve["seconds"] else 0)
            local.set_weights(self.model.get_weights())
            logits = local(xv, training=False)  # called, not evaluate(): that would ask the strategy
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(yv, logits, from_logits=True))
            acc = np.mean(np.argmax(logits, axis=1) == yv)
            curve["seconds"].append(seconds)
            curve["samples"].append(curve["samples_per_epoch"] * (epoch + 1))
            curve["val_loss"].append(float(loss))
            curve["val_accuracy"].append(float(acc))

    model.fit(source, epochs=epochs, steps_per_epoch=steps, verbose=0, callbacks=[Curve()])
    curve["staleness"] = None if lags is None else np.round(lags.numpy()).astype(int).tolist()
    return curve


def _with_staleness(model, lags):
    """The model, whose train step also counts (in `lags`, on a parameter server) how many updates
    reached the parameter servers between reading the weights and applying this step's gradient.
    The step count is read with the weights: the forward pass depends on its value (adding 0), as it
    does on the weights, so both are fetched before it runs; a control dependency alone is not kept
    across the worker/parameter-server split (measured: the count was then read at the end)."""
    import tensorflow as tf

    if lags is None:
        return model

    class Staleness(tf.keras.Model):
        def train_step(self, data):
            x, y = data
            before = self.optimizer.iterations.read_value()
            x = x + tf.cast(tf.minimum(before, 0), x.dtype)  # 0: a data dependency, not an edit
            with tf.GradientTape() as tape:
                loss = self.compiled_loss(y, self(x, training=True))
            self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables),
                                               self.trainable_variables))
            after = self.optimizer.iterations.read_value()  # this step's increment included
            lags.assign_add(tf.one_hot(tf.clip_by_value(after - before - 1, 0, MAX_LAG - 1), MAX_LAG))
            return {"loss": loss}

    return Staleness(model.inputs, model.outputs, name=model.name)


# ---------------------------------------------------------------- report

def write(results: dict, out: Path, plt) -> list:
    """The table (sync-vs-async.txt) and, with matplotlib's pyplot, the plots, in the bench's output dir:
    their paths."""
    path = out / "sync-vs-async.txt"
    path.write_text(table(results) + "\n")
    return [str(path)] + (plot(results, out, plt) if plt else [])


def plot(results: dict, out: Path, plt) -> list:
    """One PNG per (task, workers): validation accuracy and loss against training time and against
    samples, each peer's mean over seeds with its range shaded."""
    import numpy as np

    paths = []
    for task, n in sorted({(r["task"], r["workers"]) for r in results["runs"]}):
        fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharey="row")
        for r in (r for r in results["runs"] if r["task"] == task and r["workers"] == n):
            for row, metric in enumerate(("val_accuracy", "val_loss")):
                values = np.array([c[metric] for c in r["curves"]])
                for col, xkey in enumerate(("seconds", "samples")):
                    xs = np.mean([c[xkey] for c in r["curves"]], axis=0)
                    ax = axes[row, col]
                    line, = ax.plot(xs, values.mean(axis=0), "o-", ms=3, label=r["peer"])
                    ax.fill_between(xs, values.min(axis=0), values.max(axis=0), color=line.get_color(),
                                    alpha=0.2)
        for row, metric in enumerate(("validation accuracy", "validation loss")):
            axes[row, 0].set_ylabel(metric)
        axes[1, 0].set_xlabel("training time (s), validation left out")
        axes[1, 1].set_xlabel("samples seen")
        axes[0, 0].legend(fontsize=8)
        fig.suptitle(f"{task} on digits, {n} workers ({results['seeds']} seeds: mean, range shaded)")
        fig.tight_layout()
        path = out / f"sync-vs-async-{task}-{n}w.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(str(path))
    return paths


def table(results: dict) -> str:
    lines = [f"== sync vs async: digits, batch {BATCH}/worker, {results['epochs']} epochs, "
             f"{results['seeds']} seed(s); mean over seeds (range)",
             f"  {'task':5} {'N':>2} {'peer':9} {'samples/s':>10} {'val_accuracy':>21} {'val_loss':>8}"
             f"  staleness (updates behind)"]
    for r in results["runs"]:
        lo, hi = r["final_val_accuracy_range"]
        lines.append(f"  {r['task']:5} {r['workers']:>2} {r['peer']:9} {r['samples_per_sec']:10.0f} "
                     f"{r['final_val_accuracy']:8.3f} ({lo:.3f}-{hi:.3f}) {r['final_val_loss']:8.3f}  {_lag_text(r)}")
    return "\n".join(lines)
