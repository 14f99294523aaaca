"""The frequency builders and angle tables (rope_jit.frequencies), when the library has them,
against NumPy versions of their documented formulas."""

import numpy as np
import pytest

from rope_jit import frequencies

pytestmark = pytest.mark.skipif(not frequencies.has_frequency_builders(),
                                reason="the loaded librope_jit has no rope_jit_inv_freq")


def test_lang_frequencies_follow_theta_to_the_minus_two_i_over_r():
    values, attention_factor = frequencies.inv_freq("lang", 64, theta=10000.0, theta_rescale_factor=2.0)
    theta = 10000.0 * 2.0 ** (64 / 62)
    np.testing.assert_allclose(values, theta ** (-np.arange(0, 64, 2) / 64), rtol=1e-6)
    assert attention_factor == 1.0


def test_tables_hold_cos_and_sin_of_position_times_frequency_in_either_column_layout():
    inv_freq = [1.0, 0.1, 0.01, 0.001]
    angles = (np.arange(6)[:, None] + 3) * np.array(inv_freq)[None, :]
    for style, repeat in (("half", lambda a: np.concatenate([a, a], 1)), ("interleaved", lambda a: a.repeat(2, 1))):
        cos, sin = np.zeros((6, 8), np.float32), np.zeros((6, 8), np.float32)
        frequencies.rope_tables(inv_freq, cos=cos, sin=sin, position_start=3, style=style)
        np.testing.assert_allclose(cos, repeat(np.cos(angles)), atol=1e-6, err_msg=style)
        np.testing.assert_allclose(sin, repeat(np.sin(angles)), atol=1e-6, err_msg=style)
    half = np.zeros((6, 4), np.float32)
    frequencies.rope_tables(inv_freq, cos=half, position_start=3, attention_factor=0.5)
    np.testing.assert_allclose(half, 0.5 * np.cos(angles), atol=1e-6)


def test_a_bad_recipe_raises_with_the_field_named():
    with pytest.raises(ValueError, match="rope_type"):
        frequencies.inv_freq("ntk", 64)
    with pytest.raises(TypeError, match="thetta"):
        frequencies.inv_freq("default", 64, thetta=1.0)
    import rope_jit
    with pytest.raises(rope_jit.InvalidArgumentError, match="factor"):
        frequencies.inv_freq("linear", 64)  # linear needs a factor
