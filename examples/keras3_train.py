"""Keras 3 code as keras.io writes it, made data-parallel by hvdtrain: `import keras`, a layer of your
own written with `keras.ops`, and a model with its own train_step that hands its gradients to
`self.optimizer.apply` (keras.io, "Customizing what happens in fit() with TensorFlow").

    python examples/keras3_train.py [EPOCHS [OUTPUT_DIR]]                    # one worker
    horovodrun -np 2 -H localhost:2 python examples/keras3_train.py          # two, or mpirun -np 2 ...

Nothing here knows about Horovod: hvdtrain subclasses the optimizer you compiled so that its `apply`
averages the gradients over the workers first, whichever step computed them.
"""
import sys

import hvdtrain  # first: it sets TensorFlow's and MPI's measured defaults before they load

world = hvdtrain.init()  # hvd.init and this worker's GPU (or CPU threads): before building the model

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import layers, ops  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402


class Standardize(layers.Layer):
    def call(self, x):
        return (x - ops.mean(x, axis=-1, keepdims=True)) / (ops.std(x, axis=-1, keepdims=True) + 1e-6)


class CustomModel(keras.Model):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        for metric in self.metrics:
            metric.update_state(loss) if metric.name == "loss" else metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


inputs = keras.Input(shape=(64,))
x = layers.Dense(64, activation="relu")(Standardize()(inputs))
model = CustomModel(inputs, layers.Dense(10)(x), name="keras3_digits")
model.compile(optimizer=keras.optimizers.Adam(2e-3), metrics=["accuracy"],
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

x, y = load_digits(return_X_y=True)
epochs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
output_dir = sys.argv[2] if len(sys.argv) > 2 else "runs/keras3-train"
summary = hvdtrain.fit(model, ((x / 16.0).astype("float32"), y), epochs=epochs, val_split=0.2,
                       output_dir=output_dir)
if world.is_chief:
    print(f"validation accuracy {summary['metrics']['val_accuracy']:.3f} with {summary['world_size']} worker(s)")
