"""Who am I in the job, what hardware do I own, and how do ranks agree on failure.

`init()` is the only place that calls `hvd.init()`, pins the GPU of this worker's local rank (or, with
no GPU, gives it its share of the host's cores), and returns the `World`. Rank-0-only side effects go
through `rank0_only`; everything that can fail differently per rank during set-up goes through
`all_ranks_agree`, so no rank is ever left waiting in a collective for one that gave up.
"""
from __future__ import annotations

import contextlib
import enum
import functools
import logging
import os
import sys
import time
from dataclasses import dataclass

from .config import UserError

log = logging.getLogger("hvdtrain")

# Launchers announce the rank before hvd.init(): used to report config errors once, from rank 0,
# before a worker has paid for importing TensorFlow.
_RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")

EXIT_STATUS = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure, the same command may be run again
# Horovod's background cycle for launched CPU workers, by controller (Horovod's default: 1 ms). A step's
# allreduce waits for the next cycle; under Gloo each cycle is also a round of messages that costs the
# shared cores compute. Measured (docs/benchmarks.md, "The step's cost"): under MPI 0.2 ms lifted 2 workers
# on 2 cores from below one worker to above it on the mlp and cnn; under Gloo 5 ms is ResNet-50's best.
CPU_CYCLE_TIME_MS = {"mpi": "0.2", "gloo": "5"}


def under_launcher() -> bool:
    """Started by horovodrun or mpirun (which hand their workers a pseudo-terminal: isatty() is True
    there, yet every carriage return starts a new prefixed line)."""
    return any(var in os.environ for var in _RANK_VARS)


def launcher_rank() -> int:
    for var in _RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    device: str = ""  # set by init(): what this worker pinned
    cycle: str = ""  # set by init(): Horovod's cycle time, and whose choice it is

    @property
    def is_chief(self) -> bool:
        return self.rank == 0


_world = World(rank=launcher_rank())
_started_with: dict = {}  # what the first init() applied: threads, Horovod's knobs


def world() -> World:
    return _world


def rank0_only(fn):
    """Decorate a side effect (printing, writing files) so that it runs on rank 0 and is a no-op elsewhere."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _world.is_chief:
            return fn(*args, **kwargs)
        return None
    return wrapper


class Ending(enum.Enum):
    """What ends a job on every rank, and how long a rank other than 0 waits before it exits (or, for a
    failed step, before it speaks) so that rank 0 speaks first: a launcher (horovodrun, mpirun) ends
    every rank as soon as one exits. Rank 0 needs a moment to print a line every rank met (an error in
    the flags or the set-up, a preemption); a failed step is reported by the rank that hit it, and rank
    0, when it hit it too, may still be inside the step's error."""
    ERROR = 3
    PREEMPTED = 2
    FAILED_STEP = 10


def rank0_first(ending: Ending):
    """The one rule for which rank speaks first: rank 0 (the others wait; see Ending)."""
    if not _world.is_chief:
        time.sleep(ending.value)


@rank0_only
def say(msg: str, file=sys.stdout):
    print(msg, file=file, flush=True)


def set_fast_defaults():
    """Environment defaults measured to be faster (docs/benchmarks.md); a user's own setting wins.
    Must run before TensorFlow and MPI start: both read them once.

    - Open MPI busy-polls while a rank waits; with CPU workers that poll steals the cores the other
      workers compute on (a 4-rank job on 2 cores: 66 s -> 39 s). Read at MPI_Init (hvd.init()).
    - TensorFlow's default CPU allocator hands large buffers back to the OS, so every allreduce output
      of 32 MiB or more is fresh memory and pays its page faults again (25k minor faults per 64 MiB
      call); its BFC allocator keeps them: hvd.allreduce at 64 MiB went from 45-70% to 95-97% of
      mpi4py's bandwidth.
    - TensorFlow 2.15 turns its oneDNN kernels on by default only on CPUs with AVX-512 VNNI/BF16 or AMX;
      elsewhere (this AMD EPYC with AVX2) it runs its own, much slower ones: ResNet-50 32x32 on one
      thread trained at 11.3 img/s without oneDNN and 63.2 img/s with it.
    - A worker started without a launcher (plain python) is an Open MPI singleton: MPI_Init starts a
      daemon (orted) for processes it might spawn, and waits for it with growing sleeps: hvd.init()
      took 2.56 s. Nothing here spawns MPI processes; isolated, hvd.init() takes 0.24 s. Read at
      MPI_Init; launched ranks (mpirun, horovodrun, srun) are not singletons and never read it.
    """
    os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    os.environ.setdefault("OMPI_MCA_ess_singleton_isolated", "1")
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")


