"""The suite's two tiers, and what ties them: a pytest plugin (conftest.py loads it) and a command.

- The gate (`--tier gate`, scripts/test.sh): every test not marked `full`, and every `full` test that
  exercises a file changed since the full tier last passed it.
- The full tier (`--tier full`, scripts/test-full.sh): the tests marked `full`. With `--record-reach DIR`
  each test's reach is written down: every file of the repository that the test process or any
  process it started opened or ran (an audit hook; tests/sitecustomize.py puts it in every Python the
  test starts), the test's own file and the helpers it imports, and the repository paths its source
  names (a shell script, a docker file).
- `python tests/tiers.py record DIR` turns those notes into tests/full_tier.json: for each stack, the
  tests that passed, their time, and the fingerprint of every file each one reached.

A file's fingerprint is its git blob hash, but for a page of docs, where it is the hash of the commands
the page holds (tests/doc_commands.py): prose changes no command, and so adds no job to the gate.

`@pytest.mark.full` puts a test in the full tier on both stacks; `@pytest.mark.full(stack="second")`
only on the second stack's pass (the default stack's gate runs it).
"""
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "tests" / "full_tier.json"
# These choose and record the tests; what the tests prove does not depend on them.
NOT_REACHED = {"tests/tiers.py", "tests/full_tier.json", "tests/sitecustomize.py", "tests/test_tiers.py"}
# The environment every test runs in: a change to one of these reaches every test.
EVERY_TEST_REACHES = ("setup.py", "pyproject.toml", "pytest.ini", "scripts/setup.sh", "tests/conftest.py")
# A full-tier test never recorded is taken to cost this much (seconds) in the gate's estimate.
UNRECORDED_SECONDS = 120.0
# The most the full-tier tests a change reaches may add to the gate, by their recorded seconds
# (two at a time: about half of it in wall time). Past it the gate stops at once and says what to run.
GATE_EXTRA_SECONDS = float(os.environ.get("HVDTRAIN_GATE_EXTRA_SECONDS", "1500"))


# ------------------------------------------------------------------ fingerprints and reach

def relative(path) -> "str | None":
    """The repository path of a file a process opened or ran (a module's cached bytecode counts as its
    source), or None for anything outside the repository or not part of it."""
    try:
        p = os.path.abspath(os.fsdecode(path))
    except (TypeError, ValueError):
        return None
    root = str(ROOT) + os.sep
    if not p.startswith(root):
        return None
    rel = p[len(root):]
    m = re.match(r"(.*/)?__pycache__/([^/.]+)\.[^/]*\.pyc$", rel)
    if m:
        rel = (m.group(1) or "") + m.group(2) + ".py"
    if rel in NOT_REACHED or rel not in tracked():
        return None
    return rel


def tracked() -> frozenset:
    """The repository's files (git's index): what a test can reach and a change can touch."""
    global _TRACKED
    if _TRACKED is None:
        import subprocess

        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        _TRACKED = frozenset(out.split("\0")) - {""}
    return _TRACKED


_TRACKED: "frozenset | None" = None


def fingerprint(rel: str) -> str:
    """git's blob hash of the file; for a page of docs, the hash of the commands on it."""
    path = ROOT / rel
    if not path.is_file():
        return "missing"
    if rel.endswith(".md"):
        import doc_commands

        data = "\n".join(cmd for _, cmd in doc_commands.commands(path)).encode()
        return "commands:" + hashlib.sha1(data).hexdigest()[:16]
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()[:16]


def static_reach(test_file: Path) -> set:
    """The test's file and the helpers of tests/ it imports (and theirs), and the repository files and
    folders its own source names (a script, a docker file): what no audit hook sees being run."""
    found, todo = set(EVERY_TEST_REACHES), [test_file]
    while todo:
        f = todo.pop()
        rel = relative(f)
        if rel is None or rel in found:
            continue
        found.add(rel)
        for name in re.findall(r"^\s*(?:from|import)\s+(\w+)", f.read_text(), re.M):
            if (ROOT / "tests" / f"{name}.py").is_file():
                todo.append(ROOT / "tests" / f"{name}.py")
    for token in re.findall(r"\b[a-z][\w.-]*/[\w./-]*[\w]", test_file.read_text()):
        p = ROOT / token
        if p.is_file() or p.is_dir():
            found.update(r for r in (relative(q) for q in ([p] if p.is_file() else p.rglob("*"))) if r)
    return found


# ------------------------------------------------------------------ the record

def load_record() -> dict:
    if not RECORD.exists():
        return {"stacks": {}, "files": []}
    return json.loads(RECORD.read_text())


def recorded_tests(record: dict, stack: str) -> dict:
    """{nodeid: {"seconds": s, "reach": {path: fingerprint}}} of one stack."""
    files = record.get("files", [])
    return {nodeid: {"seconds": t["seconds"], "reach": dict(files[i] for i in t["reach"])}
            for nodeid, t in record.get("stacks", {}).get(stack, {}).get("tests", {}).items()}


