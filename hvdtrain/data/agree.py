"""Every collective the data need, in one place, so that every rank calls them in the same order: the
steps of an epoch (the smallest shard decides), whether any rank's share of the files is empty, and the
largest label. Each is one gather (runtime.gather: a rank that failed in set-up raises there)."""
from __future__ import annotations

from .. import runtime
from ..config import Config, UserError
from ..runtime import World


def shard_size(n: int, world: World) -> int:
    """This rank's share of n items dealt round-robin (rank r takes r, r + size, ...)."""
    return (n - world.rank + world.size - 1) // world.size


def steps(cfg: Config, world: World, mine: int, batch: int, unit: str = "samples") -> tuple:
    """(steps per epoch every rank can run, notes, the whole data set's size): the smallest shard
    decides (--steps-per-epoch caps it). mine: this rank's shard, in samples (or in batches for a
    batched source, batch=1). The notes say what each rank leaves out of every epoch."""
    sizes = runtime.gather(mine)
    total = sum(sizes)  # the shards are disjoint
    if total == 0:
        raise UserError(f"--data {cfg.data}: the data set is empty")
    steps = min(sizes) // batch
    if steps == 0:
        what = f"workers x batch size = {world.size} x {batch}" if unit == "samples" else \
            f"the {world.size} workers (one batch each)"
        raise UserError(f"--data {cfg.data}: {total} training {unit} is fewer than {what}; "
                        f"lower --batch-size or use fewer workers")
    notes: list[str] = []
    if cfg.steps_per_epoch and cfg.steps_per_epoch < steps:
        return cfg.steps_per_epoch, notes, total
    left = [s - steps * batch for s in sizes]
    if any(left):
        per_rank = ", ".join(f"rank {r}: {n}" for r, n in enumerate(left) if n)
        notes.append(f"{steps} steps per epoch on every worker (the smallest shard decides); {unit} "
                     f"left out of each epoch: {per_rank}" +
                     (" (a different set every epoch: the order is reshuffled)" if cfg.shuffle and
                      unit == "samples" else ""))
    return steps, notes, total


def any_rank(flag: bool) -> bool:
    return any(runtime.gather(int(flag)))


def largest(value: int) -> int:
    return max(runtime.gather(value))
