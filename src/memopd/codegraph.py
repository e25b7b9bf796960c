"""The code a pipeline step runs: the import closure of its command, read from the source with `ast`
(nothing is imported, so reading it has no side effects), and one hash of that code for Snakemake.

A step's command is named as "module:function" (e.g. "memopd.train.commands:cmd_train"). Its closure starts
from the module's top-level imports, the imports inside the function and inside the module's functions it
calls, and then follows every import of every module reached, including imports inside functions (the
package imports lazily, so a function-level import is as much a dependency as a top-level one). Importing
`a.b.c` runs `a/__init__.py` and `a/b/__init__.py` too, so parent packages are part of it.

The hash changes with the content of any file in the closure (a comment too), and with nothing else: a
change to code that the command never imports does not rerun its step.
"""
from __future__ import annotations

import ast
import hashlib
from functools import lru_cache
from pathlib import Path


def module_files(src: Path, package: str = "memopd") -> dict[str, Path]:
    """Every module of the package under src/ by dotted name (a package by its __init__.py)."""
    out = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _resolve(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: dict) -> set[str]:
    """The package's modules an import statement loads (with their parent packages)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
            base = ".".join(anchor + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    out = set()
    for name in names:
        while name and name not in modules and "." in name:  # `import a.b.attr` style: the longest module
            name = name.rsplit(".", 1)[0]
        if name in modules:
            out |= {name, *(p for p in _parents(name) if p in modules)}
    return out


def _imports_in(nodes, module: str, is_package: bool, modules: dict) -> set[str]:
    return {m for node in nodes for sub in ast.walk(node) if isinstance(sub, (ast.Import, ast.ImportFrom))
            for m in _resolve(sub, module, is_package, modules)}


def _tree(path: Path) -> ast.Module:
    st = path.stat()  # parsed once per content version: Snakemake asks for every rule's closure
    return _parse(path, st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=None)
def _parse(path: Path, _mtime_ns: int, _size: int) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def imports_of(module: str, modules: dict[str, Path]) -> set[str]:
    """Every module of the package that `module` imports anywhere in its source."""
    path = modules[module]
    return _imports_in([_tree(path)], module, path.name == "__init__.py", modules) - {module}


def _function_nodes(module: str, function: str, modules: dict[str, Path]) -> list[ast.stmt]:
    """The statements of `module` that running `function` executes: the module's top level (imports,
    constants, classes) and the function with the module's functions it refers to by name, transitively."""
    tree = _tree(modules[module])
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    if function not in defs:
        raise KeyError(f"{module} has no function {function}")
    reached, todo = [], [function]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.append(name)
            todo += [n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name) and n.id in defs]
    return [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            or n.name in reached]


def _function_roots(module: str, function: str, modules: dict[str, Path]) -> set[str]:
    """The modules running `module.function` imports directly, with the module and its parent packages."""
    roots = _imports_in(_function_nodes(module, function, modules), module,
                        modules[module].name == "__init__.py", modules)
    return roots | {module, *(p for p in _parents(module) if p in modules)}


def closure(target: str, modules: dict[str, Path]) -> set[str]:
    """The package's modules that running `target` ("module:function", or a whole "module") may import."""
    module, _, function = target.partition(":")
    if not function:  # importing a module runs its parent packages' __init__ first
        todo, seen = [module, *(p for p in _parents(module) if p in modules)], set()
    else:  # the module itself only through what the function reaches: its other functions' imports are not run
        todo, seen = list(_function_roots(module, function, modules) - {module}), {module}
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += imports_of(m, modules) - seen
    return seen


def code_hash(target: str, src: Path, package: str = "memopd") -> str:
    """sha256 (16 hex digits) over the closure's files, by module name and content; of the command's own
    module only the statements the function executes, so that its other commands do not count."""
    modules = module_files(src, package)
    module, _, function = target.partition(":")
    h = hashlib.sha256()
    for m in sorted(closure(target, modules)):
        if m == module and function:
            text = modules[m].read_text()
            body = "\n".join(ast.get_source_segment(text, n) or "" for n in _function_nodes(m, function, modules))
            h.update(m.encode() + b"\0" + body.encode() + b"\0")
        else:
            h.update(m.encode() + b"\0" + modules[m].read_bytes() + b"\0")
    return h.hexdigest()[:16]


def command_targets(src: Path, package: str = "memopd") -> dict[str, str]:
    """Every CLI command ("audit alignment") -> the function that runs it ("memopd.audit.commands:cmd_..."), read
    from the `cli.add("<command>", <function>, ...)` calls of the package's register functions."""
    out = {}
    for module, path in module_files(src, package).items():
        for node in ast.walk(_tree(path)):
            if _is_add(node) and len(node.args) >= 2 and isinstance(node.args[1], ast.Name):
                out[node.args[0].value] = f"{module}:{node.args[1].id}"
    return out


def _is_add(n: ast.AST) -> bool:
    """A `cli.add("<command>", ...)` call."""
    return (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add"
            and isinstance(n.func.value, ast.Name) and n.func.value.id == "cli" and bool(n.args)
            and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str))


def _adds(node: ast.AST) -> str | None:
    """The command a statement registers (a `cli.add("<command>", ...)` call anywhere in it), or None."""
    return next((n.args[0].value for n in ast.walk(node) if _is_add(n)), None)


def registration(command: str, src: Path, package: str = "memopd") -> str:
    """The source of the statements that register `command` and its arguments: its `cli.add(...)` statement and
    every statement after it up to the next command's (the `sp.add_argument(...)` calls with their defaults, which
    a rule may rely on without passing the flag). Empty if no module registers it."""
    for module, path in module_files(src, package).items():
        text = path.read_text()
        for fn in ast.walk(_tree(path)):
            if not isinstance(fn, ast.FunctionDef):
                continue
            out, inside = [], False
            for stmt in fn.body:
                added = _adds(stmt)
                if added is not None:
                    inside = added == command
                if inside:
                    out.append(ast.get_source_segment(text, stmt) or "")
            if out:
                return "\n".join(out)
    return ""


def command_hash(command: str, src: Path, package: str = "memopd", targets: dict[str, str] | None = None) -> str:
    """`code_hash` of the function running `command`, and of the statements registering its arguments (their
    defaults are part of what the step runs): "module:function@hash". `targets`: `command_targets(src, package)`,
    when the caller holds it already."""
    target = (targets or command_targets(src, package))[command]
    h = hashlib.sha256((code_hash(target, src, package) + "\0" + registration(command, src, package)).encode())
    return f"{target}@{h.hexdigest()[:16]}"


def package_hash(src: Path, package: str = "memopd") -> str:
    """sha256 (16 hex digits) over every module of the package, by name and content: the code of a step that
    may run any command (a nested workflow)."""
    h = hashlib.sha256()
    for m, path in sorted(module_files(src, package).items()):
        h.update(m.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]
