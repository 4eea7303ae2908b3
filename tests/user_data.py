"""Users' own data pipelines, written as users write them: scikit-learn's bundled data sets, tf.data,
their own TFRecord schema, Keras' image_dataset_from_directory. Handed to hvdtrain as
--data user_data:NAME (the tests put this folder on PYTHONPATH); paths come from the environment."""
import glob
import os

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_breast_cancer, load_diabetes, load_digits


def _split(x, y, n_val, seed=0):
    order = np.random.default_rng(seed).permutation(len(x))
    val, train = order[:n_val], order[n_val:]
    return (tf.data.Dataset.from_tensor_slices((x[train], y[train])),
            tf.data.Dataset.from_tensor_slices((x[val], y[val])))


def diabetes():
    """442 patients, ten standardized features, a float target (disease progression)."""
    x, y = load_diabetes(return_X_y=True)
    return _split(x.astype(np.float32), ((y - y.mean()) / y.std()).astype(np.float32), 89)


def diabetes_features_only():
    """The diabetes features without their target, as a user who forgets to return it writes it."""
    x, _ = load_diabetes(return_X_y=True)
    return tf.data.Dataset.from_tensor_slices(x.astype(np.float32))


def diabetes_val_of_8_features():
    """Validation data cut to 8 of the 10 features the model takes, as a user's slip writes it."""
    train, val = diabetes()
    return train, val.map(lambda x, y: (x[:8], y))


def breast_cancer():
    x, y = load_breast_cancer(return_X_y=True)
    x = ((x - x.mean(0)) / x.std(0)).astype(np.float32)
    return _split(x, y.astype(np.float32), 113)


def digits_onehot():
    """keras.io's MNIST convnet feeds one-hot labels (keras.utils.to_categorical)."""
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[..., None]
    return _split(x, tf.keras.utils.to_categorical(d.target, 10), 359)


def digits():
    d = load_digits()
    return _split((d.images / 16.0).astype(np.float32)[..., None], d.target.astype(np.int64), 359)


def digits_odd_val():
    """An odd number of validation examples (301), for the exact-validation test."""
    d = load_digits()
    return _split((d.images / 16.0).astype(np.float32)[..., None], d.target.astype(np.int64), 301)


def digits_rgb32():
    """Digits as 32x32 RGB images, for keras.applications models."""
    d = load_digits()
    x = np.repeat(np.kron(d.images / 16.0, np.ones((4, 4)))[..., None], 3, axis=-1).astype(np.float32)
    return _split(x[:1200], d.target[:1200].astype(np.int64), 240)


def structured():
    """A dict of named features, as keras.io's dataframe_to_dataset makes."""
    data = load_breast_cancer()
    names = ["mean radius", "mean texture", "mean smoothness", "worst area"]
    cols = [list(data.feature_names).index(n) for n in names]
    features = {n.replace(" ", "_"): data.data[:, c:c + 1].astype(np.float32) for n, c in zip(names, cols)}
    labels = data.target.astype(np.float32)
    ds = tf.data.Dataset.from_tensor_slices((features, labels))
    return ds.skip(113), ds.take(113)


def digits_batched():
    """A pipeline that batches itself, as most tf.data tutorials end: .shuffle().batch(64)."""
    train, val = digits()
    return train.shuffle(2000, seed=1).batch(64), val.batch(64)


def digits_repeat():
    """An infinite pipeline: .repeat() before batching."""
    train, _ = digits()
    return train.shuffle(2000, seed=1).repeat().batch(32)


def digits_generator():
    """Python generator data through tf.data.Dataset.from_generator."""
    d = load_digits()
    x, y = (d.images / 16.0).astype(np.float32)[..., None], d.target.astype(np.int64)

    def gen():
        for i in range(1400):
            yield x[i], y[i]

    return tf.data.Dataset.from_generator(
        gen, output_signature=(tf.TensorSpec((8, 8, 1), tf.float32), tf.TensorSpec((), tf.int64)))


def digits_single():
    """One data set, no validation part: --val-split holds one out."""
    return digits()[0]


def empty():
    return tf.data.Dataset.from_tensor_slices((np.zeros((0, 4), np.float32), np.zeros(0, np.int64)))


# ---------------------------------------------------------------- the user's own TFRecords

def write_records(folder, files, per_file):
    """TFRecords in the user's own schema: an id, 64 float pixels, a label; `files` files."""
    d = load_digits()
    n = 0
    os.makedirs(folder, exist_ok=True)
    for f in range(files):
        with tf.io.TFRecordWriter(os.path.join(folder, f"part-{f:03d}.tfrecord")) as w:
            for _ in range(per_file):
                i = n % len(d.target)
                ex = tf.train.Example(features=tf.train.Features(feature={
                    "record_id": tf.train.Feature(int64_list=tf.train.Int64List(value=[n])),
                    "pixels": tf.train.Feature(float_list=tf.train.FloatList(value=(d.data[i] / 16.0).tolist())),
                    "digit": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(d.target[i])])),
                }))
                w.write(ex.SerializeToString())
                n += 1
    return n


SCHEMA = {"record_id": tf.io.FixedLenFeature([], tf.int64),
          "pixels": tf.io.FixedLenFeature([64], tf.float32),
          "digit": tf.io.FixedLenFeature([], tf.int64)}


