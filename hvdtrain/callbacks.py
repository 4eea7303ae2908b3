"""The Keras callbacks hvdtrain adds to model.fit, and why each exists.

- EpochEnd (every rank): at each epoch's end the ranks agree. Non-trainable state (BatchNorm's moving
  statistics) is averaged, so every rank holds the same model; metrics are combined from their state
  (totals and counts summed over ranks), so they are those of one worker that saw all the data; the
  validation set, sharded, is evaluated once per example and combined the same way.
- Progress (rank 0): a line every --log-every seconds and one per epoch (a bar on a terminal).

Neither has a per-batch hook: Keras would then call every callback's hooks every step (TensorBoard's
alone cost 0.15 ms a step here). Progress reads the step counter from a timer thread instead.
"""
from __future__ import annotations

import sys
import threading
import time
import warnings

from . import compat, optimizer, runtime
from .checkpoint import per_rank_variables


def _allreduce(tensors, op):
    import horovod.tensorflow as hvd

    with runtime.collective("the epoch's end (hvdtrain.epoch_end, the metrics' allreduce)"):
        return hvd.grouped_allreduce(tensors, op=op, name="hvdtrain.epoch_end")


def average_non_trainable(model):
    """BatchNorm's moving mean and variance (per_rank_variables), averaged over ranks. Each rank's
    statistics come from its own shard; averaging them gives every rank the same model. Summed and
    divided in float64, so that values no step changed come back bit-identical at any number of
    workers (Horovod's float32 average moves about a third of them by one ulp at 3 workers)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    world = runtime.world()
    if world.size == 1:
        return
    variables = per_rank_variables(model)
    if variables:
        sums = _allreduce([tf.cast(v.value(), tf.float64) for v in variables], hvd.Sum)
        for v, total in zip(variables, sums):
            v.assign(tf.cast(total / world.size, v.dtype))


def check_the_weights_agree(model, after: str):
    """Stop a job whose ranks train apart, on every rank at once: the same weights give the same
    fingerprint (sums of the trainable weights, in float64) on every rank. They differ when a step
    applied gradients through an optimizer that does not average them (one the model keeps where
    hvdtrain cannot find it: a list, a global); after an epoch of that, far beyond float rounding."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    variables = compat.tf_variables(model.trainable_variables)
    if runtime.world().size == 1 or not variables:
        return
    values = [tf.cast(v.value(), tf.float64) for v in variables]
    mine = tf.stack([tf.add_n([tf.reduce_sum(tf.abs(v)) for v in values]),
                     tf.add_n([tf.reduce_sum(tf.square(v)) for v in values]),
                     tf.add_n([tf.reduce_sum(v) for v in values])])
    highest, lowest = (t.numpy() for t in _allreduce([mine, -mine], hvd.Max))
    lowest = -lowest
    if (highest - lowest).max() > 1e-9 * (abs(highest[0]) + 1e-30):
        held = ", ".join(optimizer.found_in(model)) or "none"
        raise runtime.UserError(
            f"the workers' weights differ after {after}: the training step applied gradients that "
            f"were not averaged. hvdtrain averages those of the optimizers {model.name} holds in its "
            f"attributes ({held}); one held elsewhere (in a list, a global) trains each worker on its own: "
            f"keep each optimizer in an attribute of the model")


def first_steps_agree():
    """For a model with optimizers of its own (keras.io's GAN): the weights' agreement checked after the
    first call of its step too, so that a step that updates the weights apart from any optimizer
    (TrainStep refuses an optimizer hvdtrain did not find before its first update) stops at its first
    steps, not an epoch later. Only such a model gets it: a batch hook makes Keras call every
    callback's after every call."""
    import tensorflow as tf

    class FirstStepsAgree(tf.keras.callbacks.Callback):
        checked = False

        def on_train_batch_end(self, batch, logs=None):
            if not self.checked:  # every rank ends its first call at the same step
                self.checked = True
                check_the_weights_agree(self.model, "its first steps")

    return FirstStepsAgree()


