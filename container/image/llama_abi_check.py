#!/usr/bin/env python3
"""Check that llama-cpp-python's ctypes bindings match a llama.cpp build: headers, struct layouts, symbols.

ctypes cannot see a C header, so bindings written for one llama.cpp commit load a library built from
another without complaint and then pass structs of the wrong size by value. This check fails instead:

    python3 llama_abi_check.py --bindings <site-packages>/llama_cpp/llama_cpp.py \\
        --header <llama.cpp>/include/llama.h [--include <dir> ...] [--library libllama.so] [--cc gcc]

  * every struct the bindings declare has the header's fields, in the header's order;
  * with --cc, every such struct has the header's size and field offsets (a C probe against the header,
    compared with the bindings' ctypes layout: the bindings module is imported, so it loads --library);
  * every enum constant the bindings define has the header's value;
  * every function the bindings bind is declared in the header with as many parameters;
  * with --library, every such function is exported by that library (nm -D).

Exit status: 0 when all agree, 1 with one line per mismatch on stderr, 2 on a usage error.
The image build runs it on the llama.cpp it compiles and on the DLC's (docs/explanation/image.md).
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_IDENT = re.compile(r"[A-Za-z_]\w*")


def strip_comments(text: str) -> str:
    """Comments removed, and DEPRECATED(declaration, "hint") unwrapped to the declaration."""
    text = _COMMENTS.sub("", text)
    return re.sub(r'DEPRECATED\(\s*(.*?)\s*,\s*"[^"]*"\s*\)', r"\1", text, flags=re.S)


def _blocks(text: str, keyword: str):
    """(name, body) for every ``<keyword> name { body }`` at any nesting, body without its braces."""
    for match in re.finditer(rf"\b{keyword}\s+(\w+)\s*\{{", text):
        depth, start = 1, match.end()
        i = start
        while depth and i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        yield match.group(1), text[start:i - 1]


def header_structs(text: str) -> dict[str, list[str]]:
    """Struct name -> field names in order (an anonymous union is one field named ``<union>``)."""
    structs = {}
    for name, body in _blocks(text, "struct"):
        flat = re.sub(r"union\s*\{[^{}]*\}", "__union__ __anon_union__", body)
        fields = []
        for declaration in flat.split(";"):
            declaration = re.sub(r"\[[^\]]*\]", "", declaration).strip()
            if not declaration:
                continue
            if "(" in declaration:  # a function pointer: (*name)(args)
                found = re.search(r"\(\s*\*\s*(\w+)\s*\)", declaration)
                fields.append(found.group(1) if found else declaration)
                continue
            names = [part.strip().split()[-1].lstrip("*") for part in declaration.split(",")]
            fields.extend("<union>" if n == "__anon_union__" else n for n in names)
        structs[name] = fields
    return structs


def _int_value(expression: str, known: dict[str, int]) -> int | None:
    expression = expression.strip()
    try:
        return int(eval(expression, {"__builtins__": {}}, dict(known)))  # noqa: S307  (C integer expressions only)
    except Exception:
        return None


def header_enums(text: str) -> dict[str, int]:
    values: dict[str, int] = {}
    for _, body in _blocks(text, "enum"):
        next_value = 0
        for item in body.split(","):
            item = item.strip()
            if not item:
                continue
            name, _, expression = item.partition("=")
            name = name.strip()
            value = _int_value(expression, values) if expression else next_value
            if value is None:
                continue
            values[name] = value
            next_value = value + 1
    return values


def header_functions(text: str) -> dict[str, int]:
    """Function name -> number of parameters, for every LLAMA_API declaration."""
    functions = {}
    for match in re.finditer(r"LLAMA_API\b([^;{]*?)\b(\w+)\s*\(([^;{]*?)\)\s*(?:,\s*\"[^\"]*\"\s*\))?\s*;", text, re.S):
        name, params = match.group(2), match.group(3).strip()
        functions[name] = 0 if params in ("", "void") else params.count(",") + 1
    return functions


def binding_declarations(source: str) -> tuple[dict[str, list[str]], dict[str, int], dict[str, int]]:
    """(struct fields, enum-like int constants, bound functions -> argument count) from the bindings' source."""
    tree = ast.parse(source)
    structs, constants, functions = {}, {}, {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for statement in node.body:
                targets = getattr(statement, "targets", None) or [getattr(statement, "target", None)]
                if any(isinstance(t, ast.Name) and t.id == "_fields_" for t in targets) and statement.value is not None:
                    if isinstance(statement.value, ast.List):
                        structs[node.name] = [e.elts[0].value for e in statement.value.elts
                                              if isinstance(e, ast.Tuple) and isinstance(e.elts[0], ast.Constant)]
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name.isupper() and (name.startswith(("LLAMA_", "GGML_"))):
                try:
                    value = ast.literal_eval(node.value)
                except ValueError:
                    value = None
                if isinstance(value, int) and not isinstance(value, bool):
                    constants[name] = value
        elif isinstance(node, ast.FunctionDef):
            for decorator in node.decorator_list:
                if (isinstance(decorator, ast.Call) and getattr(decorator.func, "id", "") == "ctypes_function"
                        and decorator.args and isinstance(decorator.args[0], ast.Constant)):
                    args = decorator.args[1] if len(decorator.args) > 1 else None
                    functions[decorator.args[0].value] = len(args.elts) if isinstance(args, ast.List) else -1
    return structs, constants, functions


def exported_symbols(library: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True)
    return {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}


def _c_layouts(header: Path, includes: list[Path], structs: dict[str, list[str]], cc: str) -> dict[str, tuple]:
    """(sizeof, [offsetof each named field]) per struct, from a C program compiled against the header."""
    lines = ["#include <stdio.h>", "#include <stddef.h>", f'#include "{header.name}"', "int main(void) {"]
    for name, fields in structs.items():
        offsets = " ".join(f"%zu" for f in fields if f != "<union>")
        arguments = "".join(f", offsetof(struct {name}, {f})" for f in fields if f != "<union>")
        lines.append(f'  printf("{name} %zu {offsets}\\n", sizeof(struct {name}){arguments});')
    lines += ["  return 0;", "}"]
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "probe.c", Path(tmp) / "probe"
        source.write_text("\n".join(lines))
        flags = [f"-I{header.parent}"] + [f"-I{d}" for d in includes]
        subprocess.run([cc, *flags, str(source), "-o", str(binary)], check=True, capture_output=True, text=True)
        out = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout
    layouts = {}
    for line in out.splitlines():
        name, size, *offsets = line.split()
        layouts[name] = (int(size), [int(o) for o in offsets])
    return layouts


def _ctypes_layouts(bindings: Path, library: Path | None, names: list[str]) -> dict[str, tuple]:
    if library is not None:
        os.environ["LLAMA_CPP_LIB_PATH"] = str(library.parent)
    spec = importlib.util.spec_from_file_location("llama_cpp.llama_cpp", bindings,
                                                  submodule_search_locations=None)
    module = importlib.import_module("llama_cpp.llama_cpp") if spec is None else None
    if module is None:
        sys.path.insert(0, str(bindings.parent.parent))
        module = importlib.import_module("llama_cpp.llama_cpp")
    layouts = {}
    for name in names:
        cls = getattr(module, name)
        offsets = [getattr(cls, field).offset for field, *_ in cls._fields_]
        layouts[name] = (ctypes.sizeof(cls), offsets)
    return layouts


# Declared by the bindings but never reached by the adapter, with the drift found in llama-cpp-python 0.3.36
# itself (its llama_opt_params lacks the header's optimizer_type): training only; SemIf never trains.
IGNORED = {"llama_opt_params": "training API, unused by SemIf"}


def check(*, bindings: Path, header: Path, includes: list[Path] = (), library: Path | None = None,
          cc: str | None = None, ignore: dict[str, str] = IGNORED) -> list[str]:
    """Every mismatch between the bindings and the llama.cpp described by ``header`` (and ``library``)."""
    text = strip_comments(header.read_text())
    c_structs, c_enums, c_functions = header_structs(text), header_enums(text), header_functions(text)
    py_structs, py_constants, py_functions = binding_declarations(bindings.read_text())
    problems = []
    common = [name for name in py_structs if name in c_structs and name not in ignore]
    for name in common:
        py_fields, c_fields = py_structs[name], c_structs[name]
        # An anonymous union in C is one named field in ctypes.
        same = len(py_fields) == len(c_fields) and all(c in ("<union>", p) for p, c in zip(py_fields, c_fields))
        if not same:
            missing = [f for f in c_fields if f not in py_fields and f != "<union>"]
            extra = [f for f in py_fields if f not in c_fields]
            detail = f"header has {missing} the bindings lack" if missing else ""
            detail += ("; " if detail and extra else "") + (f"bindings have {extra} the header lacks" if extra else "")
            problems.append(f"struct {name}: fields differ ({detail or 'same fields, different order'})")
    for name, value in sorted(py_constants.items()):
        if name in c_enums and c_enums[name] != value:
            problems.append(f"enum {name}: header {c_enums[name]}, bindings {value}")
    for name, arg_count in sorted(py_functions.items()):
        if name in ignore:
            continue
        if name not in c_functions:
            if name.startswith("llama_"):
                problems.append(f"function {name}: bound, but not declared in the header")
        elif arg_count >= 0 and c_functions[name] != arg_count:
            problems.append(f"function {name}: header takes {c_functions[name]} parameters, bindings pass {arg_count}")
    if library is not None:
        symbols = exported_symbols(library)
        for name in sorted(py_functions):
            if name.startswith("llama_") and name in c_functions and name not in symbols:
                problems.append(f"symbol {name}: not exported by {library.name}")
    if cc and not problems:
        clean = [n for n in common if "<union>" not in c_structs[n]]
        c_layout = _c_layouts(header, list(includes), {n: c_structs[n] for n in clean}, cc)
        py_layout = _ctypes_layouts(bindings, library, clean)
        for name in clean:
            if c_layout[name] != py_layout[name]:
                problems.append(f"struct {name}: C size/offsets {c_layout[name]} != ctypes {py_layout[name]}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bindings", type=Path, required=True, help="llama_cpp/llama_cpp.py")
    parser.add_argument("--header", type=Path, required=True, help="llama.h of the llama.cpp to load")
    parser.add_argument("--include", type=Path, action="append", default=[], help="ggml headers' directory")
    parser.add_argument("--library", type=Path, help="libllama.so to check symbols of (and to load for sizes)")
    parser.add_argument("--cc", help="C compiler for the struct size and offset probe")
    args = parser.parse_args(argv)
    for path in (args.bindings, args.header):
        if not path.is_file():
            print(f"llama_abi_check: {path} does not exist", file=sys.stderr)
            return 2
    problems = check(bindings=args.bindings, header=args.header, includes=args.include, library=args.library,
                     cc=args.cc)
    for problem in problems:
        print(f"ABI mismatch: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"llama_abi_check: bindings and {args.header} agree"
          + (f" (and {args.library.name} exports every bound function)" if args.library else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
