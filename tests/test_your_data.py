"""Your own data pipeline, read once and sharded at the source: your TFRecord schema, a pre-batched
pipeline, image_dataset_from_directory, repeat(), from_generator, --val-split, exact validation
metrics; at 2 workers under horovodrun and mpirun. (Dict features: test_your_model.py.)"""
import json
import os
from collections import Counter

import numpy as np
import pytest

from jobs import error_lines, launch, train

# The user data contract. The second stack's pass (marker `stacks`) runs the inputs Keras 2 adapts
# otherwise (a pre-batched and a repeating pipeline); reading and sharding are TensorFlow's, the same on both

SGD_MODEL = ("--model", "user_models:sgd_momentum")  # takes (8, 8, 1) digits; needs no num_classes


def _records(tmp_path, files, per_file):
    import user_data

    folder = tmp_path / f"records-{files}"
    user_data.write_records(str(folder), files, per_file)
    return str(folder)


def _job(np_, launcher, out, *flags, env=None):
    proc = launch(np_, launcher, ["-m", "hvdtrain", "--output-dir", str(out), "--verbose", "0",
                                  "--no-tensorboard", *flags], env=env)
    return proc


def _summary(out):
    return json.loads((out / "summary.json").read_text())


def _errors(proc):
    return error_lines(proc.stdout)


