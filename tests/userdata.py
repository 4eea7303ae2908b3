"""A user's own model and data, plugged in as module:function (tests put this folder on PYTHONPATH)."""
import os

import numpy as np
import tensorflow as tf


def tiny_model(input_shape, num_classes):
    return tf.keras.Sequential([tf.keras.layers.Input(input_shape), tf.keras.layers.Flatten(),
                                tf.keras.layers.Dense(num_classes)], name="tiny")


def blobs():
    """Two Gaussian blobs: an unbatched tf.data pipeline with a validation split."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 512)
    x = (rng.standard_normal((512, 4)) + y[:, None] * 3).astype(np.float32)
    return (tf.data.Dataset.from_tensor_slices((x[:448], y[:448])),
            tf.data.Dataset.from_tensor_slices((x[448:], y[448:])))


def fails_on_rank_1():
    """Like a file that exists on one host only: set-up fails on one rank and not the others."""
    if os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK")) == "1":
        raise FileNotFoundError("/data/shard-1.tfrecord")
    return blobs()


def nan_on_rank_1():
    """Sample 1 is NaN: with --no-shuffle it lands in rank 1's first batch and nowhere else."""
    x = np.random.default_rng(0).standard_normal((256, 4)).astype(np.float32)
    x[1] = np.nan
    return tf.data.Dataset.from_tensor_slices((x, np.zeros(256, np.int64) + (x[:, 0] > 0)))



def hangs_on_rank_1(input_shape, num_classes):
    """A model whose forward pass blocks on rank 1 from its 4th step on: a worker stuck in I/O."""
    import time

    stuck = _rank() == "1"
    calls = [0]

    def forward(x):
        calls[0] += 1
        if stuck and calls[0] > 3:
            time.sleep(3600)
        return x

    return _tiny_calling(forward, input_shape, num_classes, "hangs")


def _tiny_calling(forward, input_shape, num_classes, name):
    """tiny_model with a Python function in its forward pass (a blocking read, a slow compile)."""
    def python(x):
        y = tf.py_function(forward, [x], x.dtype)
        y.set_shape(x.shape)
        return y

    return tf.keras.Sequential([tf.keras.layers.Input(input_shape), tf.keras.layers.Lambda(python),
                                tf.keras.layers.Flatten(), tf.keras.layers.Dense(num_classes)], name=name)


def stop_at_a_plateau():
    """--callbacks: Keras' EarlyStopping on the training loss, which improves by no 100 in an epoch."""
    return [tf.keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=100.0)]


def signal_self():
    """--callbacks: SIGNAL_AT=train_begin|epoch_end sends SIGTERM to this worker (on rank SIGNAL_RANK,
    default 1) at that point of epoch 1, as a scheduler's signal could land there; the epoch_end one
    lands just before that epoch's checkpoint is written."""
    import signal

    at, rank = os.environ.get("SIGNAL_AT"), os.environ.get("SIGNAL_RANK", "1")
    mine = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == rank

    class SignalSelf(tf.keras.callbacks.Callback):
        epoch = 0

        def hit(self, where):
            if at == where and mine and self.epoch == 0:
                os.kill(os.getpid(), signal.SIGTERM)

        def on_train_begin(self, logs=None):
            self.hit("train_begin")

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_epoch_end(self, epoch, logs=None):
            self.hit("epoch_end")

    return [SignalSelf()]


def blobs_signalling_in_validation():
    """blobs, whose validation pipeline sends SIGTERM to this worker (rank SIGNAL_RANK) as the first
    validation reads its first element, when SIGNAL_AT=validation."""
    import signal

    train, val = blobs()
    at, rank = os.environ.get("SIGNAL_AT"), os.environ.get("SIGNAL_RANK", "1")
    mine = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == rank
    sent = []

    def maybe_signal(x):
        if at == "validation" and mine and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
        return x

    def element(x, y):
        x = tf.numpy_function(maybe_signal, [x], tf.float32)
        x.set_shape([4])
        return x, y

    return train, val.map(element)


def blobs_validation_of_unknown_size():
    """blobs, whose validation set is filtered: tf.data cannot tell its size without reading it."""
    train, val = blobs()
    return train, val.filter(lambda x, y: True)


def _rank() -> str:
    return os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))


def blobs_blocking_on_rank_1():
    """blobs, whose input pipeline blocks for an hour on rank 1 in epoch 2 (a read from a dead mount),
    while its process and its other threads go on."""
    import time

    train, val = blobs()
    stuck, reads = _rank() == "1", [0]

    def read(x):
        reads[0] += 1
        if stuck and reads[0] > 448 + 100:  # every rank maps all 448 elements an epoch, then takes its shard
            time.sleep(3600)
        return x

    def element(x, y):
        x = tf.numpy_function(read, [x], tf.float32)
        x.set_shape([4])
        return x, y

    return train.map(element), val


def slow_first_step_on_rank_0(input_shape, num_classes):
    """tiny_model, whose first forward pass takes SLOW_FIRST_STEP seconds on rank 0 alone (a long trace
    or XLA compile there), while rank 1 reaches the allreduce and waits."""
    import time

    calls = [0]

    def forward(x):
        calls[0] += 1
        if _rank() == "0" and calls[0] == 1:
            time.sleep(float(os.environ.get("SLOW_FIRST_STEP", "8")))
        return x

    return _tiny_calling(forward, input_shape, num_classes, "slow_first")
