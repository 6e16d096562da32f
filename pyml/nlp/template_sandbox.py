"""A Jinja2 sandbox with bounded work, for chat templates: code that comes inside model files.

Jinja's immutable sandbox stops escapes (`__class__`, `__globals__`, mutating lists) but not
work: `{{ 'a' * 1000000000 }}` allocates a gigabyte, nested loops run for hours, a macro that
calls itself twice per level never ends. Here every render has a budget (`Budget`): each loop
iteration and call is a step, each string or list an operator, call, filter or output makes is
charged by its length, and a value that would be too big is refused *before* it is made
(multiplication, concatenation, `%` and `format` widths, `center`/`ljust`..., `join`, `replace`).
Values built of shared references (`[x, x]` nested thirty deep) are measured as printed, before
they are turned into text. A render that runs out of its budget raises TemplateLimit.

The loops and outputs are reached by rewriting the parsed template (For.iter, Output, Concat
nodes wrapped in calls to the environment's checks) before it is compiled: Jinja has no hook
for iteration or for turning a value into text, and its public `parse` + `compile` accept a
rewritten tree.
"""

from __future__ import annotations

import contextvars
import math
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from functools import wraps

import jinja2
import jinja2.ext
import jinja2.nodes as nodes
import jinja2.sandbox

MAX_CHARS = 4_000_000      # any one string or list (as printed), and the rendered prompt
MAX_WORK = 64_000_000      # characters and items made in one render, all values together
MAX_STEPS = 300_000        # loop iterations and calls in one render
MAX_SECONDS = 5.0          # wall time of one render
MAX_POWER_BITS = 65_536    # an integer power's size
MAX_STRFTIME_FORMAT = 1_000

_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill"})
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[a-zA-Z%]")
_DIGITS = re.compile(r"\d+")
_NESTED_FIELD = re.compile(r"\{[^{}]*\{")  # a replacement field inside another's format spec


class TemplateLimit(jinja2.TemplateError):
    """A render that would exceed one of the limits above."""


@dataclass
class Budget:
    deadline: float = field(default_factory=lambda: time.monotonic() + MAX_SECONDS)
    steps: int = 0
    work: int = 0

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise TemplateLimit(f"more than {MAX_STEPS:,} loop iterations and calls")
        if time.monotonic() > self.deadline:
            raise TemplateLimit(f"rendering took longer than {MAX_SECONDS:g} s")

    def charge(self, n: int) -> None:
        self.work += n
        if self.work > MAX_WORK:
            raise TemplateLimit(f"more than {MAX_WORK:,} characters made in all")


_budget: contextvars.ContextVar[Budget] = contextvars.ContextVar("pyml_template_budget")


def render(template: jinja2.Template, **variables) -> str:
    """`template` rendered with a fresh budget; the text is refused past MAX_CHARS."""
    token = _budget.set(Budget())
    try:
        out, n = [], 0
        for piece in template.generate(**variables):
            n += len(piece)
            if n > MAX_CHARS:
                raise TemplateLimit(f"the rendered text is longer than {MAX_CHARS:,} characters")
            out.append(piece)
        return "".join(out)
    finally:
        _budget.reset(token)


def _current() -> Budget:
    budget = _budget.get(None)
    if budget is None:  # a render not started by render(): give it its own budget
        budget = Budget()
        _budget.set(budget)
    return budget


def _check_size(n: int, what: str) -> int:
    if n > MAX_CHARS:
        raise TemplateLimit(f"{what} would be {n:,} long (the limit is {MAX_CHARS:,})")
    _current().charge(n)
    return n


