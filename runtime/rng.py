"""Random numbers under tensor parallelism: the runtime owns them, as Megatron's RNG tracker does.

Every op of the graph that draws random numbers (dropout, bernoulli, rand...: the ops torch tags
``nondeterministic_seeded``) runs with the generator seeded for it alone (``op_seed``), from:

- the run's seed, which every rank agrees on: ``seed=`` (``PARTITA_SEED``, ``partita run --seed``)
  if set, else rank 0's ``torch.initial_seed()`` when the model is built, broadcast (``run_seed``).
  A user who seeds each rank differently after building the model changes nothing of it;
- the node, the step and the micro-batch (the forward's and its recomputation in backward see the
  same, so a recomputed dropout draws the same mask: ``FLIGHT`` holds them);
- the data-parallel rank: replicas draw different numbers for their different samples;
- the tensor-parallel rank, only when the op's output is sharded over "tp": a replicated op draws
  the same numbers on every rank of its group, so the values, and the replicated parameters they
  feed, stay identical across it; a sharded one draws distinct numbers per shard.

The user's own generator is left as it was (``torch.random.fork_rng``). How to reproduce a run:
``PARTITA_SEED=S`` (or ``torch.manual_seed(S)`` on rank 0 before building), the same plan and the
same data.

``replica_divergence`` is the consistency check (``check_replicas_every=N``): a fingerprint of
every parameter the plan replicates over "tp" (and over "dp" without ZeRO), compared across the
group; it names the first parameter that differs.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from partita.runtime.collectives import all_gather_flat

# ops that draw only for their dropout: (the dropout probability's position, its keyword)
_DROPOUT_ARG = {"scaled_dot_product_attention": (4, "dropout_p"), "dropout": (1, "p"),
                "feature_dropout": (1, "p"), "alpha_dropout": (1, "p"), "feature_alpha_dropout": (1, "p"),
                "native_dropout": (1, "p")}


def is_random(target: object, args: tuple | list = (), kwargs: dict | None = None) -> bool:
    """Whether ``target`` (an fx node's target) draws random numbers, called with ``args`` /
    ``kwargs`` when given: an op whose randomness is its dropout draws nothing at p = 0 (attention
    without dropout, a dropout of 0), so it needs no seed of its own."""
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    packet = getattr(target, "overloadpacket", None)
    at = _DROPOUT_ARG.get(getattr(packet, "__name__", ""))
    if at is None or not (args or kwargs):
        return True
    i, key = at
    p = args[i] if len(args) > i else (kwargs or {}).get(key, 0.0 if key == "dropout_p" else 0.5)
    return not (isinstance(p, (int, float)) and p == 0)


def run_seed(seed: int | None = None, group: dist.ProcessGroup | None = None) -> int:
    """The seed every rank of the job agrees on (module docstring): ``seed`` (the ``seed``
    option, ``PARTITA_SEED``, checked in core/options.py) when given."""
    if seed is not None:
        return seed % (1 << 63)
    seed_t = torch.tensor([torch.initial_seed() % (1 << 63)], dtype=torch.int64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else seed_t.device
        seed_t = seed_t.to(device)
        dist.broadcast(seed_t, src=0, group=group)
    return int(seed_t.item())


def op_seed(base: int, node: str, step: int, micro_batch: int | None, dp_rank: int, tp_rank: int | None) -> int:
    """The seed of one random op's draw (``tp_rank`` None: replicated over "tp")."""
    key = f"{base}/{node}/{step}/{micro_batch}/{dp_rank}/{'' if tp_rank is None else tp_rank}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Run the block with the generator of ``device`` seeded to ``seed``; restored afterwards.

    Only that generator is touched: ``torch.manual_seed`` would also queue a seed for every CUDA
    device (recording a stack trace each time, ~2 ms on the host) and ``fork_rng`` would save them."""
    gen = torch.cuda.default_generators[device.index or 0] if device.type == "cuda" else torch.random.default_generator
    state = gen.get_state()
    gen.manual_seed(seed)
    try:
        yield
    finally:
        gen.set_state(state)


def fingerprint(t: torch.Tensor) -> int:
    """A position-weighted sum of ``t``'s bits: equal tensors give equal numbers on every rank
    (NaNs included); changed or shuffled ones almost never do."""
    flat = t.detach().reshape(-1)
    if flat.is_floating_point() or flat.is_complex() or flat.dtype == torch.bool:
        as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
        flat = flat.contiguous().view(as_int)
    weights = torch.arange(flat.numel(), device=flat.device) % 65521 + 1
    return int((flat.to(torch.int64) * weights).sum()) ^ (flat.numel() << 40)


def replica_divergence(named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup,
                       device: torch.device) -> tuple[str, list[int]] | None:
    """The first of ``named`` (each replicated over ``group``) whose copies differ, and the ranks
    that differ from the group's first; None when all agree. A collective over ``group``."""
    if not named:
        return None
    mine = torch.tensor([fingerprint(t) for _, t in named], dtype=torch.int64, device=device)
    size = dist.get_world_size(group)
    every = mine.new_empty(size * mine.numel())
    all_gather_flat(every, mine, group=group)
    every = every.cpu().view(size, mine.numel())
    ranks = dist.get_process_group_ranks(group)
    for i, (name, _) in enumerate(named):
        differ = [ranks[r] for r in range(size) if every[r, i] != every[0, i]]
        if differ:
            return name, differ
    return None
