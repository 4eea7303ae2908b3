"""Keras' mixed-precision guide, as a user writes it: the global policy set at the top of the script,
before anything else (here before hvdtrain.init()), a functional model whose last layer computes in
float32, compiled with RMSprop, and fit with validation_split=0.2. sklearn's digits stand for MNIST.

    precision_script.py plain OUT      the user's script: one process
    precision_script.py hvdtrain OUT   hvdtrain.init()/fit() on every rank, the script otherwise the same

Rank 0 prints RESULT: the dtypes the layers computed in, the optimizer's class, the history, and
(under hvdtrain) what summary.json says of the precision.
"""
import json
import os
import sys

import tensorflow as tf

keras = tf.keras
layers = keras.layers
keras.mixed_precision.set_global_policy("mixed_float16")

import hvdtrain  # noqa: E402

mode, out = sys.argv[1], sys.argv[2]
world = hvdtrain.init() if mode == "hvdtrain" else None

from sklearn.datasets import load_digits  # noqa: E402

keras.utils.set_random_seed(2)
x_train, y_train = load_digits(return_X_y=True)
x_train = (x_train / 16.0).astype("float32")

inputs = keras.Input(shape=(64,), name="digits")
dense1 = layers.Dense(64, activation="relu", name="dense_1")
x = dense1(inputs)
dense2 = layers.Dense(64, activation="relu", name="dense_2")
x = dense2(x)
x = layers.Dense(10, name="dense_logits")(x)
outputs = layers.Activation("softmax", dtype="float32", name="predictions")(x)
model = keras.Model(inputs=inputs, outputs=outputs)
model.compile(loss="sparse_categorical_crossentropy", optimizer=keras.optimizers.RMSprop(), metrics=["accuracy"])
if world is None:
    history, precision = model.fit(x_train, y_train, batch_size=32, epochs=5, validation_split=0.2, verbose=0).history, None
else:
    summary = hvdtrain.fit(model, (x_train, y_train), batch_size=32, epochs=5, validation_split=0.2,
                           output_dir=os.path.join(out, "runs"))
    history, precision = summary["history"], summary["precision"]
if world is None or world.is_chief:
    print("RESULT " + json.dumps({
        "policy": keras.mixed_precision.global_policy().name, "dense_1": dense1.compute_dtype,
        "loss_scale_optimizer": isinstance(model.optimizer, keras.mixed_precision.LossScaleOptimizer),
        "summary": precision, **{k: [float(v) for v in history[k]] for k in ("loss", "val_accuracy")}}), flush=True)
