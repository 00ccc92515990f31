"""phantomclip inside TRL's AsyncGRPOTrainer: the α/β monitor and the ratio fix (monitor), the versions each token was
sampled at and the copies kept for them (versions), TRL's packed forward replayed on a copy (forward), the fix's
ratios (ratio), the figures over every rank (stats), what TRL must offer, checked at attach (checks), and the
stand-ins that run the trainer on a CPU without a vLLM server (cpu). Part of integrations (its imports are the
package's).

The user's three names are this package's own:

    from phantomclip.integrations.trl_async import AsyncPrecisionMonitor, with_async_shadow_ratio
"""

from .monitor import DEFAULT_RATIO, AsyncPrecisionMonitor, with_async_shadow_ratio

__all__ = ["DEFAULT_RATIO", "AsyncPrecisionMonitor", "with_async_shadow_ratio"]

from ... import moved_names

__getattr__ = moved_names(__name__)
