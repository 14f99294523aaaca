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


def test_constant_frequencies_name_num_freqs_when_it_is_not_positive():
    # The message named rotary_dim, which "constant" does not read (adversarial test, session 35).
    for count in (0, -1):
        with pytest.raises(ValueError, match="num_freqs: must be > 0 for rope_type constant"):
            frequencies.inv_freq("constant", num_freqs=count)


def test_llama3_takes_max_position_embeddings_when_the_original_context_is_unset():
    recipe = {"theta": 500000.0, "factor": 8.0}
    unset = frequencies.inv_freq("llama3", 64, max_position_embeddings=8192, **recipe)
    given = frequencies.inv_freq("llama3", 64, original_max_position_embeddings=8192, **recipe)
    assert unset == given


def test_proportional_frequencies_follow_theta_to_the_minus_two_i_over_head_dim():
    import rope_jit
    # Gemma 4's global layers: head_dim 512, partial_rotary_factor 0.25.
    values, attention_factor = frequencies.inv_freq("proportional", 128, head_dim=512, theta=1e6)
    np.testing.assert_allclose(values, 1e6 ** (-np.arange(0, 128, 2) / 512), rtol=1.2e-7)
    assert attention_factor == 1.0
    values, _ = frequencies.inv_freq("proportional", 38, head_dim=128, factor=2.0)
    np.testing.assert_allclose(values, 10000.0 ** (-np.arange(0, 38, 2) / 128) / 2, rtol=1.2e-7)
    # head_dim 0 (unset) is rotary_dim: the default type.
    assert frequencies.inv_freq("proportional", 64) == frequencies.inv_freq("default", 64)
    for head_dim in (63, 32):
        with pytest.raises(rope_jit.InvalidArgumentError,
                           match="head_dim: must be even and >= rotary_dim"):
            frequencies.inv_freq("proportional", 64, head_dim=head_dim)


def test_proportional_frequencies_match_transformers():
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if "proportional" not in ROPE_INIT_FUNCTIONS:
        pytest.skip(f"transformers {transformers.__version__} has no proportional rope type")
    cases = ((512, 0.25, 1e6, None), (128, 0.3, 10000.0, None), (128, 0.5, 10000.0, 2.0),
             (64, 1.0, 10000.0, None))
    for head_dim, partial_rotary_factor, theta, factor in cases:
        parameters = {"rope_type": "proportional", "rope_theta": theta,
                      "partial_rotary_factor": partial_rotary_factor}
        if factor is not None:
            parameters["factor"] = factor
        config = transformers.LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2,
                                          head_dim=head_dim, rope_parameters=parameters)
        hf_values, hf_attention_factor = ROPE_INIT_FUNCTIONS["proportional"](config, "cpu")
        hf_values = hf_values.numpy()
        # HF turns int(partial_rotary_factor * head_dim // 2) pairs and appends zeros (pairs that
        # do not turn) up to head_dim / 2.
        pairs = int(partial_rotary_factor * head_dim // 2)
        assert len(hf_values) == head_dim // 2
        assert not hf_values[pairs:].any()
        fields = {"head_dim": head_dim, "theta": theta}
        if factor is not None:
            fields["factor"] = factor
        values, attention_factor = frequencies.inv_freq("proportional", 2 * pairs, **fields)
        message = f"head_dim {head_dim}, partial {partial_rotary_factor}, factor {factor}"
        np.testing.assert_allclose(values, hf_values[:pairs], rtol=1e-6, err_msg=message)
        assert attention_factor == hf_attention_factor


def test_tables_with_no_sections_take_one_position_per_row():
    # mrope_sections=[] made the wrapper expect no positions, and the library read rows of them
    # past the end of a one-element buffer (adversarial test, session 35).
    inv_freq = [1.0, 0.1]
    positions = [5.0, 0.0, 2.5, 7.0]
    cos, sin = np.zeros((4, 2), np.float32), np.zeros((4, 2), np.float32)
    frequencies.rope_tables(inv_freq, cos=cos, sin=sin, positions=positions, mrope_sections=[])
    angles = np.array(positions)[:, None] * np.array(inv_freq, np.float32)[None, :]
    np.testing.assert_allclose(cos, np.cos(angles), atol=1e-7)
    np.testing.assert_allclose(sin, np.sin(angles), atol=1e-7)
    for wrong in ([], positions + positions):
        with pytest.raises(ValueError, match=r"positions: \d+ values, but the tables' 4 rows "
                                             r"need 4 "):
            frequencies.rope_tables(inv_freq, cos=cos, positions=wrong, mrope_sections=[])


def _exact_cos_sin(position, inv, divisor):
    """cos and sin of position * inv / divisor, from an exact angle, rounded once to float64:
    with mpmath where it is installed, else with decimal (the Python documentation's pi and
    Taylor-series recipes) after an exact reduction by 2 pi to 60 digits."""
    try:
        import mpmath
    except ImportError:
        mpmath = None
    if mpmath is not None:
        with mpmath.workprec(256):
            angle = mpmath.mpf(position) * mpmath.mpf(inv) / divisor
            return float(mpmath.cos(angle)), float(mpmath.sin(angle))
    import decimal
    from fractions import Fraction
    with decimal.localcontext() as context:
        context.prec = 70
        last, t, s, n, na, d, da = 0, decimal.Decimal(3), decimal.Decimal(3), 1, 0, 0, 24
        while s != last:
            last = s
            n, na = n + na, na + 8
            d, da = d + da, da + 32
            t = (t * n) / d
            s += t
        pi = s
        angle = Fraction(position) * Fraction(inv) / Fraction(divisor)
        x = decimal.Decimal(angle.numerator) / decimal.Decimal(angle.denominator)
        x -= 2 * pi * (x / (2 * pi)).to_integral_value(decimal.ROUND_HALF_EVEN)  # to [-pi, pi]
        cos = sin = decimal.Decimal(0)
        term, k = decimal.Decimal(1), 0  # x^k / k!
        while abs(term) > decimal.Decimal(10) ** -60:
            if k % 4 == 0:
                cos += term
            elif k % 4 == 1:
                sin += term
            elif k % 4 == 2:
                cos -= term
            else:
                sin -= term
            k += 1
            term = term * x / k
        return float(cos), float(sin)


@pytest.mark.parametrize("position_start", [1e10, 1e12])
def test_tables_far_out_are_within_one_float32_ulp_of_the_exact_values(position_start):
    # The float64 angle rounded to half its ulp: at 1e12, 1,500 float32 ulps of its cosine
    # (adversarial test, session 35). rope_jit.h promises one.
    inv_freq = np.array([1.0, 0.7498942, 0.0123, 1e-4, 500000.0 ** -0.5], np.float32)
    for interpolate_factor in (1.0, 3.0):
        cos, sin = np.zeros((4, 5), np.float32), np.zeros((4, 5), np.float32)
        frequencies.rope_tables(inv_freq.tolist(), cos=cos, sin=sin, position_start=position_start,
                                interpolate_factor=interpolate_factor)
        worst = 0.0
        for r in range(4):
            for i, inv in enumerate(inv_freq):
                exact = _exact_cos_sin(position_start + r, float(inv), interpolate_factor)
                for got, value in zip((cos[r, i], sin[r, i]), exact):
                    ulps = abs(float(got) - value) / float(np.spacing(np.float32(abs(value))))
                    if not ulps <= worst:  # (a NaN stays)
                        worst = ulps
        assert worst <= 1.0, f"interpolate_factor {interpolate_factor}: {worst:.3g} float32 ulps"
