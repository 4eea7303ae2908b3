"""Preemption without lost work: a scheduler's SIGTERM (Slurm's scancel or time limit, a Kubernetes
eviction, a spot instance's notice) or a signal you name stops every rank at the same step, after a
step checkpoint, and the job exits with status 75 (EX_TEMPFAIL: run the same command again).

The ranks agree without a collective of their own: each rank's "stop requested" flag rides along with
the gradients in the allreduce of every update (one scalar more in Horovod's fused buffer), so every
rank reads the same agreed value at the end of the same call of the compiled step. Then they write a
step checkpoint together (rank 0 writes, the others wait for it) and stop.
"""
from __future__ import annotations

import contextlib
import signal
from typing import Callable

from . import compat, runtime
from .runtime import EXIT_STATUS, Preempted, log

__all__ = ["EXIT_STATUS", "Preempted", "flag", "handling", "watcher", "usable"]


class _Flag:
    """The signal's flag, and the flag every rank agreed on at the last update."""

    def __init__(self):
        import tensorflow as tf

        with tf.init_scope():
            self.requested = tf.Variable(0.0, trainable=False, name="hvdtrain_stop_requested")
            self.agreed = tf.Variable(0.0, trainable=False, name="hvdtrain_stop_agreed")
        self.wired = False  # an allreduce of the gradients carries it (along_with)
        self.signal = None  # the name of the signal that set it
        self.release: Callable[[], object] = lambda: None  # puts the signals' previous handlers back

    def along_with(self, allreduce):
        """`allreduce(grads, variables)` that also averages this rank's flag with the others': any rank's
        request is every rank's, at the same update."""
        import tensorflow as tf

        self.wired = True

        def reduce(grads, variables):
            grads, variables = list(grads), list(variables)
            # Horovod's is a tf.function with AutoGraph: traced as written (optimizer._Keras2Patches)
            fn = allreduce if tf.executing_eagerly() else getattr(allreduce, "python_function", allreduce)
            out = fn(grads + [self.requested.read_value()], variables + [self.agreed])
            self.agreed.assign(out[-1])
            return out[:-1]

        return reduce


_flag = None


def flag() -> _Flag:
    global _flag
    if _flag is None:
        _flag = _Flag()
    return _flag


@contextlib.contextmanager
def handling(names):
    """While training: the signals `names` ("TERM", "USR1", ...) ask every rank to stop at the next step."""
    state = flag()
    state.requested.assign(0.0)
    state.agreed.assign(0.0)
    previous = {}

    def handler(signum, frame):
        state.signal = signal.Signals(signum).name
        state.requested.assign(1.0)

    for name in names:
        sig = getattr(signal, f"SIG{name}")
        previous[sig] = signal.signal(sig, handler)
    state.release = lambda: [signal.signal(sig, old) for sig, old in previous.items()]
    try:
        yield state
    finally:
        if not float(state.requested.numpy()):  # preempted: a second signal (a launcher's) waits for the exit
            state.release()


def watcher(ckpts, steps_per_epoch: int, first_epoch: int, first_step: int):
    """The callback that ends training at the end of the call where the ranks agreed to stop: a step
    checkpoint of that step (unless one was just written), every rank waiting for rank 0's write, then
    Preempted. Raised, not stop_training: Keras would end the epoch (validation, an epoch checkpoint)
    as if it were whole."""
    import tensorflow as tf

    state = flag()
    world = runtime.world()
    agreed = state.agreed if state.wired or world.size > 1 else state.requested

    class Watcher(tf.keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            compat.take_logs_as_tensors(self)  # it reads no logs: Keras need not convert them for it

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
            self.offset = first_step if epoch == first_epoch else 0

        def on_train_batch_end(self, batch, logs=None):
            if not float(agreed.numpy()):
                return
            epoch, step = self.epoch, self.offset + batch + 1
            if step >= steps_per_epoch:
                epoch, step = epoch + 1, 0
            if ckpts.last_saved != (epoch, step):
                ckpts.save(epoch, step)
            runtime.gather(None)  # every rank waits until rank 0 has written it
            raise Preempted(f"preempted ({state.signal or 'a signal to another rank'}): every rank stopped "
                            f"after epoch {epoch}, step {step}, and its checkpoint is written; the same command "
                            f"resumes there (exit status {EXIT_STATUS})")

    return Watcher()


def usable(world) -> bool:
    """Can the ranks agree on a stop? One worker alone, or the allreduce carries the flag (not under
    Keras 2's Adasum, whose gradient tape is Horovod's own): if not, the signals are left as they were."""
    state = flag()
    if world.size > 1 and not state.wired:
        log.info("preemption: the gradients' allreduce cannot carry the stop flag here (--reduction adasum "
                 "on Keras 2): a signal ends the job as it would without hvdtrain")
        state.release()
        return False
    return True
