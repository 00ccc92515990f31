"""Two shares of tokens compared: the 95% interval of one share (Wilson's score interval) and of the difference of
two independent shares (Newcombe's hybrid score interval). A share moved detectably only where the difference's
interval excludes zero, the one rule every interval of the project follows. Pure functions of counts."""

from __future__ import annotations

import math

Z975 = 1.959964
"""the standard normal's 0.975 quantile: a two-sided 95% interval."""


def wilson_interval(k: int, n: int) -> tuple[float, float]:
    """Wilson's (1927) 95% score interval for a share of k in n: unlike p̂ ± 1.96·√(p̂(1 − p̂)/n) it stays inside
    [0, 1] and keeps a width at k = 0 (a step with no token outside still has an upper bound). (nan, nan) for n = 0."""
    if n <= 0:
        return math.nan, math.nan
    p, z2 = k / n, Z975 * Z975
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z975 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def difference_interval(k1: int, n1: int, k2: int, n2: int) -> tuple[float, float, float]:
    """(k2/n2 − k1/n1, low, high): the difference of two independent shares with Newcombe's (1998, Statistics in
    Medicine 17: 873, method 10) hybrid score interval, built from each share's Wilson interval: it keeps its 95%
    coverage with a few dozen tokens in a count, where the plain Wald interval does not."""
    p1, p2 = k1 / n1, k2 / n2
    l1, u1 = wilson_interval(k1, n1)
    l2, u2 = wilson_interval(k2, n2)
    d = p2 - p1
    return d, d - math.sqrt((p2 - l2) ** 2 + (u1 - p1) ** 2), d + math.sqrt((u2 - p2) ** 2 + (p1 - l1) ** 2)
