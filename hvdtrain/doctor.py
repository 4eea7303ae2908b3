"""`hvdtrain doctor`: the checks that explain most first-day multi-GPU failures, one report per host.

Horovod build (TensorFlow support, controllers, tensor operations), MPI, GPUs against slots, CUDA/cuDNN
and NCCL, the GPU link topology, ops that silently land on the CPU, and CPU oversubscription. Run it
alone, or under horovodrun/mpirun with the job's own host list: every host's local rank 0 reports.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile

from . import runtime
from .config import UserError

OK, WARN, ERROR = "ok", "warn", "error"
REINSTALL = ("HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_PYTORCH=1 "
             "HOROVOD_WITHOUT_MXNET=1 pip install --no-cache-dir --force-reinstall --no-deps "
             "--no-build-isolation horovod==0.28.1")


def check(name, status, detail, **facts):
    return {"check": name, "status": status, "detail": detail, **facts}


def stack():
    """Which of hvdtrain's two stacks this host runs: the versions every host of a job must share."""
    from . import compat

    facts = compat.stack()
    return check("stack", OK, f"{facts['stack']}: Python {facts['python']}, TensorFlow {facts['tensorflow']}, "
                              f"Keras {facts['keras']}, numpy {facts['numpy']}", **facts)


def same_stack(reports) -> list:
    """One error when the hosts of a job run different stacks (a job across them would hang or fail
    at its first collective, or train different code): none when they agree."""
    seen = {rep["host"]: next((r for r in rep["results"] if r["check"] == "stack"), None) for rep in reports}
    kinds = {tuple(r[k] for k in ("stack", "python", "tensorflow", "keras", "numpy")) for r in seen.values() if r}
    if len(kinds) <= 1:
        return []
    return [check("stacks", ERROR, "the hosts run different stacks: " + "; ".join(
        f"{host}: {r['detail']}" for host, r in seen.items() if r) + "; set every host up with the same "
        "scripts/setup.sh (HVDTRAIN_STACK, PYTHON)")]


def horovod_build():
    try:
        import horovod
        import horovod.tensorflow as hvd
    except ImportError as e:
        return [check("horovod", ERROR, f"Horovod cannot be used from TensorFlow ({e}); rebuild it after "
                      f"installing TensorFlow: {REINSTALL}")]
    controllers = [n for n, built in (("MPI", hvd.mpi_built()), ("Gloo", hvd.gloo_built())) if built]
    ops = [n for n, built in (("NCCL", hvd.nccl_built()), ("MPI", hvd.mpi_built()),
                              ("Gloo", hvd.gloo_built()), ("DDL", hvd.ddl_built()),
                              ("CCL", hvd.ccl_built())) if built]
    status = OK if controllers else ERROR
    detail = (f"horovod {horovod.__version__}: TensorFlow yes; controllers {', '.join(controllers) or 'none'}; "
              f"tensor operations {', '.join(ops) or 'none'}")
    if not controllers:
        detail += f"; rebuild: {REINSTALL}"
    return [check("horovod", status, detail, version=horovod.__version__, controllers=controllers,
                  tensor_operations=ops, cuda_built=bool(hvd.cuda_built()))]


def mpi():
    found = []
    if shutil.which("mpirun"):
        out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=30)
        found.append((out.stdout or out.stderr).strip().splitlines()[0])
    with contextlib.suppress(Exception):
        from mpi4py import MPI

        found.append("mpi4py: " + MPI.Get_library_version().strip("\x00 \n").splitlines()[0])
    if not found:
        return [check("mpi", WARN, "no mpirun on PATH: use horovodrun --gloo, or install openmpi-bin")]
    import ctypes.util

    return [check("mpi", OK, "; ".join(found))] + pmix_munge(
        bool(ctypes.util.find_library("munge")), munged_answers(), os.environ.get("PMIX_MCA_psec"))


MUNGE_SOCKET = "/run/munge/munge.socket.2"  # munged's default


