"""The user's choices, from the decorator and the CLI down to the runtime: one object, validated once.

``Options`` is flat, so ``@partita.parallelize(tp=2, zero=1)``, ``partita compile --tp 2 --zero 1``
and ``Options(tp=2, zero=1)`` read alike. Each field's metadata (``option``) says which part of
the work reads it (``PLAN``: what to plan for; ``PIN``: a decision fixed for the solvers; ``RUN``:
how the runtime runs), its CLI flag and help, the commands that offer the flag, its choices (taken
from the constants that own them) and, for run options, the environment variable through which
`partita run` hands it to the ranks. A new option is a field here and its use; the rest follows
(docs/architecture.md, "The one options object").

``Pins`` and ``TrainingRequest`` (core/pins.py) are the solvers' named inputs, made from an ``Options``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from partita.core.axes.context import CP_ATTENTION
from partita.core.errors import MAX_COUNT, PartitaError, too_large
from partita.core.files import check_output, writable_folder, writable_path
from partita.core.optimizers import NO_OFFLOAD, OFFLOAD, default_optimizer, optimizer_kind
from partita.core.pins import Pins, TrainingRequest, check_positive, is_whole
from partita.core.plans.plan import OPTIMIZERS
from partita.core.precision import PRECISIONS, REDUCE_DTYPES
from partita.core.recompute import NONE, RECOMPUTE, recompute_mode
from partita.core.schedule import SCHEDULES

PLAN, PIN, RUN = "plan", "pin", "run"
ALIASES = {"microbatches": "grad_accum_steps"}  # another name users know a keyword by
NONFINITE = ("stop", "skip")  # what a step whose loss is not finite does (runtime/engine.py)
# the options a forward-only plan has no use for: given with inference=True they are refused, not dropped
TRAINING_ONLY = ("targets", "loss", "optimizer", "max_grad_norm", "scheduler")
MAX_SEED = 2**64 - 1  # torch.manual_seed's largest
NEEDS_CHECKPOINT_DIR = ("checkpoint_every", "keep_last")  # run options of no use without checkpoint_dir


def option(default: Any, part: str, help: str, *, flag: str | None = "", commands: tuple[str, ...] = ("compile",),
           env: str | None = None, choices: tuple | None = None, kind: type | None = None,
           multiple: bool = False, metavar: str | None = None, path: bool = False) -> Any:
    """A field of ``Options`` with what the CLI and the environment need to offer it. ``flag``
    "" derives ``--name-with-dashes``; None offers no flag (a keyword of the API only)."""
    meta = dict(part=part, help=help, flag=flag, commands=commands, env=env, choices=choices, kind=kind,
                multiple=multiple, metavar=metavar, path=path)
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable default")
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Options:
    """Every choice a user makes about planning and running a model (see the module docstring)."""

    # -- what to plan for ----------------------------------------------------------------------
    inputs: Any = option((), PLAN, "an example input, e.g. idx=int64[16,64]; repeat for several",
                         flag="--input", commands=("compile", "estimate"), multiple=True,
                         metavar="NAME=DTYPE[SHAPE]")
    targets: Any = option(None, PLAN, "the loss's targets, when the output does not imply them",
                          flag="--target", metavar="NAME=DTYPE[SHAPE]")
    cluster: Any = option("local", PLAN, "preset (dgx-a100, dgx-h100, h200, ethernet-10g, local) or a .toml "
                          "cluster file [default: local]", commands=("compile", "estimate"))
    nodes: int | None = option(None, PLAN, "scale the cluster to N nodes", commands=("compile", "estimate"), kind=int)
    devices: int | None = option(None, PLAN, "devices per node (e.g. local processes)",
                                 commands=("compile", "estimate"), kind=int)
    batch: int | None = option(None, PLAN, "global batch (default: the first input's leading dim)",
                               commands=("compile", "estimate"), kind=int)
    precision: str | None = option(None, PLAN, "default: bf16-mixed on GPUs, fp32 on CPU",
                                   commands=("compile", "estimate"), choices=PRECISIONS)
    reduce_dtype: str = option("fp32", PLAN, "the dtype gradients are reduced in over data parallelism "
                               "[default: fp32]", choices=REDUCE_DTYPES)
    max_grad_norm: float | None = option(None, PLAN, "clip the global gradient norm to NORM every step "
                                         "(default: no clipping)", kind=float, metavar="NORM")
    optimizer: Any = option(None, PLAN, "the optimizer whose state is planned [default: adamw]; the "
                            "decorator also takes a factory of parameters", commands=("compile", "estimate"),
                            choices=tuple(o for o in OPTIMIZERS if o != "none"))
    loss: Any = option(None, PLAN, "the loss: cross-entropy (default), mse, `model` (the model's own, given "
                       "labels=) or a function", metavar="NAME|model|FILE.py:FN")
    output: Any = option(None, PLAN, "the field (or tuple index) of the model's output the loss attaches to "
                         "(default: logits)", flag="--output-field", metavar="NAME")
    inference: bool = option(False, PLAN, "a forward-only plan: no gradients, no optimizer state",
                             commands=("compile", "estimate"), kind=bool)
    generate: int = option(0, PLAN, "with --inference: N new tokens per sequence, whose KV cache (prompt + N) "
                           "each stage holds", commands=("compile", "estimate"), kind=int, metavar="N")
    plan: str | None = option(None, PLAN, "a plan file to run, not planning", flag=None, env="PARTITA_PLAN", path=True)

    # -- decisions pinned (the solvers decide what is left None) ---------------------------------
    dp: int | None = option(None, PIN, "pin the data-parallel degree", commands=("compile", "estimate"), kind=int)
    tp: int | None = option(None, PIN, "pin the tensor-parallel degree (inside a node)", kind=int)
    pp: int | None = option(None, PIN, "pin the number of pipeline stages", kind=int)
    zero: int | None = option(None, PIN, "pin the ZeRO stage (0-3) of every data-parallel group", kind=int)
    micro_batch_size: int | None = option(None, PIN, "pin the micro-batch size", kind=int)
    grad_accum_steps: int | None = option(None, PIN, "pin the micro-batches per step (also --microbatches)",
                                          kind=int)
    schedule: str | None = option(None, PIN, "pin the pipeline schedule (the plan then has pipeline stages)",
                                  choices=SCHEDULES)
    recompute: str | None = option(None, PIN, "activation recomputation on every stage: selective (each layer's "
                                   "attention core), full (whole layers) or none [default: per stage, where memory "
                                   "binds]", choices=RECOMPUTE)
    sequence_parallel: bool | None = option(None, PIN, "split the residual stream (norms, dropouts, residual adds) "
                                            "along the sequence over the TP group [default: weighed by the "
                                            "pipeline search where memory binds; off, nothing is split along the "
                                            "sequence]", kind=bool)
    offload: str | None = option(None, PIN, "keep the optimizer's state and the masters it updates in host memory, "
                                 "stepped by the host CPU (ZeRO-Offload) [default: where nothing else fits]",
                                 choices=OFFLOAD)
    ep: int | None = option(None, PIN, "split each MoE layer's experts over groups of EP data-parallel ranks, its "
                            "tokens sent to them by all-to-all (expert parallelism; tp=1) [default: the planner's]",
                            kind=int)
    cp: int | None = option(None, PIN, "split every sequence over CP data-parallel ranks, each attention core "
                            "meeting the rest of its sequence by ring or all-to-all (context parallelism) "
                            "[default: the planner's, where the sequence binds memory]", kind=int)
    cp_attention: str | None = option(None, PIN, "how attention meets the rest of its sequence at --cp > 1: ring "
                                      "(keys and values passed around) or all-to-all (sequence slices swapped "
                                      "for heads) [default: the planner's]", choices=CP_ATTENTION)
    expert_load: str | None = option(None, PIN, "how unevenly the routers load the expert ranks: the slowest rank of "
                                     "an expert group's rows over the mean (a number >= 1, at most ep), or a router "
                                     "profile from `partita calibrate --router` [default: balanced]",
                                     metavar="LOAD|FILE")
    world_size: int | None = option(None, PIN, "the processes the plan runs on (torchrun's)", flag=None)

    # -- how the runtime runs --------------------------------------------------------------------
    weights: str | None = option(None, RUN, "pretrained weights (torch.save or .safetensors)", flag=None)
    watchdog_s: float | None = option(None, RUN, "end the job when a step waits this long in a collective, every "
                                      "rank saying what it waits in (default 300; 0: off)", flag="--watchdog",
                                      commands=("run",), env="PARTITA_WATCHDOG_S", kind=float, metavar="SECONDS")
    checkpoint_dir: str | None = option(None, RUN, "save sharded checkpoints here, and resume from the newest "
                                        "complete one", commands=("run",), env="PARTITA_CHECKPOINT_DIR", path=True)
    checkpoint_every: int | None = option(None, RUN, "save a checkpoint every N steps (with --checkpoint-dir)",
                                          commands=("run",), env="PARTITA_CHECKPOINT_EVERY", kind=int, metavar="N")
    keep_last: int | None = option(None, RUN, "keep the newest N complete checkpoints under --checkpoint-dir, "
                                   "deleting older ones (0: keep every one) [default: 3]", commands=("run",),
                                   env="PARTITA_KEEP_LAST", kind=int, metavar="N")
    async_checkpoints: bool | None = option(None, RUN, "write periodic checkpoints in the background (a CPU copy "
                                            "taken at the step; --no-async-checkpoints: the step waits for the "
                                            "write) [default: on]", commands=("run",),
                                            env="PARTITA_ASYNC_CHECKPOINTS", kind=bool)
    check_replicas_every: int | None = option(None, RUN, "compare replicated parameters across ranks every N "
                                              "steps (0: never)", flag=None, env="PARTITA_CHECK_REPLICAS_EVERY",
                                              kind=int)
    trace: str | None = option(None, RUN, "write a Chrome/Perfetto trace of every micro-batch's forward and "
                               "backward per rank", commands=("run",), env="PARTITA_TRACE", path=True)
    log_every: int | None = option(None, RUN, "rank 0 prints a progress line every N steps (0: silent; "
                                   "default 10)", flag=None, env="PARTITA_LOG_EVERY", kind=int)
    batch_check_every: int | None = option(None, RUN, "every N steps the ranks check they were given the same "
                                           "global batch (default 100)", flag=None,
                                           env="PARTITA_BATCH_CHECK_EVERY", kind=int)
    bucket_bytes: int | None = option(None, RUN, "gradient bucket size instead of the plan's", flag=None, kind=int)
    compile: bool | None = option(None, RUN, "run each rank's program through torch.compile (inductor), whole "
                                  "where it can be; a graph break is reported in one line", commands=("run",),
                                  env="PARTITA_COMPILE", kind=bool)
    seed: int | None = option(None, RUN, "the seed every rank's random ops draw from (default: rank 0's "
                              "torch.initial_seed())", commands=("run",), env="PARTITA_SEED", kind=int, metavar="S")
    nonfinite: str | None = option(None, RUN, "a step whose loss is NaN or infinite: stop (end the run, the parameters "
                                   "as before it) or skip (no update; one line says so) [default: stop]",
                                   commands=("run",), env="PARTITA_NONFINITE", choices=NONFINITE)
    scheduler: Any = option(None, RUN, "optimizer -> LR scheduler, stepped after each optimizer step", flag=None)
    log_dir: str | None = option(None, RUN, "rank 0 writes each step's metrics here as TensorBoard event files "
                                 "(needs tensorboard)", commands=("run",), env="PARTITA_LOG_DIR", path=True)
    wandb_project: str | None = option(None, RUN, "rank 0 logs each step's metrics to this wandb project (needs "
                                       "wandb)", commands=("run",), env="PARTITA_WANDB_PROJECT", metavar="PROJECT")

    def __post_init__(self) -> None:
        _set = object.__setattr__
        for f in dataclasses.fields(self):  # a switch is True or False (None: the default), not 'yes' or 1
            v = getattr(self, f.name)
            if f.metadata["kind"] is bool and v is not None and not isinstance(v, bool):
                raise PartitaError(f"{f.name}={_shown(v)} must be True or False",
                                   hint=f"pass {f.name}=True or {f.name}=False, or leave it out")
        _set(self, "inputs", _input_specs(self.inputs))
        _set(self, "recompute", recompute_mode(self.recompute))
        from partita.core.cluster import ClusterSpec

        if not isinstance(self.cluster, (str, os.PathLike, ClusterSpec)):
            raise PartitaError(f"cluster={_shown(self.cluster)} is a {type(self.cluster).__name__}: cluster= takes a "
                               "preset's name, the path of a .toml cluster file or a ClusterSpec",
                               hint="e.g. cluster='dgx-a100' or cluster='local.toml' (`partita calibrate` writes one)")
        if self.inference:
            self._check_forward_only()
        if isinstance(self.targets, str):
            from partita.core.model.inputs import parse_input_spec

            _set(self, "targets", parse_input_spec(self.targets if "=" in self.targets else f"targets={self.targets}"))
        _check_type("targets", self.targets, "an input spec such as 'float32[8,10]' or 'y=int64[8]'", _spec_type())
        _check_type("output", self.output, "a field name or a tuple index", str, int)
        if self.optimizer is not None and not callable(self.optimizer) and self.optimizer not in OPTIMIZERS:
            raise PartitaError(f"--optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}",
                               hint="partita models the memory of these optimizers only; the decorator also "
                               "takes a factory of parameters")
        from partita.core.model.losses import resolve_loss

        _set(self, "loss", resolve_loss(self.loss, self.output))
        for name in ("nodes", "devices"):
            check_positive(name, getattr(self, name))
        self.pins()  # the pins' checks (Pins)
        TrainingRequest(global_batch=self.batch if self.batch is not None else 1, precision=self.precision or "fp32",
                        reduce_dtype=self.reduce_dtype, max_grad_norm=self.max_grad_norm,
                        inference=self.inference, kv_tokens=self.generate)
        if not isinstance(self.generate, int) or isinstance(self.generate, bool) or self.generate < 0:
            raise PartitaError(f"--generate {self.generate!r} must be a whole number of tokens >= 0",
                               hint="e.g. --generate 128, or leave it out")
        if self.generate > MAX_COUNT:
            raise too_large("--generate", self.generate)
        self._check_run()

    def _check_forward_only(self) -> None:
        """A forward-only plan has no loss, no optimizer and no backward: a training option given
        with it is refused rather than dropped."""
        from partita.core.model.losses import resolve_loss

        for name in TRAINING_ONLY:
            value = getattr(self, name)
            if value is not None and not (name == "loss" and resolve_loss(value) == resolve_loss(None)):
                raise PartitaError(f"{name}={_shown(value)} has no use in a forward-only plan "
                                   "(inference)", hint=f"leave {name} out, or plan for training (without inference)")
        if self.offload not in (None, NO_OFFLOAD):
            raise PartitaError("offload has no use in a forward-only plan (inference): there is no optimizer "
                               "state", hint="leave offload out, or plan for training")
        if self.recompute not in (None, NONE):
            raise PartitaError("recomputation has no use in a forward-only plan (inference): it reruns a layer's "
                               "forward for its backward", hint="leave recompute out, or plan for training")

    def _check_run(self) -> None:
        if self.checkpoint_every is not None and not is_whole(self.checkpoint_every, 1):
            raise PartitaError(f"checkpoint_every={self.checkpoint_every!r} must be a whole number of steps >= 1",
                               hint="e.g. checkpoint_every=100, or leave it out for no periodic checkpoint")
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise PartitaError("checkpoint_every needs checkpoint_dir: where should the checkpoints go?",
                               hint="pass checkpoint_dir='DIR' too (or `partita run --checkpoint-dir DIR`)")
        if self.keep_last is not None and self.checkpoint_dir is None:  # it would be ignored
            raise PartitaError("keep_last has no use without checkpoint_dir: it says how many of the checkpoints "
                               "written there are kept", hint="pass checkpoint_dir='DIR' and checkpoint_every=N "
                               "too (`partita run --checkpoint-dir DIR --checkpoint-every N`), or leave keep_last out")
        if self.watchdog_s is not None and not (isinstance(self.watchdog_s, (int, float))
                                                and not isinstance(self.watchdog_s, bool)
                                                and 0 <= self.watchdog_s < math.inf):
            raise PartitaError(f"watchdog_s={self.watchdog_s!r} must be a number of seconds >= 0 (0 turns it off)",
                               hint="e.g. watchdog_s=600, or leave it out for the default (300 s)")
        for name, low in (("check_replicas_every", 0), ("log_every", 0), ("batch_check_every", 1),
                          ("bucket_bytes", 1), ("seed", 0), ("keep_last", 0)):
            v = getattr(self, name)
            if v is not None and not is_whole(v, low):
                raise PartitaError(f"{name}={v!r} must be a whole number >= {low}",
                                   hint=f"e.g. {name}=10, or leave it out for the default")
        if self.seed is not None and self.seed > MAX_SEED:
            raise PartitaError(f"seed={self.seed} is more than a seed holds (at most 2^64 - 1)",
                               hint="pass a whole number from 0 to 2^64 - 1, or leave it out")
        for name in ("checkpoint_dir", "trace", "weights", "plan", "log_dir"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (str, os.PathLike)):
                raise PartitaError(f"{name}={v!r} must be a path", hint=f"pass {name}='PATH', or leave it out")
        if self.wandb_project is not None and not (isinstance(self.wandb_project, str) and self.wandb_project.strip()):
            raise PartitaError(f"wandb_project={_shown(self.wandb_project)} must name a project",
                               hint="pass the Weights & Biases project's name, or leave it out")
        if self.scheduler is not None and not callable(self.scheduler):
            raise PartitaError(f"scheduler={_shown(self.scheduler)} is not a factory of the optimizer",
                               hint="e.g. scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 100, 0.5)")
        if self.nonfinite is not None and self.nonfinite not in NONFINITE:
            raise PartitaError(f"nonfinite={self.nonfinite!r} is not one of {', '.join(NONFINITE)}",
                               hint="stop ends the run at a NaN or infinite loss, skip leaves that step out")
        read = [self.plan, self.weights]  # what the run reads: no output of it may replace one
        if self.trace is not None:
            writable_path(self.trace, inputs=read)  # before the run, not after its first step
        if self.checkpoint_dir is not None:
            check_output(self.checkpoint_dir, [r for r in read if r is not None])
        for name in ("checkpoint_dir", "log_dir"):  # folders the run writes into: sane, not files, writable
            if getattr(self, name) is not None:
                writable_folder(getattr(self, name), name)

    # -- building one ------------------------------------------------------------------------------

    @classmethod
    def of(cls, base: Options | None = None, **keywords: Any) -> Options:
        """``base`` (default: the defaults) with ``keywords`` set: the decorator's keywords, by
        their names or aliases (``microbatches``); an unknown keyword is refused by name."""
        if base is not None and not isinstance(base, Options):
            raise PartitaError(f"options={_shown(base)} is a {type(base).__name__}, not partita.Options",
                               hint="pass options=partita.Options(...), or the options as keywords")
        known = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in keywords.items():
            name = ALIASES.get(key, key)
            if key in ALIASES:
                check_positive(key, value)  # named as the user wrote it (the aliased options are counts)
            if name not in known:
                close = difflib.get_close_matches(key, sorted(known | set(ALIASES)), n=1)
                raise PartitaError(f"parallelize() has no option {key!r}",
                                   hint=f"did you mean {close[0]!r}?" if close else
                                   "see `help(partita.Options)` for every option")
            if name in values and values[name] != value:
                raise PartitaError(f"{key}={value!r} and {name}={values[name]!r} disagree",
                                   hint="they are the same decision; pass one")
            values[name] = value
        return dataclasses.replace(base, **values) if base is not None else cls(**values)

    def replace(self, **changes: Any) -> Options:
        """A copy with ``changes`` (re-validated)."""
        return dataclasses.replace(self, **changes)

    def with_environment(self, environ: Mapping[str, str] | None = None) -> Options:
        """The options left unset filled in from their environment variables (`partita run`
        passes its flags that way), each checked as its keyword is; a bad value is refused naming
        the variable."""
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is None:
                value = environment_option(f.name, environ)
                if value is not None:
                    changes[f.name] = value
        return self.replace(**changes) if changes else self

    # -- what the layers below read --------------------------------------------------------------

    def pins(self, world_size: int | None = None) -> Pins:
        """The pinned decisions, for the solvers."""
        return Pins(dp=self.dp, tp=self.tp, pp=self.pp, zero_stage=self.zero, micro_batch_size=self.micro_batch_size,
                    grad_accum_steps=self.grad_accum_steps, world_size=world_size or self.world_size,
                    schedule=self.schedule, recompute=self.recompute, offload=self.offload,
                    sequence_parallel=self.sequence_parallel, ep=self.ep, cp=self.cp,
                    cp_attention=self.cp_attention, expert_load=self.expert_load)

    def cluster_spec(self) -> Any:
        """The cluster to plan for: a preset or cluster file by name, scaled by ``nodes`` / ``devices``."""
        from partita.core.cluster import ClusterSpec, load_cluster

        if isinstance(self.cluster, ClusterSpec):
            spec = self.cluster
            if self.nodes is not None:
                spec = dataclasses.replace(spec, nodes=self.nodes)
            return spec.with_devices(self.devices) if self.devices is not None else spec
        return load_cluster(self.cluster, nodes=self.nodes, devices=self.devices)

    @property
    def optimizer_factory(self) -> Callable:
        """What builds the optimizer over the parameters a rank updates."""
        return self.optimizer if callable(self.optimizer) else functools.partial(default_optimizer,
                                                                                 kind=self.optimizer or "adamw")

    @property
    def optimizer_kind(self) -> str:
        """The cost model's name for the optimizer (a factory is probed on a one-element parameter)."""
        return optimizer_kind(self.optimizer) if callable(self.optimizer) else self.optimizer or "adamw"


