"""Users' own models, written as keras.io and the Keras guides write them: built and compiled by the
user, handed to hvdtrain as --model user_models:NAME (the tests put this folder on PYTHONPATH)."""
import numpy as np
import tensorflow as tf
from tensorflow import keras
from tensorflow.keras import layers


def regression():
    """scikit-learn's diabetes: ten features, one float target, mean squared error."""
    model = keras.Sequential([layers.Input((10,)), layers.Dense(32, activation="relu"), layers.Dense(1)],
                             name="diabetes_regressor")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def three_class_head(input_shape):
    """A classifier whose head has 3 classes, compiled with a sparse crossentropy: fed digits' labels
    0..9, as a user who set the wrong number of classes."""
    model = keras.Sequential([layers.Input(input_shape), layers.Flatten(), layers.Dense(32, activation="relu"),
                              layers.Dense(3, activation="softmax")], name="three_classes")
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def regression_with_classes(input_shape, num_classes):
    """A user's general builder, which declares num_classes and has no use for it in a regression."""
    model = keras.Sequential([layers.Input(input_shape), layers.Dense(32, activation="relu"), layers.Dense(1)],
                             name="diabetes_regressor")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def xla_regression():
    """The regression above, compiled for XLA as the Keras guides suggest for speed."""
    model = regression()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"], jit_compile=True)
    return model


def auto_steps_regression():
    """The regression above, compiled with Keras' self-tuning steps_per_execution."""
    model = regression()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"], steps_per_execution="auto")
    return model


def lambda_loss():
    """A loss written inline as a lambda: Keras will not rebuild it from a saved config."""
    model = keras.Sequential([layers.Input((10,)), layers.Dense(1)], name="lambda_loss")
    model.compile("adam", loss=lambda y, p: tf.reduce_mean(tf.square(y - p)))
    return model


def binary():
    """scikit-learn's breast_cancer: a sigmoid unit, binary crossentropy and the user's own AUC."""
    model = keras.Sequential([layers.Input((30,)), layers.Dense(16, activation="relu"),
                              layers.Dense(1, activation="sigmoid")], name="cancer_classifier")
    model.compile(optimizer="adam", loss="binary_crossentropy",
                  metrics=[keras.metrics.AUC(name="auc"), "accuracy"])
    return model


def mnist_convnet(input_shape, num_classes):
    """keras.io "Simple MNIST convnet" (softmax head, one-hot labels, categorical crossentropy),
    sized for scikit-learn's 8x8 digits."""
    model = keras.Sequential([
        keras.Input(shape=input_shape),
        layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Conv2D(64, kernel_size=(3, 3), padding="same", activation="relu"),
        layers.Flatten(),
        layers.Dropout(0.5),
        layers.Dense(num_classes, activation="softmax"),
    ], name="mnist_convnet")
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    return model


def mobilenet_softmax():
    """keras.applications with its default softmax head, not compiled: hvdtrain picks the loss."""
    return keras.applications.MobileNet(input_shape=(32, 32, 3), alpha=0.25, weights=None, classes=10)


def mobilenet_logits():
    return keras.applications.MobileNet(input_shape=(32, 32, 3), alpha=0.25, weights=None, classes=10,
                                          classifier_activation=None)


def sgd_momentum():
    """A compiled optimizer that is not hvdtrain's default: SGD with momentum at lr 0.05."""
    model = keras.Sequential([layers.Input((8, 8, 1)), layers.Flatten(), layers.Dense(64, activation="relu"),
                              layers.Dense(10)], name="sgd_mlp")
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def plain_sgd():
    """Compiled with plain SGD: for the exactness test (2 workers x b equals 1 worker x 2b)."""
    model = keras.Sequential([layers.Input((8, 8, 1)), layers.Flatten(), layers.Dense(32, activation="relu"),
                              layers.Dense(10)], name="sgd_exact")
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def small_bn_cnn(input_shape, num_classes):
    """A small CNN with BatchNormalization, compiled by the user."""
    model = keras.Sequential([layers.Input(input_shape), layers.Conv2D(16, 3, padding="same"),
                              layers.BatchNormalization(), layers.ReLU(), layers.Flatten(),
                              layers.Dense(num_classes)], name="bn_cnn")
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


