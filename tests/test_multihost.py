"""Two hosts over real ssh: network namespaces node1 and node2 made by scripts/netns_cluster.sh.

Each node has its own network stack (eth0 at 198.18.0.N on a bridge), its own hostname and its own
sshd; the filesystem (and so .venv) is shared, like an NFS home on a real cluster. Needs root and
`ip netns`; run alone with `pytest -m multihost`.
"""
import ipaddress
import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from jobs import BIN, error_lines, job_env, PYTHON, ROOT, run

pytestmark = [pytest.mark.multihost, pytest.mark.alone]

CLUSTER = ROOT / "scripts" / "netns_cluster.sh"
HOSTS = "node1:2,node2:2"
TRAIN = ["-m", "hvdtrain", "--model", "mlp", "--data", "digits", "--epochs", "2", "--steps-per-epoch", "5",
         "--verbose", "0", "--no-tensorboard"]
# horovodrun forwards the launcher's environment to every rank; mpirun forwards what -x names
ENV_NAMES = ("PATH", "PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL", "PYTHONUNBUFFERED")
# 4 ranks share this machine's cores but each "host" claims 2 slots, so OpenMPI does not know it is
# oversubscribed and busy-polls: yielding when idle makes an MPI job here ~40% faster.
MPI_YIELD = {"OMPI_MCA_mpi_yield_when_idle": "1"}


def _why_no_cluster():
    if os.geteuid() != 0:
        return "multihost tests need root (network namespaces, a bridge, sshd on port 22)"
    if shutil.which("ip") is None:
        return "multihost tests need iproute2's `ip netns` (not installed)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` is not available here: {probe.stderr.strip()}"
    return None


