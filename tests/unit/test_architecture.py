"""The import graph (issue 23, "one home per contract"), read with ast: every import counts,
top-level, function-local and ``if TYPE_CHECKING:`` alike.

(a) the server's and the SDK's import graphs have no cycles; (b) the server's layers
point down: api -> calls -> engine -> hooks -> models -> root modules; (c) the server
imports from the SDK only ``hookwire.wire`` and ``hookwire.v1``, never a private
``hookwire._*`` module; (d) the SDK imports no ``hookwire_server`` module (the server
adds its commands to the ``hookwire`` command through entry points).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = {"hookwire_server": ROOT / "service" / "hookwire_server", "hookwire": ROOT / "client" / "hookwire"}

#: Each layer of the server and the layers it may import (besides its own).
LAYERS = {
    "api": {"calls", "engine", "hooks", "models", "root"},
    "calls": {"engine", "hooks", "models", "root"},
    "engine": {"hooks", "models", "root"},
    "hooks": {"models", "root"},
    "models": {"root"},
    "root": set(),
}
#: The package's __init__ exports names of lower modules lazily (``hookwire_server.serve``):
#: it sits above every layer.
EXEMPT_FROM_LAYERS = {"hookwire_server"}

#: Known violations: none (the engine seam removed the last ones: the models layer
#: imported the scheduler, batching and deferred captures, and the scheduler the models).
#: An exception added here must name its issue, and goes once it is fixed.
KNOWN: set[tuple[str, str]] = set()


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            if rel.parts[0] == "v1":  # generated stubs
                continue
            out[".".join([pkg, *rel.parts]).removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """Every module ``name`` imports, anywhere in it: the module itself where it is one of
    ours or a generated one (hookwire.v1.*), else the package its names come from."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in MODULES else base)
    return {m for m in found if m != name}


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def _ours(edges: set[str]) -> set[str]:
    return {m for m in edges if m in MODULES}


def _cycles(pkg: str, ignore: set[tuple[str, str]]) -> list[list[str]]:
    graph = {m: {t for t in _ours(e) if t.split(".")[0] == pkg and (m, t) not in ignore}
             for m, e in IMPORTS.items() if m.split(".")[0] == pkg}
    cycles, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycles.append(path[path.index(node):] + [node])
            return
        if node in done:
            return
        for nxt in sorted(graph[node]):
            visit(nxt, path + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    return cycles


#: Packages that belong to a layer of another name: the hook runtime (runtime/) is the
#: engine layer's (engines run it, in the front's process or a vLLM worker; it lays steps
#: out as the engine packs them), and nothing below the engine imports it.
SUBLAYERS = {"runtime": "engine"}


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 2 and parts[1] in SUBLAYERS:
        return SUBLAYERS[parts[1]]
    return parts[1] if len(parts) > 2 and parts[1] in LAYERS else "root"


def test_the_hook_runtime_needs_neither_grpc_nor_the_servicers_nor_the_model_registry() -> None:
    """runtime/ runs in vLLM's workers too: what it imports must load there, on bytes alone."""
    runtime = [m for m in IMPORTS if m.startswith("hookwire_server.runtime")]
    assert "hookwire_server.runtime.step" in runtime
    for module in runtime:
        ours = _ours(IMPORTS[module])
        assert not any(m.startswith("grpc") for m in IMPORTS[module]), module
        assert not {m for m in ours if m.startswith(("hookwire_server.api", "hookwire_server.calls"))}, module
        assert "hookwire_server.models.model_registry" not in ours, module


def test_the_server_and_the_sdk_have_no_import_cycles() -> None:
    assert _cycles("hookwire_server", KNOWN) == []
    assert _cycles("hookwire", set()) == []


def test_the_known_exceptions_still_exist() -> None:
    # An exception removed from the code goes from KNOWN too, so that it cannot come back.
    assert {(a, b) for a, b in KNOWN if b not in IMPORTS[a]} == set()


def test_server_layers_point_down() -> None:
    wrong = set()
    for module, edges in IMPORTS.items():
        if not module.startswith("hookwire_server") or module in EXEMPT_FROM_LAYERS:
            continue
        layer = _layer(module)
        for target in _ours(edges):
            if target.startswith("hookwire_server") and target != "hookwire_server":
                if _layer(target) != layer and _layer(target) not in LAYERS[layer]:
                    wrong.add((module, target))
            elif target == "hookwire_server":
                wrong.add((module, target))  # the package's lazy exports: import the module itself
    assert wrong - KNOWN == set()


def test_the_server_imports_only_the_sdks_wire_and_v1_packages() -> None:
    wrong = {(module, target) for module, edges in IMPORTS.items() if module.startswith("hookwire_server")
             for target in edges if target.split(".")[0] == "hookwire"
             and target.split(".")[:2] not in (["hookwire", "wire"], ["hookwire", "v1"])}
    assert wrong == set()


def test_the_sdk_imports_no_server_module() -> None:
    wrong = {(module, target) for module, edges in IMPORTS.items() if module.split(".")[0] == "hookwire"
             for target in edges if target.split(".")[0] == "hookwire_server"}
    assert wrong == set()


def test_the_checks_see_imports_of_every_kind() -> None:
    # The graph reads function-local and TYPE_CHECKING imports too (the cycles it found were type-only).
    assert "hookwire_server.hooks.passes" in IMPORTS["hookwire_server.engine.batching"]  # under TYPE_CHECKING
    assert "hookwire.wire.codec" in IMPORTS["hookwire._harvest"]  # imported inside a function
