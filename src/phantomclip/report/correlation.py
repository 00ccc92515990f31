"""Which way a cloud of points goes: Pearson's r with the least-squares slope, and Spearman's rank correlation, which
a few far points cannot decide alone. Pure functions over lists of floats; the article's sentences (prose.py) and the
notes drawn on its figures read them."""

from __future__ import annotations

import math


def pearson_and_slope(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Pearson's r and the least-squares slope of y on x; None with fewer than 3 points or no spread."""
    n = len(xs)
    if n < 3:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    if sxx <= 0 or syy <= 0:
        return None
    return sxy / math.sqrt(sxx * syy), sxy / sxx


def ranks(xs: list[float]) -> list[float]:
    """1-based ranks of xs, ties given the mean of the ranks they share."""
    order = sorted(range(len(xs)), key=xs.__getitem__)
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in order[i : j + 1]:
            out[k] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's ρ: Pearson's r of the ranks (ties averaged). A few far points move it no more than any other
    points, where they can set Pearson's r alone (the demo's r = +0.79 over 1060 points fell to +0.16 without the 20
    farthest). None with fewer than 3 points or no spread."""
    fit = pearson_and_slope(ranks(xs), ranks(ys))
    return None if fit is None else fit[0]


from ..maths.proportions import Z975  # noqa: E402  (the one 0.975 normal quantile: a two-sided 95% interval)


def spearman_interval(rho: float, n: int) -> tuple[float, float] | None:
    """A 95% interval for Spearman's ρ over n points: Fisher's z = atanh(ρ) ± 1.96·√(1.06 / (n − 3)), back through
    tanh. The 1.06 is Fieller, Hartley and Pearson's (1957, Biometrika 44: 470) variance of z for a rank correlation,
    a little wider than Pearson's 1 / (n − 3). None with fewer than 4 points (no variance) or |ρ| = 1 (z infinite)."""
    if n < 4 or abs(rho) >= 1:
        return None
    z, half = math.atanh(rho), Z975 * math.sqrt(1.06 / (n - 3))
    return math.tanh(z - half), math.tanh(z + half)


def sign_test_two_sided(ups: int, downs: int) -> float:
    """The exact two-sided sign test: under no preferred direction each of the ups + downs units goes either way with
    probability 1/2; p = 2·P(X ≥ max(ups, downs)) for X ~ Binomial(ups + downs, 1/2), at most 1 (1 with no unit)."""
    n, k = ups + downs, max(ups, downs)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k, n + 1)) / 2**n)


def cohen_size(r: float) -> str:
    """Cohen's (1988) words for the size of a correlation: |r| below 0.1 'negligible', from 0.1 'small', from 0.3
    'medium', from 0.5 'large'. A reading aid beside the number, never a test: the interval says whether there is a
    direction at all."""
    a = abs(r)
    return "negligible" if a < 0.1 else "small" if a < 0.3 else "medium" if a < 0.5 else "large"
