"""The elastic agent behind `partita run`: torch's LocalElasticAgent, aware of the other nodes.

Once a rendezvous round completes, each node's agent posts in the rendezvous store which node it
is (its ``--node-rank``, host and the global ranks of its workers) and then a heartbeat every
``HEARTBEAT_S`` from a thread of its own. So when this node's workers fail, the agent can tell a
lost node (its heartbeat stopped for ``STALE_S``, or the store it hosted is gone) from a failure
of its own, and say so in one line naming the node and its ranks (``lost_nodes``); at the end of
a run it waits only for the nodes that are still there (``_exit_barrier``). ``failure_report`` says
what a failed attempt comes to, for the launcher and for each restart.

With ``--nnodes MIN:MAX`` a node that asks to join while the run trains is let in at the next
complete checkpoint, not at once (``JoinAtCheckpoint``): the workers restart at the new size
and resume from that checkpoint, so no step is lost.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from partita.core.errors import PartitaError
from partita.runtime.processes.watchdog import EXIT_HUNG, EXIT_NODE_LOST

HEARTBEAT_S = 1.0
STALE_S = 4.0  # a node whose heartbeat has not moved for this long is lost
EXIT_WAIT_S = 300.0  # at the end, how long a node waits for the others still alive to finish


def describe(nodes: list[dict[str, Any]]) -> str:
    """``node 1 (host h, ranks 2, 3)`` for each lost node."""
    return "; ".join(f"node {n.get('node', '?')} ({'host ' + n['host'] + ', ' if n.get('host') else ''}"
                     f"rank{'s' if len(n.get('ranks', [])) != 1 else ''} "
                     f"{', '.join(map(str, n.get('ranks', []))) or '?'})" for n in nodes)


class Agent(LocalElasticAgent):
    """LocalElasticAgent that posts its node, keeps a heartbeat and can name a lost node."""

    def __init__(self, *args: Any, node_rank: int | None = None, errors: Path | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.node_rank, self.errors = node_rank, errors
        self._beat: _Heartbeat | None = None
        self._last: Any = None  # the last look at the workers (what failed)

    def _rendezvous(self, worker_group: Any) -> None:
        super()._rendezvous(worker_group)
        if self._beat is not None:
            self._beat.stop()
        info = {"node": self.node_rank if self.node_rank is not None else worker_group.group_rank,
                "host": socket.gethostname(), "ranks": [w.global_rank for w in worker_group.workers]}
        self._beat = _Heartbeat(worker_group.store, worker_group.group_rank, worker_group.group_world_size, info)

    def lost_nodes(self) -> list[dict[str, Any]]:
        """The other nodes of this round whose heartbeat stopped (waiting ``STALE_S`` to be sure)."""
        return self._beat.lost() if self._beat is not None else []

    def _monitor_workers(self, worker_group: Any) -> Any:
        self._last = super()._monitor_workers(worker_group)
        if self._last.state.name == "HEALTHY" and self.errors is not None:
            self._last = self._ended_early(worker_group) or self._last
        return self._last

    def _ended_early(self, worker_group: Any) -> Any:
        """A failed result when a rank's script ended (exit code 0) before it joined the process
        group while a rank of this node waits there for it (it would wait out the group's timeout):
        the early rank's one message, and every rank stopped."""
        from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
        from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

        handlers = getattr(self._pcontext, "subprocess_handlers", {})
        ended = {w.global_rank: w.local_rank for w in worker_group.workers
                 if w.local_rank in handlers and handlers[w.local_rank].proc.poll() == 0}
        waiting = [w.global_rank for w in worker_group.workers if w.global_rank not in ended
                   and (self.errors / f"rank{w.global_rank}.joining").exists()]
        early = [r for r in ended if not (self.errors / f"rank{r}.joining").exists()]
        if not (early and waiting):
            return None
        rank = early[0]
        # the message as a rank leaves its own (runtime/distributed.py ``_say``)
        (self.errors / f"rank{rank}.txt").write_text(str(PartitaError(
            f"rank {rank}'s script ended (exit code 0) before it built the model, while rank {waiting[0]} waits "
            "for every rank to join the run", hint="every rank must run the script as far as the model's build "
            "(partita.parallelize or ParallelModel); a rank with nothing to do must still build it")))
        self._pcontext.close()  # every rank of this node stopped now, not at the group's timeout
        failure = ProcessFailure(local_rank=ended[rank], pid=handlers[ended[rank]].proc.pid, exitcode=2,
                                 error_file="<N/A>")
        return RunResult(state=WorkerState.FAILED, failures={rank: failure})

    def _restart_workers(self, worker_group: Any) -> None:
        """Say why (the failure as the launcher reports one), then restart every rank."""
        failures = self._last.failures if self._last is not None else {}
        if failures and self.errors is not None:
            lines, _ = failure_report(failures, self.errors, self.lost_nodes())
            for line in lines:
                print(line, file=sys.stderr, flush=True)
            for f in self.errors.iterdir():  # the next attempt reports afresh
                f.unlink()
        left = self._remaining_restarts
        if failures or worker_group.state.name != "HEALTHY":
            print(f"partita: restarting every rank ({left} restart{'s' if left != 1 else ''} left after this one)",
                  file=sys.stderr, flush=True)
        super()._restart_workers(worker_group)

    def _exit_barrier(self) -> None:
        """Wait for the other nodes to finish too (the node hosting the store must outlive their use
        of it), but not for a node that is gone."""
        if self._beat is not None:
            self._beat.finish(EXIT_WAIT_S)

    def _shutdown(self, *args: Any, **kwargs: Any) -> None:
        if self._beat is not None:
            self._beat.stop()
        super()._shutdown(*args, **kwargs)


class _Heartbeat:
    """This node's entry and heartbeat in a round's store, and what it sees of the others'."""

    def __init__(self, store: Any, me: int, nodes: int, info: dict[str, Any]) -> None:
        self.store, self.me, self.nodes, self.info = store, me, nodes, info
        self.others = [g for g in range(nodes) if g != me]
        self.seen: dict[int, tuple[bytes, float]] = {}  # group rank -> (its last beat, when it changed here)
        self.known: dict[int, dict[str, Any]] = {}
        self.store_lost = False
        self._stop = threading.Event()
        store.set(f"partita/node/{me}", json.dumps(info))
        self._thread = threading.Thread(target=self._run, name="partita-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        count = 0
        while not self._stop.is_set():
            count += 1
            try:
                self.store.set(f"partita/beat/{self.me}", str(count))
                self._look()
            except Exception:  # (the store is gone: its host is lost, or the run ended)
                self.store_lost = True
                return
            self._stop.wait(HEARTBEAT_S)

    def _look(self) -> None:
        now = time.monotonic()
        for g in self.others:
            if g not in self.known and self.store.check([f"partita/node/{g}"]):
                self.known[g] = json.loads(self.store.get(f"partita/node/{g}"))
            if self.store.check([f"partita/beat/{g}"]):
                beat = self.store.get(f"partita/beat/{g}")
                if g not in self.seen or self.seen[g][0] != beat:
                    self.seen[g] = (beat, now)
            elif g not in self.seen:
                self.seen[g] = (b"", now)

    def lost(self) -> list[dict[str, Any]]:
        if not self.others:
            return []
        # long enough for a living node's beat to have moved; and a dead node's last beat may have
        # been read here up to a heartbeat (and a late wake) after it died, so wait that out too
        time.sleep(STALE_S + 2 * HEARTBEAT_S)
        if self.store_lost:  # the store lived on node 0 (it hosts the rendezvous): that node is gone
            return [next((i for i in self.known.values() if i.get("node") == 0), {"node": 0})]
        now = time.monotonic()
        return [self.known.get(g, {"node": g}) for g, (_, t) in sorted(self.seen.items()) if now - t > STALE_S]

    def finish(self, timeout_s: float) -> None:
        """Say this node is done; wait until every other node is done or lost (or ``timeout_s``)."""
        try:
            self.store.set(f"partita/done/{self.me}", "1")
        except Exception:  # (the store is gone: nobody is left to wait for)
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.store_lost:
            now = time.monotonic()
            try:
                waiting = [g for g in self.others if not self.store.check([f"partita/done/{g}"])
                           and now - self.seen.get(g, (b"", now))[1] <= STALE_S]
            except Exception:
                return
            if not waiting:
                return
            time.sleep(0.2)


def failure_report(failures: Mapping[int, Any], errors: Path, lost: list[dict]) -> tuple[list[str], int]:
    """What to print about a failed attempt, and its exit code: nothing after a hang's report (3),
    one line for lost nodes (4), each distinct user error once (2), else the first failing rank's
    traceback and one line naming it (its exit code)."""
    if EXIT_HUNG in {getattr(f, "exitcode", None) for f in failures.values()}:
        return [], EXIT_HUNG  # the watchdog's report is above (what the stopped ranks raised after it is not news)
    if lost:  # what the ranks here raised as their peers vanished is not news either
        return [f"partita: {describe(lost)} {'was' if len(lost) == 1 else 'were'} lost (its launcher stopped or its "
                "host went down); the ranks on this node were stopped"], EXIT_NODE_LOST
    messages: dict[str, list[int]] = {}
    for f in sorted(errors.glob("rank*.txt")):
        messages.setdefault(f.read_text().strip(), []).append(int(f.stem[4:]))
    if messages:
        return [f"error ({'every rank' if len(r) > 1 else f'rank {r[0]}'}): {text}" for text, r in messages.items()], 2
    if not failures:
        return ["the run failed"], 1
    # the root cause: a rank that left its traceback (its peers exit quietly once it is gone), else the first to fail
    rank, first = min(failures.items(), key=lambda kv: (not (errors / f"rank{kv[0]}.traceback").is_file(),
                                                        getattr(kv[1], "timestamp", 0), kv[0]))
    code = getattr(first, "exitcode", None)
    trace = errors / f"rank{rank}.traceback"
    lines = [trace.read_text().rstrip()] if trace.is_file() else []
    lines.append(f"the run failed: rank {rank} exited with code {code}; its "
                 f"{'traceback' if lines else 'output'} is above")
    return lines, code if isinstance(code, int) and code > 0 else 1


class JoinAtCheckpoint:
    """A rendezvous handler whose nodes waiting to join are let in only once a checkpoint newer
    than the one complete when they were first seen is complete (``--nnodes MIN:MAX`` with
    ``--checkpoint-dir``): the workers then restart at the new size from that checkpoint."""

    def __init__(self, handler: Any, checkpoint_dir: str | Path | None) -> None:
        self._handler, self._dir = handler, checkpoint_dir
        self._since: Any = None
        self._waiting = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handler, name)

    def num_nodes_waiting(self) -> int:
        from partita.runtime.state.periodic import latest

        n = self._handler.num_nodes_waiting()
        if n == 0 or self._dir is None:
            self._waiting = False
            return n
        newest = latest(self._dir)
        if not self._waiting:
            self._waiting, self._since = True, newest
            print(f"partita: {n} node(s) asking to join; they join at the next checkpoint", file=sys.stderr,
                  flush=True)
            return 0
        if newest != self._since:
            self._waiting = False
            return n
        return 0