def why_selected(entry: "dict | None", now) -> "str | None":
    """Why the gate runs a full-tier test, or None: never passed in the full tier, or a file it reaches
    differs from what it passed on. `now(path)` is the file's fingerprint today."""
    if entry is None:
        return "not passed in the full tier yet"
    changed = sorted(p for p, fp in entry["reach"].items() if now(p) != fp)
    if changed:
        return "changed since the full tier passed it: " + ", ".join(changed[:3]) + (
            f" and {len(changed) - 3} more" if len(changed) > 3 else "")
    return None


class Fingerprints(dict):
    def __missing__(self, rel):
        self[rel] = fingerprint(rel)
        return self[rel]


def write_record(notes_dir: Path) -> dict:
    """tests/full_tier.json from the notes of a full-tier run: per stack, the tests that passed (a
    failed one is left out, so the gate runs it until it passes), replacing what that stack had."""
    record = load_record()
    tests = {stack: recorded_tests(record, stack) for stack in record.get("stacks", {})}
    ran_on = {}
    for note in sorted(notes_dir.glob("*.json")):
        data = json.loads(note.read_text())
        stack = data["stack"]
        if stack not in ran_on:
            tests[stack], ran_on[stack] = {}, data["commit"]
        tests[stack].update({n: t for n, t in data["tests"].items() if t["outcome"] != "failed"})
        for n in (n for n, t in data["tests"].items() if t["outcome"] == "failed"):
            tests[stack].pop(n, None)
    now = Fingerprints()
    pairs: dict = {}
    out = {"stacks": {}, "files": []}
    for stack, entries in sorted(tests.items()):
        section = {"ran_on": ran_on.get(stack) or record["stacks"][stack].get("ran_on"), "tests": {}}
        for nodeid, t in sorted(entries.items()):
            reach = t["reach"] if isinstance(t["reach"], dict) else {p: now[p] for p in t["reach"]}
            idx = []
            for pair in sorted(reach.items()):
                if pair not in pairs:
                    pairs[pair] = len(out["files"])
                    out["files"].append(list(pair))
                idx.append(pairs[pair])
            section["tests"][nodeid] = {"seconds": round(t["seconds"], 1), "reach": idx}
        out["stacks"][stack] = section
    RECORD.write_text(json.dumps(out, indent=0, sort_keys=True) + "\n")
    return out


# ------------------------------------------------------------------ the pytest plugin

def pytest_addoption(parser):
    group = parser.getgroup("tiers")
    group.addoption("--tier", choices=("gate", "full"), help="the gate, or the full tier (tests/tiers.py)")
    group.addoption("--stack-pass", choices=("default", "second"), default="default",
                    help="which pass of scripts/test.sh this is: the .venv stack's, or the second stack's")
    group.addoption("--record-reach", metavar="DIR", help="write each test's reach and time into DIR")


def stack_of_this_python() -> str:
    import importlib.metadata

    return "keras3" if importlib.metadata.version("keras").startswith("3") else "keras2"


def is_full(item, stack_pass: str) -> bool:
    mark = item.get_closest_marker("full")
    return mark is not None and mark.kwargs.get("stack", stack_pass) == stack_pass


@pytest.hookimpl(trylast=True)  # after -m and -k: the tests of this pass alone are weighed
def pytest_collection_modifyitems(config, items):
    tier = config.getoption("--tier")
    if not tier:
        return
    stack_pass = config.getoption("--stack-pass")
    keep, drop, extra = [], [], []
    record, elsewhere = {}, {}
    if tier == "gate":
        saved, stack = load_record(), stack_of_this_python()
        record = recorded_tests(saved, stack)
        # A test not marked `stacks` is the same on either stack (docs/testing.md): its pass on the
        # stack the full tier ran it on counts (keras2 as the .venv stack: HVDTRAIN_STACK=keras2)
        for other in (s for s in saved.get("stacks", {}) if s != stack):
            elsewhere = {**recorded_tests(saved, other), **elsewhere}
    now = Fingerprints()
    for item in items:
        full = is_full(item, stack_pass)
        if tier == "full":
            (keep if full else drop).append(item)
        elif not full:
            keep.append(item)
        else:
            entry = record.get(item.nodeid)
            if entry is None and item.get_closest_marker("stacks") is None:
                entry = elsewhere.get(item.nodeid)
            why = why_selected(entry, now.__getitem__)
            if why:
                keep.append(item)
                extra.append((item.nodeid, why, (entry or {}).get("seconds", UNRECORDED_SECONDS)))
            else:
                drop.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    if tier == "gate" and not hasattr(config, "workerinput"):
        say = config.pluginmanager.get_plugin("terminalreporter").write_line
        seconds = sum(s for _, _, s in extra)
        say(f"tiers: the gate: {len(keep) - len(extra)} gate tests, and {len(extra)} full-tier tests that reach "
            f"what changed since the full tier passed them (about {seconds:.0f} test-seconds)")
        for nodeid, why, _ in extra[:int(os.environ.get("HVDTRAIN_GATE_LISTED", "40"))]:
            say(f"  {nodeid}: {why}")
        if seconds > GATE_EXTRA_SECONDS:
            pytest.exit(f"tiers: that is more than the gate's {GATE_EXTRA_SECONDS:.0f} test-seconds: run the full tier "
                        "on a fresh clone (scripts/test-full.sh) and commit the tests/full_tier.json it writes",
                        returncode=3)