def munged_answers(path=MUNGE_SOCKET) -> bool:
    """Does a munged listen there (a killed one leaves its socket file behind)?"""
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
        s.settimeout(2)
        s.connect(path)
        return True
    return False


def pmix_munge(library: bool, munged: bool, psec: str | None) -> list:
    """Debian's PMIx (libpmix2 depends on libmunge2) tries munge first; with no munged to answer it
    retries with growing sleeps: every mpirun, and every Open MPI daemon it starts, waits 2.3 s."""
    if library and not munged and not psec:
        return [check("pmix", WARN, "Open MPI's PMIx tries munge first and no munged runs here: every mpirun "
                                    "waits about 2.3 s for it; export PMIX_MCA_psec=native (or start munged)")]
    return []


def gpus(slots: int):
    import tensorflow as tf

    devices = tf.config.list_physical_devices("GPU")
    info = tf.sysconfig.get_build_info()
    cuda = f"built with CUDA {info.get('cuda_version', '-')}, cuDNN {info.get('cudnn_version', '-')}" \
        if info.get("is_cuda_build") else "a CPU-only TensorFlow build"
    results = []
    if not devices:
        status = WARN if info.get("is_cuda_build") else OK
        results.append(check("gpus", status, f"no GPU visible; TensorFlow is {cuda}", count=0))
    else:
        try:  # the decision every worker makes at start, for each local rank of this host
            picks = [runtime.choose_gpu(len(devices), r, slots, os.environ.get("CUDA_VISIBLE_DEVICES"),
                                        socket.gethostname())[1] for r in range(slots)]
            results.append(check("gpus", OK, f"{len(devices)} GPU(s) for {slots} worker(s); TensorFlow "
                                 f"{cuda}; {picks[0]}", count=len(devices), picks=picks))
        except UserError as e:
            results.append(check("gpus", ERROR, str(e), count=len(devices)))
    if devices:
        import ctypes.util

        import horovod.tensorflow as hvd

        lib = ctypes.util.find_library("nccl") or _pip_nccl()
        if hvd.nccl_built():
            results.append(check("nccl", OK, f"Horovod built with NCCL ({lib or 'library bundled'})"))
        else:
            results.append(check("nccl", WARN, "Horovod built without NCCL: GPU allreduce goes through "
                                 "MPI/Gloo on the host; rebuild with HOROVOD_GPU_OPERATIONS=NCCL"))
        results.append(topology(len(devices), slots))
    return results


def _pip_nccl():
    with contextlib.suppress(ImportError):
        import nvidia.nccl  # noqa: F401  (pip's nvidia-nccl-cu12, pulled in by tensorflow[and-cuda])

        return "nvidia-nccl-cu12 from pip"
    return None


SLOW_LINKS = ("SYS", "NODE", "PHB")  # through the CPU: a host bridge, or the socket interconnect (QPI/UPI)


def topology(n: int, local_size: int):
    """The GPU link matrix and peer access from nvidia-smi: pairs that cross the CPU get a warning, and
    GPUs on several NUMA nodes get the launcher binding that keeps each rank beside its GPU."""
    if not shutil.which("nvidia-smi"):
        return check("topology", WARN, "nvidia-smi not found: cannot read the GPU link matrix")
    run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=60)
    return topology_check(run(["nvidia-smi", "topo", "-m"]).stdout,
                          run(["nvidia-smi", "topo", "-p2p", "r"]).stdout, local_size)


def topology_check(topo_text: str, p2p_text: str, local_size: int):
    topo = parse_topology(topo_text)
    links, p2p = topo["links"], parse_p2p(p2p_text)
    gpus = [g for g in links if g.startswith("GPU")]
    slow = sorted({(a, b) for a in gpus for b in gpus if _index(a) < _index(b)
                   and (links[a].get(b) in SLOW_LINKS or p2p.get(a, {}).get(b, "OK") != "OK")})
    groups = group_by_fast_links(topo["links"], p2p)
    binding = numa_binding(topo["affinity"], local_size)
    facts = dict(matrix=links, affinity=topo["affinity"], p2p=p2p, groups=groups, binding=binding)
    advice = f"; {binding['advice']}" if binding["advice"] else ""
    if slow:
        pairs = ", ".join(f"{a}-{b} ({links[a].get(b, '?')}{', no peer access' if p2p.get(a, {}).get(b, 'OK') != 'OK' else ''})"
                          for a, b in slow)
        return check("topology", WARN, f"GPU pairs without a direct link (traffic crosses the CPU): {pairs}; "
                     f"keep a job's local ranks within one of {groups}{advice}", **facts)
    return check("topology", OK, f"{len(gpus)} GPU(s), all pairs linked directly (NVLink or PCIe "
                 f"switch){advice}", **facts)


