"""The compile counter (pyml/core/compiles.py) against Numba's own record of what it built: the
overloads a dispatcher holds after the call."""

import numba

from pyml.core import compiles


def test_a_literal_argument_is_one_kernel_not_two():
    """numba.literally makes Numba try once with a plain int, stop, and compile with the constant:
    the stopped try built nothing, so it is not counted (it was: a cold test run listed it)."""
    @numba.njit
    def scaled(kind, x):
        numba.literally(kind)
        return x * kind

    before, listed = compiles.kernels(), len(compiles.compiled())
    assert scaled(3, 2.0) == 6.0
    assert len(scaled.overloads) == 1  # Numba's own count of what it compiled
    new = compiles.compiled()[listed:]
    assert [args for name, args in new if name == "test_compiles.scaled"] == ["(Literal[int](3), float64)"]
    assert compiles.kernels() - before == len(new)  # with Numba's own helper for `literally`

def test_a_plain_kernel_and_its_callee_are_two():
    @numba.njit
    def callee(x):
        return x + 1

    @numba.njit
    def caller(x):
        return callee(x) * 2

    before = compiles.kernels()
    assert caller(1) == 4
    assert len(caller.overloads) + len(callee.overloads) == 2
    assert compiles.kernels() - before == 2


def _scaled_by(kind: int):
    """A factory as kernel_set.block_kernels is: one dispatcher per constant, same argument types."""
    @numba.njit
    def scaled(x):
        return x * kind
    return scaled


def test_a_factory_kernel_is_listed_with_the_constants_it_was_made_for():
    """Two kernels a factory made for two kinds take the same argument types: without the closure's
    constants in the name, the list read them as one kernel compiled twice."""
    listed = len(compiles.compiled())
    assert _scaled_by(2)(3.0) == 6.0 and _scaled_by(5)(3.0) == 15.0
    names = [name for name, args in compiles.compiled()[listed:] if args == "(float64,)"]
    assert names == ["test_compiles.scaled[kind=2]", "test_compiles.scaled[kind=5]"]