FAST_DEFAULTS = ("OMPI_MCA_mpi_yield_when_idle", "OMPI_MCA_ess_singleton_isolated", "TF_CPU_ALLOCATOR_USE_BFC",
                 "TF_ENABLE_ONEDNN_OPTS", "HOROVOD_CYCLE_TIME")


def applied_defaults() -> dict:
    """The settings of set_fast_defaults()/init() as this worker ran with them (None: not set)."""
    return {k: os.environ.get(k) for k in FAST_DEFAULTS}


def started() -> bool:
    """Has this process run hvd.init() and pinned its device?"""
    return _world.device != ""


def init(threads: int = 0, horovod_env: dict | None = None) -> World:
    """hvd.init(), then pin this worker's device. Must run before TensorFlow touches any device, so
    before a model is built. A second call returns the same World.

    horovod_env: Horovod's knobs (HOROVOD_TIMELINE, HOROVOD_FUSION_THRESHOLD, ...), read by hvd.init().
    """
    global _world, _started_with
    asked = {**({"threads": threads} if threads else {}), **(horovod_env or {})}
    if started():
        differ = [f"{k}={v}" for k, v in asked.items() if _started_with.get(k) != v]
        if differ:  # hvd.init() has read them: they cannot apply now
            raise UserError(f"hvdtrain.fit: {', '.join(differ)} cannot apply: the runtime (hvd.init, this worker's "
                            f"threads, Horovod's knobs) started in hvdtrain.init(), or an earlier fit, without "
                            f"{'it' if len(differ) == 1 else 'them'}; give runtime settings to hvdtrain.init()")
        return _world
    _started_with = asked
    os.environ.update(horovod_env or {})
    set_fast_defaults()
    import horovod.tensorflow as hvd
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    cycle = _cycle_time(bool(gpus))  # read by hvd.init()
    hvd.init()
    rank, size, local_rank, local_size = hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()
    index, why = choose_gpu(len(gpus), local_rank, local_size, os.environ.get("CUDA_VISIBLE_DEVICES"),
                            os.uname().nodename)
    if index is not None:
        gpu = gpus[index]
        try:
            tf.config.set_visible_devices(gpu, "GPU")
            tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError:
            raise UserError("TensorFlow had set up its GPUs before hvdtrain could pin one: call "
                            "hvdtrain.init() before building the model or touching any tensor") from None
        device = f"GPU:{index} ({gpu.name}), {why}"
    else:
        n = threads or cpu_threads_per_worker(local_size)
        try:
            tf.config.threading.set_intra_op_parallelism_threads(n)
            tf.config.threading.set_inter_op_parallelism_threads(min(2, n))
            device = f"CPU, {n} intra-op thread(s)"
        except RuntimeError:  # TensorFlow already started (hvdtrain.fit without hvdtrain.init first)
            device = f"CPU, {tf.config.threading.get_intra_op_parallelism_threads() or 'all'} thread(s)"
    _world = World(rank, size, local_rank, local_size, device, cycle)
    return _world


