"""Re-runs a user can trust: a finished run is left alone, more epochs continue it, a new world size
says so, nothing is overwritten by less; and errors that name their real cause."""
import hashlib
import json
import re
import textwrap

import pytest

from jobs import error_lines, launch, ROOT, train

FAST = ("--model", "mlp", "--data", "digits", "--steps-per-epoch", "4")


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _outputs(run_dir):
    return {name: _digest(run_dir / name) for name in ("summary.json", "model.keras", "best.weights.h5")}


def _hvdtrain(np_, launcher, run_dir, *flags, env=None):
    return launch(np_, launcher, ["-m", "hvdtrain", "--output-dir", str(run_dir), "--no-tensorboard", *flags],
                  timeout=240, env=env)


@pytest.mark.full
def test_a_finished_run_is_left_alone_and_more_epochs_continue_it(tmp_path):
    first = train(1, None, tmp_path, *FAST, "--epochs", "2")
    before = _outputs(tmp_path)
    again = _hvdtrain(1, None, tmp_path, *FAST, "--epochs", "2")
    assert again.returncode == 0, again.stdout[-3000:]
    assert (f"already trained to epoch 2 of 2 in {tmp_path}: nothing to do; --epochs N (hvdtrain.fit: epochs=N) "
            f"trains further; --no-auto-resume (auto_resume=False) or another --output-dir starts over") in again.stdout
    assert "samples/s" not in again.stdout and "resumed" not in again.stdout  # nothing trained
    assert _outputs(tmp_path) == before
    more = train(1, None, tmp_path, *FAST, "--epochs", "3")
    assert (more["first_epoch"], more["epochs_run"], more["last_epoch"]) == (2, 1, 3)
    assert first["last_epoch"] == 2


def test_a_resume_with_more_workers_says_so_and_scales_the_learning_rate(tmp_path):
    one = train(1, None, tmp_path, *FAST, "--epochs", "1", "--lr", "0.001")
    assert one["optimizer"]["lr_scaled"] == pytest.approx(0.001)
    proc = _hvdtrain(2, "gloo", tmp_path, *FAST, "--epochs", "2", "--lr", "0.001", "--verbose", "2")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "resuming a run of 1 workers with 2: the learning rate is scaled for 2 workers" in proc.stdout
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["world_size"] == 2 and s["first_epoch"] == 1
    assert s["optimizer"]["lr_scaled"] == pytest.approx(0.002)


@pytest.mark.full
def test_no_run_replaces_results_with_ones_that_cover_fewer_epochs(tmp_path):
    train(1, None, tmp_path, *FAST, "--epochs", "3")
    full = _digest(tmp_path / "summary.json")
    # resume from the first epoch's checkpoint and stop at 2: results for fewer epochs than are there
    short = train(1, None, tmp_path, *FAST, "--epochs", "2", "--resume", str(tmp_path / "checkpoints" / "ckpt-1"))
    assert short["last_epoch"] == 2
    kept = list((tmp_path / "previous").glob("*/summary.json"))
    assert len(kept) == 1 and _digest(kept[0]) == full
    assert json.loads(kept[0].read_text())["last_epoch"] == 3
    # starting afresh in a used output dir keeps the previous run too
    fresh = _hvdtrain(1, None, tmp_path, *FAST, "--epochs", "1", "--no-auto-resume")
    assert fresh.returncode == 0 and "the previous run's summary.json" in fresh.stdout
    assert len(list((tmp_path / "previous").glob("*/summary.json"))) == 2


@pytest.mark.full
@pytest.mark.parametrize("launcher", ["gloo", "mpi", "mpirun"])
def test_a_loss_that_does_not_fit_the_labels_is_one_line_naming_the_op_not_lost_peers(launcher, tmp_path):
    """A binary model (2 logits) on 10-class labels: the failure is in every worker's own step, said as
    plain Keras says it (whichever op of the step would have met the label first)."""
    proc = _hvdtrain(2, launcher, tmp_path, "--model", "user_models:two_classes", "--data", "digits",
                     "--epochs", "1", "--verbose", "0")
    assert proc.returncode != 0
    lines = error_lines(proc.stdout)
    assert len(lines) == 1, proc.stdout[-4000:]
    assert re.search(r"at epoch 1, step 1: InvalidArgumentError: Received a label value of [2-9] which is outside "
                     r"the valid range of \[0, 2\): the model's output has 2 classes", lines[0]), lines[0]
    assert "traceback in " in lines[0]
    assert "lost its peers" not in proc.stdout
    log = re.search(r"traceback in (\S+?\.log)", lines[0]).group(1)
    assert "Traceback" in open(log).read()


@pytest.mark.full
def test_an_edited_model_names_the_variables_that_differ_and_the_remedy(tmp_path):
    module = tmp_path / "mine.py"
    model = textwrap.dedent("""
        import tensorflow as tf
        def model(input_shape, num_classes):
            return tf.keras.Sequential([tf.keras.layers.Input(input_shape), tf.keras.layers.Flatten(),
                                        tf.keras.layers.Dense({width}, name="hidden"),
                                        tf.keras.layers.Dense(num_classes, name="out")])
    """)
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}:{tmp_path}"}
    module.write_text(model.format(width=16))
    flags = ("--model", "mine:model", "--data", "digits", "--steps-per-epoch", "4", "--verbose", "0")
    assert _hvdtrain(1, None, tmp_path / "run", *flags, "--epochs", "1", env=env).returncode == 0
    module.write_text(model.format(width=32))
    proc = _hvdtrain(1, None, tmp_path / "run", *flags, "--epochs", "2", env=env)
    assert proc.returncode == 2
    error = error_lines(proc.stdout)
    assert len(error) == 1, proc.stdout[-3000:]
    assert "was written by a different model (edited since?)" in error[0]
    assert "hidden/kernel is (64, 16) there, (64, 32) here" in error[0]
    assert "--no-auto-resume starts over" in error[0] and "another --output-dir" in error[0]