def combined_metrics(model, logs: dict) -> dict:
    """The model's metrics over all ranks: each metric's state variables (totals, counts, confusion
    counts) summed, then its result. Values in `logs` that no metric produced (a custom train_step's
    own) are averaged, as Horovod's MetricAverageCallback does."""
    import horovod.tensorflow as hvd
    import numpy as np

    if runtime.world().size == 1:
        return {k: _scalar(v) for k, v in logs.items()}
    variables = compat.tf_variables(v for m in model.metrics for v in m.variables)
    if variables:
        for v, total in zip(variables, _allreduce([v.value() for v in variables], hvd.Sum)):
            v.assign(total)
    results = {k: _scalar(v) for k, v in model.get_metrics_result().items() if np.asarray(v).size == 1}
    combined = {k: results[k] for k in logs if k in results}
    others = sorted(k for k in logs if k not in results)
    if others:
        for k, mean in zip(others, _allreduce([np.float64(_scalar(logs[k])) for k in others], hvd.Average)):
            combined[k] = float(mean)
    return combined


def _scalar(v) -> float:
    import numpy as np

    return float(np.asarray(v))


def make(cfg, data, world_size: int, chief: bool):
    """(EpochEnd, Progress or None). Their classes are made in functions, so that tf.keras is imported
    only when training (a bad flag fails before any worker imports TensorFlow)."""
    epoch_end = _epoch_end_class(data)()
    if chief and cfg.verbose:
        epoch_end.progress = _progress_class(cfg, data, world_size)(epoch_end)
    return epoch_end, epoch_end.progress


def _epoch_end_class(data):
    import tensorflow as tf

    class EpochEnd(tf.keras.callbacks.Callback):
        """See the module docstring. Runs before every other callback, so they all see agreed values."""

        def __init__(self):
            super().__init__()
            self.epoch_seconds = []
            self.progress = None  # its timer stops before the metrics are combined and reset

        def on_epoch_begin(self, epoch, logs=None):
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            # Keras has made the logs numpy by now: every step of the epoch has run
            self.epoch_seconds.append(time.perf_counter() - self.t0)
            if self.progress is not None:
                self.progress.pause()
            logs = logs if logs is not None else {}
            average_non_trainable(self.model)
            check_the_weights_agree(self.model, f"epoch {epoch + 1}")
            logs.update(combined_metrics(self.model, {k: v for k, v in logs.items()
                                                      if not k.startswith("val_")}))
            if data.val is not None:
                try:
                    logs.update({f"val_{k}": v for k, v in self._validate().items()})
                except Exception as e:  # noqa: BLE001 (re-raised, marked: train.fit_fixed says it was validation)
                    e.hvdtrain_validating_after_epoch = epoch + 1  # type: ignore[attr-defined]  # read by train.py
                    raise
            if optimizer.compiled_trains(self.model):  # not a model's own optimizers'
                logs["lr"] = float(self.model.optimizer.learning_rate.numpy())

        def _validate(self) -> dict:
            """This rank's part of the validation set, then the metrics of all parts together. A part
            of unknown size is evaluated one step per call: Keras runs several only on a known count."""
            per_call = compat.steps_per_execution(self.model)
            if int(data.val.cardinality()) < 0 and compat.calls_can_be_cut_short():
                self.model.steps_per_execution = 1
            try:
                with warnings.catch_warnings():  # Keras 3 calls reading a set of unknown size to its end
                    warnings.filterwarnings("ignore", message="Your input ran out of data")  # "running out"
                    local = self.model.evaluate(data.val, verbose=0, return_dict=True)
            except ValueError as e:  # Keras' word for a shard with no batch: it adds nothing
                if "Empty logs" not in str(e):
                    raise
                self.model.reset_metrics()
                local = {k: 0.0 for k in self.model.get_metrics_result()}
            finally:
                self.model.steps_per_execution = per_call
            return combined_metrics(self.model, local)

        def samples_per_sec(self) -> float:
            """This worker's training throughput: the epochs' training time, validation left out; the
            first epoch (tracing, pipeline warm-up) too when there are others."""
            seconds = self.epoch_seconds[1:] if len(self.epoch_seconds) > 1 else self.epoch_seconds
            return len(seconds) * data.steps_per_epoch * data.batch_size / sum(seconds) if seconds else 0.0

    return EpochEnd


