"""`--sections step`: what a training step costs under hvdtrain, against plain Keras on the same cores.

Per built-in model (--checkpoint-models, each at its size), round by round, interleaved:
1. plain Keras in one process (the bench's keras worker: model.fit, no Horovod);
2. hvdtrain at one worker;
3. N plain Keras processes side by side (N = the most --workers), started together: the limit of N
   workers on these cores, since they share them and exchange nothing;
4. hvdtrain at N workers.

From each round's four figures, one process's step in milliseconds, split into its parts:
- compute: plain Keras' step;
- hvdtrain's own: hvdtrain's step at one worker less plain Keras' (negative where it is faster);
- sharing the cores: a side-by-side process's step less plain Keras' step;
- the allreduce: a worker's step at N less a side-by-side process's step (the gradients' allreduce,
  Horovod's cycle, and the wait for the slower worker).
"""
from __future__ import annotations

import json
import statistics
import subprocess

from pathlib import Path

from ..config import UserError
from . import launch, sections


def step(args, out: Path) -> dict:
    n, controller, rows = max(args.workers), launch.controller(args), []
    for model in args.checkpoint_models:
        size, steps, flags = sections._sized(args, model)
        plain = _plain_keras_command(args, model, size, steps)
        runs: dict = {"plain": [], "hvdtrain_1": [], "plain_side_by_side": [], "hvdtrain_n": []}
        for rep in range(args.repeats):
            runs["plain"].append(_plain_keras([plain], args.timeout))
            runs["hvdtrain_1"].append(launch.train([launch.PY], out / f"step-{model}-one-{rep}", flags,
                                                   args.timeout)["samples_per_sec_total"])
            runs["plain_side_by_side"].append(_plain_keras([plain] * n, args.timeout))
            runs["hvdtrain_n"].append(launch.train(launch.python(n, controller, args.hosts),
                                                   out / f"step-{model}-{n}-{rep}", flags,
                                                   args.timeout)["samples_per_sec_total"])
            launch.say(f"step {model}: plain Keras {runs['plain'][-1]:.0f}, hvdtrain 1 worker "
                       f"{runs['hvdtrain_1'][-1]:.0f}; {n} x plain Keras side by side "
                       f"{runs['plain_side_by_side'][-1]:.0f}, hvdtrain {n} workers {runs['hvdtrain_n'][-1]:.0f} samples/s")
        rows.append({"model": model, "image_size": size, "steps_per_epoch": steps, "samples_per_sec": runs,
                     **_ratios_and_parts(runs, n, args.batch_size)})
    return {"workers": n, "controller": controller, "batch_size_per_worker": args.batch_size,
            "threads_per_worker": args.threads, "rows": rows}


def _ratios_and_parts(runs: dict, n: int, batch: int) -> dict:
    """Each round's ratios and step parts (ms), and their medians over the rounds."""
    def ms(rate, processes=1):  # one process's step, from the samples/s of `processes` of them together
        return 1000.0 * batch * processes / rate

    rounds = list(zip(runs["plain"], runs["hvdtrain_1"], runs["plain_side_by_side"], runs["hvdtrain_n"]))
    ratios = {"1_worker_vs_plain": [one / plain for plain, one, _, _ in rounds],
              "n_workers_vs_1_worker": [many / one for _, one, _, many in rounds],
              "n_workers_vs_plain": [many / plain for plain, _, _, many in rounds],
              "n_workers_vs_side_by_side": [many / side for _, _, side, many in rounds]}
    parts = {"compute": [ms(plain) for plain, _, _, _ in rounds],
             "hvdtrain_own": [ms(one) - ms(plain) for plain, one, _, _ in rounds],
             "sharing_the_cores": [ms(side, n) - ms(plain) for plain, _, side, _ in rounds],
             "allreduce": [ms(many, n) - ms(side, n) for _, _, side, many in rounds]}
    return {"ratios": ratios, "step_ms": parts,
            "median": {k: statistics.median(v) for k, v in {**ratios, **parts}.items()}}


def _plain_keras_command(args, model: str, size: int, steps: int) -> list:
    return [launch.PY, "-m", "hvdtrain", "bench", "--worker", "keras", "--model", model, "--image-size",
            str(size), "--batch-size", str(args.batch_size), "--steps", str(steps), "--threads", str(args.threads)]


def _plain_keras(commands: list, timeout) -> float:
    """The samples/s of these plain Keras processes together, started at once."""
    procs = [subprocess.Popen(cmd, env=launch.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in commands]
    total = 0.0
    for cmd, proc in zip(commands, procs):
        text, _ = proc.communicate(timeout=timeout)
        if proc.returncode != 0 or "BENCH " not in text:
            raise UserError(f"bench: {' '.join(map(str, cmd[:8]))} ... failed:\n{text[-2000:]}")
        total += json.loads(text.split("BENCH ", 1)[1].splitlines()[0])["samples_per_sec"]
    return total
