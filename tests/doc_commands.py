"""The shell commands of README.md and docs/*.md, read from the files themselves, and how a test runs
each one as written at small sizes (the same command, with flags appended that shrink the job, and
host1/host2 mapped to the netns hosts node1/node2; a bench command as written, with HVDTRAIN_BENCH_SMALL
set: every section it names, at its smallest sizes)."""
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
STARTS = ("python ", "horovodrun ", "mpirun ", "scripts/", ".venv/bin/", "HVDTRAIN_", "NP=", "printf ")

# Commands not run here, each with the reason (every other command in the docs is run)
NOT_RUN = {
    "scripts/test.sh": "it is the command that runs this test (CI runs it through .ci/run)",
    "scripts/test-full.sh": "the full tier, which runs this test (see docs/testing.md)",
    "HVDTRAIN_SOAK_JOBS=30 scripts/test.sh -m soak": "the soak group itself, run by scripts/test.sh",
    "scripts/docker_up.sh": "the docker group (tests/test_docker.py) runs the compose cluster",
    "scripts/docker_base.sh": "the docker group (tests/test_docker.py) builds the base image",
    "HVDTRAIN_STACK=keras2 scripts/test.sh": "scripts/test.sh runs the keras2 stack's tests itself, this way",
}


def commands(path: Path) -> list:
    """(line number, command) for each command line of indented blocks; continuations joined,
    trailing comments dropped; fenced blocks (Python snippets) left out."""
    lines, found, fenced = path.read_text().splitlines(), [], False
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("    ") and line.strip().startswith(STARTS):
            start, cmd = i + 1, line.strip()
            while cmd.endswith("\\"):
                i += 1
                cmd = cmd[:-1].rstrip() + " " + lines[i].strip()
            found.append((start, re.sub(r"\s+#\s.*$", "", cmd)))
        i += 1
    return found


def all_commands() -> list:
    return [(f"{p.relative_to(ROOT)}:{n}", cmd) for p in DOCS for n, cmd in commands(p)]


def is_bench(cmd: str) -> bool:
    """A bench command: tests/test_bench.py runs these, and checks what each section reports."""
    return bool(re.search(r"-m hvdtrain bench\b", cmd))


def names_hosts(cmd: str) -> bool:
    return bool(re.search(r"\bhost[12]\b", cmd))


def small(cmd: str, tmp: Path, yaml: Path, hostfile: Path, discovery: Path) -> str:
    """The command as written, at small sizes, writing into tmp."""
    for old, new in (("host1:8,host2:8", "node1:1,node2:1"), ("host1:4,host2:4", "node1:1,node2:1"),
                     ("ppr:4:numa", "ppr:1:numa"), ("host1", "node1"), ("host2", "node2"),
                     ("--min-np 4", "--min-np 1"), ("--max-np 12", "--max-np 2"),
                     ("hostfiles/two-nodes-4-slots", str(hostfile)), ("hosts.txt", str(discovery)),
                     ("my.yaml", str(yaml)), ("/shared/runs/exp1", str(tmp / "exp1")),
                     ("--out runs/bench", f"--out {tmp / 'bench'}")):
        cmd = cmd.replace(old, new)
    cmd = re.sub(r"-np \d+", "-np 2", cmd)
    if is_bench(cmd):
        if not (ROOT / ".venv-keras2/bin/python").exists():  # a fresh clone sets the second stack up later
            cmd = cmd.replace(".venv-keras2/bin/python", sys.executable)
        return "HVDTRAIN_BENCH_SMALL=1 " + cmd + ("" if "--out " in cmd else f" --out {tmp / 'bench'}")
    if cmd.startswith("scripts/run.sh") or re.search(r"-m hvdtrain( --|$)", cmd) and "--help" not in cmd:
        return cmd + f" --epochs 1 --steps-per-epoch 3 --output-dir {tmp / 'run'} --verbose 0 --no-tensorboard"
    if cmd.endswith(("examples/train_script.py", "examples/keras3_train.py")):
        return cmd + f" 1 {tmp / 'script'}"
    return cmd


def shell(cmd: str) -> list:
    return ["bash", "-c", cmd]


def quoted_env(env: dict, names) -> str:
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items() if k in names)