def _progress_class(cfg, data, world_size: int):
    import tensorflow as tf

    class Progress(tf.keras.callbacks.Callback):
        """Rank 0's progress: plain lines (every --log-every seconds, and one per epoch) when its
        output is a pipe or a launcher's (horovodrun, mpirun), a bar when it is a terminal."""

        def __init__(self, epoch_end):
            super().__init__()
            self.epoch_end = epoch_end
            self.tty = sys.stdout.isatty() and not runtime.under_launcher()
            self.every = (0.5 if self.tty else cfg.log_every) if cfg.verbose == 1 else 0
            self.stop = threading.Event()

        def on_train_begin(self, logs=None):
            self.started, self.epochs_done = time.perf_counter(), 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch, self.t0 = epoch, time.perf_counter()
            self.step0 = int(optimizer.steps(self.model).numpy())
            if self.every:
                self.stop.clear()
                self.thread = threading.Thread(target=self._report, daemon=True, name="hvdtrain-progress")
                self.thread.start()

        def _report(self):
            last = (0, self.t0)  # the steps done, and when a step last finished
            while not self.stop.wait(self.every):
                now = time.perf_counter()
                done = int(optimizer.steps(self.model).numpy()) - self.step0
                if done != last[0]:
                    last = (done, now)
                quiet = now - last[1]
                if quiet < self.every and done > 0:  # steps finished since the last line
                    seconds = now - self.t0
                    rate = done * data.batch_size * world_size / seconds
                    left = (data.steps_per_epoch - done) * seconds / done
                    how = f"{rate:,.0f} samples/s | epoch ETA {_clock(left)}"
                elif quiet >= max(self.every, 10):  # none: no rate to estimate from, say so
                    how = f"no step finished for {quiet:.0f} s"
                else:
                    continue
                metrics = self.model.get_metrics_result() if done > 0 else {}  # Keras 3 nests the compiled
                line = (f"epoch {self.epoch + 1}/{cfg.epochs} step {min(done, data.steps_per_epoch)}/"
                        f"{data.steps_per_epoch} {_bar(done, data.steps_per_epoch) if self.tty else ''}"
                        f"{_fmt(metrics)} | {how}")
                if self.tty:
                    print("\r" + line[:160].ljust(120), end="", flush=True)
                else:  # the line and its newline in one write: horovodrun prefixes what each read brings
                    print(f"hvdtrain: {line}\n", end="", flush=True)

        def pause(self):
            if self.every:
                self.stop.set()
                self.thread.join()

        def on_epoch_end(self, epoch, logs=None):
            self.epochs_done += 1
            seconds = self.epoch_end.epoch_seconds[-1]
            rate = data.steps_per_epoch * data.batch_size * world_size / seconds
            eta = (cfg.epochs - epoch - 1) * (time.perf_counter() - self.started) / self.epochs_done
            line = (f"epoch {epoch + 1}/{cfg.epochs} {_fmt(logs)} | {rate:,.0f} samples/s | "
                    f"{seconds:.1f} s | ETA {_clock(eta)}")
            print(("\r" + " " * 120 + "\r" if self.tty and self.every else "") + f"hvdtrain: {line}\n",
                  end="", flush=True)

        def on_train_end(self, logs=None):
            self.stop.set()

    return Progress


def _fmt(logs) -> str:
    """The logs as "loss 0.3 accuracy 0.9 val_loss ... lr ...", in that order on both Keras
    generations (Keras 3 lists the compiled metrics before the loss)."""
    import numpy as np

    items = []
    order = lambda k: (k == "lr", k.startswith("val_"), k.removeprefix("val_") != "loss")  # noqa: E731
    for k, v in sorted((logs or {}).items(), key=lambda kv: order(kv[0])):
        try:
            items.append(f"{k} {float(np.asarray(v)):.4g}")
        except (TypeError, ValueError):
            pass
    return " ".join(items)


def _bar(done: int, total: int, width: int = 20) -> str:
    full = min(width, int(width * done / max(total, 1)))
    return "[" + "=" * full + ">" * (full < width) + "." * max(0, width - full - 1) + "] "