def _cycle_time(gpus: bool) -> str:
    """Set Horovod's cycle time where hvdtrain has a measured default (launched CPU workers), and say
    which it is and where it comes from: the same words on every rank of a job."""
    controller = "gloo" if os.environ.get("HOROVOD_CONTROLLER") == "gloo" else "mpi"
    if "HOROVOD_CYCLE_TIME" in os.environ:
        return f"Horovod cycle {os.environ['HOROVOD_CYCLE_TIME']} ms (set: --cycle-time-ms or HOROVOD_CYCLE_TIME)"
    if gpus or not under_launcher():
        return "Horovod cycle 1 ms (Horovod's default)"
    os.environ["HOROVOD_CYCLE_TIME"] = CPU_CYCLE_TIME_MS[controller]
    return (f"Horovod cycle {CPU_CYCLE_TIME_MS[controller]} ms (hvdtrain's default for CPU workers under "
            f"{'Gloo' if controller == 'gloo' else 'MPI'}; --cycle-time-ms)")


def choose_gpu(visible: int, local_rank: int, local_size: int, cuda_visible_devices: str | None,
               host: str) -> tuple[int | None, str]:
    """Which of the `visible` GPUs this worker takes, and why: (index among the visible ones, reason),
    or (None, reason) for CPU workers. A pure decision, so that every case is tested without a GPU.

    - one GPU visible through CUDA_VISIBLE_DEVICES (Slurm --gpus-per-task, a per-rank wrapper) or on a
      host with one worker (one GPU per container): the scheduler chose it, take it;
    - several visible: the local rank's (Horovod's recipe); more local ranks than GPUs is an error,
      as is one unassigned GPU shared by several workers.
    """
    cvd = (cuda_visible_devices or "").strip()
    ids = [d.strip() for d in cvd.split(",") if d.strip()] if cvd else []
    if visible == 0:
        why = f"CUDA_VISIBLE_DEVICES={cvd!r} hides every GPU" if cuda_visible_devices is not None \
            and not ids else "no GPU visible"
        return None, why
    if visible == 1 and (ids or local_size == 1):
        chosen = f"CUDA_VISIBLE_DEVICES={cvd}" if ids else f"the only GPU on {host}, one worker there"
        return 0, f"the one GPU this process sees ({chosen})"
    if local_rank >= visible:
        raise UserError(f"host {host} runs {local_size} workers but this process sees {visible} GPU(s)"
                        f"{f' (CUDA_VISIBLE_DEVICES={cvd})' if ids else ''}: local rank {local_rank} has "
                        f"none; lower the slots for {host} to {visible}, or give each worker its own GPU "
                        f"through CUDA_VISIBLE_DEVICES")
    physical = f", physical GPU {ids[local_rank]}" if len(ids) == visible else ""
    return local_rank, f"local rank {local_rank} of {local_size} on {host} takes visible GPU " \
                       f"{local_rank} of {visible}{physical}"


def refresh() -> World:
    """Re-read rank and size after an elastic reset: workers came or went, ranks were renumbered.

    The device stays: a worker keeps the GPU (or the threads) it pinned at start.
    """
    global _world
    import horovod.tensorflow as hvd

    _world = World(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), _world.device, _world.cycle)
    return _world


def launched_elastic() -> bool:
    """horovodrun's elastic driver (--min-np, --host-discovery-script) marks its workers."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def cpu_threads_per_worker(local_size: int) -> int:
    """Split this host's cores among its workers so that they do not oversubscribe the CPU."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, local_size))


class Preempted(Exception):
    """Every rank stopped at the same step on a signal; a checkpoint of that step is written."""


class TrainingFailed(Exception):
    """A worker's own training step raised: the message names the rank, the step, the op and the
    cause; the traceback is in that worker's log file."""


class PeerFailed(Exception):
    """Another rank failed during set-up and said so in a collective this rank was waiting in."""


# ---------------------------------------------------------------- collectives, and what a rank waits in

_waiting: tuple | None = None  # (what, since: monotonic) while this rank waits in one of hvdtrain's collectives


