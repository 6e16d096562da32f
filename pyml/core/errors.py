"""Errors a user can act on.

Everything pyml raises for bad input derives from PymlError; the CLI prints its
message as one line and exits with `exit_code` (2 for bad input). Anything else
that escapes is an internal error (exit 1).
"""


class PymlError(Exception):
    """Bad input: a file, a flag or a prompt the user can fix."""

    exit_code = 2


class ModelFormatError(PymlError):
    """A model file that is truncated, corrupt, or disagrees with its config."""


class UnsupportedError(PymlError):
    """A well-formed input that pyml does not implement (architecture, quant type)."""


class TemplateError(PymlError):
    """A chat template (code from a model file) that fails or exceeds its limits on these messages."""


class ResolveError(PymlError):
    """A model name that cannot be found locally or fetched."""


def check_text(text: str, what: str) -> str:
    """`text`, if it is text: refuses lone surrogates, which is how Python hands over bytes that
    were not UTF-8 (argv, stdin and file names decode with surrogateescape: 0xff -> U+DCFF) and
    what JSON's "\\ud800" decodes to. Neither can be tokenized or printed."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        bad = (f"the byte 0x{code - 0xDC00:02x}, which is not UTF-8" if 0xDC80 <= code <= 0xDCFF
               else f"a lone surrogate U+{code:04X}")
        raise PymlError(f"{what} holds {bad} (at character {e.start})") from None
    return text


def was_interrupted(e: BaseException | None) -> bool:
    """True if `e` is a KeyboardInterrupt or was caused by one.

    A SIGINT that lands while Numba's dispatcher runs its Python-level steps sets the
    KeyboardInterrupt, which the compiled call then ignores; CPython reports that as
    SystemError("... returned a result with an exception set") with the interrupt as its cause.
    """
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False