class Reach:
    """Which repository files each test (and each fixture) reached, in this process and in every
    process it started; its outcome and time."""

    def __init__(self, notes: Path):
        self.notes = notes
        self.files = notes / f"files-{os.getpid()}"
        self.files.mkdir(parents=True, exist_ok=True)
        self.key = "session"
        self.seen: dict = {}
        self.tests: dict = {}
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "tests")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        tracked()  # before the hook: git's own start would be heard by it
        sys.addaudithook(self._audit)
        self.switch("session")

    def _notes_of(self, key) -> Path:
        """The file the processes started under `key` (a test, a fixture) write what they reach into."""
        return self.files / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.txt"

    def switch(self, key):
        self.key = key
        os.environ["HVDTRAIN_TEST_REACH"] = str(self._notes_of(key))
        self.seen.setdefault(key, set())

    def _audit(self, event, args):
        if event == "open":
            paths = [args[0]]
        elif event in ("subprocess.Popen", "os.exec", "os.posix_spawn"):  # as tests/sitecustomize.py hears them
            argv = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
            paths = [w for a in argv for w in str(a).split()]
        else:
            return
        for p in paths:
            if isinstance(p, (str, bytes)) and (rel := relative(p)):
                self.seen[self.key].add(rel)

    def children(self, key) -> set:
        f = self._notes_of(key)
        return {r for r in (relative(ROOT / line) for line in f.read_text().split()) if r} if f.exists() else set()

    def reach_of(self, item) -> set:
        found = static_reach(Path(item.fspath))
        # what the test's module, and the test modules it imports, read when they were collected (the
        # docs' commands a module parametrizes its tests with), what its fixtures and the test reached
        keys = [f"collect:{m}" for m in found if m.startswith("tests/test_")] + [item.nodeid] + [
            f"fixture:{n}" for n in item.fixturenames]
        for k in keys:
            found |= self.seen.get(k, set()) | self.children(k)
        return {r for r in found if r not in NOT_REACHED}


def pytest_configure(config):
    notes = config.getoption("--record-reach", None)
    if notes:
        config._tiers_reach = Reach(Path(notes).resolve())


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """What a fixture's set-up reaches counts for every test that uses it (a module's shared job)."""
    reach = getattr(request.config, "_tiers_reach", None)
    before = reach.key if reach is not None else None
    if reach is not None:
        reach.switch(f"fixture:{fixturedef.argname}")
    yield
    if reach is not None:
        reach.switch(before)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    reach = getattr(collector.config, "_tiers_reach", None)
    if reach is None or not isinstance(collector, pytest.Module):
        yield
        return
    before = reach.key
    reach.switch(f"collect:{relative(collector.path) or collector.nodeid}")
    yield
    reach.switch(before)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    reach = getattr(item.config, "_tiers_reach", None)
    if reach is None:
        return
    t = reach.tests.setdefault(item.nodeid, {"seconds": 0.0, "outcome": "passed"})
    t["seconds"] += report.duration
    if report.failed:
        t["outcome"] = "failed"
    if call.when == "teardown":
        t["reach"] = sorted(reach.reach_of(item))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if (reach := getattr(item.config, "_tiers_reach", None)) is not None:
        reach.switch(item.nodeid)


def pytest_sessionfinish(session):
    reach = getattr(session.config, "_tiers_reach", None)
    if reach is None or not reach.tests:
        return
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    tests = {n: t for n, t in reach.tests.items() if "reach" in t}
    note = {"stack": stack_of_this_python(), "commit": commit, "when": time.strftime("%Y-%m-%d %H:%M"),
            "tests": tests}
    (reach.notes / f"{note['stack']}-{os.getpid()}.json").write_text(json.dumps(note))


# ------------------------------------------------------------------ the command

def main(argv):
    if argv[:1] == ["record"] and len(argv) == 2:
        out = write_record(Path(argv[1]))
        for stack, section in out["stacks"].items():
            secs = sum(t["seconds"] for t in section["tests"].values())
            print(f"tiers: {stack}: {len(section['tests'])} full-tier tests passed on {section['ran_on'][:12]} "
                  f"({secs:.0f} test-seconds); recorded in {RECORD.relative_to(ROOT)}")
        return 0
    print("usage: python tests/tiers.py record DIR", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests"))
    sys.exit(main(sys.argv[1:]))
