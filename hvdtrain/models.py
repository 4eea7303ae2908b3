"""Models by name, or a user's own `module:function(input_shape, num_classes) -> tf.keras.Model`.

All return logits; the trainer uses a from_logits loss. None uses dropout, so data-parallel runs at
different worker counts can be compared weight for weight.
"""
from __future__ import annotations

from .config import UserError
from .data import resolve


def build(name: str, input_shape: tuple, num_classes: int):
    import tensorflow as tf

    builders = {"mlp": _mlp, "cnn": _cnn, "resnet50": _resnet50}
    if name in builders:
        return builders[name](tuple(input_shape), num_classes)
    model = resolve(name, "--model")(tuple(input_shape), num_classes)
    if not isinstance(model, tf.keras.Model):
        raise UserError(f"--model {name}: expected a tf.keras.Model, got {type(model).__name__}")
    return model


def _mlp(shape, classes):
    from tensorflow.keras import layers, Sequential

    return Sequential([layers.Input(shape), layers.Flatten(), layers.Dense(128, activation="relu"),
                       layers.Dense(64, activation="relu"), layers.Dense(classes)], name="mlp")


def _cnn(shape, classes):
    from tensorflow.keras import layers, Sequential

    if len(shape) == 2:
        shape = (*shape, 1)
        head = [layers.Input(shape[:2]), layers.Reshape(shape)]
    elif len(shape) == 3:
        head = [layers.Input(shape)]
    else:
        raise UserError(f"--model cnn needs images (height, width[, channels]), got input shape {shape}")
    return Sequential(head + [
        layers.Conv2D(32, 3, padding="same", activation="relu"),
        layers.Conv2D(64, 3, padding="same", activation="relu"),
        layers.MaxPooling2D(2),
        layers.Flatten(), layers.Dense(128, activation="relu"), layers.Dense(classes)], name="cnn")


def _resnet50(shape, classes):
    """keras.applications.ResNet50 from scratch; inputs under its 32x32 minimum are resized up."""
    import tensorflow as tf
    from tensorflow.keras import layers

    if len(shape) == 2:
        shape = (*shape, 1)
    if len(shape) != 3:
        raise UserError(f"--model resnet50 needs images (height, width[, channels]), got input shape {shape}")
    inputs = layers.Input(shape)
    x = tf.keras.layers.Reshape(shape)(inputs)
    h, w = max(32, shape[0]), max(32, shape[1])
    if (h, w) != shape[:2]:
        x = layers.Resizing(h, w)(x)
    net = tf.keras.applications.ResNet50(weights=None, input_shape=(h, w, shape[2]), classes=classes,
                                         classifier_activation=None)
    return tf.keras.Model(inputs, net(x), name="resnet50")