@contextlib.contextmanager
def collective(what: str):
    """This rank waits in the collective `what` (the watchdog reports it: ranks that all wait, each in
    another collective, are named instead of left waiting forever)."""
    global _waiting
    outer, _waiting = _waiting, (what, time.monotonic())
    try:
        yield
    finally:
        _waiting = outer


def waiting() -> tuple | None:
    """(the collective this rank waits in, for how many seconds), or None."""
    now = _waiting
    return None if now is None else (now[0], time.monotonic() - now[1])


def same_on_every_rank(decisions: dict, where: str):
    """Check that every rank took the same `decisions` (a name -> value of what shapes the traced step
    or the order of collectives): each rank decides on its own view (its callbacks, its data, its
    settings), and ranks that decided differently would trace different steps and wait forever in
    collectives that never meet. One gather; a difference is one UserError, the same on every rank."""
    if _world.size == 1 or _alone:
        return
    got = gather({k: v if isinstance(v, list) else repr(v) for k, v in decisions.items()})
    differ = [k for k in decisions if len({repr(g.get(k)) for g in got}) > 1]
    if differ:
        def values(k):
            shown = [g.get(k) for g in got]
            if isinstance(decisions[k], list):  # a model's variables: from the first item that differs
                at = next(i for i in range(max(map(len, shown)) + 1) if len({repr(l[i:i + 1]) for l in shown}) > 1)
                shown = [f"{len(l)} in all, #{at + 1} {l[at] if at < len(l) else 'none'}" for l in shown]
            by_value: dict = {}
            for r, v in enumerate(shown):
                by_value.setdefault(v, []).append(r)
            return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {v}"
                             for v, rs in by_value.items())

        raise UserError(f"{where}: the ranks decided differently, and would wait forever in collectives that never "
                        f"meet: " + " | ".join(f"{k}: {values(k)}" for k in differ) +
                        ". Give every rank the same settings, callbacks and data")


_GATHER = "hvdtrain.gather"  # one name for every set-up gather: a failed rank can answer any of them


