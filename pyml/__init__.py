"""pyml: a CPU inference engine for decoder-only language models, in NumPy and Numba,
that tells you where the time goes.

    import pyml
    lm = pyml.load_model(gguf="smollm2-135m")
    print(lm.generate("The capital of France is", max_tokens=16).text)

    with pyml.profile("prof/", report=True) as prof:   # every perf event, then the reports
        ...
"""

from pyml.core.errors import PymlError
from pyml.core.version import __version__
from pyml.nlp.api import LanguageModel, load_model
from pyml.report.profile import Profile, profile

__all__ = ["load_model", "LanguageModel", "profile", "Profile", "PymlError", "__version__"]
