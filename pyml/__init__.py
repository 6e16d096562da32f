"""pyml: a CPU inference engine for decoder-only language models, in NumPy and Numba,
that tells you where the time goes.

    import pyml
    lm = pyml.load_model(gguf="smollm2-135m")
    print(lm.generate("The capital of France is", max_tokens=16).text)
    print(pyml.perplexity(lm, open("wiki.test.raw").read(), n_ctx=512).estimate.final_line())

    with pyml.profile("prof/", report=True) as prof:   # every perf event, then the reports
        ...
"""

import importlib

from pyml.core.errors import PymlError
from pyml.core.version import __version__
from pyml.nlp.api import LanguageModel, load_model
from pyml.nlp.perplexity import perplexity

__all__ = ["load_model", "LanguageModel", "perplexity", "profile", "Profile", "PymlError", "__version__"]


def __getattr__(name):
    # pyml.profile / pyml.Profile on first use: the report package costs ~30 ms of a ~0.65 s
    # `import pyml`, and generating text never needs it.
    if name in ("profile", "Profile"):
        return getattr(importlib.import_module("pyml.report.capture"), name)
    raise AttributeError(f"module 'pyml' has no attribute {name!r}")
