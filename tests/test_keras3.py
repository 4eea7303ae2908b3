"""Keras 3 code, written as keras.io writes it (`import keras`, `keras.ops`, a custom train_step that
calls `optimizer.apply`), trained data-parallel with real processes on the Keras 3 stack. Skipped on
the Keras 2 stack; the rest of the suite runs on both."""
import numpy as np
import pytest

from jobs import KERAS3, run_worker_script, train

pytestmark = [pytest.mark.stacks, pytest.mark.skipif(not KERAS3, reason="the Keras 2 stack")]

SGD_DIGITS = ("--data", "digits", "--warmup-epochs", "0", "--epochs", "2", "--steps-per-epoch", "6",
              "--seed", "7", "--val-split", "0")


def _weights(path):
    import keras3_models

    model = keras3_models.custom_step()
    model.load_weights(path)
    return model.get_weights()


@pytest.mark.full
def test_a_custom_train_step_calling_optimizer_apply_averages_over_workers(tmp_path):
    """keras.io's Keras 3 train_step hands its gradients to optimizer.apply: at 2 workers x 16 it
    trains exactly as 1 worker x 32 at the scaled learning rate, and not as the unscaled one."""
    flags = ("--model", "keras3_models:custom_step", *SGD_DIGITS)
    two = train(2, "gloo", tmp_path / "two", *flags, "--batch-size", "16", "--lr", "0.05")
    train(1, None, tmp_path / "one", *flags, "--batch-size", "32", "--lr", "0.1")
    train(1, None, tmp_path / "unscaled", *flags, "--batch-size", "32", "--lr", "0.05")
    assert len(set(two["weights_sha256_by_rank"])) == 1
    weights = {run: _weights(tmp_path / run / "model.weights.h5") for run in ("two", "one", "unscaled")}

    def max_diff(a, b):
        return max(float(np.abs(x - y).max()) for x, y in zip(weights[a], weights[b]))

    assert max_diff("two", "one") < 1e-5
    assert max_diff("two", "unscaled") > 1e-3


@pytest.mark.parametrize("launcher", ["gloo", pytest.param("mpirun", marks=pytest.mark.full)])
def test_a_keras3_script_through_hvdtrain_fit_ends_with_plain_keras_weights(launcher, tmp_path):
    """The same script, once as plain single-process Keras on the global batch, once through
    hvdtrain.init()/fit() on 2 workers: the same weights, and model.optimizer is still the user's."""
    plain = run_worker_script(1, None, "keras3_script.py", "plain", tmp_path / "plain")
    ours = run_worker_script(2, launcher, "keras3_script.py", "hvdtrain", tmp_path)
    plain_w, our_w = (np.load(r["weights"]) for r in (plain, ours))
    diff = max(float(np.abs(plain_w[k] - our_w[k]).max()) for k in plain_w.files)
    assert len(plain_w.files) == 4 and diff < 1e-5, diff
    assert ours["optimizer"] == "DistributedSGD" and plain["optimizer"] == "SGD"
    import keras

    saved = keras.models.load_model(tmp_path / "model.keras")
    assert type(saved.optimizer).__name__ == "SGD" and int(saved.optimizer.iterations.numpy()) == 60


@pytest.mark.full
def test_batchnorm_convnet_ends_identical_on_every_rank_and_model_keras_evaluates(tmp_path):
    """A keras.io convnet with BatchNormalization: moving statistics averaged at epoch ends, so both
    ranks save the same model; model.keras loads with plain Keras and evaluates."""
    summary = train(2, "mpi", tmp_path, "--model", "keras3_models:convnet", "--data", "digits", "--epochs", "3")
    assert len(set(summary["weights_sha256_by_rank"])) == 1
    assert summary["metrics"]["val_accuracy"] > 0.3  # it learns (chance: 0.1)
    import keras

    model = keras.models.load_model(tmp_path / "model.keras")
    assert type(model.optimizer).__name__ == "Adam"
    assert model.optimizer.iterations.numpy() == 3 * summary["steps_per_epoch"]


@pytest.mark.full
def test_sparse_embedding_gradients_fp16_compression_and_groups_keep_ranks_identical(tmp_path):
    """An Embedding's gradient is an IndexedSlices: Horovod's allgather path (or --sparse-as-dense);
    fp16 compression and grouped allreduces go through the same Horovod function."""
    for i, extra in enumerate([(), ("--sparse-as-dense", "--compression", "fp16", "--allreduce-groups", "2")]):
        summary = train(2, "gloo", tmp_path / str(i), "--model", "keras3_models:embedding_bag",
                        "--data", "keras3_models:tokens", "--epochs", "2", *extra)
        assert len(set(summary["weights_sha256_by_rank"])) == 1, extra
