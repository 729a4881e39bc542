"""partita: plan and run parallel training of a PyTorch model.

The public names live in the subpackages; this module re-exports the few a
user needs: ``partita.parallelize`` (the decorator), ``partita.Options`` (its
keywords as one object), ``partita.Plan`` and ``partita.load_plan``. They are
imported when first used, so that the CLI's plan readers (`partita show`,
`diff`, `--help`) start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
_PUBLIC = {"parallelize": "partita.compiler.api", "Options": "partita.core.options", "Plan": "partita.core.plans.plan",
           "load_plan": "partita.core.plans.verify"}
__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'partita' has no attribute {name!r}")