_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")  # nvidia-smi underlines its header even into a file
_DEVICE = re.compile(r"(GPU|NIC)\d+")


def _table(text: str) -> list:
    """The lines of an nvidia-smi matrix: escape codes gone, the legend and blank lines left out."""
    return [l for l in _ESCAPE.sub("", text).split("Legend:")[0].splitlines() if l.strip()]


def _cells(line: str) -> list:
    return [c.strip() for c in line.split("\t")]


def _index(name: str) -> int:
    return int(name[3:])


def parse_topology(text: str) -> dict:
    """`nvidia-smi topo -m` -> {"links": {"GPU0": {"GPU1": "NV18", "NIC0": "PXB", ...}, ...},
    "affinity": {"GPU0": {"cpus": "0-55,112-167", "numa": "0", "gpu_numa_id": "N/A"}, ...}}."""
    lines = _table(text)
    if not lines:
        return {"links": {}, "affinity": {}}
    header = _cells(lines[0])[1:]
    devices = [h for h in header if _DEVICE.fullmatch(h)]
    extra = [h for h in header[len(devices):] if h]  # CPU Affinity, NUMA Affinity, GPU NUMA ID
    links, affinity = {}, {}
    for line in lines[1:]:
        cells = _cells(line)
        if not _DEVICE.fullmatch(cells[0]):
            continue
        values = cells[1:]
        links[cells[0]] = {d: v for d, v in zip(devices, values) if d != cells[0] and v}
        rest = values[len(devices):]
        if cells[0].startswith("GPU") and rest:
            filled = [v for v in rest if v]  # real output has an empty cell before GPU NUMA ID
            rest = filled if len(filled) == len(extra) else rest[:len(extra)]
            named = dict(zip(extra, rest))
            affinity[cells[0]] = {"cpus": named.get("CPU Affinity", ""), "numa": named.get("NUMA Affinity", ""),
                                  "gpu_numa_id": named.get("GPU NUMA ID", "")}
    return {"links": links, "affinity": affinity}


def parse_p2p(text: str) -> dict:
    """`nvidia-smi topo -p2p r` -> {"GPU0": {"GPU1": "OK", "GPU2": "NS", ...}, ...}."""
    lines = _table(text)
    if not lines:
        return {}
    gpus = [h for h in _cells(lines[0]) if _DEVICE.fullmatch(h)]
    result = {}
    for line in lines[1:]:
        cells = _cells(line)
        if _DEVICE.fullmatch(cells[0]):
            result[cells[0]] = {g: v for g, v in zip(gpus, cells[1:]) if g != cells[0] and v}
    return result


def group_by_fast_links(links: dict, p2p: dict | None = None) -> list:
    """GPUs in groups whose every pair has a direct link (NVLink or a PCIe switch) and peer access."""
    p2p = p2p or {}
    groups: list[list[str]] = []
    for gpu in sorted((g for g in links if g.startswith("GPU")), key=_index):
        for g in groups:
            if all(links[gpu].get(o, "SYS") not in SLOW_LINKS and p2p.get(gpu, {}).get(o, "OK") == "OK"
                   for o in g):
                g.append(gpu)
                break
        else:
            groups.append([gpu])
    return groups


