"""The commands, a module `pyml_<command>.py` each: pyml-infer, pyml-chat, pyml-serve, pyml-batch,
pyml-quantize, pyml-cache, pyml-report, pyml-sweep and pyml-bench; what they share (main.py,
options.py), their helpers (serve_*, batch_jobs, ray_runner, bench_*), the random-weight
checkpoint writers (standins.py) and the kernel micro-benchmark (kernel_bench.py)."""
