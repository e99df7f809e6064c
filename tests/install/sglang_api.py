"""What a consumer uses of sglang, checked against sglang's source read from its wheel (never imported).

For each consumer file (upstream's SGLang launcher modules, the plugin's profile_decode): every ``from sglang...
import name`` resolves to a definition (following re-exports and ``LazyImport``), every attribute used on an
sglang module, class or instance exists (methods through the class's sglang bases), every call passes arguments
the callee accepts, and every tuple unpacking of a call matches the number of values each of the callee's
``return (...)`` gives. Names are bound per file (imports anywhere in it, ``x = SglangClass(...)``), which is
how these files use sglang.
"""

from __future__ import annotations

import ast
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Definition:
    module: str
    node: ast.AST  # ClassDef, FunctionDef, Module (a module), or any other binding (exists, shape unknown)


def _top_level(body: list[ast.stmt]):
    """Statements of a module body, including those inside top-level if/try blocks."""
    for stmt in body:
        if isinstance(stmt, ast.If | ast.Try):
            blocks = [stmt.body, stmt.orelse]
            if isinstance(stmt, ast.Try):
                blocks += [h.body for h in stmt.handlers] + [stmt.finalbody]
            for block in blocks:
                yield from _top_level(block)
        else:
            yield stmt


class SglangSource:
    """The ``sglang`` package inside a wheel, parsed on demand."""

    def __init__(self, wheel: Path) -> None:
        self._zip = zipfile.ZipFile(wheel)
        self._files = set(self._zip.namelist())
        self._parsed: dict[str, ast.Module | None] = {}

    def text(self, path: str) -> str:
        return self._zip.read(path).decode()

    def _path(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for path in (f"{base}.py", f"{base}/__init__.py"):
            if path in self._files:
                return path
        return None

    def module(self, module: str) -> ast.Module | None:
        if module not in self._parsed:
            path = self._path(module)
            self._parsed[module] = ast.parse(self.text(path)) if path else None
        return self._parsed[module]

    def resolve(self, module: str, name: str, depth: int = 0) -> Definition | None:
        """Where ``module.name`` is defined, or None if sglang has no such name."""
        tree = self.module(module)
        if tree is None or depth > 10:
            return None
        is_package = self._path(module).endswith("__init__.py")
        star_sources = []
        for stmt in _top_level(tree.body):
            if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and stmt.name == name:
                return Definition(module, stmt)
            if isinstance(stmt, ast.ImportFrom):
                if stmt.names[0].name == "*":
                    star_sources.append(_absolute(module, stmt, is_package))
                for alias in stmt.names:
                    if (alias.asname or alias.name) == name:
                        source = _absolute(module, stmt, is_package)
                        if not source.startswith("sglang"):
                            return Definition(module, stmt)
                        return self.resolve(source, alias.name, depth + 1) or self._submodule(
                            source, alias.name
                        )
            if isinstance(stmt, ast.Import) and any((a.asname or a.name) == name for a in stmt.names):
                return Definition(module, stmt)
            targets = (
                stmt.targets
                if isinstance(stmt, ast.Assign)
                else [stmt.target]
                if isinstance(stmt, ast.AnnAssign)
                else []
            )
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                lazy = _lazy_import(stmt.value)
                return self.resolve(*lazy, depth + 1) if lazy else Definition(module, stmt)
        for star in star_sources:
            found = self.resolve(star, name, depth + 1) if star.startswith("sglang") else None
            if found is not None:
                return found
        return self._submodule(module, name) if is_package else None

    def _submodule(self, module: str, name: str) -> Definition | None:
        tree = self.module(f"{module}.{name}")
        return Definition(f"{module}.{name}", tree) if tree is not None else None

    def member(self, cls: Definition, name: str) -> Definition | None:
        """A method or class attribute of ``cls``, looked up through its bases defined in sglang."""
        for stmt in cls.node.body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) and stmt.name == name:
                return Definition(cls.module, stmt)
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and stmt.target.id == name
            ):
                return Definition(cls.module, stmt)
        for node in ast.walk(cls.node):  # instance attributes: self.<name> = ... in any method
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign) and any(
                isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                and t.attr == name
                for t in targets
            ):  # fmt: skip
                return Definition(cls.module, node)
        for base in cls.node.bases:
            if isinstance(base, ast.Name):
                found = self.resolve(cls.module, base.id)
                if found is not None and isinstance(found.node, ast.ClassDef):
                    hit = self.member(found, name)
                    if hit is not None:
                        return hit
        return None

    def fields(self, module: str, name: str) -> set[str]:
        """The annotated fields of a dataclass (or msgspec struct) defined in its own body."""
        cls = self.resolve(module, name)
        out = set()
        for stmt in cls.node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                out.add(stmt.target.id)
        return out

    def parameters(self, module: str, cls: str, method: str) -> set[str]:
        func = self.member(self.resolve(module, cls), method).node
        args = func.args
        return {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs} - {"self", "cls"}


def _absolute(module: str, stmt: ast.ImportFrom, is_package: bool) -> str:
    if not stmt.level:
        return stmt.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (stmt.level - 1)]
    return ".".join(base + ([stmt.module] if stmt.module else []))


