"""pyml: a CPU inference engine for decoder-only language models, in NumPy and Numba,
that tells you where the time goes.

    import pyml
    lm = pyml.load_model(gguf="smollm2-135m")
    print(lm.generate("The capital of France is", max_tokens=16).text)
"""

__version__ = "0.1.0"


from pyml.core.errors import PymlError  # noqa: E402


def load_model(*args, **kwargs):
    """See pyml.nlp.api.load_model."""
    from pyml.nlp.api import load_model as _load
    return _load(*args, **kwargs)


def profile(*args, **kwargs):
    """Record every perf event into a directory and write the reports; see pyml.nlp.profile."""
    from pyml.nlp.profile import profile as _profile
    return _profile(*args, **kwargs)
