"""`hvdtrain bench [--sections ...]`: the flags, then each section asked for, in a fixed order; writes
bench.json and the plots into --out and prints the report."""
from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path

from .. import bench

from .. import compat
from ..config import UserError
from . import costs, launch, report, sections, step_cost, sync_vs_async

def parser():
    p = argparse.ArgumentParser(prog="hvdtrain bench", description=bench.__doc__.splitlines()[0])
    cores = len(os.sched_getaffinity(0))
    p.add_argument("--workers", type=lambda s: [int(v) for v in s.split(",")],
                   default=list(range(1, cores + 1)), help="worker counts, e.g. 1,2,4 (default 1..cores)")
    p.add_argument("-H", "--hosts", help="host list for horovodrun beyond this machine (host:slots,...)")
    p.add_argument("--controllers", type=lambda s: s.split(","), default=["gloo", "mpi"],
                   help="horovodrun controllers to compare: gloo,mpi")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=20, help="measured steps per epoch (2 epochs)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per worker, the same at every N")
    p.add_argument("--min-bytes", type=int, default=4 << 10)
    p.add_argument("--max-bytes", type=int, default=256 << 20)
    p.add_argument("--sections", type=lambda s: s.split(","), default=DEFAULT_SECTIONS,
                   help=f"any of {', '.join(SECTIONS)} (default: {','.join(DEFAULT_SECTIONS)})")
    p.add_argument("--ranks", type=lambda s: [int(v) for v in s.split(",")], default=[2, 4, 8, 16, 32],
                   help="scale: rank counts (over --hosts, or this host)")
    p.add_argument("--records", type=int, default=200_000, help="startup: records in the user's own files")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds of every timed section")
    p.add_argument("--lever-models", type=lambda s: s.split(","), default=["resnet50", "mlp"],
                   help="levers: the built-in models, each at its size (MODEL_SIZES) with its levers")
    p.add_argument("--levers", type=lambda s: s.split(","),
                   help=f"levers: these instead of each model's own ({', '.join(sections.LEVERS)})")
    p.add_argument("--checkpoint-models", type=lambda s: s.split(","), default=["mlp", "cnn", "resnet50"],
                   help="recipe, checkpoint, callbacks, preemption, stacks, step: the built-in models, each at its size (MODEL_SIZES)")
    p.add_argument("--epoch-steps", type=_per_model, default={},
                   help="recipe, checkpoint, callbacks, preemption, stacks, step: steps per epoch by model in place of "
                        "MODEL_SIZES' (mlp=187,resnet50=13: counts that no number of steps per call divides)")
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--study-tasks", type=lambda s: s.split(","), default=["cnn", "wide"],
                   help="sync-vs-async: cnn (compute bound), wide (communication bound)")
    p.add_argument("--study-workers", type=lambda s: [int(v) for v in s.split(",")], default=[2, 4])
    p.add_argument("--study-seeds", type=int, default=3)
    p.add_argument("--study-epochs", type=int, default=10)
    p.add_argument("--other-python", help="stacks: another venv's python to compare with "
                   "(e.g. .venv-keras2/bin/python)")
    p.add_argument("--study-peer", help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=["allreduce", "keras", "sync-vs-async"], help=argparse.SUPPRESS)
    return p


