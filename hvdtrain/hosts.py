"""`hvdtrain hosts`: check a host list before a multi-node job, then print the commands that launch it.

Reads horovodrun's `-H host1:4,host2:4` or a hostfile of `host slots=N` lines (the format horovodrun,
mpirun and DeepSpeed share). Checks syntax, duplicates and slot counts (one error per bad line), ssh
reachability of every host, and that every host has the same Python, TensorFlow, Horovod and hvdtrain:
mismatched versions are a classic cause of a job that hangs instead of failing.

`--discover` turns a hostfile into the host discovery script of an elastic job (docs/reliability.md);
`--slurm` prints the Slurm allocation it runs in as horovodrun's -H (docs/multinode.md).
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys

from .config import UserError

_HOST = r"[A-Za-z0-9]([A-Za-z0-9.\-_]*[A-Za-z0-9])?"
_SPEC_ITEM = re.compile(rf"^(?P<host>{_HOST})(:(?P<slots>[^:]*))?$")
_FILE_LINE = re.compile(rf"^(?P<host>{_HOST})(\s+slots\s*=\s*(?P<slots>\S+))?(\s+max_slots\s*=\s*\S+)?$")


def parse_spec(spec: str) -> list:
    """`host1:4,host2:4` -> [("host1", 4), ("host2", 4)]; a missing slot count means 1."""
    if not spec or not spec.strip():
        raise UserError("-H: empty host list; expected host1:slots,host2:slots")
    entries: list = []
    errors: list = []
    for i, item in enumerate(spec.split(","), 1):
        m = _SPEC_ITEM.match(item.strip())
        if not m:
            errors.append(f"-H item {i} '{item}': expected host or host:slots")
            continue
        _add(entries, errors, m.group("host"), m.group("slots"), f"-H item {i} '{item}'")
    return _done(entries, errors)


def parse_hostfile(path: str, discover: bool = False) -> list:
    try:
        with open(path) as fh:
            lines = fh.read().splitlines()
    except OSError as e:
        raise UserError(f"--hostfile {path}: {e.strerror}") from None
    entries: list = []
    errors: list = []
    for n, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _FILE_LINE.match(line) or (_SPEC_ITEM.match(line) if discover else None)
        if not m:
            errors.append(f"{path}:{n}: '{raw.strip()}': expected 'host slots=N'"
                          + (" or 'host:N'" if discover else ""))
            continue
        _add(entries, errors, m.group("host"), m.group("slots"), f"{path}:{n}")
    if not entries and not errors and not discover:
        errors.append(f"{path}: no hosts")
    return _done(entries, errors)


def _add(entries, errors, host, slots, where):
    if slots is None:
        n = 1
    elif slots.isdigit() and int(slots) > 0:
        n = int(slots)
    else:
        errors.append(f"{where}: slots must be a positive integer, got '{slots}'")
        return
    if any(h == host for h, _ in entries):
        errors.append(f"{where}: host '{host}' is listed twice; give it one line with all its slots")
        return
    entries.append((host, n))


def _done(entries, errors):
    if errors:
        raise UserError("\n".join(errors))
    return entries


def parse(hostfile: str | None = None, spec: str | None = None, discover: bool = False) -> list:
    """discover: the hostfile of an elastic job, which may be empty for a while and may be written
    in the -H style (`host:N` lines) as well."""
    if hostfile and spec:
        raise UserError("give --hostfile or -H, not both")
    if hostfile:
        return parse_hostfile(hostfile, discover)
    return parse_spec(spec or "localhost:1")


def ssh_command(host: str, port: int | None, remote: str) -> list:
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o", "StrictHostKeyChecking=accept-new"]
    if port:
        cmd += ["-p", str(port)]
    return cmd + [host, remote]


def ssh_check(host: str, port: int | None = None):
    """(host, ok, detail): can we run a command there without a password prompt?"""
    try:
        proc = subprocess.run(ssh_command(host, port, "true"), capture_output=True, text=True, timeout=20)
    except FileNotFoundError:
        return host, False, "no ssh client on this machine (apt-get install openssh-client)"
    except subprocess.TimeoutExpired:
        return host, False, "ssh timed out after 20 s"
    if proc.returncode == 0:
        return host, True, "reachable over ssh"
    reason = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    return host, False, f"not reachable over ssh: {reason}"


VERSIONS = ("import sys, json; v = {'python': sys.version.split()[0]}\n"
            "for m in ('tensorflow', 'keras', 'numpy', 'horovod', 'hvdtrain'):\n"
            "    try: v[m] = __import__(m).__version__\n"
            "    except Exception as e: v[m] = 'missing'\n"
            "print(json.dumps(v))")


def local_versions(python=sys.executable) -> dict:
    out = subprocess.run([python, "-c", VERSIONS], capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def remote_versions(host: str, port: int | None, python=sys.executable):
    proc = subprocess.run(ssh_command(host, port, f"{shlex.quote(python)} -c {shlex.quote(VERSIONS)}"),
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def launch_commands(entries: list, hostfile: str | None, python="python") -> dict:
    np_ = sum(s for _, s in entries)
    spec = ",".join(f"{h}:{s}" for h, s in entries)
    where = f"--hostfile {hostfile}" if hostfile else f"-H {spec}"
    mpi_where = f"--hostfile {hostfile}" if hostfile else f"-H {spec}"
    return {
        "horovodrun": f"horovodrun -np {np_} {where} {python} -m hvdtrain --config my.yaml",
        "mpirun": (f"mpirun -np {np_} {mpi_where} -bind-to none -map-by slot -x NCCL_DEBUG=INFO "
                   f"-x LD_LIBRARY_PATH -x PATH -mca pml ob1 -mca btl ^openib "
                   f"{python} -m hvdtrain --config my.yaml"),
    }


def slurm_tasks_per_node(value: str) -> list:
    """Slurm's SLURM_TASKS_PER_NODE, "2(x3),1" -> [2, 2, 2, 1]: one count per node of the allocation."""
    counts = []
    for item in value.split(","):
        m = re.fullmatch(r"(\d+)(\(x(\d+)\))?", item.strip())
        if not m:
            raise UserError(f"SLURM_TASKS_PER_NODE={value!r}: expected counts such as 2(x3),1")
        counts += [int(m.group(1))] * int(m.group(3) or 1)
    return counts