def _note_read(record_id):
    """Append every parsed record's id to this process's file: the test's read counter."""
    def note(ids):
        with open(os.path.join(os.environ["READ_LOG_DIR"], f"reads-{os.getpid()}.txt"), "a") as fh:
            fh.write(f"{int(ids)}\n")
        return ids
    return tf.py_function(note, [record_id], tf.int64)


def parse(record):
    ex = tf.io.parse_single_example(record, SCHEMA)
    record_id = ex["record_id"]
    if os.environ.get("READ_LOG_DIR"):
        record_id = _note_read(record_id)
    with tf.control_dependencies([record_id]):
        pixels = tf.reshape(ex["pixels"], (8, 8, 1))
    return pixels, ex["digit"]


def records():
    """The usual file pipeline: list the files, interleave the readers, parse."""
    files = tf.data.Dataset.list_files(os.path.join(os.environ["RECORDS"], "*.tfrecord"), shuffle=False)
    return files.interleave(tf.data.TFRecordDataset, cycle_length=4).map(parse)


def records_batched():
    """The same pipeline as a user finishes it: shuffled and batched (by 50)."""
    return records().shuffle(1000).batch(50)


def records_sharded(ctx):
    """The same pipeline, sharded by the user: tf.distribute's InputContext style."""
    files = sorted(glob.glob(os.path.join(os.environ["RECORDS"], "*.tfrecord")))
    files = files[ctx.input_pipeline_id::ctx.num_input_pipelines]
    ds = tf.data.TFRecordDataset(files).map(parse)
    return ds.shuffle(1000, seed=ctx.seed).batch(ctx.get_per_replica_batch_size(ctx.global_batch_size))


def images():
    """Keras' image_dataset_from_directory with its defaults (batch 32, 256x256, shuffled)."""
    return tf.keras.utils.image_dataset_from_directory(os.environ["IMAGES"])


def _digits_with(labels):
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[..., None]
    order = np.random.default_rng(0).permutation(len(x))
    val, train = order[:359], order[359:]
    make = lambda idx: tf.data.Dataset.from_tensor_slices((x[idx], tf.nest.map_structure(lambda a: a[idx], labels(d.target))))
    return make(train), make(val)


def digits_two_heads():
    """(image, {"digit": 0-9, "odd": 0/1}) for a two-output model."""
    return _digits_with(lambda t: {"digit": t.astype(np.int64), "odd": (t % 2).astype(np.float32)})


def digits_multi_label():
    """k-hot targets: odd, at least 5, a multiple of 3."""
    return _digits_with(lambda t: np.stack([t % 2 == 1, t >= 5, t % 3 == 0], axis=1).astype(np.float32))


def csv_files():
    """The TF guide's CSV loading: make_csv_dataset over the user's files (batched; finite with num_epochs=1)."""
    return tf.data.experimental.make_csv_dataset(os.path.join(os.environ["CSV"], "*.csv"), batch_size=32,
                                                 label_name="digit", column_defaults=[0.0] * 64 + [0],
                                                 num_epochs=1, shuffle=False) \
        .map(lambda features, label: (tf.reshape(tf.stack(list(features.values()), axis=-1), (-1, 8, 8, 1)), label))


def write_csv(folder, files):
    d = load_digits()
    os.makedirs(folder, exist_ok=True)
    header = ",".join([f"p{i:02d}" for i in range(64)] + ["digit"])
    for f in range(files):
        rows = [",".join(f"{v / 16:.4g}" for v in d.data[i]) + f",{d.target[i]}" for i in range(f, len(d.target), files)]
        with open(os.path.join(folder, f"part-{f}.csv"), "w") as fh:
            fh.write(header + "\n" + "\n".join(rows) + "\n")


def id_records():
    """hvdtrain-format TFRecords ($ID_RECORDS), read and parsed by the user's own pipeline, in order."""
    files = sorted(glob.glob(os.environ["ID_RECORDS"]))
    spec = {"x": tf.io.FixedLenFeature([], tf.string), "y": tf.io.FixedLenFeature([], tf.int64)}

    def parse(record):
        ex = tf.io.parse_single_example(record, spec)
        x = tf.io.parse_tensor(ex["x"], tf.float32)
        x.set_shape([9])
        return x, ex["y"]
    return tf.data.TFRecordDataset(files).map(parse, num_parallel_calls=tf.data.AUTOTUNE)


def reviews():
    """keras.io "Text classification from scratch", in miniature: raw strings and a 0/1 label, as
    (train, val); the words of each class are equally frequent, so a vocabulary's order rests on ties."""
    rng = np.random.default_rng(0)
    pos, neg, filler = "great loved superb fun".split(), "awful hated dull poor".split(), "the film was a".split()
    texts, labels = [], []
    for i in range(800):
        words = filler + (pos if i % 2 else neg)
        texts.append(" ".join(rng.choice(words, rng.integers(6, 20))))
        labels.append(i % 2)
    ds = tf.data.Dataset.from_tensor_slices((texts, np.array(labels, np.int64)))
    return ds.take(640), ds.skip(640)


def breast_cancer_weighted():
    """breast_cancer with each training sample weighted by its class (x, y, weight): 3 for malignant
    (0), 0.5 for benign (1), as a user weighs the rare class without Keras' class_weight."""
    train, val = breast_cancer()
    return train.map(lambda x, y: (x, y, tf.gather([3.0, 0.5], tf.cast(y, tf.int32)))), val
