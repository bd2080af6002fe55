"""Write docs/config.md, the config reference, from the config dataclasses.

    python scripts/gen_config_doc.py            # rewrites docs/config.md
    python scripts/gen_config_doc.py --check    # exit 1 when docs/config.md is out of date

Every field of the root `Config` (tinyzero.config.root) and of its nested sections, in declaration
order: the dotted key (what `--a.b VALUE` and `a.b=VALUE` set), the type (a Literal's choices
listed), the default and the field's docstring (the string literal under the field, read from the
source with ast, as tyro and `train.py --help` read it). tests/test_docs.py checks that the file is
what this script writes.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import pathlib
import sys
import textwrap
import types
import typing

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "config.md"

HEADER = """# Config reference

Generated from the config dataclasses by `python scripts/gen_config_doc.py`; do not edit by hand
(tests/test_docs.py fails when this page and the dataclasses differ). Every key is a flag of
`train.py`: `--trainer.total_epochs 3` or, Hydra style, `trainer.total_epochs=3`; lists take several
values (`--trainer.logger console jsonl`); booleans take `true` / `false`; `None` is written `null`.
`python train.py --help` prints the same fields. Keys that veRL scripts pass under other names are
translated as [verl.md](verl.md) lists.
"""


def field_docs(cls: type) -> dict[str, str]:
    """field name -> the docstring under it, for `cls` and its dataclass bases (nearest class wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body
        for stmt, nxt in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def _section_type(hint: typing.Any) -> type | None:
    """The dataclass a field holds (also under `X | None`), else None."""
    if dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        classes = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        if len(classes) == 1:
            return classes[0]
    return None


def type_name(hint: typing.Any) -> str:
    """A short, readable type: `int`, `str | None`, `list[str]`, `"a" | "b"` for a Literal."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "None"
    if origin is not None:
        args = ", ".join(type_name(a) for a in typing.get_args(hint))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(hint, "__name__", str(hint).replace("typing.", ""))


def default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def _cell(text: str) -> str:
    """Markdown table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def sections(cls: type, prefix: str = "", doc: str = "") -> list[tuple[str, str, list[tuple[str, str, str, str]]]]:
    """(dotted section name, section doc, [(key, type, default, doc)]) in declaration order; a section's
    doc is its field's docstring in the parent, else its class docstring."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        key = f"{prefix}{f.name}"
        sub = _section_type(hint)
        if sub is not None:
            nested.extend(sections(sub, f"{key}.", docs.get(f.name) or inspect.cleandoc(sub.__doc__ or "")))
        else:
            rows.append((key, type_name(hint), default_text(f), docs.get(f.name, "")))
    own = [(prefix.rstrip("."), doc, rows)] if rows and prefix else []
    return own + nested


def render() -> str:
    """The text of docs/config.md."""
    sys.path.insert(0, str(ROOT / "src"))
    from tinyzero.config.root import Config

    out = [HEADER]
    parts = sections(Config)
    out.append("Sections: " + ", ".join(f"[`{name}`](#{name.replace('.', '')})" for name, _, _ in parts) + ".\n")
    for name, doc, rows in parts:
        out.append(f"## {name}\n")
        if doc:
            out.append(_cell(doc) + "\n")
        out.append("| key | type | default | what it does |")
        out.append("|---|---|---|---|")
        for key, type_, default, fdoc in rows:
            out.append(f"| `{key}` | `{_cell(type_)}` | `{_cell(default)}` | {_cell(fdoc)} |")
        out.append("")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/config.md is out of date")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print("docs/config.md is out of date: run `python scripts/gen_config_doc.py`")
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
