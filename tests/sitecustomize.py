"""In every Python a full-tier test starts (tests/ is on its PYTHONPATH): note each repository file the
process opens or runs into the file HVDTRAIN_TEST_REACH names, for tests/tiers.py. Nothing otherwise."""
import os
import sys


def _note_reach(notes: str) -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    skipped = (".git/", ".venv", ".full-tier/", "runs/", ".pytest_cache/")
    seen: set = set()

    def audit(event, args):
        if event == "open":
            paths = [args[0]]
        elif event in ("subprocess.Popen", "os.exec", "os.posix_spawn"):
            argv = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
            paths = [w for a in argv for w in str(a).split()]
        else:
            return
        for p in paths:
            if not isinstance(p, (str, bytes)):
                continue
            p = os.path.abspath(os.fsdecode(p))
            if not p.startswith(root) or p in seen:
                continue
            seen.add(p)
            rel = p[len(root):]
            if rel.startswith(skipped):
                continue
            with open(notes, "a") as f:  # one short line per file: several processes append alike
                f.write(rel + "\n")

    sys.addaudithook(audit)


if os.environ.get("HVDTRAIN_TEST_REACH"):
    _note_reach(os.environ["HVDTRAIN_TEST_REACH"])
