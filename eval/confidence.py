"""95% intervals of the sweeps' numbers: Wilson's for a proportion, Student's t for a mean.

A cell of a sweep holds few examples (8-32), so a mean's interval uses Student's t with n - 1 degrees of
freedom, not the normal 1.96: at n = 8 the t interval is 21% wider (t = 2.365), at n = 16 9% (2.131), at n = 32
4% (2.040). The mean of several cells' means (a press's mean over a sweep's cells, `ranking.py`) pools their
standard errors, with the covariance of cells that share examples (one task's ratios), and takes t at the
Welch-Satterthwaite degrees of freedom (`pooled_half_width`). A proportion (every score 0 or 1) uses Wilson's
interval, right at 0 and 1 and at few examples, where the normal one collapses to a point. So does Student's t when
every value of a sample is the same (its standard deviation is 0: "-1.000 [-1.000, -1.000]" of 2 examples): such a
sample bounds only how often another value occurs, at most Wilson's upper bound of 0 in n, and the values lie in a
known range (`no_spread_interval`; for 0/1 values it is Wilson's).
"""

from __future__ import annotations

import functools
import math
import statistics

LEVEL = 0.95  # two-sided
SAME = 1e-12  # values this close (relative to 1 or their size) are the same value, apart in rounding only
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
    """Half the 95% interval of the mean of `values`: t(n - 1) sd / sqrt(n) (nan for fewer than 2, or where a value
    is not finite; 0 where every value is the same: see `no_spread_interval`)."""
    n = len(values)
    if n < 2 or not all(math.isfinite(v) for v in values):
        return math.nan
    if max(values) - min(values) <= SAME * max(1.0, *map(abs, values)):  # (0.1 - 0.3 and 0.2 - 0.4 differ by 3e-17)
        return 0.0
    return t_quantile(n - 1) * statistics.stdev(values) / math.sqrt(n)


def no_spread_interval(value: float, n: int, low: float, high: float) -> tuple[float, float]:
    """The 95% interval of the mean of `n` values that all came out as `value`, each known to lie in [low, high]:
    another value occurs in at most a fraction u of the population (Wilson's upper bound for 0 of n), and lies at
    worst at an end of the range: [value - u (value - low), value + u (high - value)]. For 0/1 values that is
    Wilson's interval of 0 or n successes."""
    if not low - SAME <= value <= high + SAME:
        raise ValueError(f"value {value} lies outside its range [{low}, {high}]")
    value = min(max(value, low), high)  # (a mean of equal values may land an ulp past an end)
    u = wilson(0, n)[1]
    return value - u * (value - low), value + u * (high - value)


def pooled_half_width(groups: list[list[dict]]) -> float:
    """Half the 95% interval of the mean of k means, each the mean of one mapping's values (example -> value),
    given in groups: the means of a group may share examples (a press's cells of one task at several ratios, whose
    differences move together) and groups are independent (tasks: disjoint examples). A group's variance is that
    of its sum of means, sum_ij cov_ij n_ij / (n_i n_j) over its means i, j (cov_ij over the n_ij examples both
    hold; i = j: the variance over n_i), the mean's is their total over k^2, and t is taken at the
    Welch-Satterthwaite degrees of freedom over groups, each with its fewest examples less one, rounded down (nan
    when a mean has fewer than 2 examples or a value is nan; 0 when nothing varies). Two means sharing fewer than 2
    examples add no covariance. Groups of one mean each: independent means."""
    groups = [group for group in groups if group]
    means = [m for group in groups for m in group]
    if not means or any(len(m) < 2 for m in means):
        return math.nan
    variances, dfs = [], []
    for group in groups:
        total = 0.0
        for i, a in enumerate(group):
            for j in range(i, len(group)):  # each pair once, the cross terms twice
                b = group[j]
                common = [e for e in a if e in b]
                if len(common) > 1:
                    mean_a, mean_b = statistics.fmean(a[e] for e in common), statistics.fmean(b[e] for e in common)
                    cov = sum((a[e] - mean_a) * (b[e] - mean_b) for e in common) / (len(common) - 1)
                    total += (1 if i == j else 2) * cov * len(common) / (len(a) * len(b))
        variances.append(max(total, 0.0))  # (covariances over partly shared examples: never below 0)
        dfs.append(min(len(m) for m in group) - 1)
    total = sum(variances)
    if math.isnan(total):
        return math.nan
    if total <= SAME**2:  # nothing varies but rounding
        return 0.0
    df = total**2 / sum(v**2 / d for v, d in zip(variances, dfs, strict=True))
    return t_quantile(max(1, math.floor(df + 1e-9))) * math.sqrt(total) / len(means)  # (7 - 1e-15 is 7 df)


def wilson(successes: float, n: int, z: float = Z) -> tuple[float, float]:
    """Wilson's 95% interval for `successes` of `n` trials."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"Wilson's interval needs n >= 1 trials, got {n!r}")
    if not 0 <= successes <= n:
        raise ValueError(f"Wilson's interval needs 0 <= successes <= n = {n}, got {successes!r}")
    p, zz = successes / n, z * z / n
    centre, half = (p + zz / 2) / (1 + zz), z * math.sqrt(p * (1 - p) / n + zz / (4 * n)) / (1 + zz)
    # exactly 0 for none and 1 for all (floating point left 0 of 11 at 2.8e-17, 16 of 16 just over 1)
    return 0.0 if successes == 0 else max(0.0, centre - half), 1.0 if successes == n else min(1.0, centre + half)
