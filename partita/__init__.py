"""partita: plan and run parallel training of a PyTorch model.

The public names live in the subpackages; this module re-exports the few a
user needs: ``partita.parallelize`` (the decorator), ``partita.Plan`` and
``partita.load_plan``.
"""

__version__ = "0.1.0"

from partita.compiler.api import parallelize  # noqa: E402
from partita.core.plan import Plan  # noqa: E402
from partita.core.verify import load_plan  # noqa: E402

__all__ = ["parallelize", "Plan", "load_plan", "__version__"]
