"""`hvdtrain doctor`: the checks that explain most first-day multi-GPU failures, one report per host.

Horovod build (TensorFlow support, controllers, tensor operations), MPI, GPUs against slots, CUDA/cuDNN
and NCCL, the GPU link topology, ops that silently land on the CPU, and CPU oversubscription. Run it
alone, or under horovodrun/mpirun with the job's own host list: every host's local rank 0 reports.
"""
from __future__ import annotations

import argparse
import contextlib
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
    return [check("mpi", OK, "; ".join(found))]


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
    elif slots > len(devices):
        results.append(check("gpus", ERROR, f"{slots} workers on this host but {len(devices)} GPU(s): "
                             f"two workers would share a GPU; lower the slots", count=len(devices)))
    else:
        results.append(check("gpus", OK, f"{len(devices)} GPU(s) for {slots} worker(s); TensorFlow "
                             f"{cuda}", count=len(devices)))
    if devices:
        import ctypes.util

        import horovod.tensorflow as hvd

        lib = ctypes.util.find_library("nccl") or _pip_nccl()
        if hvd.nccl_built():
            results.append(check("nccl", OK, f"Horovod built with NCCL ({lib or 'library bundled'})"))
        else:
            results.append(check("nccl", WARN, "Horovod built without NCCL: GPU allreduce goes through "
                                 "MPI/Gloo on the host; rebuild with HOROVOD_GPU_OPERATIONS=NCCL"))
        results.append(topology(len(devices)))
    return results


def _pip_nccl():
    with contextlib.suppress(ImportError):
        import nvidia.nccl  # noqa: F401  (pip's nvidia-nccl-cu12, pulled in by tensorflow[and-cuda])

        return "nvidia-nccl-cu12 from pip"
    return None


def topology(n: int):
    """The GPU link matrix from nvidia-smi; pairs that cross the CPU interconnect get a warning."""
    if not shutil.which("nvidia-smi"):
        return check("topology", WARN, "nvidia-smi not found: cannot read the GPU link matrix")
    out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=60).stdout
    matrix = parse_topology(out)
    slow = sorted({(a, b) for a, row in matrix.items() for b, link in row.items()
                   if a < b and link in ("SYS", "NODE", "PHB")})
    groups = group_by_fast_links(matrix)
    if slow:
        return check("topology", WARN, f"GPU pairs without a direct link (traffic crosses the CPU): "
                     f"{', '.join(f'{a}-{b}' for a, b in slow)}; keep a job's local ranks within one of "
                     f"{groups}", matrix=matrix, groups=groups)
    return check("topology", OK, f"{n} GPU(s), all pairs linked directly (NVLink or PCIe switch)",
                 matrix=matrix, groups=groups)


def parse_topology(text: str) -> dict:
    """`nvidia-smi topo -m` -> {"GPU0": {"GPU1": "NV12", ...}, ...} (GPU columns only)."""
    lines = [l for l in text.splitlines() if l.strip()]
    if not lines:
        return {}
    header = lines[0].split()
    gpu_cols = [i for i, h in enumerate(header) if re.fullmatch(r"GPU\d+", h)]
    matrix = {}
    for line in lines[1:]:
        cells = line.split()
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]):
            continue
        matrix[cells[0]] = {header[i]: cells[i + 1] for i in gpu_cols if i + 1 < len(cells)
                            and header[i] != cells[0]}
    return matrix


def group_by_fast_links(matrix: dict) -> list:
    groups = []
    for gpu in sorted(matrix, key=lambda g: int(g[3:])):
        for g in groups:
            if all(matrix[gpu].get(o, "SYS") not in ("SYS", "NODE", "PHB") for o in g):
                g.append(gpu)
                break
        else:
            groups.append([gpu])
    return groups


def placement():
    """One training step with device-placement logging; ops of the model left on the CPU while a GPU
    is pinned are the classic cause of a 'multi-GPU' job slower than one GPU."""
    import numpy as np
    import tensorflow as tf

    from . import models

    if not tf.config.list_logical_devices("GPU"):
        return check("placement", OK, "no GPU pinned: every op runs on the CPU by design", cpu_ops=[])
    model = models.build("cnn", (28, 28, 1), 10)
    model.compile("sgd", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = np.zeros((8, 28, 28, 1), np.float32), np.zeros(8, np.int64)
    tf.debugging.set_log_device_placement(True)
    try:
        with capture_fd(2) as captured:
            model.train_on_batch(x, y)
    finally:
        tf.debugging.set_log_device_placement(False)
    cpu_ops = cpu_placed_ops(captured.text)
    if cpu_ops:
        return check("placement", WARN, f"{len(cpu_ops)} op(s) of a training step ran on the CPU while "
                     f"a GPU was pinned: {', '.join(cpu_ops[:10])}", cpu_ops=cpu_ops)
    return check("placement", OK, "every op of a training step ran on the GPU", cpu_ops=[])


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
    """Capture what C++ code writes to a file descriptor (TensorFlow logs placement from C++)."""

    def __init__(self, fd):
        self.fd, self.text = fd, ""

    def __enter__(self):
        self.tmp = tempfile.TemporaryFile(mode="w+b")
        sys.stderr.flush()
        self.saved = os.dup(self.fd)
        os.dup2(self.tmp.fileno(), self.fd)
        return self

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self.saved, self.fd)
        os.close(self.saved)
        self.tmp.seek(0)
        self.text = self.tmp.read().decode(errors="replace")
        self.tmp.close()
        return False


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
    results = horovod_build() + mpi()
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
    failed = any(r["status"] == ERROR for rep in reports for r in rep["results"])
    if world.is_chief:
        print(json.dumps({"hosts": reports, "ok": not failed}, indent=2) if args.json else render(reports),
              flush=True)
    return 1 if failed else 0


def _init_quietly():
    try:
        return runtime.init()
    except Exception as e:  # report it: a doctor that crashes on a broken install is no doctor
        raise UserError(f"hvd.init() failed: {e}") from None


def render(reports) -> str:
    marks = {OK: "ok  ", WARN: "WARN", ERROR: "FAIL"}
    out = []
    for rep in reports:
        out.append(f"== {rep['host']}")
        out += [f"  [{marks[r['status']]}] {r['check']}: {r['detail']}" for r in rep["results"]]
    return "\n".join(out)