def _clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def checkpoints(cfg, ckpts, steps_per_epoch: int, first_epoch: int, first_step: int, per_call: int = 1):
    """The callback that writes checkpoints (ckpts: a checkpoint.Checkpoints), or None.

    At the end of every --checkpoint-every epochs; and inside epochs every --checkpoint-every-steps
    steps (or about every --checkpoint-every-minutes, rank 0's clock turned into a step count that
    every rank is told), so that every rank reaches the save, and its collective, at the same step.
    Only then does Keras call a per-batch hook; it reads no tensor (the step count is Keras' own) and takes
    the step's logs as they are, so Keras syncs nothing for it.

    Keras calls back only between calls of the compiled step (per_call steps each), so the call before
    a save is cut short to end on it: Keras reads the count before every call (its own tuner and its
    epoch's last call change it the same way), and the same cut on every rank keeps them in step.
    """
    import tensorflow as tf

    by_steps = bool(cfg.checkpoint_every_steps or cfg.checkpoint_every_minutes)
    if not cfg.checkpoint_every and not by_steps:
        return None

    class EpochCheckpoints(tf.keras.callbacks.Callback):
        step_due_at_end = False

        def __init__(self):
            super().__init__()
            # Keras then hands the step's logs over as they are. Set on the instance: Callback.__init__
            # sets False there, which hid a class attribute, and Keras converted every step's logs
            # to numpy for this hook, a host sync per step (measured: 0.79 ms a step without the hook,
            # 0.91 with it, 0.83 now; docs/benchmarks.md).
            compat.take_logs_as_tensors(self)

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
            self.offset = first_step if epoch == first_epoch else 0  # Keras counts from the resume
            self.align(epoch * steps_per_epoch + self.offset)

        def on_train_end(self, logs=None):
            self.align(None)  # the model keeps the count it was compiled with

        def align(self, now):
            pass

        def on_epoch_end(self, epoch, logs=None):
            done = epoch + 1
            by_epoch = cfg.checkpoint_every and (done % cfg.checkpoint_every == 0 or done == cfg.epochs)
            if by_epoch or self.step_due_at_end:
                self.save(done, 0)

        def save(self, epoch, step):
            ckpts.save(epoch, step)
            self.step_due_at_end = False
            self.retime(epoch * steps_per_epoch + step)

        def retime(self, now):
            pass

    class StepCheckpoints(EpochCheckpoints):
        def __init__(self):
            super().__init__()
            self.mark = (first_epoch * steps_per_epoch + first_step, time.perf_counter())  # (step, time)
            self.every = cfg.checkpoint_every_steps or 20  # minutes: a first measurement after 20 steps
            self.measured = not cfg.checkpoint_every_minutes
            self.next_at = self.mark[0] + self.every

        def retime(self, now):
            """The step of the next save: --checkpoint-every-steps on, or as many steps as rank 0
            measured in --checkpoint-every-minutes, told to every rank."""
            if cfg.checkpoint_every_minutes:
                per_step = (time.perf_counter() - self.mark[1]) / max(now - self.mark[0], 1)
                every = max(1, int(cfg.checkpoint_every_minutes * 60 / max(per_step, 1e-9)))
                if runtime.world().size > 1:
                    import horovod.tensorflow as hvd

                    with runtime.collective("a step checkpoint's interval (hvdtrain.checkpoint_every)"):
                        every = hvd.broadcast_object(every, root_rank=0, name="hvdtrain.checkpoint_every")
                self.every, self.measured = every, True
            self.mark = (now, time.perf_counter())
            self.next_at = now + self.every

        def align(self, now):
            """The next call runs up to the next save at most (all of per_call when now is None). Keras 3
            fixes the call's length for a whole fit(): the save lands at the end of the call that
            reaches it, on every rank alike."""
            if per_call > 1 and compat.calls_can_be_cut_short():
                self.model.steps_per_execution = per_call if now is None else \
                    min(per_call, max(1, self.next_at - now))

        def on_train_batch_end(self, batch, logs=None):
            step = self.offset + batch + 1
            now = self.epoch * steps_per_epoch + step
            if now >= self.next_at and not self.step_due_at_end:
                if not self.measured:  # the first measurement, turning minutes into steps: no save
                    self.retime(now)
                elif step >= steps_per_epoch:  # the epoch's end saves, after the ranks agree there
                    self.step_due_at_end = True
                else:
                    self.save(self.epoch, step)
            self.align(now)

    return (StepCheckpoints if by_steps else EpochCheckpoints)()


# ---------------------------------------------------------------- the user's own Keras callbacks

# Keras callbacks that write files or print: rank 0 alone runs them (one file, written once)
WRITERS = ("ModelCheckpoint", "CSVLogger", "TensorBoard", "RemoteMonitor", "ProgbarLogger")


def on_rank0(callback):
    """Mark a callback of your own to run on rank 0 only (one that writes files, say):
    `hvdtrain.fit(model, data, callbacks=[hvdtrain.on_rank0(MyLogger())])`."""
    callback.hvdtrain_rank0_only = True
    return callback