class CustomModel(keras.Model):
    """The TensorFlow guide "Customizing what happens in fit()": its own train_step, which computes
    the gradients itself and calls apply_gradients."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compiled_loss(y, y_pred, regularization_losses=self.losses)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply_gradients(zip(gradients, trainable_vars))
        self.compiled_metrics.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def custom_train_step():
    inputs = keras.Input(shape=(8, 8, 1))
    x = layers.Flatten()(inputs)
    x = layers.Dense(32, activation="relu")(x)
    model = CustomModel(inputs, layers.Dense(10)(x), name="custom_step")
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def structured():
    """keras.io "Structured data classification": named inputs fed by a dict of features, normalized
    in the model, concatenated."""
    names = ["mean radius", "mean texture", "mean smoothness", "worst area"]
    inputs = {n.replace(" ", "_"): keras.Input(shape=(1,), name=n.replace(" ", "_")) for n in names}
    from sklearn.datasets import load_breast_cancer

    columns = {n: i for i, n in enumerate(load_breast_cancer().feature_names)}
    x = load_breast_cancer().data
    encoded = []
    for n in names:
        norm = layers.Normalization()
        norm.adapt(x[:, columns[n]].reshape(-1, 1).astype(np.float32))
        encoded.append(norm(inputs[n.replace(" ", "_")]))
    h = layers.Dense(16, activation="relu")(layers.concatenate(encoded))
    model = keras.Model(inputs, layers.Dense(1, activation="sigmoid")(h), name="structured")
    model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
    return model


def two_classes():
    """A two-class classifier: fed digits (labels 0-9), its loss meets labels it cannot take."""
    model = keras.Sequential([layers.Input((8, 8, 1)), layers.Flatten(), layers.Dense(2)], name="two_classes")
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def image_classifier():
    """keras.io "Image classification from scratch", shrunk: rescale and resize inside the model."""
    model = keras.Sequential([
        layers.Input((256, 256, 3)),
        layers.Rescaling(1.0 / 255),
        layers.Resizing(16, 16),
        layers.Conv2D(8, 3, activation="relu"),
        layers.GlobalAveragePooling2D(),
        layers.Dense(3, activation="softmax"),
    ], name="image_classifier")
    model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def two_heads():
    """Two outputs (keras.io "multi-input and multi-output models"): the digit, and whether it is odd;
    a loss, a weight and metrics per output, given as dicts."""
    inputs = keras.Input((8, 8, 1), name="image")
    x = layers.Dense(64, activation="relu")(layers.Flatten()(inputs))
    outputs = {"digit": layers.Dense(10, name="digit")(x), "odd": layers.Dense(1, activation="sigmoid", name="odd")(x)}
    model = keras.Model(inputs, outputs, name="two_heads")
    model.compile(optimizer=keras.optimizers.Adam(2e-3),
                  loss={"digit": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        "odd": "binary_crossentropy"},
                  loss_weights={"digit": 1.0, "odd": 0.5},
                  metrics={"digit": ["accuracy"], "odd": [keras.metrics.AUC(name="auc")]})
    return model


def multi_label():
    """Several labels per example (k-hot targets), one sigmoid unit each."""
    model = keras.Sequential([layers.Input((8, 8, 1)), layers.Flatten(), layers.Dense(64, activation="relu"),
                              layers.Dense(3, activation="sigmoid")], name="multi_label")
    model.compile(optimizer=keras.optimizers.Adam(2e-3), loss="binary_crossentropy",
                  metrics=[keras.metrics.BinaryAccuracy(name="bin_acc")])
    return model


class Counted(keras.Model):
    """Records what it trains on: after each step, (step, sample ids) go to $COUNT_DIR/rank<R>.txt,
    a sample's id being x[:, 0] * 1024. After step $KILL_AT, rank $KILL_RANK kills itself (kill -9)."""

    def train_step(self, data):
        logs = super().train_step(data)
        tf.py_function(_record, [self.optimizer.iterations, data[0][:, 0]], [])
        return logs


def _record(step, ids):
    import os
    import signal

    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK", "0")))
    with open(os.path.join(os.environ["COUNT_DIR"], f"rank{rank}.txt"), "a") as fh:
        fh.write(f"{int(step)} {' '.join(str(int(round(float(i) * 1024))) for i in ids.numpy())}\n")
    if int(step) == int(os.environ.get("KILL_AT", -1)) and rank == int(os.environ.get("KILL_RANK", 1)):
        os.kill(os.getpid(), signal.SIGKILL)


