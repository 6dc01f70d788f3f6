"""The package's module graph: no import cycle (imports inside functions count too: a deferred
import is still a dependency), and the dattn.diffusers subpackage with its former names."""

import ast
import os

import dattn


def _modules():
    """{module name: path} of every module of the installed package (the compiled _core too)."""
    root = os.path.dirname(dattn.__file__)
    found = {}
    for folder, _, files in os.walk(root):
        for f in files:
            if f.endswith(".so"):  # an extension: a module that imports nothing of ours
                rel = os.path.relpath(os.path.join(folder, f.split(".")[0]), root).split(os.sep)
                found[".".join(["dattn"] + rel)] = None
            elif f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), root)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                found[".".join(["dattn"] + rel)] = os.path.join(folder, f)
    return found


def _imports(name, path, modules):
    """The dattn modules ``name`` imports, anywhere in its source."""
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from . import x` names a module x; `from .m import f` names module m.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("dattn"):
                out.add(t)
    return out


def test_the_package_has_no_import_cycle():
    modules = _modules()
    graph = {m: _imports(m, p, modules) if p else set() for m, p in modules.items()}
    # A package's own __init__ importing its submodules is how packages are built; a submodule
    # reaching back to its package is what would close a cycle, so both count.
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if n == "dattn":
                continue  # the top-level package re-exports; nothing inside imports it back
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
    assert "dattn.torch_adapter" not in graph["dattn.attention"]


def test_nothing_imports_the_top_level_package_back():
    modules = _modules()
    for m, p in modules.items():
        if m != "dattn" and p is not None:
            assert "dattn" not in _imports(m, p, modules), m


def test_the_diffusers_subpackage_keeps_its_names():
    import dattn.diffusers as dd
    import dattn.diffusers_backend as former
    from dattn.diffusers import backend, handle, video

    assert former is backend
    for name in ("enable", "disable", "handle_of", "register", "unregister", "registered",
                 "backend_client", "enable_parallelism", "DiffusersHandle"):
        assert getattr(dd, name) is getattr(handle, name)
    assert callable(former._forward_op) and callable(former.register)
    assert set(video.GEOMETRY) >= {"WanTransformer3DModel", "HunyuanVideoTransformer3DModel",
                                   "CogVideoXTransformer3DModel", "LTXVideoTransformer3DModel"}
