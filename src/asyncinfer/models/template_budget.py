"""Chat templates rendered on a budget: :func:`budgeted_environment`.

A chat template is code from the model file, and every chat request on the model runs it, in a worker thread
shared with other work. Jinja's sandbox keeps a template away from Python's internals, not from the machine's
time and memory: two nested loops over ``range(100000)`` ran 10**10 iterations, ``{{ 'x' * 10**10 }}`` asked for
10 GB, and so did a width (``'x'.ljust(10**10)``, ``center``, ``'%9999999999s'``), a string doubled in a loop,
or ``2 ** 10 ** 8``. The environment here renders a template on a budget that holds for the whole render
(the limits are the module's constants, listed in :mod:`asyncinfer.models.tokenizer` and docs/reliability.md):

- *work* (:data:`MAX_TEMPLATE_WORK` units, plus :data:`TEMPLATE_WORK_PER_MESSAGE` for each message rendered):
  each item a loop takes and each call (a macro, a method, a filter, a test) costs one unit, plus the static
  size of the code it runs again (a loop body, a macro's body: every node of it), plus one unit for every 32
  characters or items of the values it reads (a comparison, a slice, a method's receiver and arguments);
- *characters* (:data:`MAX_TEMPLATE_CHARS`): all the text the template writes, into its output or into a
  macro's or a block's buffer, and every string its operators, methods and filters build (the items of a list
  or dict they build count as characters): what a render may hold in memory;
- *one value* (:data:`MAX_TEMPLATE_VALUE_CHARS` characters or items): checked *before* it is built, from
  the sizes of what builds it: ``*`` and ``+`` of strings and lists, ``~``, ``%`` and ``format`` (a width or
  precision over the limit is refused), the string methods that take a width, a count or a replacement
  (``ljust``, ``rjust``, ``center``, ``zfill``, ``expandtabs``, ``replace``, ``join``, ``translate``),
  the filters that do (``center``, ``indent``, ``wordwrap``, ``format``, ``replace``, ``join``, ``batch``,
  ``tojson``'s indent up to :data:`MAX_TOJSON_INDENT`), the text of a list or dict written out, a value
  compared, sorted or hashed (a list, tuple or dict held in several places counted in each: the one C call
  walks it whole), and integers of more than :data:`MAX_TEMPLATE_INT_BITS` bits (``**`` and ``*``);
- *the output* (:data:`MAX_RENDERED_CHARS` characters), *the source* (:data:`MAX_TEMPLATE_SOURCE_CHARS`,
  checked before it is compiled) and ``range`` (:data:`MAX_TEMPLATE_RANGE` items, as Jinja's sandbox).

Past a limit the render stops with :class:`ChatTemplateLimitError`, which the engine reports as any template
failure, an ``InvalidParameterError`` on the prompt. Within the limits nothing changes: a template renders the
same text as in transformers' sandbox (loops, calls and output are counted by nodes the compiled template
gains, which hand their values on untouched).
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import string
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, _PassArg, pass_context
from jinja2.visitor import NodeTransformer

#: Work units of one render (a loop's item, a call, a node run again; see the module docstring).
MAX_TEMPLATE_WORK = 1 << 22
#: More work units for each message rendered (a template's work grows with the conversation).
TEMPLATE_WORK_PER_MESSAGE = 512
#: Characters one render may write and build in all (output, buffers, strings built; a list's or dict's items count).
MAX_TEMPLATE_CHARS = 1 << 25
#: Characters (or items) of one value a template builds: a string, a list.
MAX_TEMPLATE_VALUE_CHARS = 1 << 22
#: Characters of the rendered text.
MAX_RENDERED_CHARS = 1 << 22
#: Characters of a template's source.
MAX_TEMPLATE_SOURCE_CHARS = 1 << 18
#: Items of a ``range()`` (Jinja's own sandbox limit).
MAX_TEMPLATE_RANGE = 100_000
#: Bits of an integer a template computes with ``**`` or ``*``.
MAX_TEMPLATE_INT_BITS = 1 << 16
#: ``tojson``'s indent (spaces, or characters of an indent string).
MAX_TOJSON_INDENT = 64

_SIZED = (str, list, tuple, dict, set, frozenset, range, bytes)
_DIGITS = re.compile(r"\d+")
_PERCENT = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")


class ChatTemplateLimitError(RuntimeError):
    """A chat template went past one of the render's limits (see :mod:`asyncinfer.models.template_budget`)."""


