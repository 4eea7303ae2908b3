"""Checkpoints inside an epoch: a worker killed (kill -9) at a step, the job relaunched with the same
command, resumes at the next step of the same epoch on the same data order, and ends with the
weights of an uninterrupted run, bit for bit; a counter in the model shows that, of the steps that
count, no sample was trained on twice and none was skipped. Arrays, `tfrecord:` and a user's
pipeline; horovodrun and mpirun; a kill at the first step of an epoch, at the last, and between."""
import collections
import json
import random
import re

import numpy as np
import pytest

from jobs import BIN, KERAS3, PYTHON, command, launch, run, train

N, BATCH, WORKERS, EPOCHS, EVERY = 384, 8, 2, 3, 5
STEPS = N // (BATCH * WORKERS)  # 24 per epoch, nothing left out


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The same 384 samples as npz arrays and as 4 TFRecord files; x[:, 0] is the sample's id / 1024."""
    from hvdtrain.data import write_tfrecords

    d = tmp_path_factory.mktemp("ids")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, 9)).astype(np.float32)
    x[:, 0] = np.arange(N) / 1024
    y = (x[:, 1] > 0).astype(np.int64) + 2 * (x[:, 2] > 0)
    np.savez(d / "ids.npz", x=x, y=y)
    write_tfrecords(x, y, str(d / "ids"), 4)
    return {"arrays": ("npz:" + str(d / "ids.npz"), {}),
            "tfrecord": (f"tfrecord:{d}/ids-*.tfrecord", {}),
            "pipeline": ("user_data:id_records", {"ID_RECORDS": f"{d}/ids-*.tfrecord"})}


def _flags(data):
    return ("--model", "user_models:counted", "--data", data, "--epochs", str(EPOCHS), "--batch-size",
            str(BATCH), "--val-split", "0", "--optimizer", "momentum", "--lr", "0.05", "--lr-schedule",
            "cosine", "--checkpoint-every-steps", str(EVERY), "--keep-checkpoints", "2", "--no-save-model")


def _elastic(out, argv):
    """horovodrun's elastic launch on one host of 2 slots: a dead worker's host is blacklisted, fewer
    than --min-np remain, and the whole job ends (after --elastic-timeout): a restart is a new job."""
    hostfile = out / "hosts"
    hostfile.write_text(f"localhost slots={WORKERS}\n")
    return [str(BIN / "horovodrun"), "-np", str(WORKERS), "--min-np", str(WORKERS), "--max-np", str(WORKERS),
            "--elastic-timeout", "5", "--network-interface", "lo", "--host-discovery-script",
            f"{PYTHON} -m hvdtrain hosts --discover --hostfile {hostfile}", PYTHON, *argv, "--elastic"]


def _run(launcher, out, data, env, kill_at=None, counts="counts", extra=(), flags=None):
    counts = out / counts
    counts.mkdir(parents=True, exist_ok=True)
    env = {**env, "COUNT_DIR": str(counts), "HOROVOD_GLOO_TIMEOUT_SECONDS": "10",
           **({"KILL_AT": str(kill_at), "KILL_RANK": "1"} if kill_at else {})}
    argv = ["-m", "hvdtrain", "--output-dir", str(out), "--verbose", "0", "--no-tensorboard",
            *(flags or _flags(data)), *extra]
    cmd = _elastic(out, argv) if launcher == "elastic" else command(WORKERS, launcher, argv)
    return run(cmd, env=env)


def _trained(counts, upto=None):
    """{step: ids of every rank} from the counter files, up to step `upto`."""
    steps = collections.defaultdict(list)
    for f in counts.glob("rank*.txt"):
        for line in f.read_text().splitlines():
            step, *ids = map(int, line.split())
            if upto is None or step <= upto:
                steps[step] += ids
    return steps


def _saves(per_call=1, steps=STEPS, every=EVERY, epochs=EPOCHS):
    """The steps after which checkpoints are written: every epoch's end, and `every` steps after the
    last, however many steps a call of the compiled step runs (Keras 2: the call before a save is cut
    short); under Keras 3, whose calls run per_call steps from each epoch's start (the last one of an
    epoch shorter), at the end of the call that reaches it."""
    saves, due = [], every
    for step in range(1, epochs * steps + 1):
        inside = (step - 1) % steps + 1
        if inside == steps or step >= due and inside % per_call == 0:
            saves.append(step)
            due = step + every
    return saves


def _once_per_epoch(steps):
    for epoch in range(EPOCHS):
        ids = [i for s in range(epoch * STEPS + 1, (epoch + 1) * STEPS + 1) for i in steps[s]]
        assert sorted(ids) == list(range(N)), f"epoch {epoch + 1}: {len(ids)} ids, {len(set(ids))} distinct"


