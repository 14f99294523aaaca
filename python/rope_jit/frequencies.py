"""Frequency builders (rope_jit_inv_freq) and angle tables (rope_jit_rope_tables).

HF transformers' rope types (default, linear, dynamic, yarn, llama3, longrope) and
rotary-embedding-torch's freqs_for (lang, pixel, constant), computed on the host in float64 and
rounded once. These functions arrived in a later version of the C API than rope_jit_rope; with
a library that lacks them, has_frequency_builders() is False and the calls raise
NotImplementedError.
"""

import ctypes

from . import _library
from . import _structs as s
from .runtime import _STYLES, _choice
from ._checks import c_double, c_int, c_ints, items
from .tensors import as_tensor

_P = ctypes.POINTER


def _functions():
    library = _library.load()
    cached = getattr(library, "_frequency_functions", False)
    if cached is not False:
        return library, cached
    functions = {
        "freq_init": library.optional("rope_jit_freq_config_init", None, [_P(s.FreqConfig)]),
        "inv_freq": library.optional(
            "rope_jit_inv_freq",
            ctypes.c_int,
            [_P(s.FreqConfig), _P(ctypes.c_float), ctypes.c_size_t, _P(ctypes.c_float)],
        ),
        "table_init": library.optional("rope_jit_table_config_init", None, [_P(s.TableConfig)]),
        "tables": library.optional(
            "rope_jit_rope_tables",
            ctypes.c_int,
            [_P(s.TableConfig), _P(s.DLTensor), _P(s.DLTensor), _P(s.DLTensor)],
        ),
    }
    functions = functions if all(functions.values()) else None
    library._frequency_functions = functions
    return library, functions


def has_frequency_builders():
    """Whether the loaded library has rope_jit_inv_freq and rope_jit_rope_tables."""
    return _functions()[1] is not None


def _require():
    library, functions = _functions()
    if functions is None:
        raise NotImplementedError(
            f"the loaded librope_jit ({library.path}) has no frequency builders (rope_jit_inv_freq): "
            "build a newer rope-jit"
        )
    return library, functions


def _float_array(values, name):
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name}: expected a sequence of floats, got {type(values).__name__}")
    values = [c_double(v, f"{name}[{index}]") for index, v in enumerate(values)]
    if not values:
        raise ValueError(f"{name}: must not be empty")
    return (ctypes.c_float * len(values))(*values)


# ctypes field type -> the check that converts a Python value for it without truncation.
_FIELD_CHECKS = {
    ctypes.c_int32: lambda value, name: c_int(value, name, 32),
    ctypes.c_int: lambda value, name: c_int(value, name, 32),
    ctypes.c_int64: lambda value, name: c_int(value, name, 64),
    ctypes.c_double: c_double,
}


def _field_value(name, value):
    field_type = dict(s.FreqConfig._fields_)[name]
    return _FIELD_CHECKS[field_type](value, name)


def inv_freq(rope_type, rotary_dim=0, **fields):
    """The inverse frequencies and attention factor of a RoPE recipe.

    rope_type: "default", "linear", "dynamic", "yarn", "llama3", "longrope", "proportional"
    (HF rope_type) or "lang", "pixel", "constant" (rotary-embedding-torch freqs_for).
    rotary_dim: R (HF `dim`). fields: any rope_jit_freq_config field by name (theta, factor,
    max_position_embeddings, original_max_position_embeddings, seq_len, attention_factor,
    beta_fast, beta_slow, mscale, mscale_all_dim, truncate, low_freq_factor, high_freq_factor,
    theta_rescale_factor, max_freq, num_freqs, head_dim) and short_factor / long_factor as
    sequences of R/2 floats; unnamed fields keep the library's defaults (see rope_jit.h).

    Returns (inv_freq, attention_factor): a list of R/2 floats (num_freqs for "constant") and
    a float.
    """
    library, functions = _require()
    config = library.new_struct(s.FreqConfig, functions["freq_init"])
    config.rope_type = _choice(rope_type, s.ROPE_TYPES, "rope_type")
    config.rotary_dim = c_int(rotary_dim, "rotary_dim")
    held = []
    factors = {}
    known = {name for name, _ in s.FreqConfig._fields_} - {"struct_size", "rope_type", "rotary_dim"}
    for name, value in fields.items():
        if name not in known:
            raise TypeError(f"{name}: not a field of rope_jit_freq_config (known: {sorted(known)})")
        if name in ("num_short_factor", "num_long_factor"):
            raise TypeError(f"{name}: set from the length of {name[4:]}, not given")
        if name in ("short_factor", "long_factor"):
            array = _float_array(value, name)
            held.append(array)
            factors[name] = len(array)
            value = ctypes.cast(array, _P(ctypes.c_float))
        else:
            value = _field_value(name, value)
        setattr(config, name, value)
    count = (
        config.num_freqs if config.rope_type == s.ROPE_TYPES["constant"] else config.rotary_dim // 2
    )
    if count <= 0:
        if config.rope_type == s.ROPE_TYPES["constant"]:
            raise ValueError(f"num_freqs: must be > 0 for rope_type constant, got {count}")
        raise ValueError(f"rotary_dim: must be even and > 0, got {rotary_dim}")
    if count > s.MAX_FREQUENCIES:  # (before the array: 2^31 frequencies took 8 GiB first)
        name = "num_freqs" if config.rope_type == s.ROPE_TYPES["constant"] else "rotary_dim / 2"
        raise ValueError(
            f"{name}: at most 2^24 frequencies (ROPE_JIT_MAX_FREQUENCIES), got {count}")
    # The library reads rotary_dim / 2 factors through these pointers: a shorter list would
    # be read past its end (issue 20, P1).
    for name, length in factors.items():
        if length != config.rotary_dim // 2:
            raise ValueError(
                f"{name}: {length} values, but rotary_dim {config.rotary_dim} needs one per "
                f"pair: {config.rotary_dim // 2}"
            )
    for name, length in factors.items():  # (the library checks them too)
        setattr(config, "num_" + name, length)
    values = (ctypes.c_float * count)()
    factor = ctypes.c_float()
    library.check(
        "rope_jit_inv_freq",
        functions["inv_freq"](ctypes.byref(config), values, count, ctypes.byref(factor)),
    )
    return list(values), factor.value