def netns_hosts(n: int):
    """Hosts node1..nodeN for a module's tests (scripts/netns_cluster.sh), taken down after them."""
    why = _why_no_cluster()
    if why:
        pytest.skip(why)
    up = subprocess.run([str(CLUSTER), "up", str(n)], capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        yield [f"node{i}" for i in range(1, n + 1)]
    finally:
        subprocess.run([str(CLUSTER), "down"], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def cluster():
    yield from netns_hosts(2)


def check_summary(out_dir, proc):
    assert proc.returncode == 0, proc.stdout[-4000:]
    summary = json.loads((Path(out_dir) / "summary.json").read_text())
    assert summary["world_size"] == 4
    assert sorted(set(summary["hosts"])) == ["node1", "node2"], summary["hosts"]
    digests = summary["weights_sha256_by_rank"]
    assert len(digests) == 4 and len(set(digests)) == 1, digests
    return summary


def test_nodes_are_distinct_hosts(cluster):
    """Each node: its own hostname, resolving to its own cluster address (not 127.x, which would
    make Gloo's hostname fallback advertise loopback), and it reaches the other node directly."""
    for i, node in enumerate(cluster, 1):
        other = cluster[i % len(cluster)]
        probe = subprocess.run(["ssh", node, f"hostname; getent hosts $(hostname) | cut -d' ' -f1; "
                                             f"timeout 5 bash -c 'echo > /dev/tcp/{other}/22' && echo reach"],
                               capture_output=True, text=True, timeout=60)
        assert probe.returncode == 0, probe.stderr
        assert probe.stdout.split() == [node, f"198.18.0.{i}", "reach"], probe.stdout


def test_horovodrun_mpi_two_hosts(cluster, tmp_path):
    """Launcher in the root namespace (it reaches 198.18.0.x through the bridge), ranks over ssh."""
    cmd = [str(BIN / "horovodrun"), "-np", "4", "-H", HOSTS, "--mpi", "--network-interface", "eth0",
           PYTHON, *TRAIN, "--output-dir", str(tmp_path)]
    check_summary(tmp_path, run(cmd, env=MPI_YIELD))


@pytest.mark.full
def test_horovodrun_gloo_two_hosts(cluster, tmp_path):
    """Gloo: horovodrun must run on a host of the cluster (here node1, as a user would after `ssh host1`).

    horovodrun hands the ranks the rendezvous address as the *launcher's own* IPv4 address on the
    common interface (horovod/runner/util/network.py get_driver_ip). See the next test for what
    happens when the launcher's eth0 is not on the cluster network.
    """
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in job_env().items() if k in ENV_NAMES)
    horovodrun = [str(BIN / "horovodrun"), "-np", "4", "-H", HOSTS, "--gloo", "--network-interface", "eth0",
                  PYTHON, *TRAIN, "--output-dir", str(tmp_path)]
    remote = f"cd {shlex.quote(str(ROOT))} && env {env} {shlex.join(horovodrun)}"
    check_summary(tmp_path, run(["ssh", "node1", remote]))


def _launcher_eth0():
    import psutil
    for addr in psutil.net_if_addrs().get("eth0", []):
        if addr.family.name == "AF_INET":
            return addr.address
    return None


@pytest.mark.full
def test_gloo_launcher_off_the_cluster_network_fails_on_rendezvous(cluster):
    """The failure mode of `horovodrun --gloo` started outside the cluster network, pinned precisely.

    The ranks' Gloo devices bind the right addresses (eth0 in their namespace: 198.18.0.N), but the
    rendezvous address horovodrun gives them is the launcher's eth0 address in *its* namespace,
    which the nodes cannot route to. This is where the launcher runs, not hvdtrain: MPI is unaffected
    because mpirun's out-of-band channel picks any reachable address of the launcher.
    """
    launcher_ip = _launcher_eth0()
    if launcher_ip is None:
        pytest.skip("the launcher's namespace has no eth0 here: horovodrun would fail earlier")
    if ipaddress.ip_address(launcher_ip) in ipaddress.ip_network("198.18.0.0/24"):
        pytest.skip("the launcher's eth0 is on the cluster network here: nothing to show")
    tiny = "import horovod.tensorflow as hvd; hvd.init(); print('INIT OK', hvd.size())"
    cmd = [str(BIN / "horovodrun"), "-np", "2", "-H", "node1:1,node2:1", "--gloo", "--network-interface", "eth0",
           PYTHON, "-c", tiny]
    proc = run(cmd, timeout=120, env={"HOROVOD_LOG_LEVEL": "debug"})
    out = proc.stdout
    assert proc.returncode != 0, out[-4000:]
    assert "INIT OK" not in out
    assert f"rendezvous server address: {launcher_ip}" in out, out[-4000:]
    assert "iface=eth0" in out and "addr=[198.18.0." in out, out[-4000:]   # the devices are right
    assert f"Failed to connect to {launcher_ip}:" in out and "Network is unreachable" in out, out[-4000:]


@pytest.mark.full
def test_mpirun_two_hosts(cluster, tmp_path):
    cmd = ["mpirun", "-np", "4", "-H", HOSTS, "--bind-to", "none", "--map-by", "slot",
           "--mca", "btl_tcp_if_include", "eth0", "--mca", "plm_rsh_agent", "ssh", "--mca", "mpi_yield_when_idle", "1"]
    for name in ENV_NAMES:
        cmd += ["-x", name]
    cmd += [PYTHON, *TRAIN, "--output-dir", str(tmp_path)]
    check_summary(tmp_path, run(cmd))


@pytest.mark.full
def test_hosts_check_two_hosts(cluster):
    proc = subprocess.run([PYTHON, "-m", "hvdtrain", "hosts", "-H", HOSTS, "--json"], cwd=ROOT, env=job_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["errors"] == []
    assert [h["host"] for h in report["hosts"]] == ["node1", "node2"]
    for item in report["hosts"]:
        assert item["ssh"] == "reachable over ssh"
        assert item["versions"] == report["local_versions"]
    assert report["np"] == 4


@pytest.mark.full
def test_hosts_check_names_the_host_whose_sshd_is_down(cluster):
    stop = subprocess.run([str(CLUSTER), "sshd-stop", "node2"], capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0, stop.stderr
    try:
        proc = subprocess.run([PYTHON, "-m", "hvdtrain", "hosts", "-H", HOSTS], cwd=ROOT, env=job_env(),
                              capture_output=True, text=True, timeout=240)
    finally:
        subprocess.run([str(CLUSTER), "sshd-start", "node2"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    errors = error_lines(proc.stderr)
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith("hvdtrain: error: node2: not reachable over ssh"), errors
    assert "Connection refused" in errors[0], errors
    assert "node1: 2 slot(s), reachable over ssh" in proc.stdout


@pytest.mark.full
def test_every_command_of_the_docs_that_names_hosts_runs_as_written_on_node1_and_node2(cluster, tmp_path):
    """The README's and docs' host1/host2 commands, launched from node1 as the docs say (Gloo needs the
    launcher on a host of the cluster), at small sizes: tests/doc_commands.py."""
    from doc_commands import NOT_RUN, all_commands, names_hosts, quoted_env, small

    yaml = tmp_path / "my.yaml"
    yaml.write_text("model: mlp\ndata: digits\nbatch_size: 16\nepochs: 1\nsteps_per_epoch: 3\nverbose: 0\n"
                    "tensorboard: false\n")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=1\nnode2 slots=1\n")
    env = quoted_env(job_env(MPI_YIELD), ENV_NAMES + ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
                                                      "OMPI_MCA_mpi_yield_when_idle"))
    ran, failures = 0, []
    for i, (where, cmd) in enumerate(all_commands()):
        if cmd in NOT_RUN or not (names_hosts(cmd) or "hostfiles/" in cmd):
            continue
        line = small(cmd, tmp_path / f"c{i}", yaml, hostfile, tmp_path / "hosts.txt")
        # exported inside the shell: bash run by sshd reads ~/.bashrc first (here pyenv puts its python first)
        proc = run(["ssh", "node1", f"cd {shlex.quote(str(ROOT))} && bash -c {shlex.quote(f'export {env}; {line}')}"],
                   timeout=300)
        ran += 1
        if proc.returncode != 0:
            failures.append(f"{where}: {cmd}\n  ran: {line}\n  exit {proc.returncode}: {proc.stdout[-1500:]}")
    assert ran >= 8 and not failures, "\n".join(failures)
