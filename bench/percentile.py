"""One percentile for every benchmark: the nearest rank (the smallest sample with at least
q of all samples at or below it), as the tables' p50/p99 columns are read. The benches had
two definitions, one a rank high at multiples of 100 samples (the maximum at n = 100)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def nearest_rank(ordered: Sequence[float], q: float) -> float:
    """The q-quantile (0 < q <= 1) of `ordered`, which must be sorted and non-empty."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]