def slurm_hosts(env=None) -> str:
    """The allocation this runs in, as horovodrun's -H: each node with its task count. The node names
    come from Slurm's own expander (scontrol show hostnames), the counts from SLURM_TASKS_PER_NODE."""
    import os

    env = os.environ if env is None else env
    nodelist, tasks = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"), env.get("SLURM_TASKS_PER_NODE")
    if not nodelist or not tasks:
        raise UserError("hosts --slurm: not inside a Slurm allocation (no SLURM_JOB_NODELIST/SLURM_TASKS_PER_NODE): "
                        "run it in an sbatch script or salloc, with --ntasks-per-node (or -n) set")
    try:
        names = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                               check=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError) as e:
        raise UserError(f"hosts --slurm: scontrol show hostnames {nodelist} failed ({e})") from None
    counts = slurm_tasks_per_node(tasks)
    if len(counts) != len(names):
        raise UserError(f"hosts --slurm: SLURM_TASKS_PER_NODE={tasks} gives {len(counts)} nodes, "
                        f"SLURM_JOB_NODELIST={nodelist} {len(names)}")
    return ",".join(f"{n}:{c}" for n, c in zip(names, counts))


def parser():
    p = argparse.ArgumentParser(prog="hvdtrain hosts", description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--hostfile", help="hostfile of 'host slots=N' lines")
    g.add_argument("-H", "--hosts", help="host list as for horovodrun: host1:4,host2:4")
    p.add_argument("--ssh", action=argparse.BooleanOptionalAction, default=True,
                   help="check ssh reachability and versions on every remote host")
    p.add_argument("--ssh-port", type=int, help="ssh port, as for horovodrun --ssh-port")
    p.add_argument("--python", default=sys.executable, help="the python every host runs (same path everywhere)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--slurm", action="store_true",
                   help="only print this Slurm allocation's hosts as horovodrun's -H value (node:tasks,...), "
                        "for horovodrun inside an sbatch script")
    p.add_argument("--discover", action="store_true",
                   help="only print 'host:slots' lines, as horovodrun --host-discovery-script wants: "
                        "elastic jobs re-read the hostfile every second, so edit it as hosts come and go")
    return p


def main(argv) -> int:
    args = parser().parse_args(argv)
    if args.slurm:
        print(slurm_hosts())
        return 0
    if args.discover:  # no host available (yet) is a normal state of an elastic job: print nothing
        for host, slots in parse(args.hostfile, args.hosts, discover=True):
            print(f"{host}:{slots}")
        return 0
    entries = parse(args.hostfile, args.hosts)
    report = {"hosts": [{"host": h, "slots": s} for h, s in entries], "np": sum(s for _, s in entries),
              "errors": []}
    if args.ssh:
        here = local_versions(args.python)
        report["local_versions"] = here
        for item in report["hosts"]:
            host = item["host"]
            if host in ("localhost", "127.0.0.1"):
                item.update(ssh="local", versions=here)
                continue
            _, ok, detail = ssh_check(host, args.ssh_port)
            item["ssh"] = detail
            if not ok:
                report["errors"].append(f"{host}: {detail}")
                continue
            theirs = remote_versions(host, args.ssh_port, args.python)
            item["versions"] = theirs
            if theirs != here:
                report["errors"].append(f"{host}: versions differ from this host: {theirs} vs {here}")
    report["commands"] = launch_commands(entries, args.hostfile, args.python)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for item in report["hosts"]:
            print(f"{item['host']}: {item['slots']} slot(s)" + (f", {item['ssh']}" if "ssh" in item else ""))
        for e in report["errors"]:
            print(f"hvdtrain: error: {e}", file=sys.stderr)
        print("launch with:")
        for cmd in report["commands"].values():
            print(f"  {cmd}")
    return 1 if report["errors"] else 0
