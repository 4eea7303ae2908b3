"""Which collectives set-up builds Horovod with (scripts/horovod_build.py): NCCL wherever TensorFlow is
a CUDA build and a CUDA toolkit of its major version is found, and otherwise a line that says what is
missing. Checked in-process on real tool output (tests/fixtures: `nvcc --version` of Debian trixie's
12.4 toolkit and NVIDIA's 13.0, `nvidia-smi -L` of an H100 host) and on real folders laid out as the
toolkit and NCCL's wheel lay them out. The build itself is proven by building (docs/install.md#gpus)."""
import importlib.util
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
spec = importlib.util.spec_from_file_location("horovod_build", ROOT / "scripts" / "horovod_build.py")
hb = sys.modules["horovod_build"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hb)

NVCC_12 = (FIXTURES / "nvcc" / "version-12.4-debian-trixie.txt").read_text()
NVCC_13 = (FIXTURES / "nvcc" / "version-13.0-nvidia.txt").read_text()
NCCL_H = "#define NCCL_MAJOR 2\n#define NCCL_MINOR 21\n#define NCCL_PATCH 5\n"


def _toolkit(root: Path, version_text: str) -> Path:
    """A toolkit folder whose bin/nvcc prints what the real one printed."""
    (root / "bin").mkdir(parents=True)
    (root / "out.txt").write_text(version_text)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\ncat {root / 'out.txt'}\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    return root


def _nccl(found=True):
    return lambda: hb.Nccl("/inc", "/lib", "2.21.5", "the nvidia-nccl-cu12 wheel", "$ORIGIN/../../nvidia/nccl/lib") \
        if found else None


def test_the_toolkit_version_and_gpus_are_read_from_the_tools_real_output():
    assert hb.nvcc_version(NVCC_12) == "12.4" and hb.nvcc_version(NVCC_13) == "13.0"
    assert hb.gpu_count((FIXTURES / "nvidia-smi" / "h100-x1-L.txt").read_text()) == 1
    assert hb.gpu_count("") == 0


def test_the_toolkit_is_found_by_cuda_home_before_path(tmp_path):
    home = _toolkit(tmp_path / "cuda-12.4", NVCC_12)
    on_path = _toolkit(tmp_path / "cuda-13.0", NVCC_13)
    env = {"PATH": f"{on_path / 'bin'}:/usr/bin"}
    assert hb.find_toolkit({**env, "CUDA_HOME": str(home)}) == hb.Toolkit(str(home), "12.4")
    assert hb.find_toolkit(env) == hb.Toolkit(str(on_path), "13.0")  # a module's PATH


def test_a_cuda_tensorflow_with_a_toolkit_of_its_major_builds_nccl_and_says_from_what():
    chosen = hb.plan("12.5.1", 8, hb.Toolkit("/usr", "12.4"), _nccl(), "auto", "-L/opt/x")
    # the wheel's libnccl.so.2 is on no loader path: Horovod's library looks beside it, in site-packages
    assert chosen.env["LDFLAGS"] == "-L/opt/x -Wl,-rpath,$ORIGIN/../../nvidia/nccl/lib"
    assert chosen.env["HOROVOD_GPU_OPERATIONS"] == "NCCL" and chosen.env["HOROVOD_NCCL_LINK"] == "SHARED"
    assert chosen.env["HOROVOD_CUDA_HOME"] == "/usr" and chosen.env["HOROVOD_NCCL_INCLUDE"] == "/inc"
    assert chosen.key == "nccl-cuda12.4"  # its own wheel cache, apart from the CPU build's
    assert "NCCL 2.21.5 (from the nvidia-nccl-cu12 wheel" in chosen.said and "CUDA 12.4 toolkit at /usr" in chosen.said
    assert "CXX" not in chosen.env  # g++ is the one nvcc takes


def test_horovod_is_built_with_the_newest_compiler_nvcc_takes_or_refused_in_one_line(tmp_path):
    for version in ("14", "13", "12"):  # Debian trixie: g++ is 14, nvcc 12.4 takes 13 at most
        tool = tmp_path / f"g++-{version}"
        tool.write_text("#!/bin/sh\n")
        tool.chmod(0o755)
    (tmp_path / "g++").symlink_to(tmp_path / "g++-14")
    env = {"PATH": str(tmp_path)}
    takes = lambda most: (lambda cxx: cxx != "g++" and int(cxx.split("-")[1]) <= most)
    assert hb.host_compiler(hb.Toolkit("/usr", "12.4"), env, takes(13)) == "g++-13"
    assert hb.host_compiler(hb.Toolkit("/usr", "12.4"), env, takes(11)) is None
    chosen = hb.plan("12.5.1", 1, hb.Toolkit("/usr", "12.4"), _nccl(), "auto", compiler=lambda: "g++-13")
    assert (chosen.env["CXX"], chosen.env["CC"]) == ("g++-13", "gcc-13") and "with g++-13" in chosen.said
    with pytest.raises(hb.Refused, match="Debian's g\\+\\+-13"):
        hb.plan("12.5.1", 1, hb.Toolkit("/usr", "12.4"), _nccl(), "auto", compiler=lambda: None)


