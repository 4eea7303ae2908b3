"""A user's own model and tf.data pipeline, plugged in as module:function."""
import pytest

from jobs import train


@pytest.mark.full
def test_user_model_and_dataset_train_at_two_workers(out):
    summary = train(2, "gloo", out, "--model", "userdata:tiny_model", "--data", "userdata:blobs",
                    "--epochs", "3", "--batch-size", "16", "--lr", "0.05")
    assert summary["steps_per_epoch"] == 448 // 2 // 16
    assert summary["metrics"]["val_accuracy"] > 0.9  # the blobs are 3 standard deviations apart
    assert len(set(summary["weights_sha256_by_rank"])) == 1
