"""The words every planner explains its decisions in: why a candidate lost, in one vocabulary.

Each solver states its own comparisons (passes/tp/mesh.py's mesh candidates,
passes/pipeline/decision.py's pipelines, passes/search.py's ZeRO stages not weighed)
with these phrases, so the plan's alternatives read alike whichever solver wrote them:
"chosen: ...", "1.42x slower: compute 12 ms vs 9 ms; ...", byte amounts in GB / MB,
and a ZeRO stage's traffic over its link.
"""

from __future__ import annotations

from collections.abc import Iterable

from partita.core.cluster import Link
from partita.core.plans.plan import MemoryBreakdown

CHOSEN = "chosen: fastest predicted step that fits"
ZERO_NAMES = {0: "DP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


def gb(nbytes: float) -> str:
    """``"12.34 GB"``, or ``"56.7 MB"`` below 0.1 GB."""
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.3g} MB"


def slower_parts(times: Iterable[tuple[str, float, float]], slack: float = 1e-12) -> list[str]:
    """``"NAME x ms vs y ms"`` for each (name, loser's seconds, winner's seconds) where the loser
    is more than 0.1% (and ``slack`` seconds) slower."""
    return [f"{name} {x * 1e3:.3g} ms vs {y * 1e3:.3g} ms" for name, x, y in times if x > y * 1.001 + slack]


def slower(ratio: float, parts: list[str], otherwise: str = "slower overall") -> str:
    """``"1.42x slower: PART; PART"`` (``otherwise`` when no part stands out)."""
    return f"{ratio:.2f}x slower: " + "; ".join(parts or [otherwise])


def traffic_reason(zero_stage: int, traffic_bytes: float, link: Link, seconds: float) -> str:
    """``"ZeRO-3: 390 GB/step over 1.25 GB/s = 312 s of traffic"``: a stage's data-parallel bytes
    sent per device per step, the dp group's bandwidth, and the time the cost model gives them."""
    return (f"{ZERO_NAMES[zero_stage]}: {traffic_bytes / 1e9:.3g} GB/step over "
            f"{link.bandwidth / 1e9:.3g} GB/s ({link.name}) = {seconds:.3g} s of traffic")


def peak_terms(m: MemoryBreakdown) -> str:
    """What a device holds at the step's peak beyond its model state and saved activations, as
    ``" + transient 1.2 GB + ZeRO buffers 3 GB + allocator 0.5 GB"`` (core/plans/plan.py ``MemoryBreakdown``),
    less the gradients backward has not made by then where the step frees them between steps; when
    the optimizer step's side is the larger, what it holds instead of the activations."""
    if m.at_step:
        text = f"; at the optimizer step, fp32 gradients and buffers {gb(m.step)} instead of the activations"
    else:
        terms = (("transient", m.transient), ("communication buffers", m.collectives))
        text = "".join(f" + {name} {gb(v)}" for name, v in terms if v)
        if m.grads_at_peak < m.grads:
            text += f" - grads backward has not made by then {gb(m.grads - m.grads_at_peak)}"
    return text + (f" + allocator {gb(m.allocator)}" if m.allocator else "")
