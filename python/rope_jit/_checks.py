"""Python values to C fields without silent damage.

ctypes stores an int into a narrower field modulo 2**bits (2**64 becomes 0, 2**32 + 16
becomes 16), and int() of a float or a string hides a caller's mistake (16.7 becomes 16); a
char* argument stops at the first NUL ('/a\\0/etc' becomes '/a'). These helpers raise instead,
naming the argument: OverflowError for an integer outside the C type, TypeError for a value
that is not an integer (operator.index: Python and NumPy integers and bools pass), ValueError
for a string with NUL.
"""

import operator
import os

# bits -> (lowest, highest) of the signed C integer of that width.
_SIGNED_RANGES = {bits: (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) for bits in (32, 64)}
_UNSIGNED_RANGES = {bits: (0, (1 << bits) - 1) for bits in (32, 64)}


def c_int(value, name, bits=32, signed=True):
    """`value` as a Python int that fits a C (u)int<bits>_t; raises TypeError / OverflowError
    naming `name` otherwise."""
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name}: expected an integer, got {type(value).__name__} {value!r}"
        ) from None
    lowest, highest = (_SIGNED_RANGES if signed else _UNSIGNED_RANGES)[bits]
    if not lowest <= number <= highest:
        kind = f"int{bits}" if signed else f"uint{bits}"
        raise OverflowError(
            f"{name}: {number} is outside the range of the C field ({kind}: {lowest}..{highest})"
        )
    return number


def items(values, name):
    """The elements of `values` (a list, tuple, 1-D array...) as a list; a TypeError naming
    `name` for a value that is no sequence (an int gave Python's own "'int' object is not
    iterable": adversarial pass, session 47)."""
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{name}: expected a sequence, got {type(values).__name__} {values!r}")
    try:
        return list(values)
    except TypeError:
        raise TypeError(
            f"{name}: expected a sequence, got {type(values).__name__} {values!r}"
        ) from None


def c_ints(values, name, bits=32):
    """c_int of every element of the sequence `values`, named name[i] in errors."""
    return [c_int(value, f"{name}[{index}]", bits)
            for index, value in enumerate(items(values, name))]


def c_double(value, name):
    """`value` as a float (int, float, or anything with __float__ that is not a string)."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"{name}: expected a number, got {type(value).__name__} {value!r}"
        ) from None


def c_string(value, name):
    """`value` (str, bytes or os.PathLike) as NUL-free bytes for a const char* argument."""
    data = os.fsencode(value) if isinstance(value, (str, os.PathLike)) else value
    if not isinstance(data, bytes):
        raise TypeError(f"{name}: expected a string or path, got {type(value).__name__}")
    if b"\0" in data:
        raise ValueError(
            f"{name}: contains a NUL character, which would end the C string early: {value!r}"
        )
    return data
