"""The process groups a program makes are reused by later programs (runtime/distributed.py ``_Groups``):
a rank's n-th request for (use, ranks) since its program began gets the n-th group made for it, so a
later program of the same shape makes none, and two groups one program asks for apart stay apart.
(On real gloo ranks: tests/integration/test_runtime_tp.py, the dp2xtp2 launch.)"""

from partita.runtime import distributed
from partita.runtime.distributed import _Groups


def made_by(groups: _Groups, made: list, requests: list[tuple[str, tuple[int, ...]]]) -> list:
    groups.begin()
    out = []
    for what, ranks in requests:
        out.append(groups.get(what, ranks, lambda w=what, r=ranks: made.append((w, r)) or len(made)))
    return out


def test_a_second_program_of_the_same_shape_makes_no_group():
    groups, made = _Groups(), []
    asks = [("pipeline line", (0, 2)), ("pipeline line", (1, 3)), ("ep", (0, 1))]
    first = made_by(groups, made, asks)
    second = made_by(groups, made, asks)
    assert first == second == [1, 2, 3]
    assert len(made) == 3


def test_requests_one_program_makes_apart_stay_apart():
    groups, made = _Groups(), []
    # two tied parameters held on the same stages: two groups over the same ranks, as before
    first = made_by(groups, made, [("pipeline line", (0, 2)), ("pipeline line", (0, 2))])
    assert first == [1, 2]
    # a later program asking for one reuses the first; asking for three makes one more
    assert made_by(groups, made, [("pipeline line", (0, 2))]) == [1]
    assert made_by(groups, made, [("pipeline line", (0, 2))] * 3) == [1, 2, 3]
    # the same ranks for another use are another group
    assert made_by(groups, made, [("ep", (0, 2))]) == [4]
    assert len(made) == 4


def test_groups_are_forgotten_with_the_default_group(monkeypatch):
    groups, made = _Groups(), []
    made_by(groups, made, [("ep", (0, 1))])
    world = object()  # a new default group (a process that destroyed its group and joined another)
    monkeypatch.setattr(distributed, "_default_group", lambda: world)
    assert made_by(groups, made, [("ep", (0, 1))]) == [2]
    assert groups.world is world
