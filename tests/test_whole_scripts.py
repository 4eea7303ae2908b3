"""The user's whole training script, keras.io-style, at 2 workers beside the same script in plain Keras:
several fit() calls on one model (transfer learning, then fine-tuning), Keras callbacks, Sequence data."""
import json
import re
import shutil

import numpy as np
import pytest
from jobs import KERAS3, error_lines, launch, run_worker_script, train

# The second stack's pass (marker `stacks`) runs one script per habit: two phases, the keras.io script
# (its callbacks), a Sequence, a second fit; the kill-and-relaunch variants and the callbacks script
# (the keras.io script's callbacks, and a per-batch one) run on the default stack


def max_diff(a: str, b: str) -> float:
    x, y = np.load(a), np.load(b)
    assert len(x.files) == len(y.files) > 0
    return max(float(np.abs(x[k] - y[k]).max()) for k in x.files)


@pytest.fixture(scope="module")
def plain_two_phases(tmp_path_factory):
    return run_worker_script(1, None, "transfer_learning.py", "plain", tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def two_phases(tmp_path_factory):
    out = tmp_path_factory.mktemp("ours")
    return {**run_worker_script(2, "gloo", "transfer_learning.py", "hvdtrain", out), "out": out}


@pytest.mark.full
@pytest.mark.stacks
def test_fine_tuning_after_transfer_learning_trains_at_its_own_compiled_lr_as_plain_keras(
        plain_two_phases, two_phases):
    """Phase 2 recompiles with Adam(1e-4): it trains at 2e-4 (two workers), not phase 1's 2e-3, and
    both phases together end where plain Keras ends on the global batch."""
    assert two_phases["phase1"] == pytest.approx([2e-3] * 3) and two_phases["phase2"] == pytest.approx([2e-4] * 3)
    assert max_diff(two_phases["weights"], plain_two_phases["weights"]) < 1e-5
    phase2 = json.loads((two_phases["out"] / "fit-2" / "summary.json").read_text())
    assert phase2["optimizer"]["lr_scaled"] == pytest.approx(2e-4) and phase2["epochs_run"] == 3
    assert json.loads((two_phases["out"] / "summary.json").read_text())["optimizer"]["lr_scaled"] == \
        pytest.approx(2e-3)


@pytest.mark.full
def test_fine_tuning_in_its_own_output_dir_ends_with_the_same_weights(two_phases, tmp_path):
    ours = run_worker_script(2, "gloo", "transfer_learning.py", "hvdtrain", tmp_path / "one", tmp_path / "two")
    assert max_diff(ours["weights"], two_phases["weights"]) == 0
    assert (tmp_path / "two" / "summary.json").exists() and not (tmp_path / "one" / "fit-2").exists()


@pytest.mark.full
@pytest.mark.parametrize("kill,launcher", [("phase1", "gloo"), pytest.param("between", "mpirun", marks=pytest.mark.stacks),
                                         ("phase2", "gloo")])
def test_a_two_phase_script_killed_and_relaunched_ends_with_the_uninterrupted_weights(kill, launcher, two_phases,
                                                                                      tmp_path):
    """SIGKILL on every rank inside phase 1, between the phases, or inside phase 2; the same command
    again finishes the job: a finished phase gives its final state back to the model, an interrupted
    one resumes from its checkpoint. The weights are those of the uninterrupted script, bit for bit."""
    script = ["tests/workers/transfer_learning.py", "hvdtrain", str(tmp_path)]
    killed = launch(2, launcher, script, env={"KILL": kill})
    assert killed.returncode != 0 and "RESULT" not in killed.stdout, killed.stdout[-3000:]
    again = launch(2, launcher, script)
    assert again.returncode == 0, again.stdout[-3000:]
    assert ("already trained to epoch 3 of 3" in again.stdout) == (kill != "phase1")
    assert max_diff(str(tmp_path / "weights.npz"), two_phases["weights"]) == 0


@pytest.mark.full
def test_a_second_script_on_the_first_phases_output_dir_is_told_it_is_another_phase(two_phases, tmp_path):
    """Phase 2 as a script of its own, run on phase 1's finished output dir: not "nothing to do" (the
    base would never be fine-tuned), but one error naming what differs and what to do."""
    shutil.copytree(two_phases["out"] / "checkpoints", tmp_path / "checkpoints")
    shutil.copy(two_phases["out"] / "summary.json", tmp_path / "summary.json")
    proc = launch(2, "gloo", ["tests/workers/transfer_learning.py", "hvdtrain", str(tmp_path)],
                  env={"SECOND_SCRIPT": "1"})
    assert proc.returncode != 0
    ours = error_lines(proc.stdout)
    assert len(ours) == 1 and not re.search(r"^\[\d\]<std(err|out)>:Traceback", proc.stdout, re.M), proc.stdout[-3000:]
    assert "was trained with 2 trainable weights where this model has 6" in ours[0]
    assert "another phase of training? Each hvdtrain.fit of one script on the same output_dir trains in its own " \
           "fit-N sub-directory" in ours[0]
    assert "nothing to do" not in proc.stdout


# ---------------------------------------------------------------- callbacks

@pytest.fixture(scope="module")
def with_callbacks(tmp_path_factory):
    plain_dir, our_dir = tmp_path_factory.mktemp("plain"), tmp_path_factory.mktemp("ours")
    plain = run_worker_script(1, None, "callbacks_script.py", "plain", plain_dir)
    ours = run_worker_script(2, "gloo", "callbacks_script.py", "hvdtrain", our_dir)
    return plain, ours, plain_dir, our_dir


@pytest.mark.full
def test_reduce_lr_on_plateau_changes_the_rate_that_trains_as_in_plain_keras(with_callbacks):
    """ReduceLROnPlateau halves the rate after epochs 2 and 3 on both; hvdtrain's per-step rate
    follows it, so the weights end as plain Keras' on the global batch; summary.json's history
    has the rate each epoch ran at."""
    plain, ours, _, _ = with_callbacks
    assert plain["rates"] == pytest.approx([0.1, 0.1, 0.05, 0.025]) and ours["rates"] == pytest.approx(plain["rates"])
    assert ours["lr"] == pytest.approx(plain["lr"])
    assert ours["val_loss"] == pytest.approx(plain["val_loss"], rel=1e-5)
    assert max_diff(ours["weights"], plain["weights"]) < 1e-5


@pytest.mark.full
def test_a_per_batch_callback_sees_every_batch(with_callbacks):
    plain, ours, _, _ = with_callbacks
    assert plain["batches"] == ours["batches"] == 4 * 20  # hvdtrain's rank 0: its own 20 steps an epoch


@pytest.mark.full
def test_file_writing_callbacks_write_once_from_rank_0(with_callbacks):
    """CSVLogger: one file, every epoch once; ModelCheckpoint(save_best_only): the same epochs' files
    as plain Keras; the user's own writer marked hvdtrain.on_rank0: a line per epoch, not two."""
    _, _, plain_dir, our_dir = with_callbacks
    rows = (our_dir / "log.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["0", "1", "2", "3"]
    assert sorted(p.name for p in our_dir.glob("best-*.weights.h5")) == \
        sorted(p.name for p in plain_dir.glob("best-*.weights.h5"))
    assert [l.split()[0] for l in (our_dir / "epochs.txt").read_text().splitlines()] == ["1", "2", "3", "4"]


@pytest.mark.stacks
def test_backup_and_restore_is_refused_with_what_hvdtrain_does_instead():
    import hvdtrain
    import tensorflow as tf
    from hvdtrain.config import UserError

    with pytest.raises(UserError, match="BackupAndRestore is what hvdtrain does itself"):
        hvdtrain.fit("mlp", "digits", epochs=1, callbacks=[tf.keras.callbacks.BackupAndRestore("/tmp/unused")])



@pytest.mark.full
def test_callbacks_from_the_command_line_decide_alike_on_every_rank(out):
    """--callbacks module:function: EarlyStopping stops both ranks at the same epoch (a rank going on
    alone would hang in its allreduce)."""
    summary = train(2, "mpi", out, "--callbacks", "userdata:stop_at_a_plateau", "--epochs", "6")
    assert summary["epochs_run"] == 2 and len(set(summary["weights_sha256_by_rank"])) == 1


@pytest.mark.full(stack="second")
@pytest.mark.stacks
def test_the_keras_io_script_with_rank_0_only_callbacks_trains_as_in_plain_keras(tmp_path):
    """keras.io's script as users write it: ModelCheckpoint and CSVLogger (rank 0 alone runs them; the
    checkpoint has batch hooks, for save_freq) and no per-batch callback of the user's on the other rank.
    Every rank decides the steps per call from all of the callbacks alike: the job trains, stops at
    plain Keras' epoch with its learning-rate reductions, rank 0 writes one best.keras (plain Keras
    loads it) and one log.csv, and both ranks end with the same weights."""
    plain = run_worker_script(1, None, "keras_io_script.py", "plain", tmp_path / "plain")
    ours = run_worker_script(2, "gloo", "keras_io_script.py", "hvdtrain", tmp_path / "ours", timeout=150)
    assert ours["epochs"] == plain["epochs"] < 60  # EarlyStopping stopped both at the same epoch
    assert ours["rates"] == pytest.approx(plain["rates"]) and min(plain["rates"]) < plain["rates"][0]
    assert ours["val_loss"] == pytest.approx(plain["val_loss"], rel=1e-4)
    assert max_diff(str(tmp_path / "ours" / "weights-0.npz"), str(tmp_path / "ours" / "weights-1.npz")) == 0
    assert max_diff(str(tmp_path / "ours" / "weights-0.npz"), str(tmp_path / "plain" / "weights-0.npz")) < 1e-4
    assert sorted(p.name for p in (tmp_path / "ours").rglob("best.keras")) == ["best.keras"]
    rows = (tmp_path / "ours" / "log.csv").read_text().splitlines()
    assert len(rows) == 1 + ours["epochs"] and len(list((tmp_path / "ours").rglob("log.csv"))) == 1
    if KERAS3:
        import keras
    else:
        from tensorflow import keras
    best = keras.models.load_model(tmp_path / "ours" / "best.keras")
    assert type(best.optimizer).__name__ == "Adam"


# ---------------------------------------------------------------- a keras.utils.Sequence

@pytest.mark.full
@pytest.mark.stacks
def test_a_sequence_gives_each_worker_its_own_batches_and_ends_its_epochs_as_in_plain_keras(tmp_path):
    """2 workers x batches of 32 by index equal plain Keras' batches of 64 from the same Sequence,
    which reshuffles its samples in on_epoch_end: the weights match only if every batch is taken by
    the right worker and on_epoch_end runs when Keras' fit runs it."""
    plain = run_worker_script(1, None, "sequence_script.py", "plain", tmp_path / "plain")
    ours = run_worker_script(2, "gloo", "sequence_script.py", "hvdtrain", tmp_path / "ours")
    assert ours["epochs_ended"] == plain["epochs_ended"] >= 3
    assert ours["val_accuracy"] == pytest.approx(plain["val_accuracy"], abs=1e-6)
    assert max_diff(ours["weights"], plain["weights"]) < 1e-5
    summary = json.loads((tmp_path / "ours" / "summary.json").read_text())
    assert summary["data"]["sharding"] == "batch" and summary["steps_per_epoch"] == 20


@pytest.mark.full
def test_a_shuffled_sequence_killed_inside_an_epoch_resumes_to_the_same_weights(tmp_path):
    """hvdtrain's seeded order of a Sequence's batches, and the Sequence's own reshuffling in
    on_epoch_end, come back after a crash: killed at step 8 of epoch 2 (a step checkpoint at 5), the
    same command resumes at step 6 and ends with the uninterrupted run's weights, bit for bit."""
    script = ["tests/workers/sequence_script.py", "hvdtrain"]
    proc = launch(2, "gloo", [*script, str(tmp_path / "whole")], env={"SHUFFLE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:]
    killed = launch(2, "gloo", [*script, str(tmp_path / "killed")], env={"SHUFFLE": "1", "KILL": "1"})
    assert killed.returncode != 0 and "RESULT" not in killed.stdout
    again = launch(2, "gloo", [*script, str(tmp_path / "killed")], env={"SHUFFLE": "1"})
    assert again.returncode == 0, again.stdout[-3000:]
    assert re.search(r"resumed from \S+ckpt-1-step-5 at epoch 1, step 5", again.stdout), again.stdout[-3000:]
    assert max_diff(str(tmp_path / "killed" / "weights.npz"), str(tmp_path / "whole" / "weights.npz")) == 0


# ---------------------------------------------------------------- num_classes

@pytest.mark.full
def test_counting_num_classes_is_said_with_its_time_and_num_classes_skips_it(tmp_path):
    """A model function that takes num_classes costs one pass over the labels: one line says so, with
    its time; --num-classes gives it instead (here to a regression builder that declares it)."""
    counted = launch(1, None, ["-m", "hvdtrain", "--model", "userdata:tiny_model", "--data", "userdata:blobs",
                               "--epochs", "1", "--output-dir", str(tmp_path / "a"), "--verbose", "0"])
    assert counted.returncode == 0, counted.stdout[-3000:]
    assert re.search(r"num_classes for --model userdata:tiny_model: 2, counted in one pass over the data "
                     r"\(\d+\.\d s\); --num-classes 2 \(hvdtrain.fit: num_classes=2\) skips it", counted.stdout)
    given = launch(1, None, ["-m", "hvdtrain", "--model", "user_models:regression_with_classes", "--data",
                             "user_data:diabetes", "--num-classes", "1", "--epochs", "1",
                             "--output-dir", str(tmp_path / "b"), "--verbose", "0"])
    assert given.returncode == 0, given.stdout[-3000:]
    assert "counted in one pass" not in given.stdout


@pytest.mark.full
def test_validation_of_unknown_size_is_read_to_its_end_without_a_running_out_warning(tmp_path):
    """Keras 3 warns "Your input ran out of data; interrupting training" when evaluate reads a set of
    unknown size to its end, which is what validation does: not a fault of the user's data."""
    proc = launch(1, None, ["-m", "hvdtrain", "--model", "userdata:tiny_model", "--data",
                            "userdata:blobs_validation_of_unknown_size", "--epochs", "3", "--lr", "0.05", "--output-dir",
                            str(tmp_path), "--verbose", "0"])
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["metrics"]["val_accuracy"] > 0.9
    assert "ran out of data" not in proc.stdout


@pytest.mark.full
@pytest.mark.stacks
def test_a_second_fit_without_adasum_runs_the_models_own_step_again(tmp_path):
    """Keras 2's Adasum replaces Keras' step with one through Horovod's DistributedGradientTape; the
    next fit() of the same model, without --reduction adasum, wraps the model's own step again."""
    r = run_worker_script(1, None, "second_fit_step.py", tmp_path)
    assert r["first"] == ("train_step" if KERAS3 else "_adasum")  # Keras 3: the optimizer reduces
    assert r["second"] == "train_step" and r["own"]
