"""The watchdog (runtime/processes/watchdog.py): a step that waits in a collective its peers never reach
ends, within the limit, with one message naming the ranks and the mismatched collectives, and a
non-zero exit; never a silent hang."""

import threading
import time

from partita.core.mesh import Mesh
from partita.runtime.processes.watchdog import EXIT_HUNG, FlightRecorder, Watchdog


class MemoryStore:
    """The three store calls the watchdog makes, in memory (a TCPStore across processes)."""

    def __init__(self):
        self.data, self.lock = {}, threading.Lock()

    def set(self, key, value):
        with self.lock:
            self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        with self.lock:
            return self.data[key]

    def check(self, keys):
        with self.lock:
            return all(k in self.data for k in keys)


def test_two_ranks_waiting_in_different_collectives_are_named_and_exit():
    mesh = Mesh(pp=2)
    store, exits, out = MemoryStore(), [], []
    dogs = []
    for rank, (kind, nbytes, ranks) in enumerate([("all_reduce", 1024, (0, 1)), ("broadcast", 4, None)]):
        flight = FlightRecorder()
        flight.mesh, flight.rank = mesh, rank
        flight.at(1, "backward", 3)
        flight.entered("send_recv", "pp", 8192)
        flight.entered(kind, "pp", nbytes, ranks)
        flight.busy = 1

        class Out:
            def write(self, s, rank=rank):
                out.append((rank, s))

            def flush(self):
                pass

        dogs.append(Watchdog(flight, rank=rank, world_size=2, timeout_s=0.3, store=store, out=Out(),
                             exit=exits.append, grace_s=2))
    t0 = time.monotonic()
    threads = [threading.Thread(target=d._run) for d in dogs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    # a guard against a hang, not a timing: both end after the 0.3 s limit and the 2 s grace
    assert not any(t.is_alive() for t in threads), f"the watchdogs run on after {time.monotonic() - t0:.0f} s"
    assert exits == [EXIT_HUNG, EXIT_HUNG] or sorted(exits) == [EXIT_HUNG, EXIT_HUNG]
    text = "".join(s for r, s in out)
    assert {r for r, _ in out} == {0}  # one message, from rank 0
    assert "no progress for 0.3 s" in text
    assert ("rank 0 (pipeline stage 0): waiting in all_reduce over pp ranks [0, 1] (1,024 B), step 1, "
            "micro-batch 3 backward") in text
    assert "rank 1 (pipeline stage 1): waiting in broadcast over pp ranks [0, 1] (4 B)" in text
    assert "mismatched collectives" in text and "rank 0 waits in all_reduce" in text
    assert "its peer rank 1 waits in broadcast" in text


def test_a_rank_that_never_answers_is_named():
    flight = FlightRecorder()
    flight.mesh, flight.rank, flight.busy = Mesh(dp=2), 0, 1
    flight.entered("all_reduce", "dp", 64)
    out = []

    class Out:
        def write(self, s):
            out.append(s)

        def flush(self):
            pass

    dog = Watchdog(flight, rank=0, world_size=2, timeout_s=0.2, store=MemoryStore(), out=Out(), exit=out.append,
                   grace_s=0.5)
    dog._run()
    text = "".join(s for s in out if isinstance(s, str))
    assert "rank 1 did not answer" in text and out[-1] == EXIT_HUNG


def test_outside_a_step_nothing_fires():
    flight = FlightRecorder()
    flight.mesh, flight.rank = Mesh(dp=2), 0
    flight.entered("all_reduce", "dp", 64)
    exits = []
    dog = Watchdog(flight, rank=0, world_size=2, timeout_s=0.1, store=MemoryStore(), exit=exits.append)
    dog.start()
    time.sleep(0.8)
    dog.stop()
    assert exits == []