class _Budget:
    __slots__ = ("chars", "walked", "work")

    def __init__(self, work: int, chars: int) -> None:
        self.work = work
        self.chars = chars
        # id of a list, tuple, dict or set read in this render: (the value, kept alive; the items it holds unfolded)
        self.walked: dict[int, tuple[Any, int]] = {}


_CURRENT: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("asyncinfer_template_budget",
                                                                         default=None)


def _refuse(what: str) -> None:
    raise ChatTemplateLimitError(f"the chat template {what}")


def _charge(work: int, chars: int = 0) -> None:
    budget = _CURRENT.get()
    if budget is None:  # compiling (Jinja folds constants): only the size checks hold
        return
    budget.work -= work
    budget.chars -= chars
    if budget.work < 0:
        _refuse(f"ran past its budget of work (MAX_TEMPLATE_WORK = {MAX_TEMPLATE_WORK} units, plus "
                f"{TEMPLATE_WORK_PER_MESSAGE} a message): a loop or a recursion too long")
    if budget.chars < 0:
        _refuse(f"wrote or built more than MAX_TEMPLATE_CHARS = {MAX_TEMPLATE_CHARS} characters (or items)")


def _size(value: Any) -> int:
    return len(value) if isinstance(value, _SIZED) else 0


def _reads(*values: Any) -> int:
    """Work units for reading ``values``: one for every 32 characters or items."""
    return sum(_size(v) for v in values) >> 5


_WALKED = (list, tuple, dict, set, frozenset)


def _unfolded(value: Any) -> int:
    """The items ``value`` holds, a list, tuple, dict or set held in several places counted in each (what Python's
    comparisons and hashes walk: ``[a, a]`` built 40 times over is 2**41 items), counted up to past
    :data:`MAX_TEMPLATE_VALUE_CHARS`. Each distinct container is read once a render (the sandbox is immutable: what
    a render reads cannot change under it), a unit of work for it and each of its items."""
    if not isinstance(value, _WALKED):
        return 1
    budget = _CURRENT.get()
    walked: dict[int, tuple[Any, int]] = budget.walked if budget is not None else {}
    found = walked.get(id(value))
    if found is not None and found[0] is value:
        return found[1]
    cap = MAX_TEMPLATE_VALUE_CHARS + 1
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        item, finished = stack.pop()
        children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
        if finished:
            total = 1
            for child in children:
                total += walked[id(child)][1] if isinstance(child, _WALKED) else 1
            walked[id(item)] = (item, min(total, cap))
            continue
        seen = walked.get(id(item))
        if seen is not None and seen[0] is item:
            continue
        walked[id(item)] = (item, 1)  # held inside itself (a cycle): Python's own recursion limit stops the walk
        _charge(1 + len(children))
        stack.append((item, True))
        stack.extend((child, False) for child in children if isinstance(child, _WALKED))
    return walked[id(value)][1]


def _check_walk(*values: Any) -> None:
    """Refuse to read (compare, sort, hash, hand to a filter, test or method) a value that holds more than
    :data:`MAX_TEMPLATE_VALUE_CHARS` items (:func:`_unfolded`): comparing or hashing it is one C call that walks it
    whole, holding the GIL, every thread of the process waiting, beyond any budget."""
    for value in values:
        size = _unfolded(value)
        if size > MAX_TEMPLATE_VALUE_CHARS:
            _refuse(f"would read a value holding more than {MAX_TEMPLATE_VALUE_CHARS} items (compare, sort, hash it or "
                    "hand it to a filter, a test or a method), a list, tuple or dict held in several places counted "
                    f"in each (at most MAX_TEMPLATE_VALUE_CHARS = {MAX_TEMPLATE_VALUE_CHARS})")


def _check_value(size: int, what: str) -> None:
    if size > MAX_TEMPLATE_VALUE_CHARS:
        _refuse(f"would build {what} of {size} characters or items (at most MAX_TEMPLATE_VALUE_CHARS = "
                f"{MAX_TEMPLATE_VALUE_CHARS})")


