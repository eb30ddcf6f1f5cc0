"""How one sweep value (a `Scalar`) is written wherever it is shown: tables, cell names, the rule."""

from __future__ import annotations


def show_scalar(v: object) -> str:
    """``True``/``False`` as on/off, floats in their shortest form, anything else as `str`."""
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)