def _lazy_import(value: ast.AST | None) -> tuple[str, str] | None:
    """``LazyImport("sglang.x", "Name")`` -> ("sglang.x", "Name")."""
    if (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == "LazyImport"
        and len(value.args) == 2
        and all(isinstance(a, ast.Constant) for a in value.args)
    ):
        return value.args[0].value, value.args[1].value
    return None


def _is_static(func: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in func.decorator_list)


def _call_problem(func: ast.FunctionDef, call: ast.Call, bound: bool) -> str | None:
    """Why ``call`` does not fit ``func``'s signature (``bound``: the first parameter is self/cls), or None."""
    args = func.args
    positional = [a.arg for a in args.posonlyargs + args.args][1 if bound else 0 :]
    names = {a.arg for a in args.args + args.kwonlyargs}
    starred = any(isinstance(a, ast.Starred) for a in call.args)
    if not starred and len(call.args) > len(positional) and args.vararg is None:
        return f"passes {len(call.args)} positional arguments, {func.name} takes {len(positional)}"
    for kw in call.keywords:
        if kw.arg is not None and kw.arg not in names and args.kwarg is None:
            return f"passes {kw.arg}=, which {func.name} does not take"
    return None


def _return_arities(func: ast.FunctionDef) -> list[int | None]:
    """The tuple length of each ``return`` in ``func`` itself (None: not a tuple literal)."""
    out = []
    stack = list(func.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue
        if isinstance(node, ast.Return):
            out.append(len(node.value.elts) if isinstance(node.value, ast.Tuple) else None)
        stack.extend(ast.iter_child_nodes(node))
    return out


def check_consumer(source: SglangSource, path: Path, label: str) -> list[str]:
    """Everything ``path`` uses of sglang that the sglang in ``source`` lacks or takes differently."""
    tree = ast.parse(path.read_text())
    problems: list[str] = []
    bound: dict[str, Definition] = {}  # local name -> what it is in sglang
    instances: dict[str, Definition] = {}  # local name -> the sglang class it is an instance of

    def say(node: ast.AST, text: str) -> None:
        problems.append(f"{label}:{node.lineno}: {text}")

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang") and not node.level:
            for alias in node.names:
                found = source.resolve(node.module, alias.name)
                if found is None:
                    say(node, f"from {node.module} import {alias.name}: sglang has no such name")
                else:
                    bound[alias.asname or alias.name] = found
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "sglang":
                    bound[alias.asname or "sglang"] = Definition("sglang", source.module("sglang"))

    def target(expr: ast.AST) -> tuple[Definition | None, bool]:
        """What ``expr`` names in sglang, and whether calling it binds self/cls."""
        if isinstance(expr, ast.Name):
            return bound.get(expr.id), False
        if not isinstance(expr, ast.Attribute):
            return None, False
        if isinstance(expr.value, ast.Name) and expr.value.id in instances:
            member = source.member(instances[expr.value.id], expr.attr)
            if member is None:
                say(
                    expr,
                    f"{expr.value.id}.{expr.attr}: {instances[expr.value.id].node.name} has no such member",
                )
            return member, True
        owner, _ = target(expr.value)
        if owner is None:
            return None, False
        if isinstance(owner.node, ast.Module):
            found = source.resolve(owner.module, expr.attr)
            if found is None:
                say(expr, f"{owner.module}.{expr.attr}: sglang has no such name")
            return found, False
        if isinstance(owner.node, ast.ClassDef):
            member = source.member(owner, expr.attr)
            if member is None:
                say(expr, f"{owner.node.name}.{expr.attr}: no such member")
                return None, False
            return member, not (isinstance(member.node, ast.FunctionDef) and _is_static(member.node))
        return None, False

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            callee, _ = target(node.value.func)
            if callee is not None and isinstance(callee.node, ast.ClassDef):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        instances[t.id] = callee

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            target(node)
        if not isinstance(node, ast.Call):
            continue
        callee, is_bound = target(node.func)
        if callee is None:
            continue
        func = callee.node
        if isinstance(func, ast.ClassDef):
            init = source.member(callee, "__init__")
            func, is_bound = (init.node, True) if init is not None else (None, False)
        if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            problem = _call_problem(func, node, is_bound)
            if problem:
                say(node, problem)

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            unpacked = [t for t in node.targets if isinstance(t, ast.Tuple)]
            callee, _ = target(node.value.func)
            if not unpacked or callee is None or not isinstance(callee.node, ast.FunctionDef):
                continue
            want = len(unpacked[0].elts)
            got = _return_arities(callee.node)
            if not got or any(n != want for n in got):
                say(node, f"unpacks {want} values from {callee.node.name}, which returns {got}")
    return sorted(set(problems))


def routes(source: SglangSource) -> set[str]:
    """The HTTP paths sglang's server registers (``@app.get/post/put/api_route("/path"...)``)."""
    tree = ast.parse(source.text("sglang/srt/entrypoints/http_server.py"))
    out = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "app"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.add(node.args[0].value)
    return out
