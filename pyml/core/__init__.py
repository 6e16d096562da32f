"""Stateless array math and the SIMD vocabulary the kernels are written in, the runtime
configuration, perf events, errors and the kernel cache; no model knowledge. Its I/O is the
runtime's own: file pages (mapping.py), the stamped kernel cache (jit.py, numba_runtime.py)."""