def _check_width(width: Any, what: str) -> None:
    if isinstance(width, int) and width > MAX_TEMPLATE_VALUE_CHARS:
        _check_value(width, what)


def _check_int(bits: int) -> None:
    if bits > MAX_TEMPLATE_INT_BITS:
        _refuse(f"would compute an integer of about {bits} bits (at most MAX_TEMPLATE_INT_BITS = "
                f"{MAX_TEMPLATE_INT_BITS})")


def _text_size(value: Any, limit: int = MAX_TEMPLATE_VALUE_CHARS) -> int:
    """About how many characters ``str(value)`` writes (at least that many, past ``limit`` stops counting): a
    list, dict, view or namespace is written with its items, each string quoted."""
    if isinstance(value, str):
        return len(value)
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, Namespace):
            item = item._Namespace__attrs  # what its repr writes
        if isinstance(item, str):
            total += len(item) + 2
        elif isinstance(item, (bytes, bytearray)):
            total += 4 * len(item) + 3
        elif isinstance(item, Mapping):
            total += 2 + 2 * len(item)
            _charge(1 + len(item))
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, Collection) and not isinstance(item, range):
            total += 2 + 2 * len(item)
            _charge(1 + len(item))
            stack.extend(item)
        else:
            total += 8  # a number, None, an undefined value, an object of the sandbox: a short text
    return total


def _check_text(value: Any, what: str) -> None:
    if not isinstance(value, str):
        _check_value(_text_size(value), what)


def _built(result: Any) -> Any:
    """``result`` of a call, a filter or an operator, counted; an iterator comes back counted per item."""
    if isinstance(result, str):
        _check_value(len(result), "a string")
        _charge(len(result) >> 5, len(result))
    elif isinstance(result, _SIZED) and not isinstance(result, range):  # its items count as characters: the
        # memory a render holds (a range holds none)
        _check_value(len(result), "a sequence")
        _charge(len(result) >> 5, len(result))
    elif isinstance(result, Iterator):
        return _Metered(result, 1)
    return result


class _Metered:
    """An iterable whose items each cost ``cost`` work units as they are taken."""

    __slots__ = ("_cost", "_items")

    def __init__(self, items: Any, cost: int) -> None:
        self._items = iter(items)
        self._cost = cost

    def __iter__(self) -> _Metered:
        return self

    def __next__(self) -> Any:
        item = next(self._items)
        _charge(self._cost)
        return item


# ------------------------------------------------------------------ the checks, before a value is built
def _check_mul(left: Any, right: Any) -> None:
    if isinstance(left, int) and isinstance(right, int):
        if left and right:
            _check_int(left.bit_length() + right.bit_length())
        return
    seq, count = (left, right) if isinstance(right, int) else (right, left)
    if isinstance(count, int) and isinstance(seq, (str, list, tuple, bytes)) and count > 0:
        _check_value(len(seq) * count, "a repeated sequence")


def _check_pow(left: Any, right: Any) -> None:
    if isinstance(left, int) and isinstance(right, int) and right > 0 and left not in (0, 1, -1):
        _check_int(left.bit_length() * right)


def _check_add(left: Any, right: Any) -> None:
    if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
        _check_value(len(left) + len(right), "a joined sequence")
    elif isinstance(left, int) and isinstance(right, int):
        _check_int(max(left.bit_length(), right.bit_length()) + 1)


def _check_widths(spec: str, args: Any, nested: bool) -> None:
    for digits in _DIGITS.findall(spec):
        if len(digits) > 7 or int(digits) > MAX_TEMPLATE_VALUE_CHARS:
            _refuse(f"would format a field {digits} characters wide (at most MAX_TEMPLATE_VALUE_CHARS = "
                    f"{MAX_TEMPLATE_VALUE_CHARS})")
    if nested:  # a width taken from the arguments ('%*s', '{:{}}')
        for arg in args:
            if isinstance(arg, int):
                _check_width(arg, "a formatted field")
            elif isinstance(arg, str) and len(arg) < 64:
                _check_widths(arg, (), False)


