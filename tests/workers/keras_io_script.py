"""The most common keras.io script, as a user writes it: sklearn's digits, a small Sequential compiled
with Adam, and the usual callbacks (ReduceLROnPlateau, EarlyStopping restoring the best weights,
ModelCheckpoint of the best model, CSVLogger) plus one of their own that prints the rate at each
epoch's end. None acts per batch on purpose; ModelCheckpoint and CSVLogger run on rank 0 only. Run
two ways, in OUT as the working directory (the callbacks' files are relative paths):

    keras_io_script.py plain OUT      single-process Keras on the global batch, lr scaled by hand
    keras_io_script.py hvdtrain OUT   hvdtrain.init()/fit() on every rank, the same callbacks

Beside what the user writes, only what makes the two comparable: no shuffling and no warm-up. Rank 0
prints RESULT: the epochs run, the rate each epoch ended at, and where its weights are.
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
GLOBAL_BATCH, WORKERS = 64, 2
os.makedirs(out, exist_ok=True)
os.chdir(out)


class PrintRate(keras.callbacks.Callback):
    """The user's own: the learning rate at every epoch's end."""

    def __init__(self):
        super().__init__()
        self.rates = []

    def on_epoch_end(self, epoch, logs=None):
        self.rates.append(float(np.asarray(self.model.optimizer.learning_rate)))
        print(f"epoch {epoch + 1}: lr {self.rates[-1]:.3g}", flush=True)


keras.utils.set_random_seed(7)
x, y = load_digits(return_X_y=True)
x = (x / 16.0).astype("float32")
train, val = (x[:1408], y[:1408]), (x[1408:], y[1408:])  # 22 global batches of 64
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
rates = PrintRate()
callbacks = [
    keras.callbacks.ReduceLROnPlateau(patience=1),
    keras.callbacks.EarlyStopping(patience=3, restore_best_weights=True),
    keras.callbacks.ModelCheckpoint("best.keras", save_best_only=True),
    keras.callbacks.CSVLogger("log.csv"),
    rates,
]
if world is None:
    model.optimizer.learning_rate.assign(1e-3 * WORKERS)  # the scaled rate, as hvdtrain sets it
    history = model.fit(*train, batch_size=GLOBAL_BATCH, epochs=60, validation_data=val, shuffle=False,
                        callbacks=callbacks, verbose=0).history
else:
    history = hvdtrain.fit(model, train, validation_data=val, epochs=60, batch_size=GLOBAL_BATCH // world.size,
                           shuffle=False, warmup_epochs=0, callbacks=callbacks)["history"]
np.savez(f"weights-{world.rank if world else 0}.npz", *model.get_weights())
if world is None or world.is_chief:
    print("RESULT " + json.dumps({"epochs": len(history["loss"]), "rates": rates.rates,
                                  "val_loss": [float(v) for v in history["val_loss"]]}), flush=True)
