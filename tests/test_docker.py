"""The docker-compose cluster: build the CPU image, train 2 nodes x 2 slots, read the shared volume. And
the GPU image, built here without a GPU: Horovod with NCCL, training on its CPUs as the CPU image does.

Slow the first time (debootstrap, apt, pip: ~10+ minutes); with the base image and Docker's layer
cache warm, a few minutes. Needs a Docker daemon (scripts/docker_up.sh starts one as root).
Run alone with `pytest -m docker`.
"""
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from jobs import ROOT, run

pytestmark = [pytest.mark.docker, pytest.mark.alone, pytest.mark.full]

IMAGE = os.environ.get("HVDTRAIN_IMAGE", "hvdtrain:cpu")
GPU_IMAGE = "hvdtrain:gpu"
PROJECT = "hvdtraintest"
COMPOSE_FILE = ROOT / "docker" / "docker-compose.yml"
WHEELS = ROOT / "docker" / "wheels"


def sh(cmd, timeout, check=True, env=None):
    """Run cmd to the end (run: its process group ended on timeout); stdout+stderr together."""
    proc = run([str(c) for c in cmd], timeout, {"HVDTRAIN_IMAGE": IMAGE, **(env or {})})
    if check:
        assert proc.returncode == 0, f"{' '.join(map(str, cmd))} -> {proc.returncode}\n{proc.stdout[-6000:]}"
    return proc


@pytest.fixture(scope="module")
def compose():
    up = subprocess.run([str(ROOT / "scripts" / "docker_up.sh")], capture_output=True, text=True, timeout=600)
    if up.returncode != 0:
        why = (up.stderr.strip().splitlines() or [f"exit {up.returncode}"])[-1]
        pytest.skip(f"docker cannot be started here: {why}")
    base = up.stdout.strip().split() + ["-f", str(COMPOSE_FILE), "-p", PROJECT]
    sh(base + ["down", "-v", "--remove-orphans"], timeout=180, check=False)
    try:
        yield base
    finally:
        sh(base + ["down", "-v", "--remove-orphans"], timeout=180, check=False)


@pytest.fixture(scope="module")
def image():
    sh([ROOT / "scripts" / "docker_base.sh"], timeout=1200)
    # the Horovod wheel scripts/setup.sh kept for the image's stack (Debian bookworm: Python 3.11, keras3's
    # TensorFlow 2.18.1), when this machine built one; else the image builds it (about 4 minutes)
    kept = Path.home() / ".cache" / "hvdtrain" / "horovod-0.28.1-tf2.18.1-py3.11"
    for wheel in kept.glob("horovod-0.28.1-cp311-*.whl"):
        shutil.copy(wheel, WHEELS)
    sh(["docker", "build", "--network", "host", "-f", ROOT / "docker" / "Dockerfile", "-t", IMAGE, "."],
       timeout=2400)
    return IMAGE


def read_volume(image, volume, code):
    proc = sh(["docker", "run", "--rm", "--network", "none", "--entrypoint", "python", "-v", f"{volume}:/data",
               image, "-c", code], timeout=120)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def workers(compose, image):
    sh(compose + ["up", "-d", "worker1", "worker2"], timeout=300)   # keygen runs first
    volumes = sh(["docker", "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}"],
                 timeout=60).stdout.split()
    data = [v for v in volumes if v.endswith("_data")]
    assert len(data) == 1, volumes
    return data[0]


@pytest.mark.parametrize("controller", ["mpi", "gloo"])
def test_compose_two_nodes_train(compose, image, workers, controller):
    """The launcher container is on the workers' network with the same interface name (eth0): both
    controllers work (Gloo needs that; see docs/multinode.md)."""
    out_dir = f"/data/runs/compose-{controller}"
    job = ["horovodrun", "-np", "4", "-H", "worker1:2,worker2:2", f"--{controller}", "python", "-m", "hvdtrain",
           "--model", "mlp", "--data", "digits", "--epochs", "2", "--steps-per-epoch", "5", "--verbose", "0",
           "--output-dir", out_dir]
    run = sh(compose + ["run", "--rm", "launcher", *job], timeout=600, check=False)
    assert run.returncode == 0, run.stdout[-6000:]

    found = read_volume(image, workers, (
        f"import json, os; d = {out_dir!r}; "
        "print(json.dumps({'summary': json.load(open(d + '/summary.json')), "
        "'model_bytes': os.path.getsize(d + '/model.keras')}))"))
    summary = found["summary"]
    assert summary["world_size"] == 4
    assert sorted(set(summary["hosts"])) == ["worker1", "worker2"], summary["hosts"]
    digests = summary["weights_sha256_by_rank"]
    assert len(digests) == 4 and len(set(digests)) == 1, digests
    assert found["model_bytes"] > 0


