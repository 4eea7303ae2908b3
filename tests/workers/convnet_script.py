"""keras.io's mnist_convnet ("Simple MNIST convnet") as a user writes it, with two habits of their own:
Adam on a CosineDecay schedule over the whole run, and a callback that prints the learning rate at
each epoch's end; fit with validation_split=0.1, as the example does. sklearn's digits (8x8) stand
for MNIST. Run two ways:

    convnet_script.py plain OUT      the user's script: one process, batch 32
    convnet_script.py hvdtrain OUT   hvdtrain.init()/fit() on every rank at batch 32 each, the script
                                     otherwise the same

Rank 0 prints RESULT: the rate at each epoch's end, the history, and the one-worker steps an epoch.
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
layers = keras.layers
BATCH, EPOCHS = 32, 5
os.makedirs(out, exist_ok=True)

keras.utils.set_random_seed(5)
x, y = load_digits(return_X_y=True)
x = (x[:1600] / 16.0).reshape(-1, 8, 8, 1).astype("float32")
y = keras.utils.to_categorical(y[:1600], 10)
steps = int(len(x) * 0.9) // BATCH  # 45 steps an epoch, for one worker

model = keras.Sequential([
    keras.Input(shape=(8, 8, 1)),
    layers.Conv2D(16, kernel_size=(3, 3), activation="relu"),
    layers.MaxPooling2D(pool_size=(2, 2)),
    layers.Flatten(),
    layers.Dropout(0.5),
    layers.Dense(10, activation="softmax"),
])


class PrintRate(keras.callbacks.Callback):
    """The user's own: the learning rate at every epoch's end (a schedule's value at the step)."""

    def __init__(self):
        super().__init__()
        self.rates = []

    def on_epoch_end(self, epoch, logs=None):
        lr = self.model.optimizer.learning_rate
        lr = lr(self.model.optimizer.iterations) if callable(lr) else lr  # Keras 2 gives the schedule
        self.rates.append(float(np.asarray(lr)))
        print(f"epoch {epoch + 1}: lr {self.rates[-1]:.3g}", flush=True)


schedule = keras.optimizers.schedules.CosineDecay(3e-3, decay_steps=EPOCHS * steps)
model.compile(loss="categorical_crossentropy", optimizer=keras.optimizers.Adam(schedule), metrics=["accuracy"])
rates = PrintRate()
if world is None:
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, validation_split=0.1, callbacks=[rates],
                        verbose=0).history
else:
    summary = hvdtrain.fit(model, (x, y), batch_size=BATCH, epochs=EPOCHS,
                           validation_split=0.1, callbacks=[rates], output_dir=os.path.join(out, "runs"))
    history = summary["history"]
if world is None or world.is_chief:
    print("RESULT " + json.dumps({"rates": rates.rates, "steps_one_worker": steps,
                                  **{k: [float(v) for v in history[k]] for k in ("loss", "val_loss", "val_accuracy")}}),
          flush=True)