def environment_option(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """Option ``name``'s value from its environment variable (``PARTITA_...``; None when unset or
    empty), parsed and checked as the keyword is: the one reader of partita's variables."""
    f = next(f for f in dataclasses.fields(Options) if f.name == name)
    env = f.metadata["env"]
    raw = (os.environ if environ is None else environ).get(env) if env else None
    if raw is None or raw == "":
        return None
    kind = f.metadata["kind"] or str
    try:
        value = _parse(kind, raw)
        # checked alone, as its keyword is; a rule over two options (keep_last needs checkpoint_dir) is
        # checked when with_environment sets them together
        Options(**{name: value, **({"checkpoint_dir": "."} if name in NEEDS_CHECKPOINT_DIR else {})})
    except ValueError:
        what = {int: "a whole number", float: "a number", bool: "1 or 0 (true or false)"}[kind]
        raise PartitaError(f"{env}={raw!r} is not {what}",
                           hint=f"set {env} to {what} (see `partita run --help`), or unset it") from None
    except PartitaError as e:
        raise PartitaError(f"{env}={raw!r}: {e.message}", hint=f"set {env} to a valid value, or unset it") from None
    return value


def option_fields(part: str | None = None, command: str | None = None) -> list[dataclasses.Field]:
    """The fields of ``Options`` of a ``part`` and offered as flags of ``command``, in order."""
    return [f for f in dataclasses.fields(Options)
            if (part is None or f.metadata["part"] == part)
            and (command is None or (f.metadata["flag"] is not None and command in f.metadata["commands"]))]


def flag_of(f: dataclasses.Field) -> str:
    """A field's CLI flag."""
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def _parse(kind: type, raw: str) -> Any:
    """An environment variable's text as ``kind``; ASCII only (full-width digits are no number)."""
    text = raw.strip()
    if kind is str:
        return text
    if not text.isascii():
        raise ValueError(raw)
    if kind is bool:
        words = {"1": True, "true": True, "yes": True, "on": True,
                 "0": False, "false": False, "no": False, "off": False}
        if text.lower() not in words:
            raise ValueError(raw)
        return words[text.lower()]
    return kind(text)


def _input_specs(inputs: Any) -> tuple:
    from partita.core.model.inputs import InputSpec, parse_input_spec

    if inputs is None:
        return ()
    if isinstance(inputs, Mapping):
        return tuple(parse_input_spec(f"{k}={v}") for k, v in inputs.items())
    if isinstance(inputs, (str, InputSpec)):
        inputs = [inputs]
    if not isinstance(inputs, (list, tuple)) or not all(isinstance(s, (str, InputSpec)) for s in inputs):
        raise PartitaError(f"inputs={_shown(inputs)} is not a set of example inputs",
                           hint="pass inputs={'x': 'float32[8,64]'} (a name and DTYPE[SHAPE] per argument of forward)")
    return tuple(s if isinstance(s, InputSpec) else parse_input_spec(s) for s in inputs)


def _spec_type() -> type:
    from partita.core.model.inputs import InputSpec

    return InputSpec


def _check_type(name: str, value: Any, what: str, *types: type) -> None:
    """``value`` is None or one of ``types`` (a bool is no int), else one message naming the keyword."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
        raise PartitaError(f"{name}={_shown(value)} is a {type(value).__name__}, not {what}",
                           hint=f"pass {name} as {what}, or leave it out")


def _shown(value: Any) -> str:
    """A keyword's value as a message shows it: a function by its name, a long value cut short."""
    text = (getattr(value, "__name__", None) if callable(value) else None) or repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
