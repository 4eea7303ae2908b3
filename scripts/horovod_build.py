"""Which collectives scripts/setup.sh builds Horovod with, and from what: run by set-up with the venv's
Python once TensorFlow is installed.

    python scripts/horovod_build.py     # prints `export NAME=value` lines for setup.sh; says why on stderr

- TensorFlow's CPU build: MPI and Gloo (CPU collectives), as always.
- TensorFlow's CUDA build and a CUDA toolkit of the same major version (nvcc through HOROVOD_CUDA_HOME,
  CUDA_HOME, CUDA_PATH, PATH as an HPC module sets it, or /usr/local/cuda): NCCL too, for the GPU
  allreduce. NCCL's header and library come from the wheel TensorFlow's CUDA extra installed
  (nvidia-nccl-cu12, the library TensorFlow's processes load), else from the system (libnccl-dev).
- A toolkit of another major version, or a GPU host with no toolkit: refused in one line that says
  what to get (exit 1). HVDTRAIN_NCCL=0 asks for CPU collectives anyway; HVDTRAIN_NCCL=1 refuses
  anything but NCCL.

The wheel is kept per TensorFlow, Python and collective set (`key` below): a CPU build is never handed
to a GPU venv, nor the other way round.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

GET_A_TOOLKIT = ("get a CUDA {major} toolkit: NVIDIA's cuda-toolkit-{major}-x package, Debian trixie's "
                 "nvidia-cuda-toolkit (non-free) with libnccl-dev (contrib), or `module load cuda/{major}` on "
                 "a cluster; then run set-up again (CUDA_HOME=/path/to/cuda where nvcc is not on PATH)")


OR_CPU = "; or HVDTRAIN_NCCL=0 for CPU collectives"  # every refusal's way out


class Refused(Exception):
    """Set-up cannot build what this host needs; the message says what to do, in one line."""


@dataclass(frozen=True)
class Toolkit:
    root: str  # HOROVOD_CUDA_HOME: Horovod compiles with root/bin/nvcc
    version: str  # "12.4"

    @property
    def major(self) -> str:
        return self.version.split(".")[0]


@dataclass(frozen=True)
class Nccl:
    include: str
    lib: str  # a folder with libnccl.so, which Horovod's CMake links against
    version: str
    source: str  # where it came from, as said to the user
    runpath: str = ""  # where Horovod's library finds libnccl.so.2 at run time, if not the system's


@dataclass(frozen=True)
class Plan:
    env: dict  # Horovod's build variables
    key: str  # the wheel cache's suffix for this collective set
    said: str  # one line: the collectives and what they are built from


def nvcc_version(text: str) -> str | None:
    """`nvcc --version` -> "12.4" (its "release 12.4, V12.4.131" line)."""
    m = re.search(r"release (\d+)\.(\d+)", text)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def gpu_count(nvidia_smi_l: str) -> int:
    """GPUs in `nvidia-smi -L` output ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: ...)" per GPU)."""
    return len(re.findall(r"^GPU \d+:", nvidia_smi_l, flags=re.M))


def nccl_version(header: Path) -> str:
    defines = dict(re.findall(r"^#define NCCL_(MAJOR|MINOR|PATCH)\s+(\d+)", header.read_text(), flags=re.M))
    return ".".join(defines.get(k, "?") for k in ("MAJOR", "MINOR", "PATCH"))


def _output(cmd: list) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def find_toolkit(env: dict) -> Toolkit | None:
    """The first nvcc of HOROVOD_CUDA_HOME, CUDA_HOME, CUDA_PATH, PATH and /usr/local/cuda."""
    roots = [env[k] for k in ("HOROVOD_CUDA_HOME", "CUDA_HOME", "CUDA_PATH") if env.get(k)]
    on_path = shutil.which("nvcc", path=env.get("PATH", ""))
    if on_path:
        roots.append(str(Path(on_path).parent.parent))  # /usr/bin/nvcc: /usr; a module's .../cuda/bin/nvcc
    roots.append("/usr/local/cuda")
    for root in roots:
        nvcc = Path(root) / "bin" / "nvcc"
        if nvcc.is_file():
            version = nvcc_version(_output([str(nvcc), "--version"]))
            if version:
                return Toolkit(root, version)
    return None


