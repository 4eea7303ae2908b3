"""A failed training step explained in one line, by the rank that can say why.

TensorFlow's errors are long (a traceback of the traced step, the op, the message), and Horovod gives
every surviving rank the same words whether a peer died or a peer's own step raised: `report` finds the
line that matters, or which peer's process is gone, and keeps the traceback in the rank's log file.
"""
from __future__ import annotations

import re
import socket

from . import runtime
from .runtime import log


def in_a_collective(e) -> bool:
    """Did `e` come out of Horovod's collectives (a peer's death or failure reaches a rank so), not
    from the step's own ops? An invalid step (one XLA cannot compile, say) is the rank's own, even
    where its text names Horovod's ops."""
    return "horovod" in f"{type(e).__module__} {e}".lower() and type(e).__name__ != "InvalidArgumentError"


def report(e, what: str, where: str, world, workers):
    """One line for the cause, from the rank that hit it; the traceback in that rank's log file.

    Horovod gives every other rank the same words whether a peer died or a peer's own step raised (and
    that peer reports why), so a survivor looks: a peer on this host whose process is gone died."""
    text = str(e)
    if in_a_collective(e) and world.size > 1:
        host = socket.gethostname()
        table = ", ".join(f"rank {r} on {h} (pid {p})" for r, (h, p) in enumerate(workers))
        gone = [f"rank {r} (pid {p})" for r, (h, p) in enumerate(workers) if h == host and not _alive(p)]
        remote = any(h != host for h, _ in workers)
        if gone:
            log.error("rank %d lost its peers during training (%s on %s exited). Workers were: %s. The "
                      "launcher names the one that exited first.", world.rank, ", ".join(gone), host, table,
                      extra=runtime.EVERY_RANK)
        elif remote:
            log.error("rank %d stopped: Horovod shut down (%s): a worker on another host died, or its "
                      "training step failed and it reports why. Workers were: %s. A stall shutdown is "
                      "reported above by Horovod.", world.rank, text.strip().splitlines()[0][:120], table,
                      extra=runtime.EVERY_RANK)
        else:  # every peer is alive on this host: one's own step failed, and it reports why
            log.error("rank %d stopped: a peer's training step failed (it reports why)", world.rank,
                      extra=runtime.FILE_ONLY)
        raise SystemExit(1)
    log.error("%s failed on rank %d", what, world.rank, exc_info=e, extra=runtime.FILE_ONLY)
    logfile = f"; traceback in {log_file()}" if log_file() else ""
    raise runtime.TrainingFailed(f"{what} failed on rank {world.rank} {where}: {explain(e)}{logfile}") from None


def _alive(pid: int) -> bool:
    """Is this process running (a zombie, dead but not yet reaped by the launcher, is not)?"""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def log_file() -> str | None:
    for h in log.handlers:
        if hasattr(h, "baseFilename"):
            return h.baseFilename
    return None


LABEL_OUT_OF_RANGE = re.compile(r"a label is outside the classes of the model; label, classes:\]? \[?(-?\d+)\]? \[?(\d+)")


def explain(e: Exception) -> str:
    """The op and the message that explain a failed step, from TensorFlow's long error text."""
    text, kind = str(e), type(e).__name__
    label = LABEL_OUT_OF_RANGE.search(text)  # optimizer.TrainStep's check, in Keras' words
    if label:
        value, classes = label.groups()
        return (f"{kind}: Received a label value of {value} which is outside the valid range of [0, {classes}): "
                f"the model's output has {classes} classes, and the labels must be below it")
    # several steps per call: Keras' loop over steps hides the step's own error behind AutoGraph's
    # "'outputs' must be defined before the loop", and names it in a note
    hidden = re.search(r"AutoGraph tried to define it automatically, but ran into an? (\w+): ", text)
    if hidden:
        text, kind = text[hidden.end():], hidden.group(1)
    # a Keras layer's error: its message sits between "Exception encountered when calling layer" (Keras 3:
    # "... calling Sequential.call()", in bold) and the arguments of the call
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    text = re.sub(r"(Call arguments|Arguments) received by .*", "", text, flags=re.S)
    text = re.sub(r"Exception encountered when calling [^\n]*", "", text)
    node = re.search(r"\{\{node ([^}]+)\}\}", text) or re.search(r"Detected at node '?([^'\s]+)", text)
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    # TensorFlow puts the cause after the "defined at" traceback and before [[{{node ...}}]]
    cause = [l for l in lines if not l.startswith(("File ", "Detected at node", "[[", "Graph execution",
                                                   "in user code", "Traceback", "Node:"))
             and not re.match(r"^(\S+\.py|<\S+>|\w[\w.]*\(|return |self\.|x = |outputs = )", l)
             and "defined at (most recent call last)" not in l]
    cause = [re.sub(r"\s*\[Op:\S+\]", "", l) for l in cause]
    message = (cause[-1] if cause else lines[-1] if lines else kind)[:400]
    message = re.sub(rf"^{kind}: ", "", message)
    return kind + (f" at {node.group(1)}" if node else "") + f": {message}"