def numa_binding(affinity: dict, local_size: int) -> dict:
    """Which launcher binding keeps local rank r (which takes GPU r) on GPU r's NUMA node."""
    gpus = sorted(affinity, key=_index)[:max(local_size, 1)]
    nodes = [affinity[g]["numa"] for g in gpus]
    known = [n for n in nodes if n not in ("", "N/A")]
    result = {"numa_by_local_rank": nodes, "advice": ""}
    if len(set(known)) < 2:
        return result  # one NUMA node (or none reported): any placement is near its GPU
    per_node = len(gpus) // len(set(known))
    contiguous = nodes == sorted(nodes, key=nodes.index) and all(nodes.count(n) == per_node for n in set(nodes))
    if contiguous:
        result["advice"] = (f"GPUs span NUMA nodes {'/'.join(dict.fromkeys(nodes))}: bind each rank to its GPU's "
                            f"node with `mpirun --map-by ppr:{per_node}:numa --bind-to numa` (horovodrun --mpi: "
                            f"--binding-args=\"--map-by ppr:{per_node}:numa --bind-to numa\"; Gloo binds "
                            f"nothing)")
    else:
        cpus = "; ".join(f"local rank {r}: {affinity[g]['cpus']}" for r, g in enumerate(gpus))
        result["advice"] = (f"GPUs alternate between NUMA nodes ({', '.join(nodes)} by local rank): bind each "
                            f"rank with an Open MPI rankfile or `numactl --physcpubind` ({cpus})")
    return result


def placement():
    """One training step with device-placement logging; ops of the model left on the CPU while a GPU
    is pinned are the classic cause of a 'multi-GPU' job slower than one GPU."""
    import tensorflow as tf

    if not tf.config.get_visible_devices("GPU"):  # not list_logical_devices: it would start the context
        return check("placement", OK, "no GPU pinned: every op runs on the CPU by design", cpu_ops=[])
    text = placement_log()
    if "/device:" not in text:
        return check("placement", WARN, "TensorFlow wrote no placement log (its context had started "
                     "before the check): ops on the CPU cannot be ruled out", cpu_ops=[])
    cpu_ops = cpu_placed_ops(text)
    if cpu_ops:
        return check("placement", WARN, f"{len(cpu_ops)} op(s) of a training step ran on the CPU while "
                     f"a GPU was pinned: {', '.join(cpu_ops[:10])}", cpu_ops=cpu_ops)
    return check("placement", OK, "every op of a training step ran on the GPU", cpu_ops=[])