@pytest.mark.full
def test_own_tfrecord_schema_is_sharded_by_file_and_each_record_read_once_per_epoch(tmp_path):
    reads = tmp_path / "reads"
    reads.mkdir()
    env = {"RECORDS": _records(tmp_path, 8, 250), "READ_LOG_DIR": str(reads)}
    proc = _job(2, "gloo", tmp_path / "run", *SGD_MODEL, "--data", "user_data:records", "--epochs", "2",
                "--batch-size", "50", env=env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    s = _summary(tmp_path / "run")
    assert s["data"]["sharding"] == "file" and s["data"]["samples"] == 2000 and s["steps_per_epoch"] == 20
    per_process = [Counter(int(l) for l in f.read_text().split()) for f in reads.iterdir()]
    assert len(per_process) == 2
    assert not set(per_process[0]) & set(per_process[1])  # each worker parses only its own files
    total = per_process[0] + per_process[1]
    assert set(total) == set(range(2000)) and set(total.values()) == {2}  # once per epoch, 2 epochs


@pytest.mark.full
def test_a_shuffled_and_batched_file_pipeline_is_parsed_only_by_training(tmp_path):
    """list_files -> interleave -> map(parse) -> shuffle -> batch: neither the shard's probe nor its
    count runs the parse, so each record is parsed once per epoch and no more."""
    reads = tmp_path / "reads"
    reads.mkdir()
    env = {"RECORDS": _records(tmp_path, 8, 250), "READ_LOG_DIR": str(reads)}
    proc = _job(2, "gloo", tmp_path / "run", *SGD_MODEL, "--data", "user_data:records_batched", "--epochs", "2",
                env=env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    s = _summary(tmp_path / "run")
    assert s["data"]["sharding"] == "file" and s["steps_per_epoch"] == 20
    total = sum((Counter(int(l) for l in f.read_text().split()) for f in reads.iterdir()), Counter())
    assert set(total) == set(range(2000)) and set(total.values()) == {2}  # once per epoch, 2 epochs


@pytest.mark.full
def test_fewer_files_than_workers_falls_back_to_element_sharding_and_says_so(tmp_path):
    env = {"RECORDS": _records(tmp_path, 1, 600)}
    proc = _job(2, "mpirun", tmp_path / "run", *SGD_MODEL, "--data", "user_data:records", "--epochs", "1",
                env=env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "reads fewer files than the 2 workers: sharded by element instead" in proc.stdout
    assert ", sharded by element: " in proc.stdout and "sharded by batch" not in proc.stdout
    s = _summary(tmp_path / "run")
    assert s["data"]["sharding"] == "element" and s["steps_per_epoch"] == 600 // 2 // 32


@pytest.mark.full
def test_batched_csv_files_whose_reader_cannot_be_sharded_by_file_are_sharded_by_batch_and_say_so_once(tmp_path):
    """The note and the training line name the same unit: a batched pipeline's elements are batches."""
    import user_data

    user_data.write_csv(str(tmp_path / "csv"), 4)
    proc = _job(2, "gloo", tmp_path / "run", *SGD_MODEL, "--data", "user_data:csv_files", "--epochs", "1",
                env={"CSV": str(tmp_path / "csv")})
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "its reader (CSVDataset) cannot be sharded by file by TensorFlow: sharded by batch instead" in proc.stdout
    assert ", sharded by batch: " in proc.stdout and "sharded by element" not in proc.stdout
    assert "tf_auto_shard failed" not in proc.stdout  # TensorFlow's rewrite is not asked, so it dumps nothing
    s = _summary(tmp_path / "run")
    assert s["data"]["sharding"] == "batch" and s["steps_per_epoch"] == 1797 // 32 // 2


@pytest.mark.full
def test_a_data_function_taking_a_context_shards_and_batches_itself(tmp_path):
    env = {"RECORDS": _records(tmp_path, 4, 200)}
    proc = _job(2, "gloo", tmp_path / "run", *SGD_MODEL, "--data", "user_data:records_sharded",
                "--epochs", "2", "--batch-size", "25", env=env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    s = _summary(tmp_path / "run")
    assert s["data"]["sharding"] == "yours" and s["batch_size_per_worker"] == 25
    assert s["steps_per_epoch"] == 400 // 25 and len(set(s["weights_sha256_by_rank"])) == 1


@pytest.mark.full
@pytest.mark.stacks
def test_a_pre_batched_pipeline_is_taken_as_per_worker_batches(out):
    proc = _job(2, "mpirun", out, *SGD_MODEL, "--data", "user_data:digits_batched", "--epochs", "3",
                "--batch-size", "32")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "is batched by 64 per worker, so that is the batch size; --batch-size 32 is not used" in proc.stdout
    s = _summary(out)
    # 1438 training digits in 23 batches of 64: 12 and 11 per worker, so 11 steps, 1 batch noted as left out
    assert s["batch_size_per_worker"] == 64 and s["steps_per_epoch"] == 11 and s["data"]["sharding"] == "batch"
    assert "batches left out of each epoch: rank 0: 1" in proc.stdout
    assert s["metrics"]["val_accuracy"] > 0.85


def _write_pngs(folder, per_class=40):
    """Three classes of 24x24 PNGs: red, green and blue squares with noise."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    for c, name in enumerate(("red", "green", "blue")):
        (folder / name).mkdir(parents=True)
        for i in range(per_class):
            img = rng.integers(0, 60, (24, 24, 3)).astype(np.uint8)
            img[4:20, 4:20, c] = 200 + rng.integers(0, 55)
            tf.io.write_file(str(folder / name / f"{i}.png"), tf.io.encode_png(img))


@pytest.mark.full
def test_image_dataset_from_directory_with_its_defaults(tmp_path):
    _write_pngs(tmp_path / "images")
    proc = _job(2, "gloo", tmp_path / "run", "--model", "user_models:image_classifier", "--data",
                "user_data:images", "--epochs", "6", env={"IMAGES": str(tmp_path / "images")})
    assert proc.returncode == 0, proc.stdout[-3000:]
    s = _summary(tmp_path / "run")
    # 120 images in batches of 32 (its default): 4 batches, 2 per worker
    assert s["batch_size_per_worker"] == 32 and s["steps_per_epoch"] == 2 and s["data"]["sharding"] == "batch"
    assert s["metrics"]["accuracy"] > 0.9 and len(set(s["weights_sha256_by_rank"])) == 1


@pytest.mark.full
@pytest.mark.stacks
def test_a_repeating_pipeline_trains_with_steps_per_epoch_and_is_a_clear_error_without(tmp_path):
    proc = _job(2, "mpirun", tmp_path / "no", *SGD_MODEL, "--data", "user_data:digits_repeat")
    assert proc.returncode != 0 and len(_errors(proc)) == 1
    assert "is infinite (it repeats): give --steps-per-epoch N" in _errors(proc)[0]
    proc = _job(2, "mpirun", tmp_path / "yes", *SGD_MODEL, "--data", "user_data:digits_repeat",
                "--steps-per-epoch", "12", "--epochs", "3")
    assert proc.returncode == 0, proc.stdout[-3000:]
    s = _summary(tmp_path / "yes")
    assert s["steps_per_epoch"] == 12 and s["epochs_run"] == 3 and s["metrics"]["accuracy"] > 0.7


@pytest.mark.full
def test_a_generator_pipeline_is_counted_on_each_shard_and_trains(out):
    s = train(2, "gloo", out, *SGD_MODEL, "--data", "user_data:digits_generator", "--epochs", "3")
    assert s["data"] == {"sharding": "element", "samples": 1400, "validation": False}
    assert s["steps_per_epoch"] == 700 // 32 and s["metrics"]["accuracy"] > 0.85


@pytest.mark.full
def test_val_split_holds_out_part_of_a_single_dataset(out):
    proc = _job(2, "mpirun", out, *SGD_MODEL, "--data", "user_data:digits_single", "--val-split", "0.25",
                "--epochs", "3", "--early-stopping-patience", "2")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "validation: 0.25 of user_data:digits_single held out by position (--val-split)" in proc.stdout
    s = _summary(out)
    # 1438 elements: floor(1438 x 0.25) = 359 held out, 1079 left to train on
    assert s["data"]["samples"] == 1079 and s["data"]["validation"] and s["metrics"]["val_accuracy"] > 0.85


@pytest.mark.full
def test_early_stopping_on_validation_without_validation_data_is_a_clear_error(tmp_path):
    proc = _job(2, "gloo", tmp_path, *SGD_MODEL, "--data", "user_data:digits_single",
                "--early-stopping-patience", "2")
    assert proc.returncode != 0 and len(_errors(proc)) == 1
    assert "watches val_loss, but there is no validation data" in _errors(proc)[0]


@pytest.mark.full
def test_validation_metrics_equal_a_one_worker_evaluation_of_the_same_weights(out):
    """301 validation digits over 2 workers (151 and 150): the metrics of all of them, exactly."""
    import tensorflow as tf
    import user_data

    s = train(2, "mpirun", out, *SGD_MODEL, "--data", "user_data:digits_odd_val", "--epochs", "2")
    model = tf.keras.models.load_model(out / "model.keras")
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    one = model.evaluate(user_data.digits_odd_val()[1].batch(32), verbose=0, return_dict=True)
    assert one["loss"] == pytest.approx(s["metrics"]["val_loss"], rel=1e-6, abs=1e-6)
    assert one["accuracy"] == pytest.approx(s["metrics"]["val_accuracy"], abs=1e-6)
    assert round(one["accuracy"] * 301) == pytest.approx(one["accuracy"] * 301, abs=1e-3)


@pytest.mark.full
def test_an_empty_dataset_is_a_clear_error(tmp_path):
    proc = _job(2, "gloo", tmp_path, "--model", "user_models:regression", "--data", "user_data:empty")
    assert proc.returncode != 0 and len(_errors(proc)) == 1
    assert "user_data:empty: the data set is empty" in _errors(proc)[0]


@pytest.mark.full
def test_val_split_of_a_file_pipeline_says_it_shards_by_element_without_tensorflows_error(tmp_path):
    """--val-split numbers the elements (enumerate), which TensorFlow's by-file rewrite cannot walk:
    one line says so, instead of the rewrite's 100-line grappler error on every rank."""
    env = {"RECORDS": _records(tmp_path, 4, 150)}
    proc = _job(2, "gloo", tmp_path / "run", *SGD_MODEL, "--data", "user_data:records", "--epochs", "1",
                "--val-split", "0.2", env=env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "it numbers its elements (enumerate, as --val-split does)" in proc.stdout
    assert "tf_auto_shard failed" not in proc.stdout
    assert _summary(tmp_path / "run")["data"] == {"sharding": "element", "samples": 480, "validation": True}


@pytest.mark.stacks
def test_data_objects_are_named_by_what_they_hold_in_the_output_dir_and_the_log():
    """hvdtrain.fit(model, (train, val)) writes runs/<model>-dataset, and (x, y) runs/<model>-arrays:
    the name shows in the log and the summary, where 'tuple' said nothing."""
    import tensorflow as tf
    from hvdtrain import config, train

    ds = tf.data.Dataset.range(4)
    assert train._label(ds) == train._label((ds, ds)) == train._label([ds, None]) == "dataset"
    assert train._label((np.zeros((4, 2)), np.zeros(4))) == "arrays"
    assert config.Config(model="mlp", data=train._label((ds, ds))).run_dir == os.path.join("runs", "mlp-dataset")


@pytest.mark.stacks
def test_checkpoints_of_a_data_pair_named_tuple_before_still_resume(tmp_path):
    import hvdtrain.checkpoint as ckpt
    from hvdtrain import config

    def saved_with(data):
        (tmp_path / ckpt.META).write_text(json.dumps({"config": config.Config(model="m", data=data).to_dict()}))
        return str(tmp_path / "ckpt-3")

    ckpt.check_same_job(config.Config(model="m", data="dataset"), saved_with("tuple"))
    ckpt.check_same_job(config.Config(model="m", data="arrays"), saved_with("tuple"))
    with pytest.raises(config.UserError, match="data: 'tuple' there, 'synthetic' now"):
        ckpt.check_same_job(config.Config(model="m", data="synthetic"), saved_with("tuple"))
    with pytest.raises(config.UserError, match="data: 'dataset' there, 'arrays' now"):
        ckpt.check_same_job(config.Config(model="m", data="arrays"), saved_with("dataset"))