@pytest.fixture(scope="module")
def straight(sources, tmp_path_factory):
    """One uninterrupted run per source (horovodrun), to compare with."""
    runs = {}
    for name, (data, env) in sources.items():
        out = tmp_path_factory.mktemp(f"straight-{name}")
        proc = _run("gloo", out, data, env)
        assert proc.returncode == 0, proc.stdout[-3000:]
        runs[name] = (json.loads((out / "summary.json").read_text()), _trained(out / "counts"))
        _once_per_epoch(runs[name][1])
    return runs


@pytest.mark.parametrize("source, launcher, kill_at", [
    ("arrays", "gloo", STEPS + 1),                   # the first step of epoch 2
    ("tfrecord", "mpirun", 2 * STEPS),               # the last step of epoch 2
    ("pipeline", "gloo", random.Random(7).randint(STEPS + 2, 2 * STEPS - 1)),  # between
    # between, in epoch 1, after the first step checkpoint (Keras 3: at the end of the first call of 10)
    pytest.param("arrays", "mpirun", random.Random(8).randint(12, STEPS - 1), marks=pytest.mark.stacks),
    ("arrays", "elastic", random.Random(9).randint(STEPS + 2, 2 * STEPS - 1)),  # the whole elastic job
], ids=["arrays-horovodrun-first-step", "tfrecord-mpirun-last-step", "pipeline-horovodrun-mid-epoch",
        "arrays-mpirun-mid-epoch", "arrays-elastic-job-restarted"])
@pytest.mark.full
def test_worker_killed_inside_an_epoch_resumes_at_the_next_step_and_ends_bit_identical(
        source, launcher, kill_at, sources, straight, tmp_path):
    data, env = sources[source]
    killed = _run(launcher, tmp_path, data, env, kill_at=kill_at, counts="killed")
    assert killed.returncode != 0, "the worker should have been killed"
    resumed = _run(launcher, tmp_path, data, env, counts="resumed")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    start = summary["first_epoch"] * STEPS + summary["first_step"]
    per_call = summary["steps_per_execution"] if KERAS3 else 1
    assert start == max(s for s in _saves(per_call) if s < kill_at), "resumed from the last checkpoint before the kill"
    assert summary["weights_sha256_by_rank"] == straight[source][0]["weights_sha256_by_rank"]
    # the steps that count: the killed run's up to the checkpoint, then the resumed run's
    counted = _trained(tmp_path / "killed", upto=start)
    assert max(_trained(tmp_path / "killed")) >= kill_at
    later = _trained(tmp_path / "resumed")
    assert min(later) == start + 1
    counted.update(later)
    _once_per_epoch(counted)
    assert counted == straight[source][1], "the same samples at the same steps as the uninterrupted run"


@pytest.mark.stacks  # the gate's job on the second stack: it trains, checkpoints and resumes
def test_an_epoch_of_187_steps_runs_10_steps_per_call_and_resumes_bit_identical_inside_its_shorter_last_call(tmp_path):
    """187 steps an epoch (11 x 17: no count from 2 to 10 divides it) at the default 10 steps per call:
    18 calls of 10 and a last one of 7, on both Keras generations. A worker killed inside epoch 1's last,
    shorter call (step 185) resumes from the save at step 150, runs the epoch's rest (3 calls of 10 and
    one of 7) and ends with the uninterrupted run's weights, bit for bit, each sample trained on once
    per epoch."""
    steps, every, epochs = 187, 50, 2
    n = steps * BATCH * WORKERS
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, 9)).astype(np.float32)
    x[:, 0] = np.arange(n) / 1024
    np.savez(tmp_path / "ids.npz", x=x, y=(x[:, 1] > 0).astype(np.int64))
    flags = list(_flags(f"npz:{tmp_path / 'ids.npz'}"))
    flags[flags.index("--epochs") + 1], flags[flags.index("--checkpoint-every-steps") + 1] = str(epochs), str(every)

    def job(out, counts, kill_at=None):
        return _run("gloo", out, None, {}, kill_at=kill_at, counts=counts, flags=flags)

    assert job(tmp_path / "straight", "counts").returncode == 0
    straight = json.loads((tmp_path / "straight" / "summary.json").read_text())
    assert "10 step(s) per call" in (tmp_path / "straight" / "logs" / "rank0.log").read_text()
    killed = job(tmp_path / "two", "killed", kill_at=185)
    assert killed.returncode != 0, "the worker should have been killed"
    resumed = job(tmp_path / "two", "resumed")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    per_call = 10 if KERAS3 else 1
    assert (summary["first_epoch"], summary["first_step"]) == (0, 150) == \
        (0, max(s for s in _saves(per_call, steps, every, epochs) if s < 185))
    assert summary["weights_sha256_by_rank"] == straight["weights_sha256_by_rank"]
    counted = _trained(tmp_path / "two" / "killed", upto=150)
    counted.update(_trained(tmp_path / "two" / "resumed"))
    whole = _trained(tmp_path / "straight" / "counts")
    assert counted == whole and len(whole) == epochs * steps, "the same samples at the same steps, uninterrupted"
    for epoch in range(epochs):
        ids = [i for s in range(epoch * steps + 1, (epoch + 1) * steps + 1) for i in whole[s]]
        assert sorted(ids) == list(range(n))


