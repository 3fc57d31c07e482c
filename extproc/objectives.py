"""A request's latency objectives and priority (`Objectives`), what the request, admission and the policies share.

How they are read from headers and configuration, and what admission does with them: ``extproc/admission.py``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Objectives:
    """A request's latency objectives and priority.

    Attributes:
        ttft_s: TTFT objective, seconds (> 0); None = none.
        tpot_s: TPOT objective, seconds per output token after the first (> 0); None = none.
        priority: the Inference Extension's priority; negative = sheddable, 0 = the default.
    """

    ttft_s: float | None = None
    tpot_s: float | None = None
    priority: int = 0

    @property
    def sheddable(self) -> bool:
        return self.priority < 0


NO_OBJECTIVES = Objectives()
"""A request with no objective and priority 0: never refused, chosen as before."""