def placement_log() -> str:
    """TensorFlow's own placement log of one training step of the built-in cnn. Measured on TF 2.15:
    the placer prints to stdout (not the log on stderr, whatever TF_CPP_MIN_LOG_LEVEL says), and only
    when the switch is on before TensorFlow's context starts, so this must be the process's first op."""
    import numpy as np
    import tensorflow as tf

    from . import models

    tf.debugging.set_log_device_placement(True)
    try:
        with capture_fd(1) as out, capture_fd(2) as err:
            model = models.BUILDERS["cnn"]((28, 28, 1), 10)
            model.compile("sgd", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            model.train_on_batch(np.zeros((8, 28, 28, 1), np.float32), np.zeros(8, np.int64))
    finally:
        tf.debugging.set_log_device_placement(False)
    return out.text + err.text


_HOST_SIDE = re.compile(r"(Iterator|Dataset|Identity|NoOp|Const|_Arg|_Retval|Placeholder|ReadVariableOp"
                        r"|VarHandleOp|AssignVariableOp|DestroyResourceOp|Shape)")


def cpu_placed_ops(log_text: str) -> list:
    """Op types the placement log shows on a CPU device, less the ones that live there by design."""
    ops = set()
    for m in re.finditer(r"Executing op (\S+) in device \S*device:CPU:\d+", log_text):
        ops.add(m.group(1))
    for m in re.finditer(r"\((\w+)\): /job:\S*device:CPU:\d+", log_text):
        ops.add(m.group(1))
    return sorted(op for op in ops if not _HOST_SIDE.fullmatch(op))


class capture_fd(contextlib.AbstractContextManager):
    """Capture what C++ code writes to a file descriptor (TensorFlow prints placement from C++)."""

    def __init__(self, fd):
        self.fd, self.text = fd, ""

    def __enter__(self):
        self.tmp = tempfile.TemporaryFile(mode="w+b")
        _flush_all()
        self.saved = os.dup(self.fd)
        os.dup2(self.tmp.fileno(), self.fd)
        return self

    def __exit__(self, *exc):
        _flush_all()
        os.dup2(self.saved, self.fd)
        os.close(self.saved)
        self.tmp.seek(0)
        self.text = self.tmp.read().decode(errors="replace")
        self.tmp.close()
        return False


def _flush_all():
    """Python's buffers and C's (printf to a file is block-buffered), before a descriptor changes hands."""
    import ctypes

    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.CDLL(None).fflush(None)


def cpu_threads(slots: int, threads: int):
    cores = len(os.sched_getaffinity(0))
    per_worker = threads or runtime.cpu_threads_per_worker(slots)
    total = per_worker * slots
    facts = {"cores": cores, "workers": slots, "threads_per_worker": per_worker}
    if total > cores:
        return check("cpu", WARN, f"{slots} worker(s) x {per_worker} intra-op thread(s) = {total} > "
                     f"{cores} core(s): workers will oversubscribe the CPU; leave --threads at 0", **facts)
    return check("cpu", OK, f"{slots} worker(s) x {per_worker} intra-op thread(s) on {cores} core(s)", **facts)


def ssh_reachable(hosts, port=None):
    from . import hosts as hosts_lib

    return [check(f"ssh {h}", OK if ok else ERROR, detail) for h, ok, detail in
            (hosts_lib.ssh_check(h, port) for h in hosts)]


def host_report(args) -> dict:
    slots = args.slots or runtime.world().local_size
    results = [stack()] + horovod_build() + mpi()
    if results[0]["status"] != ERROR:
        results += gpus(slots) + [placement()]
    results.append(cpu_threads(slots, args.threads))
    if args.hostfile or args.hosts:
        from . import hosts as hosts_lib

        hostnames = [h for h, _ in hosts_lib.parse(args.hostfile, args.hosts)]
        results += ssh_reachable([h for h in hostnames if h not in ("localhost", "127.0.0.1")], args.ssh_port)
    return {"host": socket.gethostname(), "results": results}


def parser():
    p = argparse.ArgumentParser(prog="hvdtrain doctor", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print JSON instead of a readable report")
    p.add_argument("--slots", type=int, default=0,
                   help="workers per host to check against (default: the launcher's local size, or 1)")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per worker, as for training")
    p.add_argument("--hostfile", help="check ssh reachability of the hosts in this hostfile")
    p.add_argument("-H", "--hosts", help="check ssh reachability of these hosts (host:slots,...)")
    p.add_argument("--ssh-port", type=int, help="ssh port, as for horovodrun --ssh-port")
    return p


def main(argv) -> int:
    args = parser().parse_args(argv)
    world = runtime.world()
    if world.size > 1 or "HOROVOD_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        world = _init_quietly()
    report = host_report(args) if world.local_rank == 0 else None
    reports = [r for r in runtime.gather(report) if r]
    if reports:
        reports[0]["results"] += same_stack(reports)
    failed = any(r["status"] == ERROR for rep in reports for r in rep["results"])
    if world.is_chief:
        print(json.dumps({"hosts": reports, "ok": not failed}, indent=2) if args.json else render(reports),
              flush=True)
    return 1 if failed else 0


def _init_quietly():
    try:
        return runtime.init()
    except Exception as e:  # noqa: BLE001 (reported: a doctor that crashes on a broken install is no doctor)
        raise UserError(f"hvd.init() failed: {e}") from None


def render(reports) -> str:
    marks = {OK: "ok  ", WARN: "WARN", ERROR: "FAIL"}
    out = []
    for rep in reports:
        out.append(f"== {rep['host']}")
        out += [f"  [{marks[r['status']]}] {r['check']}: {r['detail']}" for r in rep["results"]]
    return "\n".join(out)