@pytest.mark.full
def test_a_resume_that_cannot_be_replayed_says_why_and_what_to_change(tmp_path):
    """A keras-io pipeline (.shuffle().batch(), reshuffled every epoch) and a model with Dropout: the
    resumed epoch restarts, and the log names both causes and the remedy."""
    flags = ("--model", "user_models:dropout_mlp", "--data", "user_data:digits_batched", "--epochs", "1",
             "--checkpoint-every-steps", "5", "--keep-checkpoints", "10")
    train(1, None, tmp_path / "a", *flags)
    assert ("checkpoints inside an epoch: a resume cannot continue user_data:digits_batched where it stopped, "
            "because it reshuffles every epoch") in (tmp_path / "a" / "logs" / "rank0.log").read_text()
    proc = launch(1, None, ["-m", "hvdtrain", "--output-dir", str(tmp_path / "b"), *flags,
                            "--resume", str(tmp_path / "a" / "checkpoints" / "ckpt-0-step-10")])
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "resuming: dropout draws new random numbers after a restart" in proc.stdout
    assert ("cannot continue at step 11, because it reshuffles every epoch" in proc.stdout and
            "give reshuffle_each_iteration=False" in proc.stdout and "restarts from its first step" in proc.stdout)
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["first_step"] == 0


@pytest.mark.full
def test_checkpoint_every_minutes_saves_inside_epochs_at_steps_every_rank_agrees_on(sources, tmp_path):
    """Rank 0 turns the minutes into a step count and tells the others: a save inside an epoch gathers
    every rank's BatchNorm state, so a rank saving at another step would hang the job, not pass."""
    data, env = sources["arrays"]
    flags = [f if f != "--checkpoint-every-steps" else "--checkpoint-every-minutes" for f in _flags(data)]
    flags[flags.index("--checkpoint-every-minutes") + 1] = "0.001"  # 60 ms: a save every few steps
    flags[flags.index("--keep-checkpoints") + 1] = "1000"
    argv = ["-m", "hvdtrain", "--output-dir", str(tmp_path), "--no-tensorboard", *flags]
    proc = launch(WORKERS, "gloo", argv, env={**env, "COUNT_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-3000:]
    index = "\n".join(l for l in (tmp_path / "checkpoints" / "checkpoint").read_text().splitlines()
                      if l.startswith("all_model_checkpoint_paths"))
    inside = [int(e) * STEPS + int(s) for e, s in re.findall(r'"ckpt-(\d+)-step-(\d+)"', index)]
    assert inside and all(0 < s % STEPS for s in inside), index
    assert min(inside) > 20  # the first 20 steps only measure how long a step takes
    assert [f"ckpt-{e}" for e in range(1, EPOCHS + 1)] == re.findall(r'"(ckpt-\d+)"', index)


@pytest.mark.stacks  # Keras 2's: run by the second stack's pass
@pytest.mark.skipif(KERAS3, reason="Keras 3's CallbackList converts every call's logs to Python numbers "
                    "for every callback, whatever the callbacks take")
@pytest.mark.parametrize("flag", [{"checkpoint_every_steps": 1000}, {"checkpoint_every_minutes": 5.0}])
def test_the_step_checkpoint_hook_takes_the_step_logs_as_tensors_no_host_sync_per_step(flag):
    """Keras converts every step's logs to numpy (a host sync per step) when one of the callbacks with
    a batch hook does not take tensors. hvdtrain's hook takes them, so a callback after it that takes
    tensors still gets tensors, as Keras' fit would hand them over."""
    import tensorflow as tf

    from hvdtrain import callbacks, config

    cfg = config.Config(**flag)
    epoch_end, progress = callbacks.make(cfg, None, 2, True)
    saver = callbacks.checkpoints(cfg, None, 100, 0, 0)
    seen = []

    class TakesTensors(tf.keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self._supports_tf_logs = True

        def on_train_batch_end(self, batch, logs=None):
            seen.append(logs["loss"])

    hooks = tf.keras.callbacks.CallbackList([epoch_end, saver, progress, TakesTensors()], add_history=True)
    saver.on_epoch_begin(0)
    hooks.on_train_batch_end(0, {"loss": tf.constant(1.0)})
    assert len(seen) == 1 and tf.is_tensor(seen[0])