def gather(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank (a plain list with one worker).

    All of hvdtrain's gathers share one name, and carry (ok, value): a rank that fails during set-up
    sends its error into whichever gather the others are waiting in (`all_ranks_agree`), so they raise
    it instead of waiting forever for a collective it will never reach.
    """
    if _world.size == 1 or _alone:
        return [obj]
    import horovod.tensorflow as hvd

    with collective("a gather of hvdtrain's (hvdtrain.gather)"):
        got = hvd.allgather_object((True, obj), name=_GATHER)
    failed = [(r, v) for r, (ok, v) in enumerate(got) if not ok]
    if failed:
        raise PeerFailed(_where(failed))
    return [v for _, v in got]


_alone = False


@contextlib.contextmanager
def alone():
    """gather() and all_ranks_agree() answer for this rank alone: an elastic worker may be joining a
    running job, and must not call a collective before hvd.elastic.run has synced it with the others."""
    global _alone
    _alone = True
    try:
        yield
    finally:
        _alone = False


def _where(failed) -> str:
    ranks = [r for r, _ in failed]
    where = "" if len(ranks) == _world.size else \
        f" (on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
    return failed[0][1] + where


def all_ranks_agree(fn, *args, **kwargs):
    """Run a set-up step on every rank; if it failed on any rank, raise the same UserError on all.

    A rank that failed alone would otherwise leave the others blocked in their next collective.
    """
    error, result = None, None
    try:
        result = fn(*args, **kwargs)
    except PeerFailed as e:  # agreed already, inside fn: every rank raises it now
        raise UserError(str(e)) from None
    except UserError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 (a bug or the environment's: its traceback in this rank's log)
        log.exception("set-up failed on rank %d", _world.rank, extra=FILE_ONLY)
        error = f"{type(e).__name__}: {e}"
    if _world.size == 1 or _alone:
        if error:
            raise UserError(error)
        return result
    import horovod.tensorflow as hvd

    with collective("a gather of hvdtrain's (hvdtrain.gather)"):
        got = hvd.allgather_object((error is None, error), name=_GATHER)
    failed = [(r, e) for r, (ok, e) in enumerate(got) if not ok]
    if failed:
        raise UserError(_where(failed))
    return result


class UnexpectedFallback(Exception):
    """A fast path gave way to its slower fallback under HVDTRAIN_NO_FALLBACK=1 (the tests set it)."""


def fallback(key: str, what: str, error: Exception):
    """A fast path failed and its slower fallback runs instead: said where the user sees it (a
    warning). Under HVDTRAIN_NO_FALLBACK=1, as the tests run, it raises instead, so that a broken fast
    path fails a test rather than slow a user down; a test that expects the fallback `key` lists it in
    HVDTRAIN_EXPECTED_FALLBACKS (comma-separated)."""
    if os.environ.get("HVDTRAIN_NO_FALLBACK") == "1" and \
            key not in os.environ.get("HVDTRAIN_EXPECTED_FALLBACKS", "").split(","):
        raise UnexpectedFallback(f"{key}: {what} ({type(error).__name__}: {error})") from error
    log.warning("%s (%s: %s)", what, type(error).__name__, str(error)[:300])


EVERY_RANK = {"every_rank": True}
FILE_ONLY = {"file_only": True}  # tracebacks: in the worker's log file, not on the terminal


def setup_logging(log_file: str | None = None):
    """Every worker logs to its own file; the terminal gets rank 0's lines, and those marked
    `extra=EVERY_RANK` from every worker (what each one pinned, for instance)."""
    fmt = logging.Formatter("%(asctime)s rank %(rank)s/%(size)s %(levelname)s %(message)s")
    log.setLevel(logging.INFO)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
    log.removeFilter(_stamp_rank)
    log.addFilter(_stamp_rank)
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("hvdtrain[%(rank)s]: %(message)s"))
    h.addFilter(lambda record: (_world.is_chief or getattr(record, "every_rank", False))
                and not getattr(record, "file_only", False))
    log.addHandler(h)
    if log_file:
        os.makedirs(os.path.dirname(log_file), exist_ok=True)
        fh = logging.FileHandler(log_file)
        fh.setFormatter(fmt)
        log.addHandler(fh)


def _stamp_rank(record) -> bool:
    """The rank at the time of the record: elastic resets renumber ranks."""
    record.rank, record.size = _world.rank, _world.size
    return True


_UNCAUGHT: list = []  # what names a failure that ends a loop of the user's own (train.broadcast sets it)


def on_uncaught(explain):
    """`explain(exception)` is asked first about an exception that ends the script: True when it said
    what happened in its own words (a loop's peer that died), False to leave it to Python."""
    _UNCAUGHT[:] = [explain]


def report_errors_once():
    """An hvdtrain error that ends a user's script (hvdtrain.fit raised it, the script did not catch
    it) prints one line from rank 0, as `python -m hvdtrain` does, not a traceback from every rank.
    It stays an exception: a script may catch it. The exit status is Python's for an uncaught one, 1."""
    previous = sys.excepthook
    if getattr(previous, "hvdtrain", False):
        return

    def hook(kind, value, tb):
        if issubclass(kind, Preempted):  # the status a scheduler's requeue or a relaunch loop looks for
            if _world.is_chief:
                print(f"hvdtrain: {value}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(EXIT_STATUS)
        if _UNCAUGHT and not issubclass(kind, (UserError, TrainingFailed)) and _UNCAUGHT[0](value):
            return None
        if not issubclass(kind, (UserError, TrainingFailed)):
            return previous(kind, value, tb)
        if issubclass(kind, UserError) and not _world.is_chief:
            rank0_first(Ending.ERROR)
            return None
        print(f"hvdtrain: error: {value}", file=sys.stderr, flush=True)
        return None

    hook.hvdtrain = True  # type: ignore[attr-defined]  # marks hvdtrain's own hook, so it is set once
    sys.excepthook = hook
