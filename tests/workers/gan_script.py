"""keras.io's GAN ("Customizing what happens in fit(): a GAN"), as a user writes it: a model with its
own compile(d_optimizer, g_optimizer, loss_fn), no call(), and a train_step with two tapes and two
optimizers, trained on sklearn's digits (8x8 images, so that it runs in seconds). Run two ways:

    gan_script.py plain OUT      single-process Keras on the global batch
    gan_script.py hvdtrain OUT   hvdtrain.init()/fit() on every rank, the script otherwise the same
    gan_script.py hidden OUT     as hvdtrain, but the GAN keeps its optimizers in a dict, where
                                 hvdtrain cannot find them: the job must stop, not train apart

Rank 0 prints RESULT: the losses of each epoch and which optimizers the model holds after fit.
Every rank saves its weights in OUT, so the test can compare them.
"""
import json
import os
import sys

import hvdtrain

mode, out = sys.argv[1], sys.argv[2]
world = hvdtrain.init() if mode in ("hvdtrain", "hidden") else None

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

keras = tf.keras
GLOBAL_BATCH, LATENT = 64, 16
os.makedirs(out, exist_ok=True)

keras.utils.set_random_seed(3)
images = (load_digits().images[:1280] / 8.0 - 1.0).reshape(-1, 64).astype("float32")  # 20 global batches

discriminator = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64), keras.layers.LeakyReLU(0.2),
                                  keras.layers.Dense(1)], name="discriminator")
generator = keras.Sequential([keras.Input((LATENT,)), keras.layers.Dense(64), keras.layers.LeakyReLU(0.2),
                              keras.layers.Dense(64, activation="tanh")], name="generator")


class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def train_step(self, real_images):
        batch_size = tf.shape(real_images)[0]
        random_latent_vectors = tf.random.normal(shape=(batch_size, self.latent_dim))
        generated_images = self.generator(random_latent_vectors)
        combined_images = tf.concat([generated_images, real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * tf.random.uniform(tf.shape(labels))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))

        random_latent_vectors = tf.random.normal(shape=(batch_size, self.latent_dim))
        misleading_labels = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))

        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}


class HiddenOptimizersGAN(GAN):
    """The same GAN, its optimizers in a dict (so `d_optimizer` reads them from there)."""

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        keras.Model.compile(self)
        self.held = {"d": d_optimizer, "g": g_optimizer}
        self.loss_fn = loss_fn
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")

    d_optimizer = property(lambda self: self.held["d"])
    g_optimizer = property(lambda self: self.held["g"])


gan = (HiddenOptimizersGAN if mode == "hidden" else GAN)(discriminator=discriminator, generator=generator,
                                                          latent_dim=LATENT)
gan.compile(d_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
            g_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
            loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
if world is None:
    dataset = tf.data.Dataset.from_tensor_slices(images).batch(GLOBAL_BATCH)
    history = gan.fit(dataset, epochs=4, verbose=0).history
else:
    dataset = tf.data.Dataset.from_tensor_slices(images).batch(GLOBAL_BATCH // world.size)
    history = hvdtrain.fit(gan, dataset, epochs=4, output_dir=os.path.join(out, "runs"))["history"]
np.savez(os.path.join(out, f"weights-{world.rank if world else 0}.npz"), *gan.get_weights())
if world is None or world.is_chief:
    print("RESULT " + json.dumps({"d_loss": [float(v) for v in history["d_loss"]],
                                  "g_loss": [float(v) for v in history["g_loss"]],
                                  "optimizers": [type(gan.d_optimizer).__name__, type(gan.g_optimizer).__name__],
                                  "d_steps": int(gan.d_optimizer.iterations.numpy())}), flush=True)