def test_a_toolkit_of_another_major_is_refused_in_one_line():
    with pytest.raises(hb.Refused) as refused:
        hb.plan("12.5.1", 0, hb.Toolkit("/usr/local/cuda", "13.0"), _nccl(), "auto")
    message = str(refused.value)
    assert "\n" not in message and "is 13.0" in message and "CUDA 12.5.1" in message
    assert "HVDTRAIN_NCCL=0" in message


@pytest.mark.parametrize("gpus", [1, 0])
def test_a_gpu_host_without_a_toolkit_is_told_how_to_get_one_and_a_cpu_host_builds_cpu_collectives(gpus):
    if gpus:
        with pytest.raises(hb.Refused) as refused:
            hb.plan("12.5.1", gpus, None, _nccl(), "auto")
        assert "nvidia-cuda-toolkit" in str(refused.value) and "module load cuda/12" in str(refused.value)
    else:  # an image built on a machine without GPUs or nvcc: said, not silent
        chosen = hb.plan("12.5.1", gpus, None, _nccl(), "auto")
        assert chosen.key == "cpu" and "no CUDA toolkit" in chosen.said


def test_a_cpu_tensorflow_builds_cpu_collectives_unless_the_host_has_gpus():
    assert hb.plan(None, 0, hb.Toolkit("/usr/local/cuda", "13.0"), _nccl(), "auto").key == "cpu"
    with pytest.raises(hb.Refused, match="tensorflow\\[and-cuda\\]"):
        hb.plan(None, 2, None, _nccl(), "auto")
    assert hb.plan(None, 2, None, _nccl(), "0").key == "cpu"  # asked for


def test_nccl_asked_for_and_missing_is_refused():
    with pytest.raises(hb.Refused, match="libnccl-dev"):
        hb.plan("12.2", 0, hb.Toolkit("/usr", "12.4"), _nccl(found=False), "1")


def test_nccl_from_a_wheel_is_linked_by_a_libnccl_so_of_its_own(tmp_path, monkeypatch):
    wheel = tmp_path / "site" / "nvidia" / "nccl"
    (wheel / "include").mkdir(parents=True)
    (wheel / "lib").mkdir()
    (wheel / "include" / "nccl.h").write_text(NCCL_H)
    (wheel / "lib" / "libnccl.so.2").write_bytes(b"\x7fELF")
    (tmp_path / "site" / "nvidia" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in [m for m in sys.modules if m == "nvidia" or m.startswith("nvidia.")]:
        monkeypatch.delitem(sys.modules, name)
    found = hb.find_nccl(hb.Toolkit("/nowhere", "12.4"), tmp_path / "link", {})
    assert (found.version, found.include, found.source) == ("2.21.5", str(wheel / "include"), "the nvidia-nccl-cu12 wheel")
    # horovod/tensorflow/mpi_lib*.so, two folders below site-packages, finds the wheel's library
    assert os.path.normpath(str(tmp_path / "site" / "horovod" / "tensorflow" / found.runpath.replace("$ORIGIN/", ""))) \
        == str(wheel / "lib")
    assert os.path.realpath(Path(found.lib) / "libnccl.so") == str(wheel / "lib" / "libnccl.so.2")


def test_the_script_prints_the_plan_setup_evaluates():
    """This machine's own answer, through the command set-up runs: its TensorFlow is a CPU build."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "horovod_build.py"), "/nonexistent"],
                         capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert out.returncode == 0, out.stderr
    assert "export HVDTRAIN_COLLECTIVES=cpu" in out.stdout.splitlines()
    assert "TensorFlow is a CPU build" in out.stdout


@pytest.mark.parametrize("device, tf_version, has_kernels", [
    ("CPU:0", "2.18.1", False), ("GPU:0", "2.15.1", True), ("GPU:0", "2.18.1", True),
    ("GPU:0", "2.20.0", False), ("GPU:0", "2.21.0", False)])
def test_jit_compile_is_refused_where_horovod_has_no_xla_kernels(device, tf_version, has_kernels):
    """Set-up leaves Horovod's XLA kernels out of builds against TensorFlow 2.20+ (scripts/setup.sh), and
    Horovod has none on CPUs: there --jit-compile is refused before training, with the reason."""
    from hvdtrain.compiling import horovod_lacks_xla_kernels

    why = horovod_lacks_xla_kernels(device, tf_version)
    assert (why == "") == has_kernels
    if not has_kernels and device.startswith("GPU"):
        assert f"TensorFlow {tf_version}" in why and "2.20+" in why