def _format_args(args: Any) -> list[Any]:
    if isinstance(args, tuple):
        return list(args)
    if isinstance(args, Mapping):
        return list(args.values())
    return [args]


def _check_percent(fmt: str, args: Any) -> None:
    values = _format_args(args)
    for match in _PERCENT.finditer(fmt):
        _check_widths(match.group(0), values, "*" in match.group(0))
    _check_value(len(fmt) + sum(_text_size(v) for v in values), "a formatted string")


def _check_format(fmt: str, args: Any, kwargs: Mapping[str, Any]) -> None:
    _charge(len(fmt))  # the sandbox's formatter goes through the fields in Python
    values = [*args, *kwargs.values()]
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # str.format raises the same
    for _, _, spec, _ in fields:
        if spec:
            _check_widths(spec, values, "{" in spec)
    _check_value(len(fmt) + sum(_text_size(v) for v in values), "a formatted string")


def _check_join(sep: str, items: list[Any]) -> None:
    _check_value(len(sep) * max(len(items) - 1, 0) + sum(_text_size(i) for i in items), "a joined string")


def _check_replace(text: str, old: Any, new: Any, count: Any = -1) -> None:
    if not (isinstance(text, str) and isinstance(old, str) and isinstance(new, str)) or len(new) <= len(old):
        return
    found = len(text) + 1 if not old else text.count(old)
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    _check_value(len(text) + found * (len(new) - len(old)), "a replaced string")


