"""What an axis declares, and the one way its rules are checked: on the pins at compile, on a plan
at verify.

A rule reads settings (the degrees and each axis's own choice: ``SETTINGS``) and facts about the
model and cluster (``FACTS``). It is checked wherever everything it reads is known: on the pins
(unpinned settings are None, and no fact is known yet) when ``Pins`` is made; on the pins with the
facts the graph and the cluster give when the planner starts (passes/search.py); on a plan's
settings with the facts its decisions give (core/plans/verify.py). One rule, one message, in two voices:
the CLI's (``--sequence-parallel with --tp 1``) and the plan file's (``training.sequence_parallel =
true with mesh.tp = 1``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# setting -> (the CLI's flag, the plan file's field)
SETTINGS: dict[str, tuple[str, str]] = {
    "dp": ("--dp", "mesh.dp"),
    "tp": ("--tp", "mesh.tp"),
    "pp": ("--pp", "mesh.pp"),
    "ep": ("--ep", "mesh.ep"),
    "cp": ("--cp", "mesh.cp"),
    "cp_attention": ("--cp-attention", "training.cp_attention"),
    "expert_load": ("--expert-load", "training.expert_load"),
    "zero_stage": ("--zero", "training.zero_stage"),
    "schedule": ("--schedule", "training.schedule"),
    "grad_accum_steps": ("--grad-accum-steps", "training.grad_accum_steps"),
    "recompute": ("--recompute", "stages[].recompute"),  # a set of modes on a plan: its stages'
    "offload": ("--offload", "training.offload"),
    "sequence_parallel": ("--sequence-parallel", "training.sequence_parallel"),
    "inference": ("--inference", "training.inference"),
}
# what the model and the cluster hold, by name: None where not known (the pins alone, or a fact a plan
# does not record)
FACTS = ("attention_core", "repeated_layers", "residual_stream", "experts", "host_bandwidth", "sequence", "heads")

Say = Callable[..., str]  # (setting, value=its own) -> the setting in the voice's words


@dataclass(frozen=True)
class Rule:
    """A combination this version does not plan or run: ``broken(values)`` over the settings and facts
    in ``reads``; ``message(say, values)`` names the settings in the voice of ``say``; ``hint`` (the
    CLI's voice) how to fix it."""

    reads: tuple[str, ...]
    broken: Callable[[Mapping[str, Any]], bool]
    message: Callable[[Say, Mapping[str, Any]], str]
    hint: str

    def known(self, values: Mapping[str, Any]) -> bool:
        return all(values.get(name) is not None for name in self.reads)


@dataclass(frozen=True)
class Axis:
    """One parallelism axis: its name, the settings it owns (the pins a user may fix, the plan fields
    compile writes), its rules, and the checks of a plan that need more than the settings (a
    parameter's layout against the model's experts): ``plan_checks(plan) -> [problem, ...]``."""

    name: str
    settings: tuple[str, ...]
    rules: tuple[Rule, ...] = ()
    plan_checks: Callable[[Any], list[str]] | None = None
    describe: Callable[[Any], str | None] = lambda plan: None  # what a plan decided on it (None: off)


def carved_out_of_dp(setting: str, groups: str, article: str, note: str = "") -> Rule:
    """The rule of an axis whose groups are carved out of the data-parallel group (ep, cp; core/mesh.py):
    its degree divides dp. ``groups`` names them in the message, ``note`` adds to it."""
    flag = SETTINGS[setting][0]
    return Rule((setting, "dp"), lambda v: v[setting] > 1 and v["dp"] % v[setting] != 0,
                lambda say, v: f"{say(setting)} does not divide {say('dp')}: {groups} are carved out of the "
                               f"data-parallel group{note}",
                f"pin {article} {flag} that divides --dp, or leave {flag} out")


def pin_voice(values: Mapping[str, Any]) -> Say:
    """Settings in the CLI's words: ``--tp 1``, ``--sequence-parallel``, ``--inference``."""
    def say(name: str, value: Any = None) -> str:
        value = values[name] if value is None else value
        flag = SETTINGS[name][0]
        if isinstance(value, (set, frozenset)):
            value = "/".join(sorted(value))
        if value is True:
            return flag
        if value is False:
            return f"--no-{flag[2:]}"
        return f"{flag} {value}"
    return say


def plan_voice(values: Mapping[str, Any], stages: Sequence[Any] = ()) -> Say:
    """Settings in the plan file's words: ``mesh.tp = 1``, ``training.sequence_parallel = true``,
    ``stages[0, 1].recompute = 'full'``."""
    def say(name: str, value: Any = None) -> str:
        value = values[name] if value is None else value
        field = SETTINGS[name][1]
        if name == "recompute":
            modes = sorted(value) if isinstance(value, (set, frozenset)) else [value]
            at = [str(s.index) for s in stages if s.recompute in modes]
            return f"stages[{', '.join(at)}].recompute = {' / '.join(repr(m) for m in modes)}"
        if isinstance(value, bool):
            return f"{field} = {'true' if value else 'false'}"
        return f"{field} = {value!r}" if isinstance(value, str) else f"{field} = {value}"
    return say


def broken_rules(rules: Sequence[Rule], values: Mapping[str, Any], say: Say) -> list[tuple[str, str]]:
    """(message, hint) of each rule that ``values`` break, among those whose readings are all known."""
    return [(r.message(say, values), r.hint) for r in rules if r.known(values) and r.broken(values)]