def find_nccl(toolkit: Toolkit, link_dir: Path, env: dict) -> Nccl | None:
    """NCCL from the nvidia-nccl-cu12 wheel, else the toolkit's or the system's. The wheel has
    libnccl.so.2 and no libnccl.so: a link named so, in link_dir, is what CMake is pointed at."""
    if env.get("HOROVOD_NCCL_HOME") or env.get("HOROVOD_NCCL_INCLUDE"):
        home = env.get("HOROVOD_NCCL_HOME", "")
        include = env.get("HOROVOD_NCCL_INCLUDE") or f"{home}/include"
        lib = env.get("HOROVOD_NCCL_LIB") or f"{home}/lib"
        return Nccl(include, lib, nccl_version(Path(include) / "nccl.h"), "HOROVOD_NCCL_* as you set them")
    try:
        import nvidia.nccl as wheel  # pulled in by tensorflow[and-cuda]
        base = Path(list(wheel.__path__)[0])
    except ImportError:
        base = None
    if base is not None and (base / "include" / "nccl.h").is_file() and (base / "lib" / "libnccl.so.2").is_file():
        link_dir.mkdir(parents=True, exist_ok=True)
        link = link_dir / "libnccl.so"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(base / "lib" / "libnccl.so.2")
        # horovod/tensorflow/mpi_lib*.so and nvidia/nccl/lib/ lie in the same site-packages
        return Nccl(str(base / "include"), str(link_dir), nccl_version(base / "include" / "nccl.h"),
                    "the nvidia-nccl-cu12 wheel", "$ORIGIN/../../nvidia/nccl/lib")
    for include, libs in ((f"{toolkit.root}/include", [f"{toolkit.root}/lib64", f"{toolkit.root}/lib"]),
                          ("/usr/include", ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64"])):
        lib = next((d for d in libs if (Path(d) / "libnccl.so").exists()), None)
        if (Path(include) / "nccl.h").is_file() and lib:
            return Nccl(include, lib, nccl_version(Path(include) / "nccl.h"), f"the system ({lib})")
    return None


def host_compiler(toolkit: Toolkit, env: dict, accepts=None) -> str | None:
    """The C++ compiler nvcc takes as its host compiler: $CXX (or g++) where it does, else the newest
    g++-N here that it does (nvcc 12.4 takes GCC 13 at most; Debian trixie's g++ is 14). None: none.
    Horovod compiles everything with that one compiler (CMAKE_CUDA_HOST_COMPILER is CMAKE_CXX_COMPILER)."""
    # by its full path, as CMake gives it: Debian's nvcc finds a bare "g++" in a folder of its own first
    accepts = accepts or (lambda cxx: subprocess.run(
        [f"{toolkit.root}/bin/nvcc", "-ccbin", shutil.which(cxx, path=env.get("PATH", "")), "-E", "-x", "cu",
         os.devnull, "-o", os.devnull], capture_output=True, timeout=120).returncode == 0)
    default = env.get("CXX") or "g++"
    versions = sorted((int(m.group(1)) for p in env.get("PATH", "").split(":") if os.path.isdir(p)
                       for m in [re.fullmatch(r"g\+\+-(\d+)", f) for f in os.listdir(p)] if m), reverse=True)
    for cxx in [default, *(f"g++-{v}" for v in dict.fromkeys(versions))]:
        if shutil.which(cxx, path=env.get("PATH", "")) and accepts(cxx):
            return cxx
    return None


def _cpu(why: str) -> Plan:
    return Plan({}, "cpu", f"Horovod with MPI and Gloo (CPU collectives): {why}")


def plan(tf_cuda: str | None, gpus: int, toolkit: Toolkit | None, nccl, wanted: str, ldflags: str = "",
         compiler=lambda: "g++", cxx: str = "") -> Plan:
    """What to build. tf_cuda: the CUDA version TensorFlow was built with (None: a CPU build);
    nccl: a callable giving the Nccl found (looked for only once NCCL is to be built); wanted:
    HVDTRAIN_NCCL ("auto", "1", "0"); ldflags: the LDFLAGS the build has already; compiler: a
    callable giving host_compiler(); cxx: $CXX."""
    if wanted == "0":
        return _cpu("HVDTRAIN_NCCL=0")
    if tf_cuda is None:
        if wanted == "1" or gpus:
            raise Refused(f"{'HVDTRAIN_NCCL=1' if wanted == '1' else f'this host has {gpus} GPU(s)'}, and "
                          f"TensorFlow is a CPU build: set up with TensorFlow's CUDA build "
                          f"(HVDTRAIN_TF='tensorflow[and-cuda]==VERSION')" + OR_CPU)
        return _cpu("TensorFlow is a CPU build")
    major = tf_cuda.split(".")[0]
    if toolkit is None:
        if wanted == "1" or gpus:
            raise Refused(f"no CUDA toolkit (nvcc) found for Horovod's NCCL ops, which TensorFlow's CUDA "
                          f"{tf_cuda} needs on {'this GPU host' if gpus else 'HVDTRAIN_NCCL=1'}: "
                          + GET_A_TOOLKIT.format(major=major) + OR_CPU)
        return _cpu(f"no CUDA toolkit (nvcc) found; {GET_A_TOOLKIT.format(major=major)} for NCCL")
    if toolkit.major != major:
        raise Refused(f"the CUDA toolkit at {toolkit.root} is {toolkit.version}, and TensorFlow was built with "
                      f"CUDA {tf_cuda}: Horovod's NCCL ops must be compiled by a CUDA {major} toolkit; "
                      + GET_A_TOOLKIT.format(major=major) + OR_CPU)
    found = nccl()
    if found is None:
        raise Refused(f"the CUDA {toolkit.version} toolkit at {toolkit.root} has no NCCL beside it, and no "
                      f"nvidia-nccl-cu12 wheel is installed: install libnccl-dev, or set HOROVOD_NCCL_HOME"
                      + OR_CPU)
    host = compiler()
    if host is None:
        raise Refused(f"nvcc {toolkit.version} takes none of the C++ compilers here as its host compiler "
                      f"({cxx or 'g++'}, g++-N): install one it takes (CUDA 12.4: GCC 13 at most, "
                      f"Debian's g++-13)" + OR_CPU)
    env = {"HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_CUDA_HOME": toolkit.root, "HOROVOD_NCCL_LINK": "SHARED",
           "HOROVOD_NCCL_INCLUDE": found.include, "HOROVOD_NCCL_LIB": found.lib}
    if host != (cxx or "g++"):  # Horovod builds its C++ with the compiler nvcc takes
        env.update(CXX=host, CC=host.replace("g++", "gcc"))
    if found.runpath:  # the wheel's library is on no loader path: Horovod's library is told where it is
        env["LDFLAGS"] = f"{ldflags} -Wl,-rpath,{found.runpath}".strip()
    return Plan(env, f"nccl-cuda{toolkit.version}",
                f"Horovod with NCCL {found.version} (from {found.source}; GPU allreduce) compiled by the CUDA "
                f"{toolkit.version} toolkit at {toolkit.root} with {host}, and MPI and Gloo")


def tensorflow_cuda() -> str | None:
    import tensorflow as tf

    info = tf.sysconfig.get_build_info()
    return info.get("cuda_version") if info.get("is_cuda_build") else None


def main(link_dir: str) -> int:
    env = dict(os.environ)
    gpus = gpu_count(_output(["nvidia-smi", "-L"])) if shutil.which("nvidia-smi") else 0
    toolkit = find_toolkit(env)
    try:
        chosen = plan(tensorflow_cuda(), gpus, toolkit, lambda: find_nccl(toolkit, Path(link_dir), env),
                      env.get("HVDTRAIN_NCCL", "auto"), env.get("LDFLAGS", ""),
                      lambda: host_compiler(toolkit, env), env.get("CXX", ""))
    except Refused as e:
        print(f"setup: {e}", file=sys.stderr)
        return 1
    for name, value in {**chosen.env, "HVDTRAIN_COLLECTIVES": chosen.key, "HVDTRAIN_COLLECTIVES_SAID": chosen.said}.items():
        print(f"export {name}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.getcwd(), ".nccl-link")))
