"""Resolve ``FILE.py:NAME`` to something that builds a model.

NAME may be an ``nn.Module`` class (built with no arguments), a zero-argument
factory function, or a name decorated with ``@partita.parallelize`` (whose
arguments then supply inputs and cluster).
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from partita.core.errors import ModelLoadError
from partita.core.files import check_regular_file


@dataclass(frozen=True)
class ModelTarget:
    name: str
    factory: Callable[[], torch.nn.Module]
    options: object | None  # the decorator's Options when NAME was decorated


def load_function(text: str) -> Callable:
    """``FILE.py:NAME`` as the function it names (a loss, say)."""
    mod, name, path = _import(text)
    obj = getattr(mod, name)
    if not callable(obj):
        raise ModelLoadError(f"{text} is a {type(obj).__name__}, not a function",
                             hint="point FILE.py:NAME at a function")
    return obj


def load_target(text: str) -> ModelTarget:
    from partita.compiler.api import Parallelized

    mod, name, path = _import(text)
    obj = getattr(mod, name)
    if isinstance(obj, Parallelized):
        return ModelTarget(name, _checked_factory(obj.target, text), obj.options)
    if not _buildable(obj):
        raise ModelLoadError(f"{text} is a {type(obj).__name__}, not a model class or factory",
                             hint="point FILE.py:NAME at an nn.Module class or a function returning a module")
    return ModelTarget(name, _checked_factory(obj, text), None)


def _import(text: str) -> tuple[object, str, Path]:
    """The module of ``FILE.py:NAME``, imported, and NAME (which it has)."""
    path_text, sep, name = text.rpartition(":")
    if not sep or not path_text or not name:
        raise ModelLoadError(f"{text!r} is not FILE.py:NAME", hint="e.g. examples/models.py:gpt_tiny")
    path = check_regular_file(path_text, what="model file", error=ModelLoadError,
                              hint="pass FILE.py:NAME with the path of an existing Python file")
    module_name = f"_partita_user_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ModelLoadError(f"cannot import {path}: not a Python file",
                             hint="pass FILE.py:NAME, a .py file defining NAME")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = mod
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # the user's file failed to import: say where
        raise ModelLoadError(f"importing {path} failed: {type(e).__name__}: {e}",
                             hint="fix the error in the model file (the chained error shows where)") from e
    except SystemExit as e:  # a script's top level ran (sys.exit, argparse's exit): it would end partita too
        raise ModelLoadError(f"importing {path} called sys.exit({e.code!r}): its top level runs a script",
                             hint="put the script's code under `if __name__ == \"__main__\":`, so that importing "
                             "the file only defines the model") from None
    finally:
        sys.path.pop(0)
    if not hasattr(mod, name):
        public = sorted(n for n, v in vars(mod).items() if not n.startswith("_") and _buildable(v))
        raise ModelLoadError(f"{path} has no {name!r}",
                             hint=f"models and factories there: {', '.join(public) or 'none'}")
    return mod, name, path


def _buildable(obj: object) -> bool:
    if inspect.isclass(obj):
        return issubclass(obj, torch.nn.Module)
    return inspect.isfunction(obj) or isinstance(obj, torch.nn.Module)


def _checked_factory(obj: Callable[..., torch.nn.Module], text: str) -> Callable[[], torch.nn.Module]:
    if isinstance(obj, torch.nn.Module):
        return lambda: obj
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return obj
    required = [p.name for p in sig.parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if required:
        raise ModelLoadError(
            f"{text} needs arguments ({', '.join(required)}) to build",
            hint="point at a zero-argument factory function that builds the model",
        )
    return obj
