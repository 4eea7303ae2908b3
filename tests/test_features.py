"""Training features at 1 and 2 workers: checkpoints and resume, accumulation, compression, Adasum,
clipping, mixed precision, schedules, Horovod knobs, determinism, NaN handling, early stopping.

The runs that need no process of their own train in one job per launcher, one after another
(tests/workers/many_fits.py), each in its own output dir."""
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest

from jobs import ROOT, error_lines, launch, start, train

FAST = ("--model", "mlp", "--data", "digits", "--steps-per-epoch", "6")
EXACT = FAST + ("--optimizer", "sgd", "--warmup-epochs", "0", "--seed", "3")
# the same, as hvdtrain.fit's keys
FAST_KEYS = dict(model="mlp", data="digits", steps_per_epoch=6)
EXACT_KEYS = dict(FAST_KEYS, optimizer="sgd", warmup_epochs=0, seed=3)
RUNS = {
    "gloo": {
        "acc": dict(EXACT_KEYS, epochs=1, steps_per_epoch=12, batch_size=8, backward_passes_per_step=2, lr=0.05),
        "clip-two": dict(EXACT_KEYS, clip_norm=0.05, epochs=1, batch_size=16, lr=0.5),
        "fp16-compression": dict(model="mlp", data="digits", epochs=4, compression="fp16"),
        "mixed_float16": dict(FAST_KEYS, epochs=3, precision="mixed_float16"),
        "mixed_bfloat16": dict(FAST_KEYS, epochs=3, precision="mixed_bfloat16"),
        "step": dict(FAST_KEYS, epochs=5, lr=0.01, warmup_epochs=1, lr_schedule="step", lr_decay_epochs=[2, 4],
                     lr_decay_factor=0.5),
        "early-stopping": dict(FAST_KEYS, epochs=20, lr=1e-9, monitor="val_accuracy", early_stopping_patience=1),
    },
    "mpi": {
        "adasum": dict(model="mlp", data="digits", epochs=4, reduction="adasum"),
        "grouped": dict(EXACT_KEYS, epochs=2, allreduce_groups=3),
        "fused": dict(EXACT_KEYS, epochs=2),
    },
    None: {  # one worker, plain python
        "acc-big": dict(EXACT_KEYS, epochs=1, steps_per_epoch=6, batch_size=32, lr=0.2),
        "clip-one": dict(EXACT_KEYS, clip_norm=0.05, epochs=1, batch_size=32, lr=1.0),
        "clip-free": dict(EXACT_KEYS, epochs=1, batch_size=32, lr=1.0),
        "cosine": dict(FAST_KEYS, epochs=4, lr=0.01, lr_schedule="cosine"),
    },
}


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    """Every run of RUNS, one job per launcher: {run: its output dir}."""
    done = {}
    for launcher, runs in RUNS.items():
        base = tmp_path_factory.mktemp(f"fits-{launcher}")
        (base / "spec.json").write_text(json.dumps({str(base / name): keys for name, keys in runs.items()}))
        proc = launch(2 if launcher else 1, launcher,
                      [str(ROOT / "tests" / "workers" / "many_fits.py"), str(base / "spec.json")], timeout=900)
        assert proc.returncode == 0, proc.stdout[-4000:]
        done.update({name: base / name for name in runs})
    return done


def _summary(fits, name) -> dict:
    return json.loads((fits[name] / "summary.json").read_text())


def _weights(path):
    import tensorflow as tf

    return tf.keras.models.load_model(path / "model.keras").get_weights()


def _max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(_weights(a), _weights(b)))


# ---------------------------------------------------------------- checkpoints

