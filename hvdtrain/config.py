"""The one training configuration: a dataclass filled from defaults, then a YAML file, then flags.

Every field's help text lives in its metadata, so `--help`, the YAML keys and the validation below
can never disagree. Validation happens in `Config.validate` and nowhere else; it raises `UserError`
with one line a user can act on. Nothing here imports TensorFlow, so a bad flag fails in well under
a second, before any worker spends time importing it.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import os
from dataclasses import dataclass, field
import typing
from typing import Dict, Optional, Tuple


class UserError(Exception):
    """A mistake in what the user asked for: reported as one line, exit status 2, no traceback."""


MODELS = ("mlp", "cnn", "resnet50")
DATA_SOURCES = ("digits", "synthetic", "npz:PATH", "tfrecord:GLOB", "mnist", "fashion_mnist",
                "cifar10", "module:function")
OPTIMIZERS = ("sgd", "momentum", "adam", "rmsprop")
# What a field left unset (None) falls back to when neither the model's own compile nor the data decide
DEFAULT_BATCH_SIZE, DEFAULT_LR, DEFAULT_OPTIMIZER = 32, 1e-3, "adam"
# Keras steps per call of the compiled step: against 1 at 2 workers, 1.6x for the MLP, 1.09x for the CNN,
# even for ResNet-50 (docs/benchmarks.md); 1 under --elastic, where Horovod's commit callback counts calls
DEFAULT_STEPS_PER_EXECUTION = 10
BUILT_IN_VAL_SPLIT = 0.2  # held out from the built-in data sets that come without a validation split
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")
SCHEDULES = ("constant", "step", "cosine")


class Mode(str, enum.Enum):
    """A mode a flag names: compared as the enum, read and written (flags, YAML, summary.json) as its word."""

    def __str__(self) -> str:
        return self.value


class Reduction(Mode):
    """How the gradients are combined: Horovod's ring-allreduce average, or Adasum."""
    AVERAGE = "average"
    ADASUM = "adasum"


class Sharding(Mode):
    """How a worker takes its part of the data (docs/data.md): every Nth element, its own files, every
    Nth batch of a pre-batched source, the user's own function's part, or all of it (one worker)."""
    ELEMENT = "element"
    FILE = "file"
    BATCH = "batch"
    YOURS = "yours"
    NONE = "none"


class Compression(Mode):
    """What the allreduce sends: the gradients as they are, or as float16."""
    NONE = "none"
    FP16 = "fp16"


