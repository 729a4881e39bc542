"""How the tests run several processes, and how they compare a run with one process.

Processes:
- ``launch(world, fn, *args)``: ``fn(ctx, *args)`` on every rank of a gloo process group of
  ``world`` CPU processes; returns each rank's result (as JSON reads it back). The ranks stay up
  between launches (a group of each size, up to ``KEEP_RANKS`` processes in all, until a launcher
  subprocess ends them: each rank holds ~1 GB once it has run a model, and groups kept alongside
  a torchrun test slowed it 2-3x), so a run of tests pays for starting processes, importing
  torch, joining a group and capturing each model once (a rank keeps its captures,
  core/model/capture_memo.py), not once per launch. tests/integration/conftest.py runs the files that
  start launchers last, so the groups outlive most tests. A failure (an
  exception on any rank, a rank that dies or does not answer within ``timeout_s``) ends that
  group and raises one ``AssertionError`` with every rank's traceback or state and the tail of
  its output; the next launch starts a fresh group. So does a launch after which a rank runs more
  than ``MAX_RANK_THREADS`` threads (gloo keeps every process group's for the life of the
  process). ``fn`` must be a module-level function of an importable module (the ranks import it
  by its name, ``tests.workers.dp_worker`` and the like: the tests' ``*_worker.py`` files). A
  worker measures and returns; the test asserts.
- ``command(*argv)``, ``torchrun(script, *args, nproc=N)``, ``partita_cli(*args)``: a subprocess
  (the launchers themselves under test) with one thread per process and the repository's root on
  ``PYTHONPATH`` (a script run as a file imports ``tests.`` and ``examples.`` modules by those
  names); with ``check`` (the default) a non-zero exit raises one message with the
  command, its exit code and the tails of its output (under ``torchrun``, each rank's own).

Comparisons with the single-process reference:
- ``reference_step`` (one plain step on the whole global batch), ``reference_backward`` (its
  gradients as a plan's micro-batches accumulate them), ``plain_training`` (a plain loop);
- ``max_abs_diff`` and ``max_rel_diff`` of losses, gradients or parameters (lists or dicts);
- rank-side, ``gaps(got, want)``: how far tensors are from the reference, as the few numbers a
  tolerance needs (plain data, for the rank's result); test-side, ``beyond(gaps, rtol=, atol=)``
  and ``numbers_beyond(got, want, rtol=, atol=)``: what lies outside ``|got - want| <= atol + rtol
  |want|`` (``torch.testing.assert_close``'s rule), element by element, each named; empty when
  everything is close.

Plans: ``calls`` (a plan's or a run's collectives per kind, axis and bytes), ``fast_cluster`` (a
cluster file whose links make TP pay), ``gather_tp`` (full tensors from a rank's TP shards),
``plans_spread`` (rank-side: a launch's plans made once, spread over its ranks, and gathered).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import gc
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
WORKERS = TESTS / "workers"  # what the ranks and the launched scripts run (rank-side code)
PARTITA = str(Path(sys.executable).with_name("partita"))
# the root, for a script run as a file: it imports ``tests.workers.tied_script``, ``examples.models``
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}

COLLECTIVE_TIMEOUT_S = 120  # a rank waiting for its peers this long fails (gloo's own timeout)
LAUNCH_TIMEOUT_S = 600  # a launch whose ranks have not all answered by then fails
GRACE_S = 5.0  # once a rank has failed, how long the others get to answer before the group ends
TAIL = 3000  # characters of a process's output shown when it fails
KEEP_RANKS = 6  # groups stay up between launches while they hold this many processes in all (2 and 4 ranks)
# A group that has made this many threads in a rank is ended after its launch: every process group a
# plan makes (new_group, a DeviceMesh's) keeps gloo's threads for the life of the process, each waking
# now and then; after 15 minutes of launches 6 kept ranks ran 1,400 threads each, a load of 180 on 2 cores.
MAX_RANK_THREADS = 256


@contextlib.contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """Fail, naming ``what``, if the block runs past ``seconds`` (a guard against a hang, not a
    timing: make the bound generous, many times what a loaded machine takes). Main thread only."""
    def expired(signum: int, frame: Any) -> None:
        raise AssertionError(f"{what} did not finish within {seconds:.0f} s: it hangs")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def threads_of(pid: int | str = "self") -> int:
    """The threads process ``pid`` runs, its native ones (gloo's) too; 0 where /proc does not say."""
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(text: str, n: int = TAIL) -> str:
    text = text.rstrip()
    return text if len(text) <= n else "..." + text[-n:]


# ---------------------------------------------------------------------------------------------
# A group of gloo ranks that runs one function after another


def _serve(rank: int, world: int, port: int, conn: Connection, log: str) -> None:
    """A rank: join the group, then run each ``(fn, args)`` received and send back its result."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from partita.core.model.capture_memo import memoize_captures

    memoize_captures()  # a rank runs many plans of the same few models: each captured once
    try:
        from partita.runtime.distributed import init_distributed

        ctx = init_distributed(timeout_s=COLLECTIVE_TIMEOUT_S)
        assert ctx.initialized_here and ctx.backend == "gloo" and (ctx.rank, ctx.world_size) == (rank, world), ctx
    except BaseException:
        conn.send(("error", "joining the process group: " + traceback.format_exc()))
        return
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the test process is gone
            return
        if job is None:
            break
        fn, args = job
        try:
            result = fn(ctx, *args)
        except BaseException:
            sys.stdout.flush()
            conn.send(("error", traceback.format_exc()))
        else:
            sys.stdout.flush()
            conn.send(("ok", json.dumps(result)))  # plain data, as the test reads it (a loss is a float)
        # What outlives a job (imported modules, kept captures and groups) is moved out of the
        # collector's walks: a capture of a module instance collects (core/model/capture.py), and with
        # everything walked each collection took 0.2-0.5 s, 12% of the tier's samples.
        gc.collect()
        gc.freeze()
    from partita.runtime.distributed import destroy

    destroy(ctx)


class Ranks:
    """``world`` processes in one gloo group, each running ``_serve``."""

    def __init__(self, world: int) -> None:
        import torch.multiprocessing as mp

        spawn = mp.get_context("spawn")
        self.world = world
        self.logdir = Path(tempfile.mkdtemp(prefix=f"partita-ranks{world}-"))
        port = free_port()
        self.conns: list[Connection] = []
        self.procs = []
        for rank in range(world):
            mine, theirs = spawn.Pipe()
            p = spawn.Process(target=_serve, args=(rank, world, port, theirs, str(self.log(rank))), daemon=True)
            p.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(p)

    def log(self, rank: int) -> Path:
        return self.logdir / f"rank{rank}.log"

    def run(self, fn: Callable, args: tuple, timeout_s: float) -> list:
        start = {r: self.log(r).stat().st_size if self.log(r).exists() else 0 for r in range(self.world)}
        for c in self.conns:
            c.send((fn, args))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        t0 = time.monotonic()
        deadline, failed_at = t0 + timeout_s, None
        pending = set(range(self.world))
        while pending:
            now = time.monotonic()
            limit = deadline if failed_at is None else min(deadline, failed_at + GRACE_S)
            if now >= limit:
                break
            waits = {self.conns[r]: r for r in pending} | {self.procs[r].sentinel: r for r in pending}
            for ready in wait(list(waits), timeout=limit - now):
                r = waits[ready]
                if r not in pending:
                    continue
                if ready is self.conns[r] or self.conns[r].poll():
                    try:
                        status, value = self.conns[r].recv()
                    except (EOFError, OSError):
                        status, value = "error", f"died (exit code {self.procs[r].exitcode})"
                else:
                    self.procs[r].join(1)
                    status, value = "error", f"died (exit code {self.procs[r].exitcode})"
                pending.discard(r)
                if status == "ok":
                    results[r] = json.loads(value)
                else:
                    errors[r] = value
                    failed_at = failed_at or time.monotonic()
        if not errors and not pending:
            return [results[r] for r in range(self.world)]
        elapsed = time.monotonic() - t0
        self.kill()
        lines = [f"{fn.__module__}.{fn.__name__} on {self.world} ranks failed after {elapsed:.0f} s:"]
        for r in range(self.world):
            if r in errors:
                state = "raised:\n" + _tail(errors[r])
            elif r in pending:
                state = ("did not answer within the launch's limit" if failed_at is None
                         else f"had not answered {GRACE_S:.0f} s after another rank failed") + " (ended)"
            else:
                state = "finished"
            out = self.log(r).read_bytes()[start[r]:].decode(errors="replace") if self.log(r).exists() else ""
            lines.append(f"--- rank {r} {state}"
                         + (f"\n    its output:\n{_tail(out, TAIL // 2)}" if out.strip() else ""))
        self.close()
        _why[self.world] = "a launch failed"
        raise AssertionError("\n".join(lines))

    def threads(self) -> int:
        """The most threads one of the ranks runs (0 where /proc does not say)."""
        return max(threads_of(p.pid) for p in self.procs)

    def kill(self) -> None:
        for p in self.procs:
            p.kill()
            p.join()

    def close(self) -> None:
        """Ask the ranks to leave the group and end (killed if they do not within 10 s)."""
        for c, p in zip(self.conns, self.procs):
            if p.is_alive():
                try:
                    c.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.conns:
            c.close()
        shutil.rmtree(self.logdir, ignore_errors=True)
        if _groups.get(self.world) is self:
            del _groups[self.world]


_groups: dict[int, Ranks] = {}
STARTS: collections.Counter[str] = collections.Counter()  # groups started, by why (the session's summary)


def launch(world: int, fn: Callable, *args: Any, timeout_s: float = LAUNCH_TIMEOUT_S) -> list:
    """``fn(ctx, *args)`` on each rank of a ``world``-process gloo group; every rank's result,
    printed for the log. See the module docstring for what a failure reports."""
    group = _groups.get(world)
    if group is None:
        # each rank holds ~1 GB once it has run a model; a group larger than the kept ones runs beside
        # them and ends after its launch, so they need not start again
        if world <= KEEP_RANKS and world + sum(_groups) > KEEP_RANKS:
            _close_all()
        STARTS[_why.pop(world, "first launch of its size") if world <= KEEP_RANKS else "larger than kept"] += 1
        group = _groups[world] = Ranks(world)
    try:
        per_rank = group.run(fn, args, timeout_s)
    finally:
        for size, kept in list(_groups.items()):  # an idle group's threads wake too
            if size > KEEP_RANKS:
                kept.close()
            elif kept.threads() > MAX_RANK_THREADS:
                kept.close()
                _why[size] = f"over {MAX_RANK_THREADS} threads"
    for rank, results in enumerate(per_rank):
        for r in results if isinstance(results, list) else [results]:
            print(rank, r)
    return per_rank


_why: dict[int, str] = {}  # world size -> why its group was ended (the next one's reason to start)


def _close_all(why: str = "room for another size") -> None:
    for size, group in list(_groups.items()):
        group.close()
        _why[size] = why


atexit.register(_close_all)


# ---------------------------------------------------------------------------------------------
# Launchers under test, as subprocesses


def command(*argv: str | Path, timeout_s: float = 300, check: bool = True, env: Mapping[str, str] | None = None,
            logs: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``argv``; with ``check``, a non-zero exit fails with one message (``logs``: a torchrun
    log folder whose ranks' own output to show)."""
    argv = [str(a) for a in argv]
    _close_all("a launcher ran")  # the launcher's own processes get the memory (kept groups slowed them 2-3x)
    t0 = time.monotonic()
    r = subprocess.run(argv, env=dict(env or ENV), capture_output=True, text=True, timeout=timeout_s)
    if check and r.returncode != 0:
        lines = [f"`{' '.join(argv)}` exited with {r.returncode} after {time.monotonic() - t0:.0f} s"]
        for log in sorted(logs.rglob("stderr.log")) if logs is not None else []:
            text = log.read_text(errors="replace")
            lines.append(f"--- local rank {log.parent.name}'s stderr:\n{_tail(text, TAIL // 2)}")
        lines.append(f"--- stderr:\n{_tail(r.stderr)}")
        if r.stdout.strip():
            lines.append(f"--- stdout:\n{_tail(r.stdout, TAIL // 3)}")
        raise AssertionError("\n".join(lines))
    return r


def torchrun(script: str | Path, *args: str | Path, nproc: int, **kw: Any) -> subprocess.CompletedProcess:
    """``script`` on ``nproc`` local ranks under torchrun (each rank's output also kept apart, for
    the failure message)."""
    logs = Path(tempfile.mkdtemp(prefix="partita-torchrun-"))
    try:
        return command(sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                       "--log-dir", logs, "--tee", "3", script, *args, logs=logs, **kw)
    finally:
        shutil.rmtree(logs, ignore_errors=True)


def partita_cli(*args: str | Path, **kw: Any) -> subprocess.CompletedProcess:
    """The ``partita`` command line."""
    return command(PARTITA, *args, **kw)


# ---------------------------------------------------------------------------------------------
# The single-process reference, and how far a run is from it


def reference_step(reference: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable,
                   x: torch.Tensor, y: torch.Tensor, grads: dict[str, torch.Tensor] | None = None, *,
                   micro_batch: int | None = None) -> float:
    """One single-process step on the whole global batch; its gradients into ``grads`` if given.

    With ``micro_batch`` the batch runs as consecutive micro-batches of that many rows and the
    loss is their mean, as a plan's step computes it (equal to the whole batch's mean loss unless
    a layer mixes rows: BatchNorm's statistics are the micro-batch's)."""
    chunks = [slice(None)] if micro_batch is None else [slice(i, i + micro_batch)
                                                          for i in range(0, x.shape[0], micro_batch)]
    loss = sum(loss_fn(reference(x[rows]), y[rows]) for rows in chunks) / len(chunks)
    loss.backward()
    if grads is not None:
        grads.update({n: p.grad.detach().clone() for n, p in reference.named_parameters()})
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def reference_backward(reference: torch.nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor,
                       micro_batches: int = 1) -> float:
    """The gradients of the mean loss over ``micro_batches`` consecutive micro-batches, accumulated
    as a plan's ``train_step`` does (each micro-batch's loss / m, backward in turn, so that a
    replicated plan matches bit for bit); returns the mean loss. No optimizer step."""
    mbs = x.shape[0] // micro_batches
    total = torch.zeros(())
    for i in range(micro_batches):
        rows = slice(i * mbs, (i + 1) * mbs)
        part = loss_fn(reference(x[rows]), y[rows])
        total += part.detach()
        (part / micro_batches).backward()
    return float(total / micro_batches)


def plain_training(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: Iterable, loss=None
                   ) -> tuple[list[float], dict]:
    """A plain loop over whole batches, no partita: the losses and the final state_dict. A batch's
    inputs are one tensor or a tuple of them (a model with several inputs)."""
    from partita.core.model.losses import resolve_loss, training_loss

    loss_fn = resolve_loss(loss)
    losses = []
    for x, y in batches:
        value = training_loss(loss_fn, model, x if isinstance(x, tuple) else (x,), y)
        value.backward()
        opt.step()
        opt.zero_grad()
        losses.append(value.item())
    return losses, model.state_dict()


Tensors = Mapping[str, torch.Tensor] | Sequence[torch.Tensor]


def _pairs(got: Tensors, want: Tensors) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    if isinstance(got, Mapping):
        return [(k, got[k], want[k]) for k in got]
    return [(str(i), a, b) for i, (a, b) in enumerate(zip(got, want))]


def max_abs_diff(got: Tensors, want: Tensors) -> float:
    """The largest |got - want| over all pairs (0 for none)."""
    return max((float((a.float() - b.float()).abs().max()) for _, a, b in _pairs(got, want) if a.numel()),
               default=0.0)


def max_rel_diff(got: Sequence[float], want: Sequence[float]) -> float:
    """The largest |got - want| / |want| over paired numbers (losses)."""
    return max((abs(a - b) / abs(b) for a, b in zip(got, want)), default=0.0)


def gaps(got: Tensors, want: Tensors) -> dict:
    """How far ``got`` is from ``want`` (dicts: over ``got``'s keys), rank-side, as plain data that
    a test judges with ``beyond`` against any tolerance ``|got - want| <= atol + rtol |want|``:

    - ``max_abs``: the largest ``|got - want|``, for the log;
    - ``worst``: ``[key, |want|, |got - want|]`` of the elements that decide every such tolerance
      (the upper-left convex hull of the points (|want|, |got - want|): for any rtol, atol >= 0, if
      some element is outside, one of these is; a handful, not the tensors). An element equal to
      its reference is never outside (infinities of one sign included); a NaN or an infinite
      difference counts as infinitely far, at |want| 0;
    - ``unlike``: the pairs whose shape or dtype differ (``assert_close`` refuses them).
    """
    keys, unlike, points = [], [], []
    for key, a, b in _pairs(got, want):
        if a.shape != b.shape or a.dtype != b.dtype:
            unlike.append(f"{key}: {a.dtype} {list(a.shape)}, the reference's {b.dtype} {list(b.shape)}")
            continue
        a, b = a.detach().double().flatten(), b.detach().double().flatten()
        diff = (a - b).abs()
        diff[a == b] = 0.0
        size = b.abs()
        bad = ~torch.isfinite(diff)
        diff[bad], size[bad] = math.inf, 0.0
        far = diff > 0
        keys.append(key)
        points.append(torch.stack([size[far], diff[far], torch.full_like(size[far], len(keys) - 1)], dim=1))
    pts = torch.cat(points) if points else torch.zeros(0, 3, dtype=torch.float64)
    max_abs = float(pts[:, 1].max()) if len(pts) else 0.0
    # The Pareto front first (no other point has a larger difference at a |want| as small), in
    # order of |want|, then its upper hull (a point under the chord of its neighbours is never the
    # first outside: one of them is outside whenever it is).
    pts = pts[torch.argsort(pts[:, 1], descending=True, stable=True)]
    pts = pts[torch.argsort(pts[:, 0], stable=True)]
    before = torch.cat([pts.new_full((1,), -1.0), torch.cummax(pts[:, 1], 0).values[:-1]]) if len(pts) else pts[:, 1]
    hull: list[tuple[float, float, int]] = []
    for w, d, k in pts[pts[:, 1] > before].tolist():
        while len(hull) >= 2 and (
                (hull[-1][1] - hull[-2][1]) * (w - hull[-2][0]) <= (d - hull[-2][1]) * (hull[-1][0] - hull[-2][0])):
            hull.pop()
        hull.append((w, d, int(k)))
    return {"max_abs": max_abs, "worst": [[keys[k], w, d] for w, d, k in hull], "unlike": unlike}


def beyond(found: Mapping[str, Any], *, rtol: float, atol: float) -> list[str]:
    """Test-side: what ``gaps`` found outside ``|got - want| <= atol + rtol |want|``, each named
    (the pairs of another shape or dtype too); empty when every element is close."""
    outside = [f"{key}: |got - want| = {d:.3g} > atol + rtol |want| = {atol:g} + {rtol:g} x {w:.3g}"
               for key, w, d in found["worst"] if not d <= atol + rtol * w]
    return outside + found["unlike"]


def numbers_beyond(got: Sequence[float], want: Sequence[float], *, rtol: float, atol: float) -> list[str]:
    """Test-side: the numbers (losses, norms; in pairs) outside ``|got - want| <= atol + rtol |want|``,
    each with its index; empty when all are close and there are as many."""
    outside = [f"{i}: {a!r}, the reference's {b!r}" for i, (a, b) in enumerate(zip(got, want))
               if not abs(a - b) <= atol + rtol * abs(b)]
    if len(got) != len(want):
        outside.append(f"{len(got)} numbers, the reference's {len(want)}")
    return outside


def calls(entries: Iterable[Sequence]) -> dict:
    """Calls per (kind, axis, bytes) of ``[kind, axis, bytes, count]`` entries: the plan lists
    forward and backward reshards of one size apart."""
    out: dict = {}
    for kind, axis, nbytes, count in entries:
        out[(kind, axis, nbytes)] = out.get((kind, axis, nbytes), 0) + count
    return out


def fast_cluster(tmp_path: Path) -> str:
    """A cluster file: 4 CPU processes with NVLink-like links. On `local`'s slow gloo links the ILP
    rightly keeps every op replicated at tp=2; here splitting pays, so the plan splits."""
    from partita.core.cluster import load_cluster

    fast = tmp_path / "fast.toml"
    fast.write_text(load_cluster("local").to_toml().replace("intra_node_gb_per_s = 1", "intra_node_gb_per_s = 1e6")
                    .replace("intra_node_latency_us = 100", "intra_node_latency_us = 0.001"))
    return str(fast)


def gather_tp(tp_program, local: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full tensors from this rank's TP shards of ``local`` (by the program's placements), for the
    comparison: the test's own collectives, which the runtime's counter does not see."""
    import torch.distributed as dist

    tp = tp_program.tp
    out = {}
    for name, (_, placement) in tp_program.local_parameters().items():
        t = local[name].contiguous()
        if placement.startswith("shard(") and tp.size > 1:
            parts = [torch.empty_like(t) for _ in range(tp.size)]
            dist.all_gather(parts, t, group=tp.group)
            t = torch.cat(parts, dim=int(placement[6:-1]))
        out[name] = t
    return out


def plans_spread(ctx, makers: Sequence[Callable[[], Any]]) -> list:
    """Rank-side: each case's plan, ``makers[i]()`` (its ``compile_model(...).plan``), made on one rank
    alone (rank ``i mod world``, all ranks at once) and gathered to every rank, so that a launch of
    many cases spreads its planning over the ranks instead of planning each case on every one (the
    plan does not depend on the rank that makes it, as the decorator's rank 0 plans for all). What a
    maker raised stands in its place (a ``PartitaError`` with its ``message`` and ``hint``), for the
    case to raise. Every rank calls it with the same makers."""
    import pickle

    import torch.distributed as dist

    mine: dict[int, Any] = {}
    for i in range(ctx.rank, len(makers), ctx.world_size):
        try:
            mine[i] = makers[i]()
        except Exception as e:  # sent as it is if it survives pickling (its attributes too), else named
            try:
                pickle.loads(pickle.dumps(e))
                mine[i] = e
            except Exception:
                mine[i] = RuntimeError(f"{type(e).__name__}: {e}")
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)
    return [gathered[i % ctx.world_size][i] for i in range(len(makers))]
