"""A user's own model and data set, plugged into hvdtrain without changing either.

    python -m hvdtrain --config examples/text_classifier.yaml
    horovodrun -np 2 -H localhost:2 python -m hvdtrain --config examples/text_classifier.yaml

The model has an Embedding layer, whose gradient is sparse (tf.IndexedSlices): the YAML turns on
sparse_as_dense so Horovod allreduces it as a dense tensor, usually faster than an allgather.
"""
import numpy as np
import tensorflow as tf

VOCAB, LENGTH = 500, 20


def model(input_shape, num_classes):
    """--model examples.text_classifier:model (called with the data's input shape and classes)."""
    tokens = tf.keras.Input(input_shape, dtype="int32")
    x = tf.keras.layers.Embedding(VOCAB, 16)(tokens)
    x = tf.keras.layers.GlobalAveragePooling1D()(x)
    return tf.keras.Model(tokens, tf.keras.layers.Dense(num_classes)(x), name="text_classifier")


def dataset():
    """--data examples.text_classifier:dataset: unbatched (tokens, label), plus a validation split.

    A toy task with a real signal: the label says whether tokens from the upper half of the vocabulary
    are the majority of the sentence.
    """
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, (3000, LENGTH)).astype(np.int32)
    y = ((x >= VOCAB // 2).sum(axis=1) > LENGTH // 2).astype(np.int64)
    train = tf.data.Dataset.from_tensor_slices((x[:2400], y[:2400]))
    val = tf.data.Dataset.from_tensor_slices((x[2400:], y[2400:]))
    return train, val
