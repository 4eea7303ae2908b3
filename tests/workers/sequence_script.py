"""A keras.utils.Sequence as many code bases feed data: batches by index, the samples reshuffled in
on_epoch_end by the Sequence's own seeded generator. Run two ways:

    sequence_script.py plain OUT      single-process Keras, batches of 64, lr scaled by hand
    sequence_script.py hvdtrain OUT   hvdtrain.init()/fit() on every rank, batches of 64 / workers

Two workers' batches i and i+1 of 32 are plain Keras' batch of 64 (the same permutation of the
samples), so the weights match when each worker takes its own batches by index and on_epoch_end runs
after every epoch. SHUFFLE=1 lets hvdtrain shuffle the batches; KILL=1 kills every rank (SIGKILL) at
the 8th step of the second epoch, with a step checkpoint every 5 steps. Rank 0 writes OUT/weights.npz
and prints RESULT.
"""
import json
import os
import signal
import sys

import hvdtrain

mode, out = sys.argv[1], sys.argv[2]
world = hvdtrain.init() if mode == "hvdtrain" else None

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

keras = tf.keras
GLOBAL_BATCH, EPOCHS = 64, 3


class DigitsSequence(keras.utils.Sequence):
    def __init__(self, x, y, batch_size):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size
        self.order, self.epochs_ended = np.arange(len(x)), 0

    def __len__(self):
        return len(self.x) // self.batch_size

    def __getitem__(self, i):
        idx = self.order[i * self.batch_size:(i + 1) * self.batch_size]
        return self.x[idx], self.y[idx]

    def on_epoch_end(self):
        self.epochs_ended += 1
        self.order = np.random.RandomState(self.epochs_ended).permutation(len(self.x))


keras.utils.set_random_seed(3)
x, y = load_digits(return_X_y=True)
x = (x / 16.0).astype("float32")
batch = GLOBAL_BATCH // (world.size if world else 1)
train, val = DigitsSequence(x[:1280], y[:1280], batch), DigitsSequence(x[1280:1792], y[1280:1792], batch)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
if world is None:
    model.optimizer.learning_rate.assign(0.1)  # the rate hvdtrain scales to at 2 workers
    history = model.fit(train, validation_data=val, epochs=EPOCHS, shuffle=False, verbose=0).history
else:
    class Kill(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if self.epoch == 1 and batch == 7:
                os.kill(os.getpid(), signal.SIGKILL)

    history = hvdtrain.fit(model, train, validation_data=val, epochs=EPOCHS, shuffle=bool(os.environ.get("SHUFFLE")),
                           warmup_epochs=0, output_dir=out, verbose=0, tensorboard=False, checkpoint_every_steps=5,
                           callbacks=[Kill()] if os.environ.get("KILL") else [])["history"]
if world is None or world.is_chief:
    os.makedirs(out, exist_ok=True)
    np.savez(os.path.join(out, "weights.npz"), *model.get_weights())
    print("RESULT " + json.dumps({"weights": os.path.join(out, "weights.npz"), "epochs_ended": train.epochs_ended,
                                  "val_accuracy": [float(v) for v in history["val_accuracy"]]}), flush=True)
