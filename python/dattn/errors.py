"""dattn's errors as Python exceptions.

Each carries the C++ message, which names the field, the value and what is valid, and the field
itself as ``field``. They subclass the built-in exception a Python user would catch for that
kind of problem.
"""


class Error(Exception):
    """Base of dattn's errors; ``field`` names the input the error is about."""

    field: str = ""


class InvalidArgument(Error, ValueError):
    """Malformed input: a shape, dtype, metadata value or option that is not valid."""


class Unsupported(Error, NotImplementedError):
    """A valid request that this backend, platform or device does not serve."""


class NotAvailable(Error, RuntimeError):
    """A backend (or engine) that cannot run on this machine."""


class InvalidArgumentType(InvalidArgument, TypeError):
    """An argument of the wrong type (a string where a number goes, a list where a mapping
    goes): an ``InvalidArgument`` that is also the ``TypeError`` PyTorch raises for it."""


class UnsupportedTensor(Unsupported, InvalidArgument):
    """A tensor dattn does not compute on (another device than the CPU, or a dtype such as
    float64): both a request dattn does not serve (``Unsupported``, a ``NotImplementedError``)
    and an argument that is not valid here (``InvalidArgument``, a ``ValueError``)."""


def _with_field(cls, message, field):
    e = cls(message)
    e.field = field
    return e


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def as_int(value, field: str) -> int:
    """``value`` as a Python int: an int or an integer scalar (numpy, torch: anything with
    ``__index__``), not a bool, within int64; else ``InvalidArgument`` naming ``field``."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise _with_field(
            InvalidArgumentType, f"{field}: expected an int, got {value!r:.80}", field
        )
    try:
        n = value.__index__()
    except Exception:  # a tensor with more than one element, say
        raise _with_field(
            InvalidArgumentType, f"{field}: expected an int, got {value!r:.80}", field
        ) from None
    if not _INT64_MIN <= n <= _INT64_MAX:
        raise _with_field(
            InvalidArgument, f"{field}: {n} is outside int64 [-2^63, 2^63 - 1]", field
        )
    return int(n)


def as_float(value, field: str) -> float:
    """``value`` as a float (an int, a float or a numeric scalar; not a bool or a string); else
    ``InvalidArgumentType`` naming ``field``."""
    if isinstance(value, (bool, str, bytes)) or not (
        hasattr(value, "__float__") or hasattr(value, "__index__")
    ):
        raise _with_field(
            InvalidArgumentType, f"{field}: expected a number, got {value!r:.80}", field
        )
    try:
        return float(value)
    except Exception:
        raise _with_field(
            InvalidArgumentType, f"{field}: expected a number, got {value!r:.80}", field
        ) from None
