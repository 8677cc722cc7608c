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


def test_a_mean_of_means_pools_standard_errors_at_welch_satterthwaite_df():
    from kvpress.eval.confidence import pooled_half_width

    halves = [(t_quantile(7) * 0.1, 8), (t_quantile(7) * 0.1, 8)]  # two means, standard error 0.1 each, n = 8
    assert pooled_half_width(halves) == pytest.approx(t_quantile(14) * math.sqrt(0.02) / 2)  # df = 7 + 7
    wide = pooled_half_width([(t_quantile(1) * 0.05, 2), (t_quantile(31) * 0.05, 32)])
    assert wide < t_quantile(1) * math.sqrt(0.005) / 2  # df between 1 and 32, not each cell's own t summed
    assert pooled_half_width([(0.0, 8), (0.0, 8)]) == 0.0 and math.isnan(pooled_half_width([(0.1, 1), (0.1, 8)]))