def _per_model(text: str) -> dict:
    """mlp=187,resnet50=13 as {"mlp": 187, "resnet50": 13}."""
    try:
        pairs = [item.split("=") for item in text.split(",")]
        return {model: int(steps) for model, steps in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MODEL=STEPS,..., got {text!r}") from None


def _sync_vs_async(args, out, results):
    return sync_vs_async.study(
        args, out, lambda python, run_dir, flags: launch.train(python, run_dir, flags, args.timeout),
        lambda n: launch.python(n, args.controllers[0], args.hosts), launch.env, launch.say)


# every section, in the order they run: what runs it, given (args, out, the results so far); its
# results go into bench.json under its name (sync-vs-async: sync_vs_async)
SECTIONS = {
    "allreduce": lambda args, out, results: sections.allreduce(args),
    "scaling": lambda args, out, results: sections.scaling(args, out, results.get("allreduce", ())),
    "levers": lambda args, out, results: sections.levers(args, out),
    "baseline": lambda args, out, results: sections.keras_baseline(args, out),
    "recipe": lambda args, out, results: sections.recipe(args, out),
    "startup": lambda args, out, results: costs.startup(args, out),
    "checkpoint": lambda args, out, results: costs.checkpoint_cost(args, out),
    "callbacks": lambda args, out, results: sections.callbacks_cost(args, out),
    "preemption": lambda args, out, results: sections.preemption_cost(args, out),
    "stacks": lambda args, out, results: sections.stacks(args, out),
    "scale": lambda args, out, results: sections.scale(args, out),
    "step": lambda args, out, results: step_cost.step(args, out),
    "sync-vs-async": _sync_vs_async,
}
NOT_BY_DEFAULT = ("stacks", "scale", "step")  # another venv; many ranks; many rounds of four runs
DEFAULT_SECTIONS = [s for s in SECTIONS if s not in NOT_BY_DEFAULT]
SMALL = "HVDTRAIN_BENCH_SMALL"  # set (to 1): every section as asked for, at its smallest sizes
DRY_RUN = "HVDTRAIN_BENCH_DRY_RUN"  # set (to 1): the flags checked as every section reads them; nothing runs


def check(args):
    """What a section would refuse after the sections before it ran for an hour: refused now."""
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        raise UserError(f"bench: unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    levers = set(args.levers or ()) - set(sections.LEVERS)
    if levers:
        raise UserError(f"bench: unknown lever(s) {', '.join(sorted(levers))}; choose from {', '.join(sections.LEVERS)}")
    unsized = set(args.epoch_steps) - set(sections.MODEL_SIZES)
    if unsized:
        raise UserError(f"bench: --epoch-steps names {', '.join(sorted(unsized))}; choose from "
                        f"{', '.join(sections.MODEL_SIZES)}")
    if "stacks" in args.sections and not (args.other_python and os.access(args.other_python, os.X_OK)):
        raise UserError(f"bench: --sections stacks needs --other-python, another venv's python (e.g. "
                        f".venv-keras2/bin/python); got {args.other_python!r}")


def shrink(args):
    """The sections as asked for, each at its smallest sizes: one round, the MLP on 8x8 inputs, at most
    2 workers and 2 ranks, a few hundred records, a study of 2 epochs (a curve of two points). For the
    test that runs the docs' commands as written; its figures measure nothing (the report says so)."""
    args.workers = sorted({min(w, 2) for w in args.workers})
    args.ranks, args.study_workers = [2], [2]
    args.model, args.image_size, args.batch_size, args.steps, args.repeats = "mlp", 8, 16, 1, 1
    args.min_bytes, args.max_bytes, args.records = 4 << 10, 16 << 10, 400
    args.lever_models, args.checkpoint_models = ["mlp"], ["mlp"]
    args.epoch_steps = {m: min(n, 11) for m, n in args.epoch_steps.items()}  # still no count per call divides it
    args.study_tasks, args.study_seeds, args.study_epochs = args.study_tasks[:1], 1, min(args.study_epochs, 2)
    launch.say(f"{SMALL} is set: every section at its smallest sizes (1 round, the MLP, at most 2 "
               f"workers); these figures measure nothing")


def main(argv) -> int:
    args = parser().parse_args(argv)
    if args.worker == "allreduce":
        return sections.allreduce_worker(args)
    if args.worker == "keras":
        return sections.keras_worker(args)
    if args.worker == "sync-vs-async":
        return sync_vs_async.worker(args)
    check(args)
    if os.environ.get(SMALL):
        shrink(args)
    if os.environ.get(DRY_RUN):
        launch.say(f"{DRY_RUN} is set: the flags are valid for the sections {', '.join(args.sections)}; "
                   f"nothing was run")
        return 0
    args.max_workers = max(args.workers)
    if "sync-vs-async" in args.sections and compat.keras3():
        args.sections = [s for s in args.sections if s != "sync-vs-async"]
        print("bench: sync-vs-async left out: its tf.distribute peers (MultiWorkerMirroredStrategy, "
              "ParameterServerStrategy) do not train Keras 3 models (tensorflow#72388); run it on the keras2 "
              "stack (HVDTRAIN_STACK=keras2 scripts/setup.sh)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"host": socket.gethostname(), "cores": len(os.sched_getaffinity(0)),
               "args": {k: v for k, v in vars(args).items() if k != "worker"},
               "scaling": {"model": args.model, "image_size": args.image_size,
                           "batch_size_per_worker": args.batch_size, "threads_per_worker": args.threads,
                           "rows": []}}
    for name, run in SECTIONS.items():
        if name in args.sections:
            results[name.replace("-", "_")] = run(args, out, results)
    (out / "bench.json").write_text(json.dumps(results, indent=2))
    plt = report.pyplot()
    results["plot"] = report.plot(results, out / "scaling.png", plt) if plt else None
    written = [results["plot"]] if results["plot"] else []
    if "sync_vs_async" in results:
        written += sync_vs_async.write(results["sync_vs_async"], out, plt)
    print(report.report(results))
    if not plt:
        print("bench: no plots: matplotlib is not installed here (pip install matplotlib draws them)")
    print(f"wrote {out / 'bench.json'}" + "".join(f", {p}" for p in written))
    return 0