def printed_size(value, limit: int | None = None) -> int:
    """About how many characters `value` takes as text, stopping once past `limit` (MAX_CHARS):
    strings by length, containers by their items (each object measured once, so a structure of
    shared references costs its distinct objects), anything else as one character."""
    limit = MAX_CHARS if limit is None else limit
    sizes: dict = {}

    def size(v) -> int:
        if isinstance(v, str):
            return len(v)
        if not isinstance(v, (list, tuple, dict, set, frozenset)):
            return 1
        if id(v) in sizes:
            return sizes[id(v)]
        sizes[id(v)] = 0  # a cycle (not makeable in the immutable sandbox) counts once
        total = len(v) + 2
        for item in (v.items() if isinstance(v, dict) else v):
            total += size(item)
            if total > limit:
                break
        sizes[id(v)] = total
        return total

    return size(value)


def _check_printed(value, what: str):
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        _check_size(printed_size(value), what)
    return value


def _length(value) -> int | None:
    return printed_size(value) if isinstance(value, (str, list, tuple, dict, set, frozenset)) else None


def _check_percent_format(fmt: str) -> None:
    widths = 0
    for width, precision in _PERCENT_SPEC.findall(fmt):
        if "*" in (width, precision):
            raise TemplateLimit("a '%' format with a '*' width or precision")
        widths += int(width or 0) + int(precision or 0)
    _check_size(len(fmt) + widths, "a '%' formatted string")


def _check_brace_format(fmt: str) -> None:
    widths = [int(d) for d in _DIGITS.findall(fmt)]  # widths and precisions (and harmless field numbers)
    _check_size(len(fmt) + sum(widths), "a formatted string")


class BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox, with every operator, call, loop and output under the budget."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def __init__(self, filters: dict, globals: dict, **options):
        super().__init__(extensions=[jinja2.ext.loopcontrols], **options)
        self.filters.update(filters)
        self.globals.update(globals, strftime_now=strftime_now)
        del self.globals["lipsum"]  # lipsum(n=10**9): paragraphs on demand, and no template needs it
        for name, check in _FILTER_CHECKS.items():
            self.filters[name] = _checked_filter(self.filters[name], check)

    # --- the rewrite: loops, outputs and ~ go through the checks below ---
    def compile_bounded(self, source: str) -> jinja2.Template:
        tree = self.parse(source)
        for loop in list(tree.find_all(nodes.For)):
            loop.iter = self._wrap("pyml_iter", loop.iter)
        for output in list(tree.find_all(nodes.Output)):
            output.nodes = [self._wrap("pyml_output", child) for child in output.nodes]
        for concat in list(tree.find_all(nodes.Concat)):
            concat.nodes = [self._wrap("pyml_output", child) for child in concat.nodes]
        return self.template_class.from_code(self, self.compile(tree), self.make_globals(None), None)

    def _wrap(self, check: str, node: nodes.Expr) -> nodes.Expr:
        return nodes.Call(nodes.EnvironmentAttribute(check, lineno=node.lineno), [node], [], None, None,
                          lineno=node.lineno)

    def pyml_iter(self, iterable: Iterable):
        budget = _current()
        for item in iterable:
            budget.step()
            yield item

    def pyml_output(self, value):
        if isinstance(value, str):
            _current().charge(len(value))
        else:
            _check_printed(value, "a value printed")
        return value

    # --- operators and calls ---
    def call_binop(self, context, operator: str, left, right):
        if operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                _check_size(printed_size(seq) * max(n, 0), "a repeated string or list")
            elif isinstance(seq, int) and isinstance(n, int) and seq.bit_length() + n.bit_length() > MAX_POWER_BITS:
                raise TemplateLimit(f"a product of more than {MAX_POWER_BITS:,} bits")  # squaring in a loop
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            _check_size(printed_size(left) + printed_size(right), "a concatenation")
        elif operator == "%" and isinstance(left, str):
            _check_percent_format(left)
            _check_printed(right, "a '%' argument")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if right * math.log2(abs(left)) > MAX_POWER_BITS:
                raise TemplateLimit(f"a power of more than {MAX_POWER_BITS:,} bits")
        result = super().call_binop(context, operator, left, right)
        if (n := _length(result)) is not None:
            _current().charge(n)
        return result

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's own spelling)
        _current().step()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            _check_str_method(owner, getattr(__obj, "__name__", ""), args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        if (n := _length(result)) is not None:
            _current().charge(n)
        return result

    def wrap_str_format(self, value):
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        fmt = value.__self__

        @wraps(wrapper)
        def checked(*args, **kwargs):
            _check_brace_format(fmt)
            for arg in (*args, *kwargs.values()):
                _check_printed(arg, "a format argument")
                if isinstance(arg, int) and arg > MAX_CHARS and _NESTED_FIELD.search(fmt):  # '{0:{1}}': a width
                    raise TemplateLimit(f"a format width of more than {MAX_CHARS:,}")
            return wrapper(*args, **kwargs)
        return checked


def _check_str_method(s: str, name: str, args: tuple, kwargs: dict) -> None:
    if name in _WIDTH_METHODS and args and isinstance(args[0], int):
        _check_size(max(args[0], len(s)), f"str.{name}")
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        _check_size(len(s) + s.count("\t") * max(int(tab), 0), "str.expandtabs")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = s.count(args[0]) if args[0] else len(s) + 1
        _check_size(len(s) + count * max(len(args[1]) - len(args[0]), 0), "str.replace")
    elif name == "join" and args:
        items = args[0]
        _check_size(sum(printed_size(x) for x in items) + len(s) * max(len(items) - 1, 0)
                    if isinstance(items, (list, tuple)) else 0, "str.join")


# --- filters: the arguments that decide a result's size, checked before the filter runs ---

def _join_check(value, d="", attribute=None):
    if isinstance(value, (list, tuple)):
        _check_size(printed_size(value) + len(str(d)) * len(value), "a join")


def _indent_check(s, width=4, *rest, **kw):
    pad = len(width) if isinstance(width, str) else int(width)
    _check_size(len(str(s)) + (str(s).count("\n") + 1) * max(pad, 0), "an indent")


def _replace_check(s, old, new, count=None):
    s, old, new = str(s), str(old), str(new)
    n = s.count(old) if old else len(s) + 1
    _check_size(len(s) + min(n, count if count is not None and count >= 0 else n) *
                max(len(new) - len(old), 0), "a replace")


def _tojson_check(value, ensure_ascii=False, indent=None, *rest, **kw):
    if isinstance(indent, int) and indent > 16 or isinstance(indent, str) and len(indent) > 16:
        raise TemplateLimit("tojson's indent is more than 16")
    _check_printed(value, "a tojson value")


_FILTER_CHECKS = {
    "center": lambda value, width=80: _check_size(max(int(width), len(str(value))), "a centred string"),
    "indent": _indent_check,
    "join": _join_check,
    "replace": _replace_check,
    "format": lambda value, *args, **kw: (_check_percent_format(str(value)), _check_printed(args, "format")),
    "batch": lambda value, linecount, fill_with=None: _check_size(int(linecount), "a batch"),
    "slice": lambda value, slices, fill_with=None: _check_size(int(slices), "a slice"),
    "sum": lambda iterable, attribute=None, start=0: _check_printed(iterable, "a sum"),
    "string": lambda value: _check_printed(value, "a string"),
    "tojson": _tojson_check,
}


def _checked_filter(original, check):
    """`original` with `check` run on its arguments first (after the context or environment
    Jinja passes to some filters, which the check does not see)."""
    passes = getattr(original, "jinja_pass_arg", None) is not None

    @wraps(original)
    def checked(*args, **kwargs):
        check(*(args[1:] if passes else args), **kwargs)
        return original(*args, **kwargs)
    return checked


def strftime_now(format: str) -> str:
    """transformers' helper, with the format bounded (each directive can grow it about 30-fold)."""
    if len(format) > MAX_STRFTIME_FORMAT:
        raise TemplateLimit(f"strftime_now's format is longer than {MAX_STRFTIME_FORMAT:,} characters")
    return datetime.now().strftime(format)
