"""float8_e4m3fn decoded from its bit fields by hand: the independent decoder the scoring tests' brute forces share."""

from __future__ import annotations

NAN = float("nan")


def e4m3(byte: int) -> float:
    """float8_e4m3fn from its bit fields: 1 sign, 4 exponent (bias 7), 3 mantissa; S.1111.111 is NaN, no inf."""
    s, e, m = byte >> 7, (byte >> 3) & 15, byte & 7
    if e == 15 and m == 7:
        return NAN
    v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


#: ``E4M3[b]``: the value of byte ``b``.
E4M3 = [e4m3(b) for b in range(256)]
