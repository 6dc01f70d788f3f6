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


class UnsupportedTensor(Unsupported, InvalidArgument):
    """A tensor dattn does not compute on (another device than the CPU, or a dtype such as
    float64): both a request dattn does not serve (``Unsupported``, a ``NotImplementedError``)
    and an argument that is not valid here (``InvalidArgument``, a ``ValueError``)."""


def _with_field(cls, message, field):
    e = cls(message)
    e.field = field
    return e
