"""Keras 3 code as keras.io writes it today: `import keras`, `keras.ops`, a `keras.Model` subclass with
its own train_step that calls `self.optimizer.apply`. Handed to hvdtrain as --model keras3_models:NAME
or through hvdtrain.fit (the tests put this folder on PYTHONPATH); imported only on the Keras 3 stack."""
import keras
import tensorflow as tf
from keras import layers, ops


class CustomModel(keras.Model):
    """keras.io "Customizing what happens in fit() with TensorFlow" (Keras 3): the step computes the
    gradients itself and hands them to self.optimizer.apply."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class Standardize(layers.Layer):
    """A layer of the user's own, written with keras.ops (backend-agnostic Keras 3 code)."""

    def call(self, x):
        mean = ops.mean(x, axis=-1, keepdims=True)
        return (x - mean) / (ops.std(x, axis=-1, keepdims=True) + 1e-6)


def custom_step(lr=0.05):
    """Digits (8x8x1), SGD: a subclassed functional model with its own train_step."""
    inputs = keras.Input(shape=(8, 8, 1))
    x = Standardize()(layers.Flatten()(inputs))
    x = layers.Dense(32, activation="relu")(x)
    model = CustomModel(inputs, layers.Dense(10)(x), name="custom_step")
    model.compile(optimizer=keras.optimizers.SGD(lr), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def convnet(input_shape, num_classes):
    """keras.io "Simple MNIST convnet" in Keras 3, sized for scikit-learn's 8x8 digits, with
    BatchNormalization (averaged over workers at epoch ends)."""
    model = keras.Sequential([
        keras.Input(shape=input_shape),
        layers.Conv2D(16, kernel_size=(3, 3), activation="relu"),
        layers.BatchNormalization(),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Flatten(),
        layers.Dense(num_classes, activation="softmax"),
    ], name="keras3_convnet")
    model.compile(loss="sparse_categorical_crossentropy", optimizer=keras.optimizers.Adam(1e-3),
                  metrics=["accuracy"])
    return model


def embedding_bag():
    """Token ids through an Embedding: its gradient is sparse (tf.IndexedSlices) on TensorFlow."""
    inputs = keras.Input(shape=(12,), dtype="int32")
    x = layers.Embedding(500, 8)(inputs)
    x = layers.GlobalAveragePooling1D()(x)
    model = keras.Model(inputs, layers.Dense(2)(x), name="embedding_bag")
    model.compile(optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def tokens():
    """Sequences of 12 token ids; the class is whether ids below 250 outnumber the others."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.integers(0, 500, size=(1024, 12)).astype("int32")
    y = ((x < 250).sum(axis=1) > 6).astype("int64")
    pairs = tf.data.Dataset.from_tensor_slices((x, y))
    return pairs.take(896), pairs.skip(896)