def users(callbacks, cfg) -> list:
    """The user's callbacks: those given to hvdtrain.fit, else those --callbacks module:function returns."""
    from .config import UserError
    from .data import resolve

    if callbacks is None:
        callbacks = resolve(cfg.callbacks, "--callbacks")() if cfg.callbacks else []
    callbacks = list(callbacks)
    for cb in callbacks:
        if type(cb).__name__ == "BackupAndRestore":
            raise UserError("callbacks: BackupAndRestore is what hvdtrain does itself (checkpoints in output_dir, "
                            "resumed by the same command, on every worker alike): leave it out")
    return callbacks


def for_this_rank(callbacks, chief: bool) -> list:
    """The user's callbacks this rank runs: every one, but the file writers (WRITERS, on_rank0's) on
    rank 0 only."""
    kept = []
    for cb in callbacks:
        if chief or not (getattr(cb, "hvdtrain_rank0_only", False)
                         or any(c.__name__ in WRITERS and c.__module__.startswith(("keras", "tf_keras"))
                                for c in type(cb).__mro__)):
            kept.append(cb)
    return kept


def acting_per_batch(callbacks) -> list:
    """The names of the callbacks that act per training batch (Keras then calls every callback at
    every step): asked of every user's callback, those rank 0 alone runs included, so that every rank
    decides the same steps per call."""
    return [type(cb).__name__ for cb in callbacks if compat.acts_per_batch(cb)]


def agree_to_stop():
    """The callback, last at every epoch's end, that makes one rank's stop every rank's: a callback
    that runs on rank 0 alone (or decides on a rank's own view) may set stop_training there, and a
    rank that stopped alone would leave the others waiting in the next step's allreduce."""
    import tensorflow as tf

    class AgreeToStop(tf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            stops = runtime.gather(bool(self.model.stop_training))
            if any(stops) and not all(stops):
                runtime.log.info("epoch %d: a callback on rank%s %s stopped training there: every rank stops",
                                 epoch + 1, "s" if sum(stops) > 1 else "",
                                 ", ".join(str(r) for r, s in enumerate(stops) if s))
            self.model.stop_training = any(stops)

    return AgreeToStop()


def following_the_learning_rate(learning_rate, batch_hooks: bool) -> tuple:
    """(before, after): two callbacks around the user's, so that a callback that changes the learning
    rate (ReduceLROnPlateau, LearningRateScheduler, your own) changes the one that trains.

    hvdtrain sets the rate inside every step (learning_rate: optimizer.LearningRate: scaling, warm-up,
    schedule), which would undo a callback's change at the next step. So `before` notes the rate the
    user's callbacks are shown, `after` sees what they left: a change by a ratio multiplies
    hvdtrain's rate by that ratio from then on (LearningRate.factor), on every rank alike (rank 0's
    ratio, when the ranks' callbacks disagree)."""
    import tensorflow as tf

    def rate(model):
        return float(model.optimizer.learning_rate.numpy())

    class Before(tf.keras.callbacks.Callback):
        seen = 0.0  # the rate the user's callbacks were shown last

        def on_train_begin(self, logs=None):
            lr = self.model.optimizer.learning_rate  # what the first step will train at
            lr.assign(tf.cast(learning_rate(optimizer.steps(self.model)), lr.dtype))

        def on_epoch_begin(self, epoch, logs=None):
            self.seen = rate(self.model)

        on_epoch_end = on_epoch_begin

    class After(tf.keras.callbacks.Callback):
        def follow(self, agree: bool):
            now = rate(self.model)
            ratio = now / before.seen if before.seen and now != before.seen else 1.0
            if agree and runtime.world().size > 1:
                import horovod.tensorflow as hvd

                with runtime.collective("the learning rate's change by a callback (hvdtrain.lr_ratio)"):
                    ratio = hvd.broadcast_object(ratio, root_rank=0, name="hvdtrain.lr_ratio")
            if ratio != 1.0:
                learning_rate.factor.assign(learning_rate.factor * ratio)
                lr = self.model.optimizer.learning_rate
                lr.assign(tf.cast(before.seen * ratio, lr.dtype))  # the same on every rank

        def on_epoch_begin(self, epoch, logs=None):
            self.follow(agree=True)

        on_epoch_end = on_epoch_begin

    if batch_hooks:
        def note(self, batch, logs=None):
            self.seen = rate(self.model)

        def follow(self, batch, logs=None):
            self.follow(agree=False)

        Before.on_train_batch_begin = Before.on_train_batch_end = note
        After.on_train_batch_begin = After.on_train_batch_end = follow
    before = Before()
    return before, After()