def _check_str_method(text: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if name in ("ljust", "rjust", "center", "zfill"):
        _check_width(args[0] if args else kwargs.get("width"), f"a string padded by {name}()")
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(size, int) and size > 1:
            _check_value(len(text) + text.count("\t") * size, "a string with its tabs expanded")
    elif name == "replace":
        _check_replace(text, *args, **kwargs)
    elif name == "format":
        _check_format(text, args, kwargs)
    elif name == "format_map" and args and isinstance(args[0], Mapping):
        _check_format(text, (), args[0])
    elif name == "translate" and args and isinstance(args[0], Mapping):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        _check_value(len(text) * max(longest, 1), "a translated string")


# ------------------------------------------------------------------ filters
def _check_indent(s: Any, width: Any = 4, *_: Any, **__: Any) -> None:
    per_line = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    if isinstance(s, str) and per_line > 0:
        _check_value(len(s) + (s.count("\n") + 1) * per_line, "an indented string")


def _check_wordwrap(s: Any, width: Any = 79, break_long_words: Any = True, wrapstring: Any = None,
                    *_: Any, **__: Any) -> None:
    if isinstance(s, str) and isinstance(wrapstring, str) and isinstance(width, int) and width > 0:
        _check_value(len(s) + (len(s) // width + 1) * len(wrapstring), "a wrapped string")
    _charge(_size(s))  # textwrap works a character at a time


def _check_batch(value: Any, linecount: Any = 0, fill_with: Any = None) -> None:
    if fill_with is not None:
        _check_width(linecount, "a batch")


def _check_slice(value: Any, slices: Any = 0, fill_with: Any = None) -> None:
    _check_width(slices, "a list of slices")


def _check_filter_format(value: Any, *args: Any, **kwargs: Any) -> None:
    if isinstance(value, str):
        _check_percent(value, kwargs or args)


def _check_filter_join(value: Any, d: Any = "", attribute: Any = None) -> None:
    if isinstance(value, (list, tuple)) and isinstance(d, str):
        _check_join(d, list(value))


def _check_filter_replace(s: Any, old: Any = "", new: Any = "", count: Any = None) -> None:
    _check_replace(s, old, new, -1 if count is None else count)


def _check_sum(iterable: Any, attribute: Any = None, start: Any = 0) -> None:
    """``sum`` of lists or strings: each addition copies what it has, so its work is the items times the size."""
    if isinstance(start, (list, tuple, str)):
        if attribute is not None:
            _refuse("would sum sequences by an attribute (not counted: refused)")
        total = len(start) + sum(_size(item) for item in iterable)
        _check_value(total, "a sum of sequences")
        _charge(len(iterable) * total >> 5)


def _check_center(value: Any, width: Any = 80) -> None:
    _check_width(width, "a centred string")


def _check_string(value: Any, *_: Any, **__: Any) -> None:
    _check_text(value, "a string")


_FILTER_CHECKS = {"center": _check_center, "indent": _check_indent, "wordwrap": _check_wordwrap,
                  "batch": _check_batch, "slice": _check_slice, "format": _check_filter_format, "sum": _check_sum,
                  "join": _check_filter_join, "replace": _check_filter_replace, "string": _check_string,
                  "pprint": _check_string, "e": _check_string, "escape": _check_string,
                  "forceescape": _check_string, "safe": _check_string}


# Filters (and tests) whose work on a string is a pass of C code: a unit for every 32 characters it reads. The
# others (title, urlize, unique, sort, map...) go through a string a character or a word at a time in Python,
# about a microsecond a character: 4 units a character. Each item of a list, tuple or dict read costs a unit.
_FAST_ON_TEXT = frozenset({"length", "count", "string", "upper", "lower", "trim", "replace", "escape", "e",
                           "forceescape", "safe", "first", "last", "center", "indent", "format", "capitalize",
                           "list", "tojson", "default", "d", "reverse", "int", "float", "bool", "wordcount",
                           "truncate", "join", "items", "abs", "round", "in", "eq", "equalto", "ne", "==", "!=",
                           "defined", "undefined", "none", "mapping", "iterable", "sequence", "number",
                           "integer", "true", "false", "sameas", "filter", "test"})


def _wrap_filter(name: str, func: Any) -> Any:
    check = _FILTER_CHECKS.get(name)
    skip = 0 if _PassArg.from_obj(func) is None else 1
    fast = name in _FAST_ON_TEXT

    @functools.wraps(func)  # keeps jinja_pass_arg: the filter gets what it got
    def budgeted(*args: Any, **kwargs: Any) -> Any:
        values = args[skip:]
        _check_walk(*values, *kwargs.values())
        _charge(1 + sum((len(v) >> 5 if fast else 4 * len(v)) if isinstance(v, str) else _size(v) for v in values)
                + _reads(*kwargs.values()))
        if name == "sum" and values and not isinstance(values[0], (list, tuple)):  # its items as a counted list
            args = (*args[:skip], list(_Metered(values[0], 1)), *values[1:])
            values = args[skip:]
        if name == "join" and values:  # its items as a counted list (what join reads), then its size
            args, kwargs = (*args[:skip], *_join_items(args[0] if skip else None, *values, **kwargs)), {}
            values = args[skip:]
        if check is not None and values:
            check(*values, **kwargs)
        return _built(func(*args, **kwargs))

    return budgeted


def _join_items(eval_ctx: Any, value: Any, d: Any = "", attribute: Any = None) -> tuple[Any, ...]:
    """``join``'s arguments as the list of items it joins (an attribute's values, with ``attribute``) and the
    separator."""
    items = list(value) if isinstance(value, (list, tuple)) else list(_Metered(value, 1))
    if attribute is not None and eval_ctx is not None:
        from jinja2.filters import make_attrgetter

        items = list(map(make_attrgetter(eval_ctx.environment, attribute), items))
    return (items, d)


def tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
           separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """``json.dumps``, as transformers' ``tojson`` (non-ASCII kept), its text counted as it is written."""
    if isinstance(indent, int) and indent > MAX_TOJSON_INDENT or isinstance(indent, str) and len(
            indent) > MAX_TOJSON_INDENT:
        _refuse(f"would indent JSON by {indent if isinstance(indent, int) else len(indent)} characters a level "
                f"(at most MAX_TOJSON_INDENT = {MAX_TOJSON_INDENT})")
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                               sort_keys=sort_keys)
    if indent is None:  # one C call: the size of what it reads first
        _check_value(_text_size(value), "a JSON text")
        return encoder.encode(value)
    pieces, total = [], 0
    for piece in encoder.iterencode(value):
        total += len(piece)
        _check_value(total, "a JSON text")
        _charge(1)
        pieces.append(piece)
    return "".join(pieces)


# ------------------------------------------------------------------ the nodes a compiled template gains
@pass_context
def _each(_context: Any, items: Any, cost: int = 1) -> Any:
    """A loop's items, each costing ``cost``."""
    return _Metered(items, cost)


@pass_context
def _run(_context: Any, work: int, chars: int) -> str:
    """What running a body again costs: its nodes, and the text it writes as it stands."""
    _charge(work, chars)
    return ""


@pass_context
def _emit(_context: Any, value: Any) -> Any:
    """A value written out, counted."""
    if isinstance(value, str):
        _charge(1 + (len(value) >> 5), len(value))
        return value
    _check_text(value, "a text")
    text = str(value)
    _check_value(len(text), "a text")
    _charge(1 + (len(text) >> 5), len(text))
    return text


@pass_context
def _read(_context: Any, value: Any) -> Any:
    """A value a comparison, a slice or a dict's key reads, counted by its size (compared or hashed whole)."""
    _check_walk(value)
    _charge(_reads(value))
    return value


def _concat(parts: list[Any]) -> str:
    """``a ~ b``: Jinja's ``str_join``, its size checked first."""
    sizes = 0
    for part in parts:
        sizes += len(part) if isinstance(part, str) else _text_size(part)
    _check_value(sizes, "a joined string")
    text = "".join(map(str, parts))
    _check_value(len(text), "a joined string")
    _charge(1 + (len(text) >> 5), len(text))
    return text


def _static(body: list[nodes.Node]) -> tuple[int, int]:
    work = chars = 0
    for node in body:
        for inner in (node, *node.find_all(nodes.Node)):
            work += 1
            if isinstance(inner, nodes.TemplateData):
                chars += len(inner.data)
    return work, chars


def _filter(node: nodes.Expr, name: str, *args: Any) -> nodes.Filter:
    return nodes.Filter(node, name, [nodes.Const(a) for a in args], [], None, None, lineno=node.lineno)


class _Instrument(NodeTransformer):
    """Adds the nodes that count a template's work to its tree (each hands its value on as it is)."""

    def visit_Output(self, node: nodes.Output) -> nodes.Node:
        self.generic_visit(node)
        node.nodes = [n if isinstance(n, nodes.TemplateData) else _filter(n, "_asyncinfer_emit") for n in node.nodes]
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return _filter(nodes.List(node.nodes, lineno=node.lineno), "_asyncinfer_concat")

    def visit_Compare(self, node: nodes.Compare) -> nodes.Node:
        self.generic_visit(node)
        node.expr = _filter(node.expr, "_asyncinfer_read")
        for operand in node.ops:
            operand.expr = _filter(operand.expr, "_asyncinfer_read")
        return node

    def visit_Dict(self, node: nodes.Dict) -> nodes.Node:
        self.generic_visit(node)
        for pair in node.items:
            pair.key = _filter(pair.key, "_asyncinfer_read")  # hashed as the dict is built
        return node

    def visit_Getitem(self, node: nodes.Getitem) -> nodes.Node:
        self.generic_visit(node)
        return _filter(node, "_asyncinfer_read") if isinstance(node.arg, nodes.Slice) else node

    def _bodies(self, node: Any) -> Any:
        self.generic_visit(node)
        work, chars = _static(node.body)
        if work:
            node.body.insert(0, nodes.Output([_filter(nodes.Const(work), "_asyncinfer_run", chars)],
                                             lineno=node.lineno))
        if isinstance(node, nodes.For):
            per_item = 1 + (_static([node.test])[0] if node.test is not None else 0)
            node.iter = _filter(node.iter, "_asyncinfer_each", per_item)
        return node

    visit_For = visit_Macro = visit_CallBlock = visit_Block = _bodies


class BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with the budget of the module docstring; its templates are
    :class:`BudgetedTemplate`."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.template_class = BudgetedTemplate
        self.filters["tojson"] = tojson
        self.filters = {name: _wrap_filter(name, f) for name, f in self.filters.items()}
        self.tests = {name: _wrap_filter(name, f) for name, f in self.tests.items()}
        self.filters.update(_asyncinfer_emit=_emit, _asyncinfer_concat=_concat, _asyncinfer_read=_read,
                            _asyncinfer_run=_run, _asyncinfer_each=_each)
        self.globals["range"] = _range
        self.globals["lipsum"] = _lipsum

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        return _Instrument().visit(super()._parse(source, name, filename))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            _check_mul(left, right)
        elif operator == "**":
            _check_pow(left, right)
        elif operator == "+":
            _check_add(left, right)
        elif operator == "%" and isinstance(left, str):
            _check_percent(left, right)
        _charge(1 + _reads(left, right))
        return _built(super().call_binop(context, operator, left, right))

    def getitem(self, obj: Any, argument: Any) -> Any:
        """``obj[argument]``: a key hashed (a dict's) or compared, its size checked first."""
        _check_walk(argument)
        return super().getitem(obj, argument)

    def wrap_str_format(self, value: Any) -> Any:
        """Jinja's sandboxed ``str.format`` and ``format_map`` (handed out with the method), widths checked."""
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        text, name = value.__self__, value.__name__

        @functools.wraps(wrapper)
        def checked(*args: Any, **kwargs: Any) -> Any:
            _check_str_method(text, name, args, kwargs)
            return wrapper(*args, **kwargs)

        return checked

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        values = {k: v for k, v in kwargs.items() if not k.startswith("_")}  # not the loop's own variables
        receiver = getattr(obj, "__self__", None)
        _check_walk(receiver, *args, *values.values())
        _charge(1 + _reads(receiver, *args, *values.values()))
        if isinstance(receiver, str):
            _check_str_method(receiver, getattr(obj, "__name__", ""), args, values)
            if getattr(obj, "__name__", "") == "join" and args:
                items = list(_Metered(args[0], 1)) if not isinstance(args[0], (list, tuple)) else list(args[0])
                _check_join(receiver, items)
                args = (items, *args[1:])
        elif isinstance(obj, LoopContext) and args:  # a recursive loop's next level
            args = (_Metered(args[0], 1), *args[1:])
        return _built(super().call(context, obj, *args, **kwargs))


def _range(*args: int) -> range:
    items = range(*args)
    try:
        count = len(items)
    except OverflowError:
        count = MAX_TEMPLATE_RANGE + 1
    if count > MAX_TEMPLATE_RANGE:
        _refuse(f"asked for a range of more than MAX_TEMPLATE_RANGE = {MAX_TEMPLATE_RANGE} items")
    return items


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    from jinja2.utils import generate_lorem_ipsum

    if isinstance(n, int) and isinstance(max, int):
        _check_value(n * max * 12, "a lorem ipsum")
        _charge(n * max)
    return generate_lorem_ipsum(n=n, html=html, min=min, max=max)


class BudgetedTemplate(jinja2.Template):
    """A template whose ``render`` runs on a budget of its own (:data:`MAX_TEMPLATE_WORK`, ...) and stops past
    :data:`MAX_RENDERED_CHARS` characters of output, with :class:`ChatTemplateLimitError`."""

    def render(self, *args: Any, **kwargs: Any) -> str:
        variables = dict(*args, **kwargs)
        messages = variables.get("messages")
        extra = len(messages) * TEMPLATE_WORK_PER_MESSAGE if isinstance(messages, (list, tuple)) else 0
        token = _CURRENT.set(_Budget(MAX_TEMPLATE_WORK + extra, MAX_TEMPLATE_CHARS))
        try:
            pieces, total = [], 0
            for piece in self.root_render_func(self.new_context(variables)):
                total += len(piece)
                if total > MAX_RENDERED_CHARS:
                    _refuse(f"rendered more than MAX_RENDERED_CHARS = {MAX_RENDERED_CHARS} characters")
                pieces.append(piece)
            return "".join(pieces)
        except Exception:  # noqa: BLE001 - Jinja's handle_exception raises it again, its traceback the template's
            self.environment.handle_exception()
        finally:
            _CURRENT.reset(token)

    def generate(self, *args: Any, **kwargs: Any) -> Iterator[str]:
        yield self.render(*args, **kwargs)


def check_source(source: str) -> None:
    """Refuse a template source longer than :data:`MAX_TEMPLATE_SOURCE_CHARS` before it is compiled."""
    if len(source) > MAX_TEMPLATE_SOURCE_CHARS:
        _refuse(f"is {len(source)} characters long (at most MAX_TEMPLATE_SOURCE_CHARS = "
                f"{MAX_TEMPLATE_SOURCE_CHARS})")
