"""Models by name, or yours; and how each is compiled for training.

Yours is `--model module:function` (or a tf.keras.Model handed to hvdtrain.fit), compiled or not. The
function may take `input_shape` and/or `num_classes` (read from the data) or nothing. A compiled
model keeps its loss, loss weights, metrics and optimizer (hvdtrain scales and wraps the optimizer
only); an uncompiled one gets `--loss`/`--metrics`, else a classification loss whose from_logits
follows the model's output activation.

The built-in models return logits and use no dropout, so data-parallel runs at different worker
counts can be compared weight for weight.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from . import compat
from .config import DEFAULT_STEPS_PER_EXECUTION, UserError
from .data import resolve

_FROM_LOGITS_LOSSES = ("sparse_categorical_crossentropy", "categorical_crossentropy", "binary_crossentropy")


def needs_classes(name) -> str | None:
    """What needs the number of classes from the data to build this model (for the messages), or None."""
    if not isinstance(name, str):
        return None
    if name in BUILDERS:
        return f"the built-in model {name}"
    return f"--model {name}" if "num_classes" in _parameters(resolve(name, "--model")) else None


def build(name: str, data):
    """The model `name` for `data` (a data.Data): built-in, or module:function."""
    import tensorflow as tf

    if name in BUILDERS:
        shape = data.input_shape
        if not isinstance(shape, tuple) or not all(isinstance(d, int) for d in shape):
            raise UserError(f"--model {name} takes one input tensor, but the data's inputs are {shape}; "
                            f"bring your own model (--model module:function)")
        return BUILDERS[name](shape, data.num_classes)
    fn = resolve(name, "--model")
    wanted = _parameters(fn)
    given = {"input_shape": lambda: data.input_shape, "num_classes": lambda: data.num_classes}
    unknown = [p for p in wanted if p not in given]
    if unknown:
        raise UserError(f"--model {name}: the function may take input_shape and/or num_classes, "
                        f"not {', '.join(unknown)}")
    model = fn(**{p: given[p]() for p in wanted})
    if not isinstance(model, tf.keras.Model):
        raise UserError(f"--model {name}: expected a tf.keras.Model, got {type(model).__name__}")
    return model


def _parameters(fn) -> list:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


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


BUILDERS = {"mlp": _mlp, "cnn": _cnn, "resnet50": _resnet50}


# ---------------------------------------------------------------- compiling for training

@dataclass
class Compile:
    """How the model is compiled for training: the user's own compile, kept, or hvdtrain's choice."""
    optimizer: object  # the model's compiled optimizer (None: not compiled)
    kwargs: dict  # everything model.compile takes but the optimizer
    loss: str  # what the loss is, in words, for the summary
    steps_per_execution: int  # what it trains with: asked for, or hvdtrain's default
    notes: list = field(default_factory=list)


def compile_plan(model, cfg, steps_per_epoch: int | None = None, batch_callbacks: bool = False) -> Compile:
    """Keep what the user compiled; flags replace parts of it (with a note); fill in what is missing.
    steps_per_epoch: the epoch's length of one stream across epochs, which the steps per call divide
    under Keras 3 (None: the data end every epoch).
    batch_callbacks: the user's callbacks act per batch: unless asked otherwise, 1 step per call."""
    user = compat.compile_config(model)
    notes = []
    activations = output_activations(model)
    if cfg.loss:
        loss = _named_loss(cfg.loss, activations)
        if user.get("loss") is not None:
            notes.append(f"--loss {cfg.loss} replaces the model's compiled loss {describe(user['loss'])}")
        described = cfg.loss
    elif user.get("loss") is not None or (user and type(model).train_step is not _keras_train_step()):
        loss, described = user.get("loss"), f"{describe(user.get('loss'))} (model.compile)"
    else:
        loss, described = _default_loss(model, activations)
    binary_logits = _binary_logits(loss, activations)
    metrics: list | None
    if cfg.metrics is not None:
        metrics = [_named_metric(m, binary_logits) for m in cfg.metrics]
        if user.get("metrics"):
            notes.append(f"--metrics {' '.join(cfg.metrics)} replace the model's compiled metrics")
    elif user:
        metrics = user.get("metrics")
    else:
        metrics = [_named_metric("accuracy", binary_logits)]
    asked = cfg.steps_per_execution or compat.compiled_steps_per_execution(user)
    per_call = asked if isinstance(asked, int) else 1 if cfg.elastic or batch_callbacks else \
        DEFAULT_STEPS_PER_EXECUTION
    if batch_callbacks and not isinstance(asked, int):
        notes.append("a callback acts per batch: 1 step per call, so that Keras calls it at every step "
                     "(steps_per_execution=N calls it every N steps)")
    if asked == "auto":  # Keras retunes it from each process's own clock, in a thread
        notes.append(f"the model was compiled with steps_per_execution='auto': it trains with {per_call} "
                     f"steps per call (hvdtrain's default), since Keras would tune it on each rank's own "
                     f"clock and the ranks must call back at the same steps (a checkpoint inside an epoch "
                     f"gathers from all)")
    if compat.keras3() and steps_per_epoch:
        per_call = _whole_calls(per_call, steps_per_epoch, notes)
    jit = cfg.jit_compile if cfg.jit_compile is not None else user.get("jit_compile")
    kwargs = {"loss": loss, "metrics": metrics,
              "loss_weights": user.get("loss_weights"), "weighted_metrics": user.get("weighted_metrics"),
              "run_eagerly": user.get("run_eagerly"),
              # as the user compiled it, so model.keras keeps it (Keras 3 takes no None, and reads it
              # once per fit: what it trains with)
              "steps_per_execution": per_call if compat.keras3() else asked,
              # Keras 3's default "auto" turns XLA on wherever a GPU is: only an explicit True asks
              "jit_compile": jit is True}
    return Compile(user.get("optimizer"), kwargs, described, per_call, notes)


