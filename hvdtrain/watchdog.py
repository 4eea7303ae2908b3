"""A hung rank, named: rank, host and pid in one line, then the job ends so that it can be resumed.

A rank that stops taking part leaves the others waiting inside an allreduce forever, and Horovod names
it under neither controller: its stall check runs on rank 0's background thread, which waits in the
same per-cycle exchange as everyone else once a peer's process is frozen (docs/reliability.md). Three
kinds of hang, told apart:

- **frozen**: the process stopped (SIGSTOP, stuck in the kernel on a dead mount or a hung driver): all
  of its threads stop, so it stops answering a heartbeat (`hang_frozen_seconds`, 45 by default);
- **stuck**: the process lives, but its step never reaches the gradients' allreduce (an input pipeline
  or a forward pass blocked on that worker): every rank counts its arrivals at that allreduce, and the
  stuck rank stays one behind the ranks that wait for it (`hang_stuck_seconds`; by default the larger
  of 3 minutes and 50 median steps, so a long step is never a hang);
- **apart**: every rank waits in a collective and none completes (`hang_collective_seconds`, 60 by
  default): they wait in different ones (one rank at an epoch's end, another in a step), or in steps
  traced differently (Horovod matches a tensor by its name in the traced step). Each rank says which
  collective it waits in, and what its step was traced with, so the line says why where it can.

The heartbeats go over a TCP connection of their own from every rank to rank 0 (Horovod's channels
are the ones blocked), each sent by a thread beside training, so a long first step (tracing, XLA), a
checkpoint write or a slow validation is never taken for a frozen process. Rank 0 judges; a frozen
rank 0 is named by rank 1, whose heartbeat goes unanswered. Every live rank then exits with status 75
(preemption's "run the same command again"), the launcher ends the frozen one, and the relaunch
resumes from the last checkpoint.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import socket
import statistics
import sys
import threading
import time

from . import runtime
from .runtime import EXIT_STATUS, log

STUCK_FLOOR_S, STUCK_MEDIAN_STEPS = 180.0, 50  # the default stuck bound: max(3 min, 50 median steps)
FIRST_STEP_FACTOR = 5  # a rank's first step of a fit may trace and compile (XLA): 5 bounds, 15 min by default


# ---------------------------------------------------------------- what a rank reports

class _Arrivals:
    """How many times this rank's step reached the gradients' allreduce, and how many times it left it
    (variables the step increments), and what the allreduce was traced with."""

    def __init__(self):
        import tensorflow as tf

        with tf.init_scope():
            self.count = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvdtrain_allreduce_arrivals")
            self.left = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvdtrain_allreduce_left")
        self.traced: dict = {}  # the last trace's gradients: how many, their names (what Horovod names them by)

    def counting(self, allreduce):
        """`allreduce(grads, variables)` (preemption's, a plain function) that first counts this rank's
        arrival, once its gradients exist, then its leaving, once the averaged gradients exist."""
        import tensorflow as tf

        def reduce(grads, variables):
            grads = list(grads)
            flat = [t for t in tf.nest.flatten(grads, expand_composites=True) if t is not None]
            if not tf.executing_eagerly():
                names = [getattr(t, "name", "") for t in flat]
                self.traced = {"gradients": len(grads),
                               "gradient names": hashlib.sha1("|".join(names).encode()).hexdigest()[:12],
                               "first gradient": names[0] if names else ""}
            with tf.control_dependencies(flat):
                self.count.assign_add(1)
            out = allreduce(grads, variables)
            with tf.control_dependencies([t for t in tf.nest.flatten(out, expand_composites=True) if t is not None]):
                self.left.assign_add(1)
            return out

        return reduce

    def inside(self) -> bool:
        """Is this rank's step waiting in the gradients' allreduce now?"""
        return int(self.count.numpy()) > int(self.left.numpy())


_arrivals = None


def arrivals() -> _Arrivals:
    global _arrivals
    if _arrivals is None:
        _arrivals = _Arrivals()
    return _arrivals


_busy = None  # what this rank is doing that may keep it from the next allreduce for long


@contextlib.contextmanager
def busy(what: str):
    """A known long pause of this rank (a checkpoint write): not a hang, however long it takes."""
    global _busy
    _busy = what
    try:
        yield
    finally:
        _busy = None


# ---------------------------------------------------------------- rank 0's judgement

@dataclasses.dataclass
class Peer:
    rank: int
    host: str
    pid: int
    seen: float | None  # when its last heartbeat came (monotonic); None: it has not connected
    arrived: int = 0  # its arrivals at the allreduce since this fit began
    busy: str | None = None
    gone: bool = False  # it closed its connection: it ended (or died, which its launcher reports)
    waiting: str | None = None  # the collective it waits in
    waited: float = 0.0  # for how long
    traced: dict = dataclasses.field(default_factory=dict)  # what its step was traced with (Watchdog.facts)

    def name(self) -> str:
        return f"rank {self.rank} on {self.host} (pid {self.pid})"


def verdict(peers: list, now: float, frozen_s: float, stuck_s: float, moved: float,
            collective_s: float = 0) -> str | None:
    """What is hung, in words, or None. `moved`: when any rank last arrived at an allreduce.

    Frozen: no heartbeat for frozen_s. Apart: every rank has waited in a collective for collective_s,
    and none has completed: they wait in different ones, or in one traced differently on each rank
    (Horovod matches tensors by their names in the traced step). Stuck: the ranks disagree on their
    arrivals, nobody has arrived for stuck_s and nobody is busy; the ranks behind are named (one still
    in its first step of this fit, which may be compiling, after FIRST_STEP_FACTOR times as long)."""
    live = [p for p in peers if not p.gone]
    frozen = [p for p in live if frozen_s and p.seen is not None and now - p.seen > frozen_s]
    if frozen:
        return (f"{', '.join(p.name() for p in frozen)} has not answered for {now - min(p.seen for p in frozen):.0f} s: "
                f"its process is stopped or stuck in the kernel")
    if collective_s and live and all(p.waiting for p in live) and min(p.waited for p in live) >= collective_s:
        return apart(live)
    counts = [p.arrived for p in live]
    if not stuck_s or not counts or min(counts) == max(counts) or any(p.busy for p in live):
        return None
    behind = [p for p in live if p.arrived < max(counts)]
    if now - moved <= stuck_s * (FIRST_STEP_FACTOR if min(counts) == 0 else 1):
        return None
    ahead = [p.rank for p in live if p.arrived == max(counts)]
    return (f"{', '.join(p.name() for p in behind)} has not reached the gradients' allreduce for "
            f"{now - moved:.0f} s, while rank{'s' if len(ahead) > 1 else ''} {', '.join(map(str, ahead))} "
            f"wait{'' if len(ahead) > 1 else 's'} there for it: its input pipeline or its step is blocked")


def apart(live: list) -> str:
    """The ranks that all wait in collectives that never meet, each one's collective, and why where
    their steps were traced differently."""
    waits: dict = {}
    for p in live:
        waits.setdefault(p.waiting, []).append(p)
    where = "; ".join(f"{', '.join(p.name() for p in ps)} in {what}" for what, ps in waits.items())
    line = (f"the ranks wait in collectives that never meet, for {min(p.waited for p in live):.0f} s: {where}")
    differ = [k for k in sorted({k for p in live for k in p.traced}) if len({str(p.traced.get(k)) for p in live}) > 1]
    if differ:
        facts = "; ".join(f"rank {p.rank}: " + ", ".join(f"{k} {p.traced.get(k)}" for k in differ) for p in live)
        line += f". Their steps were traced differently ({facts})"
    elif len(waits) == 1:
        line += (". They traced the same number of gradients, but Horovod matches a collective by its name in "
                 "each rank's traced step: something in the step or the model differs between the ranks")
    return line


def stuck_bound(configured: float | None, step_seconds: list) -> float:
    """hang_stuck_seconds as given (0: off), else the larger of 3 minutes and 50 median steps."""
    if configured is not None:
        return configured
    median = statistics.median(step_seconds) if step_seconds else 0.0
    return max(STUCK_FLOOR_S, STUCK_MEDIAN_STEPS * median)


# ---------------------------------------------------------------- the heartbeats

def _place() -> tuple:
    """Processes with the same boot id and network namespace reach each other over loopback."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
        return boot, os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return socket.gethostname(), 0


def _addresses() -> list:
    """This host's IPv4 addresses but loopback, the interface Horovod was told to use first."""
    import fcntl
    import struct

    first = os.environ.get("HOROVOD_GLOO_IFACE")
    found: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            ip = socket.inet_ntoa(packed[20:24])
            if not ip.startswith("127."):
                found.insert(0, ip) if name == first else found.append(ip)
    return found


class Watchdog:
    """One fit's watch: rank 0 listens and judges, every other rank sends it heartbeats."""

    def __init__(self, cfg, world: runtime.World, resume_point=lambda: None, facts=None,
                 then: str = "the same command resumes from the last checkpoint"):
        """facts: what this rank's step runs with (its steps per call), told when the ranks wait apart.
        then: what the user does next, said after the hang is named."""
        self.world, self.resume_point, self.facts, self.then = world, resume_point, dict(facts or {}), then
        self.frozen_s, self.stuck_s = cfg.hang_frozen_seconds, cfg.hang_stuck_seconds
        self.collective_s = cfg.hang_collective_seconds
        self.interval = max(0.2, min(5.0, (self.frozen_s or 30) / 6, (self.collective_s or 30) / 6))
        self.on = world.size > 1 and bool(self.frozen_s or self.stuck_s != 0 or self.collective_s)
        # (arrival, since when) while this rank waits in the gradients' allreduce
        self.inside_since: tuple[int, float] | None = None
        self.stopped = threading.Event()
        self.ending = threading.Event()  # this rank is about to exit: the job is hung
        self.base = int(arrivals().count.numpy())
        self.listener: socket.socket | None = None
        self.unanswered_since: float | None = None  # since when rank 0 owes this rank an answer
        self.poke, self.answers, self.connected = threading.Event(), 0, False  # heartbeat now; answers had
        contact = None
        if self.on and world.is_chief:
            self.listener = socket.create_server(("0.0.0.0", 0), backlog=world.size)
            contact = {"port": self.listener.getsockname()[1], "place": _place(), "ips": _addresses(),
                       "token": os.urandom(8).hex()}
        # one gather: every rank's host and pid (the failure report names them too), rank 0's address
        got = runtime.gather((socket.gethostname(), os.getpid(), contact))
        self.workers = [(h, p) for h, p, _ in got]
        self.contact = got[0][2]
        if not self.on:
            return
        if world.is_chief:
            now = time.monotonic()
            self.peers = [Peer(r, h, p, now if r == 0 else None) for r, (h, p) in enumerate(self.workers)]
            self.lock = threading.Lock()
            self.verdict: str | None = None
            self.told: set[int] = set()
            self._thread(self._accept)
            self._thread(self._judge)
        else:
            self._thread(self._beat)

    def _thread(self, fn, *args):
        threading.Thread(target=fn, args=args, name=f"hvdtrain-watchdog-{fn.__name__.strip('_')}", daemon=True).start()

    def arrived(self) -> int:
        return int(arrivals().count.numpy()) - self.base

    def waiting(self) -> tuple:
        """(the collective this rank waits in, for how many seconds), or (None, 0): one of hvdtrain's
        own (runtime.collective), or the gradients' allreduce inside the step."""
        own = runtime.waiting()
        if own is not None:
            self.inside_since = None
            return own
        if not arrivals().inside():
            self.inside_since = None
            return None, 0.0
        n = self.arrived()
        if self.inside_since is None or self.inside_since[0] != n:
            self.inside_since = (n, time.monotonic())
        return f"the gradients' allreduce of its step {n}", time.monotonic() - self.inside_since[1]

    def traced(self) -> dict:
        return {**arrivals().traced, **self.facts}

    def on_failure(self):
        """This rank's step failed. If the job is hung, the watchdog's line is the one to print: when
        it is ending the job already (a peer that was told exits, and this rank's step fails with it),
        wait for it to exit the process; when a peer has been silent for a while, this failure is what
        that silence caused (Gloo gives up on a frozen peer after its own 30 s timeout): name it now,
        and end. Otherwise return at once: the failure is reported as any other."""
        if not self.on:
            return
        now, quiet = time.monotonic(), 3 * self.interval
        if self.world.is_chief and not self.ending.is_set():
            with self.lock:
                what = verdict(self.peers, now, quiet, 0, now)
            if what:
                self._end(what)
        elif not self.ending.is_set():
            if self.unanswered_since is not None and now - self.unanswered_since > quiet:
                self._rank0_frozen(now - self.unanswered_since)
            asked = self.answers
            self.poke.set()  # ask rank 0 now whether the job is ending
            while self.answers == asked and self.connected and not self.ending.is_set() \
                    and time.monotonic() < now + 2.0:
                time.sleep(0.02)
        if self.ending.is_set():
            time.sleep(60)  # the watchdog's thread exits the process

    def stop(self):
        self.stopped.set()
        self.poke.set()
        if self.listener is not None:
            with contextlib.suppress(OSError):
                self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
            self.listener.close()

    # rank 0 --------------------------------------------------------

    def _accept(self):
        assert self.listener is not None  # rank 0's
        while not self.stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self._thread(self._serve, conn)  # this connection, not the loop's next one

    def _serve(self, conn):
        """One rank's heartbeats: its arrivals and what it is busy with; the answer says go on, or end."""
        peer = None
        with conn, conn.makefile("rw") as io:
            for line in io:
                try:
                    beat = json.loads(line)
                except ValueError:
                    return
                if not isinstance(beat, dict) or beat.get("token") != self.contact["token"]:
                    return
                with self.lock:
                    peer = self.peers[beat["rank"]]
                    peer.seen, peer.arrived, peer.busy = time.monotonic(), beat["arrived"], beat["busy"]
                    peer.waiting, peer.waited, peer.traced = beat["waiting"], beat["waited"], beat["traced"]
                io.write(json.dumps({"end": self.verdict}) + "\n")
                io.flush()
                if self.verdict:
                    self.told.add(peer.rank)
                if self.verdict or self.stopped.is_set():
                    return
        if peer is not None:
            with self.lock:
                peer.gone = True

    def _judge(self):
        me = self.peers[0]
        moved, last = time.monotonic(), None
        steps: list[float] = []
        while not self.stopped.wait(self.interval):
            now = time.monotonic()
            if last is not None and now - last[0] > 3 * self.interval:  # this process was stopped itself
                with self.lock:  # (the whole job suspended): nobody else is to blame for the gap
                    for p in self.peers:
                        p.seen = now if p.seen is not None else None
                moved = now
            with self.lock:
                me.seen, me.arrived, me.busy = now, self.arrived(), _busy
                (me.waiting, me.waited), me.traced = self.waiting(), self.traced()
                if last is not None and me.arrived > last[1]:
                    steps.append((now - last[0]) / (me.arrived - last[1]))
                    del steps[:-100]
                counts = tuple(p.arrived for p in self.peers)
                if last is None or counts != last[2]:
                    moved = now
                last = (now, me.arrived, counts)
                what = verdict(self.peers, now, self.frozen_s, stuck_bound(self.stuck_s, steps), moved,
                               self.collective_s)
            if what:
                self._end(what)

    def _end(self, what: str):
        point = self.resume_point()
        where = f" (after epoch {point[0]}" + (f", step {point[1]})" if point[1] else ")") if point else ""
        self.ending.set()
        self.verdict = f"{what}. Every rank ends now (exit status {EXIT_STATUS}); {self.then}{where}"
        _announce(self.verdict)
        waiting = {p.rank for p in self.peers[1:] if not p.gone and p.seen is not None
                   and time.monotonic() - p.seen < self.interval * 3}  # the frozen cannot be told
        deadline = time.monotonic() + 2 * self.interval + 1
        while not waiting <= self.told and time.monotonic() < deadline:  # told with their next heartbeat
            time.sleep(0.05)
        _exit()

    # every other rank ----------------------------------------------

    def _connect(self):
        here = _place() == tuple(self.contact["place"])
        for ip in ["127.0.0.1"] if here else self.contact["ips"]:
            try:
                return socket.create_connection((ip, self.contact["port"]), timeout=5)
            except OSError:
                continue
        log.warning("hang detection is off on rank %d: rank 0's watchdog (port %d) answers at none of %s",
                    self.world.rank, self.contact["port"], ", ".join(self.contact["ips"]) or "its addresses",
                    extra=runtime.EVERY_RANK)
        return None

    def _beat(self):
        try:
            self._beat_connected()
        finally:
            self.connected = False

    def _beat_connected(self):
        conn = self._connect()
        if conn is None:
            return
        conn.settimeout(self.interval)
        self.connected = True
        with conn:
            buf = b""
            while not self.stopped.is_set():
                try:
                    waiting, waited = self.waiting()
                    conn.sendall(json.dumps({"token": self.contact["token"], "rank": self.world.rank,
                                             "arrived": self.arrived(), "busy": _busy, "waiting": waiting,
                                             "waited": waited, "traced": self.traced()}).encode() + b"\n")
                    answer, buf = self._answer(conn, buf)
                except OSError:  # rank 0 closed it: this fit ended there (or rank 0 died, which is reported)
                    return
                if answer is None:
                    if self.stopped.is_set():
                        return
                    self._rank0_frozen(self.frozen_s)
                if answer.get("end"):
                    self.ending.set()
                    log.error("%s", answer["end"], extra=runtime.FILE_ONLY)
                    _exit()
                self.answers += 1
                self.poke.wait(self.interval)
                self.poke.clear()

    def _rank0_frozen(self, silent: float):
        self.ending.set()
        if self.world.rank == 1:  # one line for the job: the lowest rank left says it
            host, pid = self.workers[0]
            _announce(f"rank 0 on {host} (pid {pid}) has not answered for {silent:.0f} s: its process is stopped "
                      f"or stuck in the kernel. Every rank ends now (exit status {EXIT_STATUS}); {self.then}")
        _exit()

    def _answer(self, conn, buf: bytes):
        """(rank 0's answer, what is left of the bytes), or None once frozen_s passed without one; time
        this process spent stopped itself does not count."""
        waited, self.unanswered_since = 0.0, time.monotonic()
        while b"\n" not in buf:
            if self.frozen_s and waited >= self.frozen_s or self.stopped.is_set():
                return None, buf
            t = time.monotonic()
            try:
                got = conn.recv(4096)
            except socket.timeout:
                took = time.monotonic() - t
                waited += took if took < 3 * self.interval else self.interval
                continue
            if not got:
                raise OSError("closed by rank 0")
            buf += got
        line, buf = buf.split(b"\n", 1)
        self.unanswered_since = None
        return json.loads(line), buf


def _announce(msg: str):
    log.error("%s", msg, extra=runtime.FILE_ONLY)
    print(f"hvdtrain: {msg}", file=sys.stderr, flush=True)


def _exit():
    for h in log.handlers:
        h.flush()
    sys.stdout.flush()
    os._exit(EXIT_STATUS)
