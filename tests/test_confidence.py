"""95% intervals: Student's t quantiles and Wilson's interval (`kvpress.eval.confidence`)."""

from __future__ import annotations

import math

import pytest

from kvpress.eval.confidence import mean_half_width, t_quantile, wilson


def test_t_quantiles_are_the_tables():
    table = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 5: 2.5706, 7: 2.3646, 15: 2.1314, 31: 2.0395,
             100: 1.9840, 1000: 1.9623}  # fmt: skip
    for df, t in table.items():
        assert t_quantile(df) == pytest.approx(t, abs=1e-4), df
    assert t_quantile(4, 0.99) == pytest.approx(4.6041, abs=1e-4)
    assert t_quantile(10**5) == pytest.approx(1.96, abs=1e-3)  # the normal quantile in the limit


def test_t_quantile_refuses_what_it_cannot_compute():
    for df in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="df must be a whole number >= 1"):
            t_quantile(df)
    for level in (0, 1, 1.5):
        with pytest.raises(ValueError, match="level must be in"):
            t_quantile(3, level)


def test_a_mean_interval_widens_with_few_examples():
    values = [0.0, 1.0, 1.0, 0.5, 0.25, 0.75, 1.0, 0.0]  # n = 8
    sd = math.sqrt(sum((v - 0.5625) ** 2 for v in values) / 7)
    assert mean_half_width(values) == pytest.approx(2.3646 * sd / math.sqrt(8), abs=1e-4)
    assert math.isnan(mean_half_width([0.5]))
    assert wilson(3, 4) == pytest.approx((0.3006, 0.9544), abs=1e-4)
    assert all(wilson(0, n)[0] == 0.0 and wilson(n, n)[1] == 1.0 for n in range(1, 80))  # (0 of 11 gave 2.8e-17)


def test_a_mean_of_means_pools_standard_errors_at_welch_satterthwaite_df():
    """Independent means (groups of one): their standard errors pooled, t at the Welch-Satterthwaite df."""
    from kvpress.eval.confidence import pooled_half_width

    values = [0.0, 1.0, 1.0, 0.5, 0.25, 0.75, 1.0, 0.0]
    se = mean_half_width(values) / t_quantile(7)
    two = [[dict(enumerate(values))], [dict(enumerate(reversed(values)))]]  # the same variance, n = 8 each
    assert pooled_half_width(two) == pytest.approx(t_quantile(14) * math.sqrt(2 * se**2) / 2)  # df = 7 + 7
    wide = pooled_half_width([[{0: 0.0, 1: 0.1}], [dict(enumerate(values * 4))]])
    assert wide < t_quantile(1) * math.sqrt(0.005 / 2 + (mean_half_width(values * 4) / t_quantile(31)) ** 2) / 2
    v1, v2 = 0.005 / 2, (mean_half_width(values * 4) / t_quantile(31)) ** 2  # the two means' variances
    df = (v1 + v2) ** 2 / (v1**2 / 1 + v2**2 / 31)  # Welch-Satterthwaite, not whole: rounded down
    assert df % 1 > 0.01 and wide == pytest.approx(t_quantile(math.floor(df)) * math.sqrt(v1 + v2) / 2)
    assert pooled_half_width([[{0: 0.5, 1: 0.5}], [{0: 1.0, 1: 1.0}]]) == 0.0
    assert math.isnan(pooled_half_width([[{0: 0.1}], [{0: 0.1, 1: 0.2}]]))
    assert math.isnan(pooled_half_width([[{0: math.nan, 1: 0.2}], [{0: 0.1, 1: 0.2}]]))
    assert pooled_half_width([[], *two]) == pooled_half_width(two) and math.isnan(pooled_half_width([[]]))


def test_means_over_the_same_examples_count_their_covariance():
    """One task's cells at two ratios hold the same examples: two equal cells are one cell's interval (not a
    sqrt(2) narrower one, as independent means would be), cells that move apart cancel, and a group's df is its
    examples' less one."""
    from kvpress.eval.confidence import pooled_half_width

    values = [0.0, 1.0, 1.0, 0.5, 0.25, 0.75, 1.0, 0.0]
    cell = dict(enumerate(values))
    assert pooled_half_width([[cell, dict(cell)]]) == pytest.approx(mean_half_width(values))
    assert pooled_half_width([[cell], [dict(cell)]]) < mean_half_width(values)  # as two independent tasks
    assert pooled_half_width([[cell, {e: 1 - v for e, v in cell.items()}]]) == pytest.approx(0.0, abs=1e-12)
    partial = {e: v for e, v in cell.items() if e < 4}  # shares 4 of its examples with `cell`
    shared = pooled_half_width([[cell, partial]])
    var, var4 = (mean_half_width(values) / t_quantile(7)) ** 2, (mean_half_width(values[:4]) / t_quantile(3)) ** 2
    cov = var4 * 4 * 4 / (8 * 4)  # their covariance over the 4 shared examples (their variance), n_ij / (n_i n_j)
    assert shared == pytest.approx(t_quantile(3) * math.sqrt(var + var4 + 2 * cov) / 2)


def test_a_sample_without_spread_bounds_how_often_another_value_occurs():
    """Every value the same: t collapses to a point ("-1.000 [-1.000, -1.000]" of 2 examples); the interval is the
    range another value can reach in at most Wilson's upper bound of 0 in n of the population. For 0/1 values it is
    Wilson's; a NaN or infinite value has no t interval (a bare AttributeError from statistics before)."""
    from kvpress.eval.confidence import no_spread_interval

    assert mean_half_width([0.3, 0.3]) == 0.0 and mean_half_width([0.1 - 0.3, 0.2 - 0.4]) == 0.0  # (3e-17 apart)
    u2 = wilson(0, 2)[1]
    assert no_spread_interval(-1.0, 2, -1.0, 1.0) == pytest.approx((-1.0, -1.0 + 2 * u2))
    assert no_spread_interval(0.3, 2, 0.0, 1.0) == pytest.approx((0.3 - 0.3 * u2, 0.3 + 0.7 * u2))
    assert no_spread_interval(1.0, 6, 0.0, 1.0) == pytest.approx(wilson(6, 6))
    assert no_spread_interval(0.0, 32, -1.0, 1.0) == pytest.approx((-0.107, 0.107), abs=1e-3)
    with pytest.raises(ValueError, match="outside its range"):
        no_spread_interval(1.5, 4, 0.0, 1.0)
    assert math.isnan(mean_half_width([0.1, math.nan])) and math.isnan(mean_half_width([0.1, math.inf]))


@pytest.mark.parametrize("successes, n, said", [(4.5, 4, "0 <= successes <= n = 4"), (-0.5, 4, "0 <= successes"),
                                                (0, 0, "n >= 1"), (1, 2.0, "n >= 1")])  # fmt: skip
def test_wilson_refuses_counts_it_cannot_hold(successes, n, said):
    with pytest.raises(ValueError, match=said):
        wilson(successes, n)
