"""95% intervals of the sweeps' numbers: Wilson's for a proportion, Student's t for a mean.

A cell of a sweep holds few examples (8-32), so a mean's interval uses Student's t with n - 1 degrees of
freedom, not the normal 1.96: at n = 8 the t interval is 21% wider (t = 2.365), at n = 16 9% (2.131), at n = 32
4% (2.040). The mean of several cells' means (a press's mean over a sweep's cells, `ranking.py`) pools their
standard errors with t at the Welch-Satterthwaite degrees of freedom (`pooled_half_width`). A proportion (every
score 0 or 1) uses Wilson's interval, right at 0 and 1 and at few examples, where the normal one collapses to a
point.
"""

from __future__ import annotations

import functools
import math
import statistics

LEVEL = 0.95  # two-sided
Z = 1.96  # the normal quantile of LEVEL, as written (Wilson's interval)


@functools.cache
def t_quantile(df: int, level: float = LEVEL) -> float:
    """The t with P(|T| <= t) = `level` for Student's t with `df` (>= 1, whole) degrees of freedom: its
    distribution function is a finite sum for whole df (Abramowitz and Stegun 26.7.3-4), inverted by bisection."""
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"df must be a whole number >= 1, got {df!r}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    low, high = 0.0, 1.0
    while _central(high, df) < level:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        if _central(mid, df) < level:
            low = mid
        else:
            high = mid
        if high - low < 1e-12 * high:
            break
    return (low + high) / 2


def _central(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with `df` degrees of freedom."""
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:  # odd: 2/pi (theta + sin cos (1 + 2/3 cos^2 + 2.4/(3.5) cos^4 + ...))
        term = total = 1.0
        for k in range(2, df - 1, 2):
            term *= k / (k + 1) * c2
            total += term
        return 2 / math.pi * (theta + (s * math.cos(theta) * total if df > 1 else 0.0))
    term = total = 1.0  # even: sin (1 + 1/2 cos^2 + 1.3/(2.4) cos^4 + ...)
    for k in range(1, df - 2, 2):
        term *= k / (k + 1) * c2
        total += term
    return s * total


def mean_half_width(values: list[float]) -> float:
    """Half the 95% interval of the mean of `values`: t(n - 1) sd / sqrt(n) (nan for fewer than 2)."""
    n = len(values)
    return t_quantile(n - 1) * statistics.stdev(values) / math.sqrt(n) if n > 1 else math.nan


def pooled_half_width(parts: list[tuple[float, int]]) -> float:
    """Half the 95% interval of the mean of k independent means, each given as (half its own t interval, its
    examples n): their standard errors se_i = half_i / t(n_i - 1) give se = sqrt(sum se_i^2) / k, and t is taken
    at the Welch-Satterthwaite degrees of freedom (sum se_i^2)^2 / sum(se_i^4 / (n_i - 1)), rounded down (nan when
    a mean has fewer than 2 examples; 0 when no mean varies)."""
    if not parts or any(n < 2 or math.isnan(half) for half, n in parts):
        return math.nan
    variances = [(half / t_quantile(n - 1)) ** 2 for half, n in parts]
    total = sum(variances)
    if total == 0:
        return 0.0
    df = total**2 / sum(v**2 / (n - 1) for v, (_, n) in zip(variances, parts, strict=True))
    return t_quantile(max(1, math.floor(df))) * math.sqrt(total) / len(parts)


def wilson(successes: float, n: int, z: float = Z) -> tuple[float, float]:
    """Wilson's 95% interval for `successes` of `n` trials."""
    p, zz = successes / n, z * z / n
    centre, half = (p + zz / 2) / (1 + zz), z * math.sqrt(p * (1 - p) / n + zz / (4 * n)) / (1 + zz)
    return max(0.0, centre - half), min(1.0, centre + half)