@pytest.mark.full
def test_killed_and_resumed_run_ends_with_the_weights_of_an_uninterrupted_run(tmp_path):
    flags = FAST + ("--epochs", "10")
    straight = train(2, "mpirun", tmp_path / "straight", *flags)
    run_dir = tmp_path / "killed"
    proc = start(2, "mpirun", ["-m", "hvdtrain", "--output-dir", str(run_dir), *flags],
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    index = run_dir / "checkpoints" / "checkpoint"
    deadline = time.monotonic() + 120
    while not index.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole job, launcher and workers, mid-training
    proc.wait()
    resumed = train(2, "mpirun", run_dir, *flags)
    assert 1 <= resumed["first_epoch"] < 10, "the kill should land before the last epoch"
    assert resumed["weights_sha256_by_rank"] == straight["weights_sha256_by_rank"]


@pytest.mark.full
def test_only_the_last_k_checkpoints_are_kept_and_resume_path_restarts_from_one(tmp_path):
    train(1, None, tmp_path / "a", *FAST, "--epochs", "4", "--keep-checkpoints", "2")
    ckpts = sorted(p.name for p in (tmp_path / "a" / "checkpoints").glob("ckpt-*.index"))
    assert ckpts == ["ckpt-3.index", "ckpt-4.index"]
    meta = json.loads((tmp_path / "a" / "checkpoints" / "config.json").read_text())
    assert meta["epoch"] == 4 and meta["config"]["keep_checkpoints"] == 2
    again = train(2, "gloo", tmp_path / "b", *FAST, "--epochs", "5",
                  "--resume", str(tmp_path / "a" / "checkpoints" / "ckpt-3"))
    assert again["first_epoch"] == 3 and again["epochs_run"] == 2


# ---------------------------------------------------------------- gradients

def test_accumulating_two_passes_on_two_workers_equals_one_worker_with_four_times_the_batch(fits):
    assert _max_diff(fits["acc"], fits["acc-big"]) < 1e-5


def test_clipping_applies_to_the_averaged_gradient(fits):
    assert _max_diff(fits["clip-two"], fits["clip-one"]) < 1e-5
    assert _max_diff(fits["clip-one"], fits["clip-free"]) > 1e-3  # the clip was active


@pytest.mark.parametrize("run", ["fp16-compression", "adasum"])
def test_compression_and_adasum_train_and_keep_ranks_identical(run, fits):
    s = _summary(fits, run)
    assert len(set(s["weights_sha256_by_rank"])) == 1
    assert s["metrics"]["val_accuracy"] > 0.85


def test_grouped_allreduce_gives_the_weights_of_the_ungrouped_one(fits):
    """Groups change when each gradient is sent, not what is summed: two ranks' average is exact."""
    grouped = _summary(fits, "grouped")
    assert grouped["config"]["allreduce_groups"] == 3 and len(set(grouped["weights_sha256_by_rank"])) == 1
    assert _max_diff(fits["grouped"], fits["fused"]) == 0.0


@pytest.mark.full
def test_sparse_embedding_gradients_allreduced_as_dense_in_the_example(out):
    s = train(2, "gloo", out, "--config", "examples/text_classifier.yaml")
    assert s["config"]["sparse_as_dense"] is True and len(set(s["weights_sha256_by_rank"])) == 1
    assert s["metrics"]["val_accuracy"] > 0.85


@pytest.mark.parametrize("precision, loss_scaling", [("mixed_float16", True), ("mixed_bfloat16", False)])
def test_mixed_precision_trains_with_loss_scaling_where_needed(precision, loss_scaling, fits):
    s, out = _summary(fits, precision), fits[precision]
    assert s["precision"] == {"policy": precision, "loss_scaling": loss_scaling}
    assert len(set(s["weights_sha256_by_rank"])) == 1 and np.isfinite(s["metrics"]["loss"])
    import tensorflow as tf

    saved = tf.keras.models.load_model(out / "model.keras").optimizer  # compiled as it trained
    assert isinstance(saved, tf.keras.mixed_precision.LossScaleOptimizer) == loss_scaling


# ---------------------------------------------------------------- schedules and knobs

def test_step_schedule_multiplies_the_scaled_lr_at_each_milestone(fits):
    assert _summary(fits, "step")["metrics"]["lr"] == pytest.approx(0.01 * 2 * 0.25, rel=1e-5)


def test_cosine_schedule_decays_to_almost_zero(fits):
    assert _summary(fits, "cosine")["metrics"]["lr"] < 0.01 * 0.05


@pytest.mark.full
def test_timeline_is_written_by_rank0_as_a_chrome_trace_and_gloo_says_it_has_no_stall_check(tmp_path):
    timeline = tmp_path / "timeline.json"
    proc = launch(2, "gloo", ["-m", "hvdtrain", "--output-dir", str(tmp_path / "run"), "--verbose", "0",
                              "--no-tensorboard",
                              *FAST, "--epochs", "1", "--horovod-timeline", str(timeline),
                              "--fusion-threshold-mb", "32", "--cycle-time-ms", "2",
                              "--stall-check-seconds", "30"])
    assert proc.returncode == 0, proc.stdout[-3000:]
    text = timeline.read_text()
    assert text.startswith("[") and "ALLREDUCE" in text
    assert "Horovod's stall check does not report under the Gloo controller" in proc.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["runtime_env"]["HOROVOD_CYCLE_TIME"] == "2.0"  # the flag wins over hvdtrain's default
    assert "Horovod cycle 2.0 ms (set: --cycle-time-ms" in (tmp_path / "run" / "logs" / "rank1.log").read_text()


@pytest.mark.full
def test_same_seed_gives_bit_identical_weights_twice(tmp_path):
    a = train(2, "gloo", tmp_path / "a", *FAST, "--epochs", "2", "--seed", "5")
    b = train(2, "gloo", tmp_path / "b", *FAST, "--epochs", "2", "--seed", "5")
    c = train(2, "gloo", tmp_path / "c", *FAST, "--epochs", "2", "--seed", "6")
    assert a["weights_sha256_by_rank"] == b["weights_sha256_by_rank"]
    assert a["weights_sha256_by_rank"] != c["weights_sha256_by_rank"]


# ---------------------------------------------------------------- stopping

@pytest.mark.full
@pytest.mark.parametrize("launcher", ["gloo", "mpirun"])
def test_nan_loss_on_one_worker_stops_every_worker_at_the_same_step(launcher, tmp_path):
    # a linear model: oneDNN's fused Dense+ReLU turns a NaN input into 0, which would hide the NaN
    proc = launch(2, launcher, ["-m", "hvdtrain", "--data", "userdata:nan_on_rank_1", "--no-shuffle",
                                "--model", "userdata:tiny_model",
                                "--batch-size", "8", "--output-dir", str(tmp_path)], timeout=120)
    assert proc.returncode != 0
    ours = error_lines(proc.stdout)
    assert len(ours) == 1 and "NaN or infinite at epoch 1, step 1" in ours[0], proc.stdout[-3000:]


def test_early_stopping_decides_on_averaged_metrics_and_keeps_the_best_weights(fits):
    s = _summary(fits, "early-stopping")
    assert s["epochs_run"] == 2  # no improvement after the first epoch: stop after 1 more
    assert (fits["early-stopping"] / "best.weights.h5").is_file()


@pytest.mark.full
def test_examples_run_from_their_yaml(out):
    s = train(2, "gloo", out, "--config", "examples/small_cnn.yaml")
    assert s["config"]["model"] == "examples.small_cnn:model" and s["metrics"]["val_accuracy"] > 0.9


@pytest.mark.full
def test_a_checkpoint_of_another_model_is_refused_not_half_restored(tmp_path):
    train(1, None, tmp_path, *FAST, "--epochs", "1")
    proc = launch(1, None, ["-m", "hvdtrain", "--output-dir", str(tmp_path), "--model", "cnn",
                            "--data", "digits", "--epochs", "2"], timeout=120)
    assert proc.returncode == 2
    assert "belongs to a different job (model: 'mlp' there, 'cnn' now)" in proc.stdout
