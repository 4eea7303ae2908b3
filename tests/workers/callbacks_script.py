"""A keras.io-style script with the callbacks users bring: ReduceLROnPlateau, ModelCheckpoint (best only),
CSVLogger, and two of their own (one per batch, one that writes a file). Run two ways:

    callbacks_script.py plain OUT      single-process Keras on the global batch, lr scaled by hand
    callbacks_script.py hvdtrain OUT   hvdtrain.init()/fit() on every rank, the same callbacks

Rank 0 writes the final weights to OUT/weights.npz and prints RESULT: the learning rate each epoch
started at (as the callbacks saw it), the batches the per-batch hook saw, and the history.
"""
import json
import os
import sys

import hvdtrain

mode, out = sys.argv[1], sys.argv[2]
world = hvdtrain.init() if mode == "hvdtrain" else None

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

keras = tf.keras
GLOBAL_BATCH, STEPS, EPOCHS, WORKERS = 64, 20, 4, 2


class LearningRateLog(keras.callbacks.Callback):
    """The user's own: the rate each epoch starts at, and a count of the batches it is called for."""

    def __init__(self):
        super().__init__()
        self.rates, self.batches = [], 0

    def on_epoch_begin(self, epoch, logs=None):
        self.rates.append(float(np.asarray(self.model.optimizer.learning_rate)))

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1


class EpochLines(keras.callbacks.Callback):
    """The user's own file writer: a line per epoch."""

    def on_epoch_end(self, epoch, logs=None):
        with open(os.path.join(out, "epochs.txt"), "a") as fh:
            fh.write(f"{epoch + 1} {logs['val_loss']:.6f}\n")


keras.utils.set_random_seed(3)
x, y = load_digits(return_X_y=True)
x = (x / 16.0).astype("float32")
train, val = (x[:GLOBAL_BATCH * STEPS], y[:GLOBAL_BATCH * STEPS]), (x[1280:1792], y[1280:1792])
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
os.makedirs(out, exist_ok=True)
rates = LearningRateLog()
callbacks = [
    # min_delta 1.0: no epoch "improves" after the first, so the rate halves from the second epoch's end
    keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1, min_delta=1.0),
    keras.callbacks.ModelCheckpoint(os.path.join(out, "best-{epoch:02d}.weights.h5"), monitor="val_accuracy",
                                    save_best_only=True, save_weights_only=True),
    keras.callbacks.CSVLogger(os.path.join(out, "log.csv")),
    rates,
    hvdtrain.on_rank0(EpochLines()) if world else EpochLines(),
]
if world is None:
    model.optimizer.learning_rate.assign(0.05 * WORKERS)  # the scaled rate, as hvdtrain sets it
    history = model.fit(*train, batch_size=GLOBAL_BATCH, epochs=EPOCHS, validation_data=val, shuffle=False,
                        callbacks=callbacks, verbose=0).history
else:
    history = hvdtrain.fit(model, train, validation_data=val, epochs=EPOCHS, batch_size=GLOBAL_BATCH // world.size,
                           shuffle=False, warmup_epochs=0, output_dir=out, verbose=0, tensorboard=False,
                           keep_best=False, callbacks=callbacks)["history"]
if world is None or world.is_chief:
    np.savez(os.path.join(out, "weights.npz"), *model.get_weights())
    print("RESULT " + json.dumps({"weights": os.path.join(out, "weights.npz"), "rates": rates.rates,
                                  "batches": rates.batches, "val_loss": [float(v) for v in history["val_loss"]],
                                  "lr": [float(v) for v in history.get("lr") or history["learning_rate"]]}),
          flush=True)
