"""Horovod's own Keras recipe, written by hand as a user would instead of using hvdtrain: the bench's
peer (`hvdtrain bench --sections recipe`). It follows horovod/examples/tensorflow2/
tensorflow2_keras_mnist.py step by step: init, pin a GPU, shard, scale the lr, DistributedOptimizer,
broadcast, metric-average and warm-up callbacks, verbose on rank 0 only (its rank-0 ModelCheckpoint
is left out: it writes after an epoch's timing). Only the model (the same as
hvdtrain's), the synthetic data and the per-worker thread budget come from the bench, so that both
do the same work. Every rank prints `RECIPE {"rank": r, "samples_per_sec": s, "first_epoch_s": t}`
(samples/s over the epochs after the first, as hvdtrain's summary counts them; t: the first epoch,
which traces the step).

Under Keras 3, Horovod's Keras layer (DistributedOptimizer, its callbacks) does not work; the recipe is
then what a Keras 3 user writes by hand: a train_step that averages the gradients with
`hvd.allreduce` before `optimizer.apply`, rank 0's variables broadcast before the first step, and the
warm-up as a LearningRateScheduler.

    horovodrun -np 2 python -m hvdtrain.bench.horovod_recipe --model cnn --image-size 16 --steps 100
"""
import argparse
import json
import time

import numpy as np
import tensorflow as tf
import horovod.tensorflow.keras as hvd

from hvdtrain import models


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="mlp")
    p.add_argument("--image-size", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=100, help="steps per epoch")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()

    # Horovod: initialize Horovod, pin one GPU per process
    hvd.init()
    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)

    shape = (args.image_size, args.image_size, 3)
    n = args.batch_size * args.steps * hvd.size()
    x = np.random.default_rng(hvd.rank()).standard_normal((n, *shape), dtype=np.float32)
    y = np.random.default_rng(100 + hvd.rank()).integers(0, 10, n)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().shuffle(10000).batch(args.batch_size)

    model = models.BUILDERS[args.model](shape, 10)
    scaled_lr = 0.001 * hvd.size()
    if hasattr(tf.keras, "ops"):
        return keras3(args, model, dataset, scaled_lr)
    # Horovod: adjust learning rate based on number of GPUs, add Horovod Distributed Optimizer
    opt = hvd.DistributedOptimizer(tf.optimizers.Adam(scaled_lr))
    # Horovod: experimental_run_tf_function=False so that TF uses hvd.DistributedOptimizer()
    model.compile(loss=tf.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer=opt,
                  metrics=["accuracy"], experimental_run_tf_function=False)

    timer = Timer()
    callbacks = [
        # Horovod: broadcast initial variable states from rank 0 to all other processes
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Horovod: average metrics among workers at the end of every epoch
        hvd.callbacks.MetricAverageCallback(),
        # Horovod: the first epochs warm up to scaled_lr
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=1, verbose=1),
        timer,
    ]
    # Horovod: write logs on worker 0 only
    verbose = 1 if hvd.rank() == 0 else 0
    model.fit(dataset, steps_per_epoch=args.steps, callbacks=callbacks, epochs=args.epochs, verbose=verbose)
    report(args, timer)


class Timer(tf.keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self.t0 = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self.t0)


def report(args, timer):
    timed = timer.seconds[1:] or timer.seconds
    rate = len(timed) * args.steps * args.batch_size / sum(timed)
    print("RECIPE " + json.dumps({"rank": hvd.rank(), "samples_per_sec": rate, "first_epoch_s": timer.seconds[0]}),
          flush=True)


def keras3(args, built, dataset, scaled_lr):
    """The same recipe as a Keras 3 user writes it by hand, with Horovod's TensorFlow ops."""
    import horovod.tensorflow as hvd_tf
    import keras

    class HorovodModel(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
            grads = tape.gradient(loss, self.trainable_variables)
            # Horovod: average the gradients over the workers
            grads = hvd_tf.grouped_allreduce(grads, op=hvd_tf.Average)
            self.optimizer.apply(grads, self.trainable_variables)
            for metric in self.metrics:
                metric.update_state(loss) if metric.name == "loss" else metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    model = HorovodModel(built.inputs, built.outputs)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(scaled_lr), metrics=["accuracy"])
    # Horovod: broadcast the initial variables (and the optimizer's) from rank 0 before the first step
    model.optimizer.build(model.trainable_variables)
    hvd_tf.broadcast_variables([v.value for v in model.variables + model.optimizer.variables], root_rank=0)
    timer = Timer()
    # Horovod: the first epoch warms up to scaled_lr (by epoch, as keras.callbacks take it)
    warmup = keras.callbacks.LearningRateScheduler(
        lambda epoch, lr: scaled_lr / hvd.size() if epoch == 0 else scaled_lr)
    model.fit(dataset, steps_per_epoch=args.steps, callbacks=[warmup, timer], epochs=args.epochs,
              verbose=1 if hvd.rank() == 0 else 0)
    report(args, timer)


if __name__ == "__main__":
    main()