@pytest.fixture(scope="module")
def gpu_image(compose):
    """The GPU image on a trixie base made by debootstrap: Debian's CUDA toolkit is a layer of its own, so a
    rebuild after a code change costs the set-up layer at most, not the toolkit's download."""
    sh([ROOT / "scripts" / "docker_base.sh"], timeout=1200, env={"SUITE": "trixie"})
    sh(["docker", "build", "--network", "host", "-f", ROOT / "docker" / "Dockerfile.gpu", "-t", GPU_IMAGE, "."],
       timeout=3600)
    return GPU_IMAGE


def in_image(image, *cmd, timeout=600):
    """cmd in a fresh container of image, with no network, as a user's `docker run` would."""
    return sh(["docker", "run", "--rm", "--network", "none", "--shm-size", "1g", "--entrypoint", cmd[0], image,
               *cmd[1:]], timeout=timeout)


def default_job_metrics(image):
    """The README's job at 2 workers inside image: its final metrics, from rank 0's summary."""
    proc = in_image(image, "bash", "-c",
                    "horovodrun -np 2 python -m hvdtrain --verbose 0 --output-dir /tmp/run >/tmp/job.log 2>&1 "
                    "|| { tail -40 /tmp/job.log; exit 1; }; "
                    "python -c 'import json; print(json.dumps(json.load(open(\"/tmp/run/summary.json\"))[\"metrics\"]))'")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_gpu_image_has_horovod_with_nccl_and_trains_as_the_cpu_image_does(compose, image, gpu_image):
    """What a GPU cluster needs is in the image: Horovod's NCCL ops (check-build, nccl_built, the doctor),
    and on CPUs it trains the default job to the CPU image's numbers, alone and as the compose cluster."""
    check = in_image(gpu_image, "horovodrun", "--check-build").stdout
    assert re.search(r"\[X\] NCCL", check), check
    built = in_image(gpu_image, "python", "-c", "import horovod.tensorflow as h; print('NCCL', h.nccl_built())")
    assert re.search(r"^NCCL [1-9]\d*$", built.stdout, re.M), built.stdout
    doctor = sh(["docker", "run", "--rm", "--network", "none", "--entrypoint", "python", gpu_image, "-m",
                 "hvdtrain", "doctor"], timeout=300, check=False).stdout
    assert "tensor operations NCCL, MPI, Gloo" in doctor, doctor

    on_gpu_image, on_cpu_image = default_job_metrics(gpu_image), default_job_metrics(image)
    assert on_gpu_image.keys() == on_cpu_image.keys()
    for name, value in on_cpu_image.items():
        assert on_gpu_image[name] == pytest.approx(value, rel=1e-5), (name, on_gpu_image, on_cpu_image)

    # the compose file starts the same cluster from the GPU image, on the same subnet: the CPU one goes first
    sh(compose + ["down", "-v", "--remove-orphans"], timeout=180, check=False)
    cluster = [c if c != PROJECT else PROJECT + "gpu" for c in compose]
    env = {"HVDTRAIN_IMAGE": gpu_image}
    try:
        sh(cluster + ["up", "-d", "worker1", "worker2"], timeout=300, env=env)
        job = sh(cluster + ["run", "--rm", "launcher"], timeout=600, check=False, env=env)
        assert job.returncode == 0, job.stdout[-6000:]
        summary = read_volume(gpu_image, PROJECT + "gpu_data",
                              "import json; print(json.dumps(json.load(open('/data/runs/compose/summary.json'))))")
        assert summary["world_size"] == 4 and sorted(set(summary["hosts"])) == ["worker1", "worker2"], summary
    finally:
        sh(cluster + ["down", "-v", "--remove-orphans"], timeout=180, check=False, env=env)