def counted(input_shape, num_classes):
    """An MLP with BatchNormalization (state each rank holds alone within an epoch), not compiled."""
    inputs = keras.Input(input_shape)
    x = layers.Dense(32)(inputs)
    x = layers.BatchNormalization()(x)
    x = layers.ReLU()(x)
    return Counted(inputs, layers.Dense(num_classes)(x), name="counted")


def dropout_mlp():
    """A compiled MLP with Dropout, as most keras.io examples have one."""
    model = keras.Sequential([layers.Input((8, 8, 1)), layers.Flatten(), layers.Dense(32, activation="relu"),
                              layers.Dropout(0.2), layers.Dense(10)], name="dropout_mlp")
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def bag_of_tokens():
    """keras.io-style text classifier on integer token ids of any length: embed, average, sigmoid."""
    model = keras.Sequential([layers.Embedding(100, 8), layers.GlobalAveragePooling1D(),
                              layers.Dense(1, activation="sigmoid")], name="bag_of_tokens")
    model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
    return model


def text_vectorized():
    """keras.io "Text classification from scratch": TextVectorization inside the model, adapted in
    build() on the user's texts. Here each rank adapts on its own sample of them (as a user who
    adapts on a part of the data, drawn anew in every process), so the ranks' vocabularies differ."""
    import horovod.tensorflow as hvd

    import user_data

    texts = [t.numpy() for t, _ in user_data.reviews()[0]]
    order = np.random.default_rng(hvd.rank()).permutation(len(texts))[:40]
    vectorize = layers.TextVectorization(max_tokens=8, output_sequence_length=20)
    vectorize.adapt(tf.constant([texts[i] for i in order]))
    inputs = keras.Input(shape=(1,), dtype="string")
    x = layers.GlobalAveragePooling1D()(layers.Embedding(8, 8)(vectorize(inputs)))
    model = keras.Model(inputs, layers.Dense(1, activation="sigmoid")(x), name="text_vectorized")
    model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
    return model


def text_tf_idf():
    """keras.io "Large-scale multi-label text classification": TF-IDF bigrams into an MLP. As above, each
    rank adapts on its own sample, so the ranks' vocabularies and IDF weights differ."""
    import horovod.tensorflow as hvd

    import user_data

    texts = [t.numpy() for t, _ in user_data.reviews()[0]]
    order = np.random.default_rng(hvd.rank()).permutation(len(texts))[:40]
    vectorize = layers.TextVectorization(max_tokens=16, ngrams=2, output_mode="tf_idf")
    vectorize.adapt(tf.constant([texts[i] for i in order]))
    inputs = keras.Input(shape=(1,), dtype="string")
    x = layers.Dense(16, activation="relu")(vectorize(inputs))
    model = keras.Model(inputs, layers.Dense(1, activation="sigmoid")(x), name="text_tf_idf")
    model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
    return model


def frozen_mobilenet():
    """keras.io's transfer learning: a pretrained base, frozen, called in inference mode, under a new
    head. The seeds stand for weights="imagenet" (no download here): the same base at every build,
    with BatchNorm statistics that a pretraining left, not Keras' initial 0 and 1."""
    keras.utils.set_random_seed(3)
    base = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, include_top=False,
                                          weights=None)
    rng = np.random.default_rng(3)
    for w in base.non_trainable_weights:
        w.assign((rng.uniform(0.5, 2.0, w.shape) if "variance" in w.name else rng.normal(0, 0.5, w.shape))
                 .astype(np.float32))
    base.trainable = False
    inputs = keras.Input((32, 32, 3))
    x = base(inputs, training=False)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dropout(0.2)(x)
    outputs = layers.Dense(10)(x)
    model = keras.Model(inputs, outputs, name="frozen_mobilenet")
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def fine_tuned_mobilenet():
    """keras.io's second step: the base unfrozen to fine-tune at a low learning rate, still called in
    inference mode, so its BatchNorm statistics stay as they were loaded."""
    model = frozen_mobilenet()
    model.layers[1].trainable = True
    model.compile(optimizer=keras.optimizers.Adam(1e-5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model
