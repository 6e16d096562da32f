"""The commands: pyml-infer, pyml-quantize, pyml-report, pyml-sweep, pyml-bench (each module
`pyml_<command>.py` holds one), what they share (main.py), the benchmark's models and engines,
the random-weight checkpoint writers (standins.py) and the kernel micro-benchmark."""
