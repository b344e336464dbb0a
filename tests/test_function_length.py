"""Habits the house keeps (issue 38 item 8), read from the source with ast:

- no function in product code (kvpool, transfer, disagg) has more than 45 logical lines
  (statements, as `tokenize` ends them, docstring included): a long function is several
  concepts, give each its name. Logical, not physical, lines: the formatter may spread one
  call over several lines without making a function longer;
- none takes more than 6 positional parameters (besides self): the rest are keyword-only, so
  a new parameter cannot silently take another's place;
- a wire message is built with its required fields by position at most: its optional fields by
  name (TransferDone's `settled` once landed in a new `digest` field by position)."""

import ast
import io
import tokenize
from pathlib import Path

import msgspec

from disagg.control import messages

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 45
MAX_POSITIONAL = 6
PRODUCT = ("kvpool", "transfer", "disagg")


def _sources(packages=PRODUCT):
    for pkg in packages:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            text = f.read_text()
            yield f.relative_to(ROOT), text, ast.parse(text)


def _functions(tree):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def lengths() -> dict[str, int]:
    out = {}
    for name, text, tree in _sources():
        ends = [t.start[0] for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.NEWLINE]
        for node in _functions(tree):
            out[f"{name}:{node.lineno}:{node.name}"] = sum(node.lineno <= line <= node.end_lineno for line in ends)
    return out


def test_no_function_is_longer_than_the_limit():
    long = {name: n for name, n in lengths().items() if n > LIMIT}
    assert long == {}, f"functions over {LIMIT} logical lines (split them, each part named for what it does): {long}"


def test_no_function_takes_more_than_six_positional_parameters():
    many = {}
    for name, _, tree in _sources():
        for node in _functions(tree):
            pos = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
            if len(pos) > MAX_POSITIONAL:
                many[f"{name}:{node.lineno}:{node.name}"] = pos
    assert many == {}, f"more than {MAX_POSITIONAL} positional parameters (make the rest keyword-only): {many}"


def test_wire_messages_get_their_optional_fields_by_name():
    required = {}
    for cls in vars(messages).values():
        if isinstance(cls, type) and issubclass(cls, msgspec.Struct) and cls.__module__ == messages.__name__:
            info = msgspec.structs.fields(cls)
            required[cls.__name__] = sum(f.required for f in info)
    wrong = []
    for name, _, tree in _sources((*PRODUCT, "tests", "scripts")):
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in required
                and len(node.args) > required[node.func.id]
            ):
                wrong.append(f"{name}:{node.lineno}: {node.func.id} with {len(node.args)} positional arguments")
    assert wrong == [], wrong
