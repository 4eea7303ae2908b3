"""A user's own Keras model on a built-in data source: a small CNN on scikit-learn's digits.

    python -m hvdtrain --config examples/small_cnn.yaml
"""
import tensorflow as tf


def model(input_shape, num_classes):
    inputs = tf.keras.Input(input_shape)
    x = tf.keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    x = tf.keras.layers.Flatten()(x)
    x = tf.keras.layers.Dense(64, activation="relu")(x)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(num_classes)(x), name="small_cnn")