def rope_tables(
    inv_freq,
    *,
    cos=None,
    sin=None,
    xpos_scale=None,
    position_start=0.0,
    positions=None,
    interpolate_factor=1.0,
    attention_factor=1.0,
    style="half",
    mrope_sections=None,
    mrope_interleaved=False,
    float32_angles=False,
    xpos_scale_base=512.0,
    xpos_center=0.0,
):
    """Fills cos, sin and/or xpos_scale (host tensors, [P, n] half or [P, 2n] full tables,
    float32/float16/bfloat16; at least one) for the n = len(inv_freq) pairs.

    Row r holds position position_start + r, or positions[axis * P + r] when `positions` (a
    flat sequence of A*P floats, A = len(mrope_sections) or 1) is given; see
    rope_jit_table_config in rope_jit.h for every other field. Returns (cos, sin, xpos_scale).
    """
    library, functions = _require()
    config = library.new_struct(s.TableConfig, functions["table_init"])
    frequencies = _float_array(inv_freq, "inv_freq")
    held = [frequencies]
    config.inv_freq = ctypes.cast(frequencies, _P(ctypes.c_float))
    config.num_freqs = len(frequencies)
    config.position_start = c_double(position_start, "position_start")
    config.interpolate_factor = c_double(interpolate_factor, "interpolate_factor")
    config.attention_factor = c_double(attention_factor, "attention_factor")
    config.style = _choice(style, _STYLES, "style")
    axes = 1
    if mrope_sections is not None:
        values = c_ints(mrope_sections, "mrope_sections")
        sections = (ctypes.c_int32 * max(len(values), 1))(*values)
        held.append(sections)
        config.mrope_sections = ctypes.cast(sections, _P(ctypes.c_int32))
        config.num_mrope_sections = len(values)
        axes = max(len(values), 1)  # no sections: one position axis, as the library reads it
        config.mrope_interleaved = 1 if mrope_interleaved else 0
    config.float32_angles = 1 if float32_angles else 0
    config.xpos_scale_base = c_double(xpos_scale_base, "xpos_scale_base")
    config.xpos_center = c_double(xpos_center, "xpos_center")
    tables = []
    for name, value in (("cos", cos), ("sin", sin), ("xpos_scale", xpos_scale)):
        tables.append(None if value is None else as_tensor(value, name, writable=True))
    if positions is not None:
        # The library reads axes * rows positions (rows: the tables' first extent): a shorter
        # list would be read past its end (issue 20, P1).
        values = [c_double(p, f"positions[{index}]")
                  for index, p in enumerate(items(positions, "positions"))]
        given = [table for table in tables if table is not None]
        rows = max((len(table.shape) and table.shape[0] for table in given), default=0)
        if given and len(values) != axes * rows:  # (no table at all: the library names that)
            raise ValueError(
                f"positions: {len(values)} values, but the tables' {rows} rows need {axes * rows} "
                f"({axes} position axis(es) x {rows} rows)"
            )
        array = (ctypes.c_double * max(len(values), 1))(*values)
        held.append(array)
        config.positions = ctypes.cast(array, _P(ctypes.c_double))
        config.num_positions = len(values)  # the library checks it too
    pointers = [None if table is None else table.pointer for table in tables]
    library.check("rope_jit_rope_tables", functions["tables"](ctypes.byref(config), *pointers))
    del held, tables
    return cos, sin, xpos_scale