def _whole_calls(per_call: int, steps_per_epoch: int, notes: list) -> int:
    """One stream across epochs under Keras 3, which fixes the steps per call for a whole fit() and,
    reading one iterator across epochs, runs whole calls: an epoch's last call would read the next
    epoch's batches. So the count divides the epoch (finite data end each epoch's last call where the
    epoch ends instead: data.Data.feed)."""
    fits = max(n for n in range(1, per_call + 1) if steps_per_epoch % n == 0)
    if fits != per_call:
        notes.append(f"{fits} step{'s' if fits > 1 else ''} per call, not {per_call}: the data are one stream "
                     f"across epochs, and Keras 3 runs whole calls, so the count divides the epoch's "
                     f"{steps_per_epoch} steps")
    return fits


def _keras_train_step():
    import tensorflow as tf

    return tf.keras.Model.train_step


def output_activations(model) -> list:
    """The activation at each output of a functional or sequential model ('softmax', 'sigmoid',
    'linear', ...), or None where it cannot be read (a subclassed model)."""
    import tensorflow as tf

    try:
        outputs = model.outputs or []
    except AttributeError:
        outputs = []
    found: list[str | None] = []
    for t in outputs:
        layer = compat.producer(t)
        if isinstance(layer, tf.keras.layers.Softmax):
            found.append("softmax")
            continue
        fn = getattr(layer, "activation", None)
        found.append(getattr(fn, "__name__", None))
    return found


def _probabilities(activations) -> bool:
    return bool(activations) and all(a in ("softmax", "sigmoid") for a in activations)


def _named_loss(name: str, activations):
    """A Keras loss by name; the crossentropies get from_logits from the output activation."""
    import tensorflow as tf

    if name in _FROM_LOGITS_LOSSES:
        cls = {"sparse_categorical_crossentropy": tf.keras.losses.SparseCategoricalCrossentropy,
               "categorical_crossentropy": tf.keras.losses.CategoricalCrossentropy,
               "binary_crossentropy": tf.keras.losses.BinaryCrossentropy}[name]
        return cls(from_logits=not _probabilities(activations))
    try:
        return tf.keras.losses.get(name)
    except (ValueError, TypeError):
        raise UserError(f"--loss {name}: not a Keras loss (e.g. mse, mae, binary_crossentropy, "
                        f"categorical_crossentropy, sparse_categorical_crossentropy)") from None


def _named_metric(name: str, binary_logits: bool):
    """A Keras metric by name; accuracy and AUC on binary logits get the threshold/flag logits need."""
    import tensorflow as tf

    if binary_logits and name in ("accuracy", "acc"):
        return tf.keras.metrics.BinaryAccuracy(name=name, threshold=0.0)
    if binary_logits and name == "auc":
        return tf.keras.metrics.AUC(name=name, from_logits=True)
    if name in ("accuracy", "acc", "crossentropy", "ce"):
        return name  # Keras picks the right one from the loss and the shapes
    try:
        tf.keras.metrics.get(name)
    except (ValueError, TypeError):
        raise UserError(f"--metrics {name}: not a Keras metric (e.g. accuracy, auc, mae, mse)") from None
    return name


def _binary_logits(loss, activations) -> bool:
    import tensorflow as tf

    return isinstance(loss, tf.keras.losses.BinaryCrossentropy) and loss.get_config().get("from_logits")


def _default_loss(model, activations):
    """Sparse categorical crossentropy, from_logits unless the model ends in a softmax."""
    import tensorflow as tf

    outputs = getattr(model, "outputs", None) or []
    units = [t.shape[-1] for t in outputs]
    if len(units) > 1:
        raise UserError("the model has several outputs: compile it with a loss for each, or pass --loss")
    if units and units[0] == 1 or activations == ["sigmoid"]:
        raise UserError("the model has one output unit: compile it with its loss, or pass --loss "
                        "(mse for regression, binary_crossentropy for two classes)")
    probs = _probabilities(activations)
    what = ("softmax output" if probs else "logits (the output has no softmax)") if activations else \
        "logits (assumed: the output activation of a subclassed model cannot be read; pass --loss or " \
        "compile the model to choose)"
    return (tf.keras.losses.SparseCategoricalCrossentropy(from_logits=not probs),
            f"sparse categorical crossentropy on {what}")


def describe(loss) -> str:
    if loss is None:
        return "none"
    if isinstance(loss, str):
        return loss
    if isinstance(loss, dict):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in loss.items()) + "}"
    if isinstance(loss, (list, tuple)):
        return "[" + ", ".join(describe(v) for v in loss) + "]"
    return getattr(loss, "name", None) or getattr(loss, "__name__", None) or type(loss).__name__
