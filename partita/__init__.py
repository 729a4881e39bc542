"""partita: plan and run parallel training of a PyTorch model.

The public names live in the subpackages; this module re-exports the few a
user needs: ``partita.parallelize`` (the decorator), ``partita.Options`` (its
keywords as one object), ``partita.Plan`` and ``partita.load_plan``.
"""

from partita.compiler.api import parallelize
from partita.core.options import Options
from partita.core.plan import Plan
from partita.core.verify import load_plan

__version__ = "0.1.0"
__all__ = ["parallelize", "Options", "Plan", "load_plan", "__version__"]
