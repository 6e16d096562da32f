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