def _f(default, help, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class Config:
    config: Optional[str] = _f(None, "YAML file with any of these fields as keys; flags win over it")
    model: str = _f("mlp", f"model: one of {', '.join(MODELS)}, or module:function returning a "
                           "tf.keras.Model, compiled or not (it may take input_shape and/or num_classes)")
    data: str = _f("digits", f"data source: one of {', '.join(DATA_SOURCES)}; a function may take a "
                             "context (rank, workers, batch size) and shard itself")
    epochs: int = _f(10, "number of epochs")
    batch_size: Optional[int] = _f(None, f"batch size per worker (global batch = batch_size x workers); "
                                         f"default: a batched pipeline's own, else {DEFAULT_BATCH_SIZE}")
    lr: Optional[float] = _f(None, "learning rate for one worker, scaled by the number of workers; "
                                   f"default: the compiled optimizer's, else {DEFAULT_LR}")
    optimizer: Optional[str] = _f(None, f"optimizer: one of {', '.join(OPTIMIZERS)}; default: the "
                                        f"model's compiled optimizer, else {DEFAULT_OPTIMIZER}")
    loss: Optional[str] = _f(None, "Keras loss name (mse, binary_crossentropy, ...); default: the "
                                   "compiled loss, else sparse categorical crossentropy; crossentropies "
                                   "take from_logits from the model's output activation")
    metrics: Optional[Tuple[str, ...]] = _f(None, "Keras metric names; default: the compiled metrics, else "
                                                  "accuracy")
    num_classes: Optional[int] = _f(None, "classes, for the built-in models and a model function that takes "
                                          "num_classes; default: counted in the labels (one pass over the data)")
    class_weight: Tuple[Tuple[int, float], ...] = _f((), "each class's weight in the loss, Keras' "
                                                         "fit(class_weight=): --class-weight 0=1 1=5 (YAML "
                                                         "and hvdtrain.fit: {0: 1, 1: 5}); default: none")
    callbacks: Optional[str] = _f(None, "module:function returning a list of Keras callbacks (they see the "
                                        "metrics of all workers; those that write files run on rank 0)")
    warmup_epochs: float = _f(1.0, "epochs of linear warm-up from lr to lr x workers (0: none)")
    seed: int = _f(42, "random seed for weights and data order")
    output_dir: Optional[str] = _f(None, "where everything the run writes goes "
                                         "(default: runs/<model>-<data>)")
    steps_per_epoch: Optional[int] = _f(None, "cap on steps per epoch (default: one pass over "
                                              "each worker's shard)")
    val_split: Optional[float] = _f(None, "fraction held out for validation when the data has no "
                                          f"validation set; default: {BUILT_IN_VAL_SPLIT} for the "
                                          "built-in data sets, none for yours (0: none)")
    shuffle: bool = _f(True, "reshuffle the training data every epoch (same order on every rank)")
    synthetic_shape: Tuple[int, int, int] = _f((32, 32, 3), "input shape of the synthetic source")
    synthetic_classes: int = _f(10, "classes of the synthetic source")
    synthetic_samples: int = _f(2048, "samples of the synthetic source")
    threads: int = _f(0, "intra-op threads per CPU worker (0: cores / workers on this host)")
    tensorboard: bool = _f(True, "write TensorBoard logs (rank 0)")
    save_model: bool = _f(True, "save the final model to output_dir/model.keras (rank 0)")
    worker_logs: bool = _f(True, "every worker writes output_dir/logs/rank<N>.log")
    verbose: int = _f(1, "progress on rank 0: 0 silent, 1 a line every --log-every seconds (a bar on a "
                         "terminal) and one per epoch, 2 one line per epoch")
    log_every: float = _f(30.0, "seconds between progress lines within an epoch (verbose 1)")
    steps_per_execution: Optional[int] = _f(None, "training steps per call of the compiled step (Keras): "
                                                  "fewer Python round trips per step; step checkpoints "
                                                  "still land on their steps; default: the model's "
                                                  "compile, else 10 (1 with --elastic)")
    jit_compile: Optional[bool] = _f(None, "compile the training step with XLA (GPU workers only: Horovod "
                                           "has XLA kernels for its allreduce only there); "
                                           "default: the model's compile, else off")
    # checkpoints
    checkpoint_every: int = _f(1, "write a checkpoint every N epochs and at the end (0: never)")
    checkpoint_every_steps: int = _f(1000, "also write one every N steps inside an epoch (0: never); a "
                                           "resume continues at the next step, on the same data order")
    checkpoint_every_minutes: Optional[float] = _f(None, "instead of --checkpoint-every-steps: about "
                                                         "every M minutes (rank 0 times the steps)")
    keep_checkpoints: int = _f(3, "keep the last K checkpoints")
    resume: Optional[str] = _f(None, "resume from this checkpoint (a ckpt-N path or a checkpoint dir)")
    auto_resume: bool = _f(True, "resume from output_dir/checkpoints when it holds a checkpoint")
    # gradients
    backward_passes_per_step: int = _f(1, "micro-batches accumulated per update (effective batch = "
                                          "batch_size x passes x workers)")
    compression: str = _f("none", "gradient compression for the allreduce: none or fp16")
    allreduce_groups: int = _f(0, "split the gradients into N groups, each allreduced as soon as all of "
                                  "its gradients are ready (Horovod's num_groups; 0: Horovod's fusion alone)")
    reduction: str = _f("average", "gradient reduction: average (ring-allreduce) or adasum")
    sparse_as_dense: bool = _f(False, "allreduce sparse gradients (embeddings) as dense tensors")
    clip_norm: Optional[float] = _f(None, "clip the averaged gradient to this global norm")
    precision: Optional[str] = _f(None, f"compute precision: {', '.join(PRECISIONS)}; default: the "
                                        f"Keras global policy the script set, else float32")
    # learning-rate schedule after warm-up
    lr_schedule: str = _f("constant", f"after warm-up: {', '.join(SCHEDULES)}")
    lr_decay_epochs: Tuple[int, ...] = _f((), "step schedule: epochs at which the lr is multiplied by "
                                              "lr_decay_factor")
    lr_decay_factor: float = _f(0.1, "step schedule: multiplier at each of lr_decay_epochs")
    # stopping and best model, decided on metrics averaged over all workers
    early_stopping_patience: int = _f(0, "stop after N epochs without improvement of monitor (0: off)")
    monitor: str = _f("val_loss", "metric for early stopping and best-model keeping")
    keep_best: bool = _f(True, "save output_dir/best.weights.h5 whenever monitor improves (rank 0)")
    preemption_signals: Tuple[str, ...] = _f(("TERM",), "signals that stop every worker at the same next step, "
                                                        "after a step checkpoint, with exit status 75 (the same "
                                                        "command resumes); e.g. TERM USR1 (Slurm's "
                                                        "--signal=USR1@120); none: off")
    hang_frozen_seconds: float = _f(45.0, "name a rank whose process has not answered for this long (stopped, "
                                          "or stuck in the kernel), then end the job with exit status 75 (the "
                                          "same command resumes from the last checkpoint); 0: off")
    hang_stuck_seconds: Optional[float] = _f(None, "name a live rank that has not reached its step's allreduce for "
                                                   "this long while the others wait there (its input pipeline or "
                                                   "step blocked), then end the job as above; default: the larger "
                                                   "of 180 s and 50 median steps; 0: off")
    hang_collective_seconds: float = _f(60.0, "name the ranks when every one has waited this long in a "
                                              "collective that never completes (they wait in different ones, "
                                              "or traced their steps differently), then end the job as above; "
                                              "0: off")
    deterministic: bool = _f(True, "deterministic TensorFlow ops: same seed, same weights, bit for bit")
    # Horovod knobs
    horovod_timeline: Optional[str] = _f(None, "write Horovod's Chrome-trace timeline here (rank 0)")
    stall_check_seconds: Optional[int] = _f(None, "warn when a rank has not joined an allreduce "
                                                  "for this long (Horovod default 60)")
    stall_shutdown_seconds: Optional[int] = _f(None, "end the job when a rank has stalled for this "
                                                     "long (Horovod default: never)")
    fusion_threshold_mb: Optional[float] = _f(None, "tensor fusion buffer in MiB (Horovod default 128)")
    cycle_time_ms: Optional[float] = _f(None, "Horovod background cycle time in ms (default: 0.2 for CPU "
                                              "workers under MPI, 5 under Gloo, else Horovod's 1)")
    autotune: bool = _f(False, "let Horovod tune fusion threshold and cycle time")
    # elastic training: under `horovodrun --min-np/--max-np --host-discovery-script`
    elastic: bool = _f(False, "elastic training: keep going when workers die, take in hosts that "
                              "appear (needs horovodrun with --host-discovery-script or --min-np)")
    commit_every: int = _f(10, "elastic: commit the training state every N steps (and every epoch; with "
                               "--steps-per-execution K, at the end of the call that reaches them); a "
                               "failure rolls back to the last commit")

    # ---- validation: the one place ----
    def validate(self, model_object: bool = False, data_object: bool = False) -> "Config":
        """model_object/data_object: hvdtrain.fit() was handed a model or data object, and `model`
        or `data` only names it (for the output dir and the summary)."""
        for name in ("epochs", "batch_size", "synthetic_classes", "synthetic_samples",
                     "keep_checkpoints", "backward_passes_per_step", "commit_every", "steps_per_execution",
                     "num_classes"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise UserError(f"--{_flag(name)} must be a positive integer, got {getattr(self, name)}")
        if self.lr is not None and not self.lr > 0:
            raise UserError(f"--lr must be positive, got {self.lr}")
        if self.log_every < 0:
            raise UserError(f"--log-every must be >= 0 seconds, got {self.log_every}")
        if self.warmup_epochs < 0:
            raise UserError(f"--warmup-epochs must be >= 0, got {self.warmup_epochs}")
        if self.steps_per_epoch is not None and self.steps_per_epoch <= 0:
            raise UserError(f"--steps-per-epoch must be a positive integer, got {self.steps_per_epoch}")
        if self.val_split is not None and not 0 <= self.val_split < 1:
            raise UserError(f"--val-split must be at least 0 and below 1, got {self.val_split}")
        if self.metrics is not None and not all(isinstance(m, str) and m for m in self.metrics):
            raise UserError(f"--metrics takes Keras metric names, got {list(self.metrics)}")
        if self.loss is not None and not self.loss:
            raise UserError("--loss takes a Keras loss name, e.g. mse or binary_crossentropy")
        if self.threads < 0:
            raise UserError(f"--threads must be >= 0, got {self.threads}")
        if any(d <= 0 for d in self.synthetic_shape):
            raise UserError(f"--synthetic-shape must be positive, got {list(self.synthetic_shape)}")
        if self.checkpoint_every_minutes is not None and not self.checkpoint_every_minutes > 0:
            raise UserError(f"--checkpoint-every-minutes must be positive, got {self.checkpoint_every_minutes}")
        for name in ("checkpoint_every", "checkpoint_every_steps", "early_stopping_patience", "allreduce_groups"):
            if getattr(self, name) < 0:
                raise UserError(f"--{_flag(name)} must be >= 0, got {getattr(self, name)}")
        for name, allowed in (("compression", tuple(Compression)), ("reduction", tuple(Reduction)),
                              ("precision", PRECISIONS), ("lr_schedule", SCHEDULES)):
            if getattr(self, name) not in allowed and not (name == "precision" and self.precision is None):
                raise UserError(f"--{_flag(name)} must be one of {', '.join(allowed)}, "
                                f"got {getattr(self, name)!r}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise UserError(f"--clip-norm must be positive, got {self.clip_norm}")
        if list(self.lr_decay_epochs) != sorted(set(self.lr_decay_epochs)) or \
                any(e <= 0 for e in self.lr_decay_epochs):
            raise UserError(f"--lr-decay-epochs must be increasing positive epochs, "
                            f"got {list(self.lr_decay_epochs)}")
        if self.lr_schedule == "step" and not self.lr_decay_epochs:
            raise UserError("--lr-schedule step needs --lr-decay-epochs, e.g. --lr-decay-epochs 30 60")
        for name in ("hang_frozen_seconds", "hang_stuck_seconds", "hang_collective_seconds"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise UserError(f"--{_flag(name)} must be 0 (off) or a number of seconds, got {getattr(self, name)}")
        for name in ("fusion_threshold_mb", "cycle_time_ms", "stall_check_seconds", "stall_shutdown_seconds"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise UserError(f"--{_flag(name)} must be positive, got {getattr(self, name)}")
        if self.allreduce_groups and self.reduction == Reduction.ADASUM:
            raise UserError("--allreduce-groups groups Horovod's ring-allreduce; --reduction adasum "
                            "reduces each gradient on its own")
        if self.elastic and self.reduction == Reduction.ADASUM:
            raise UserError("--elastic runs on the Gloo controller and --reduction adasum needs MPI; "
                            "drop one of them")
        if self.resume and not (os.path.exists(self.resume) or os.path.exists(self.resume + ".index")):
            raise UserError(f"--resume {self.resume!r}: no such checkpoint")
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise UserError(f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        import signal

        for name in self.preemption_signals:
            if name.upper() in ("KILL", "STOP") or not isinstance(getattr(signal, f"SIG{name}", None), signal.Signals):
                raise UserError(f"--preemption-signals: {name!r} is not a signal a process can handle; give names "
                                f"without SIG, e.g. TERM USR1")
        if self.callbacks is not None and not _is_module_ref(self.callbacks):
            raise UserError(f"--callbacks takes module:function (a function returning a list of Keras callbacks), "
                            f"got {self.callbacks!r}")
        if not model_object and self.model not in MODELS and not _is_module_ref(self.model):
            raise UserError(f"unknown model {self.model!r}; choose one of {', '.join(MODELS)} "
                            "or give module:function")
        kind, _, arg = self.data.partition(":")
        if data_object:
            pass
        elif kind in ("npz", "tfrecord"):
            if not arg:
                raise UserError(f"--data {kind!r}: needs a path, e.g. {kind}:/data/train.{kind}")
            if kind == "npz" and not os.path.isfile(arg):
                raise UserError(f"--data {self.data!r}: no such file")
        elif kind in ("digits", "synthetic", "mnist", "fashion_mnist", "cifar10") and not arg:
            pass
        elif not _is_module_ref(self.data):
            raise UserError(f"unknown data source {self.data!r}; choose one of {', '.join(DATA_SOURCES)}")
        return self

    def class_weights(self) -> Optional[Dict[int, float]]:
        """class_weight as Keras' fit takes it, {class index: weight}; None when not given."""
        return dict(self.class_weight) or None

    @property
    def run_dir(self) -> str:
        """Deterministic, so every rank agrees without talking and a re-run finds its checkpoints."""
        if self.output_dir:
            return self.output_dir
        tag = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.data.split("/")[-1])
        return os.path.join("runs", f"{self.model.replace(':', '_')}-{tag}")

    def to_dict(self) -> dict:
        """As JSON keeps it (lists, a mapping for class_weight), and as from_dict takes it back."""
        d = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
        d["class_weight"] = self.class_weights() or {}
        return d

    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.run_dir, "checkpoints")

    def horovod_env(self) -> dict:
        """The Horovod knobs as the environment variables hvd.init() reads."""
        env = {}
        if self.horovod_timeline:
            env["HOROVOD_TIMELINE"] = os.path.abspath(self.horovod_timeline)
        if self.stall_check_seconds:
            env["HOROVOD_STALL_CHECK_TIME_SECONDS"] = str(self.stall_check_seconds)
        elif self.hang_collective_seconds and "HOROVOD_STALL_CHECK_TIME_SECONDS" not in os.environ:
            # Horovod's stall warning (every 60 s, the tensors of every rank) comes after hvdtrain's line
            env["HOROVOD_STALL_CHECK_TIME_SECONDS"] = str(int(max(60, 2 * self.hang_collective_seconds)))
        if self.stall_shutdown_seconds:
            env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = str(self.stall_shutdown_seconds)
        if self.fusion_threshold_mb:
            env["HOROVOD_FUSION_THRESHOLD"] = str(int(self.fusion_threshold_mb * 1024 * 1024))
        if self.cycle_time_ms:
            env["HOROVOD_CYCLE_TIME"] = str(self.cycle_time_ms)
        if self.jit_compile:
            env["HOROVOD_ENABLE_XLA_OPS"] = "1"  # Horovod's XLA kernels (GPU builds), for the allreduce
        if self.autotune:
            env["HOROVOD_AUTOTUNE"] = "1"
            env["HOROVOD_AUTOTUNE_LOG"] = os.path.abspath(os.path.join(self.run_dir, "autotune.csv"))
        return env


def _is_module_ref(s: str) -> bool:
    mod, sep, fn = s.partition(":")
    return bool(sep and fn.isidentifier() and all(p.isidentifier() for p in mod.split(".")))


def _flag(name: str) -> str:
    return name.replace("_", "-")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage on every rank and exit; we report once
        raise UserError(message)


def build_parser(prog="hvdtrain") -> argparse.ArgumentParser:
    """A flag per field, its kind from the field's type: a switch for a bool, N values for a tuple."""
    p = _Parser(prog=prog, description="Data-parallel Keras training on Horovod. Run it alone, or "
                "under horovodrun/mpirun for several workers.", argument_default=argparse.SUPPRESS)
    for f in dataclasses.fields(Config):
        text, hint = f.metadata["help"], _not_none(HINTS[f.name])
        kw = {"help": text if "default:" in text else f"{text} (default: {f.default})"}
        if f.name in SPECIAL:
            kw["nargs"] = "*"
        elif hint is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(hint) is tuple:
            items = typing.get_args(hint)
            kw["nargs"], kw["type"] = "*" if items[-1] is Ellipsis else len(items), items[0]
        else:
            kw["type"] = hint
        p.add_argument(f"--{_flag(f.name)}", dest=f.name, **kw)  # type: ignore[arg-type]  # kw: each kind's own keys
    return p


def load(argv=None) -> Config:
    """Defaults < YAML file < flags, then validate."""
    flags = vars(build_parser().parse_args(argv))
    values = {}
    if flags.get("config"):
        values.update(_read_yaml(flags["config"]))
    values.update(flags)
    return from_dict(values).validate()


# Keras fit() keywords that hvdtrain.fit cannot take with Keras' meaning, and why (the others it takes:
# docs/python-api.md "Keras' fit keywords"; validation_split is hvdtrain.fit's own keyword)
KERAS_FIT_REFUSED = {
    "x": "hvdtrain.fit(model, data): pass x and y as data=(x, y)",
    "y": "hvdtrain.fit(model, data): pass x and y as data=(x, y)",
    "sample_weight": "sample_weight: give the weights in the data, a tf.data.Dataset of (x, y, "
                     "sample_weight), so that each worker's shard keeps its own",
    "initial_epoch": "initial_epoch: hvdtrain resumes from its own checkpoints in output_dir, at the epoch "
                     "and step they were saved at; a run without them starts at epoch 1",
    "validation_steps": "validation_steps: every worker evaluates its shard of the whole validation set, so "
                        "the metrics are those of all of it; give a smaller validation set instead",
    "validation_batch_size": "validation_batch_size: the validation set is evaluated at batch_size; batch "
                             "it yourself in a tf.data.Dataset to choose",
    "validation_freq": "validation_freq: hvdtrain validates after every epoch, where the workers agree on "
                       "their metrics; give no validation data to skip it",
    **{key: f"{key}: Keras 2's, for a Sequence read in threads or processes; Keras 3 has none (a PyDataset takes "
            f"workers= itself), and hvdtrain reads a Sequence in each worker's own order"
       for key in ("max_queue_size", "workers", "use_multiprocessing")},
}


def from_dict(values: dict) -> Config:
    """A Config from values as flags, YAML or hvdtrain.fit give them, each coerced to its field's type."""
    kwargs = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name in KERAS_FIT_REFUSED:
            raise UserError(KERAS_FIT_REFUSED[name])
        if name not in HINTS:
            raise UserError(f"unknown config key {key!r}; known keys: {', '.join(sorted(HINTS))}")
        try:
            kwargs[name] = SPECIAL.get(name, _coerce)(HINTS[name], value)
        except (TypeError, ValueError):
            raise UserError(f"config key {key!r}: expected {_describe(HINTS[name])}, got {value!r}") from None
    return Config(**kwargs)


def _coerce(hint, value, item=False):
    """`value` as the type `hint` says (Optional[X], Tuple[X, ...], Tuple[X, Y], bool, int, float, str);
    ValueError where it is not one. No bool passes for a number, no fraction for an int, and a number
    passes for a string only as a field's whole value (YAML `output_dir: 2024`), not in a list."""
    if typing.get_origin(hint) is typing.Union:  # Optional[X]
        return None if value is None else _coerce(_not_none(hint), value)
    if typing.get_origin(hint) is tuple:
        items = typing.get_args(hint)
        if isinstance(value, str):
            value = [value]  # YAML `metrics: accuracy`, one value for a list
        if not isinstance(value, (list, tuple)):
            raise ValueError
        items = items[:1] * len(value) if items[-1] is Ellipsis else items
        if len(items) != len(value):
            raise ValueError
        return tuple(_coerce(t, v, item=True) for t, v in zip(items, value))
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError
        return value
    if isinstance(value, bool) or (hint is not str and not isinstance(value, (int, float, str))):
        raise ValueError
    if hint is int:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError
        return int(value)
    if hint is float:
        return float(value)
    if hint is str and (isinstance(value, str) or not item):
        return str(value)
    raise ValueError


def _class_weight(hint, value) -> tuple:
    """{class: weight} (YAML, hvdtrain.fit, a summary's config) or CLASS=WEIGHT strings (flags), as
    (class, weight) pairs: a class index >= 0 once, a weight >= 0."""
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)):
        pairs = [v.partition("=")[::2] if isinstance(v, str) and "=" in v else (v, None) for v in value]
    else:
        raise ValueError
    weights = {}
    for k, v in pairs:
        c: Optional[int]
        w: Optional[float]
        try:
            c, w = int(k), float(v)
        except (TypeError, ValueError):
            c, w = None, None
        if c is None or w is None or isinstance(k, (bool, float)) or c < 0 or not w >= 0 or c in weights:
            raise UserError(f"--class-weight takes CLASS=WEIGHT pairs, one per class (a class index >= 0, a "
                            f"weight >= 0), e.g. --class-weight 0=1 1=5; got {k if v is None else f'{k}={v}'!r}")
        weights[c] = w
    return tuple(weights.items())


def _not_none(hint):
    """X of Optional[X]; any other type as it is."""
    if typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _describe(hint) -> str:
    hint = _not_none(hint)
    if typing.get_origin(hint) is tuple:
        items = typing.get_args(hint)
        return f"a list of {_describe(items[0])}" if items[-1] is Ellipsis else f"{len(items)} x {_describe(items[0])}"
    return hint.__name__


HINTS = typing.get_type_hints(Config)  # every field's real type: the flags and the coercion follow it
SPECIAL = {"class_weight": _class_weight}  # the fields a type alone cannot read


def _read_yaml(path: str) -> dict:
    import yaml

    try:
        with open(path) as fh:
            doc = yaml.safe_load(fh)
    except FileNotFoundError:
        raise UserError(f"--config {path}: no such file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"--config {path}: malformed YAML{where}: {getattr(e, 'problem', e)}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise UserError(f"--config {path}: expected a mapping of config keys, got {type(doc).__name__}")
    if "config" in doc:
        raise UserError(f"--config {path}: a config file cannot name another config file")
    return doc


def flags_markdown() -> str:
    """The flags as a markdown table (flag, default, what it does), made from the parser build_parser()
    makes and the fields' own metadata, so that the docs cannot restate them by hand: docs/training.md
    holds this table between marker comments (scripts/flags_doc.py writes it there; a test compares)."""
    import re

    def cell(text: str) -> str:  # paths such as runs/<model>-<data> as code, so that <...> shows
        return re.sub(r"(\S*<[^>\s]+>\S*)", r"`\1`", text).replace("|", "\\|")

    fields = {f.name: f for f in dataclasses.fields(Config)}
    kinds: Dict[object, str] = {int: "N", float: "X", str: "TEXT"}
    rows = ["| flag | default | what it does |", "| --- | --- | --- |"]
    for action in build_parser()._actions:
        if action.dest not in fields:
            continue  # --help
        f, text = fields[action.dest], fields[action.dest].metadata["help"]
        if isinstance(action, argparse.BooleanOptionalAction):
            flag = ", ".join(f"`{s}`" for s in action.option_strings)
        else:
            kind = "K=V" if action.dest in SPECIAL else kinds.get(action.type, "VALUE")
            args = f"{kind} ..." if action.nargs == "*" else " ".join([kind] * int(action.nargs or 1))
            flag = f"`{action.option_strings[0]} {args}`"
        said = re.search(r" \(default: (.*)\)$", text) or re.search(r"; default: ([^;]*)", text)
        if said:
            default, text = said.group(1), text[:said.start()] + text[said.end():]
        elif f.default is None:
            default = "unset"
        elif isinstance(f.default, bool):
            default = "on" if f.default else "off"
        elif isinstance(f.default, tuple):
            default = " ".join(str(v) for v in f.default) or "none"
        else:
            default = str(f.default)
        rows.append(f"| {flag} | {cell(default)} | {cell(text)} |")
    return "\n".join(rows) + "\n"
