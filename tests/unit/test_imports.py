"""The import graph of services/, shared/ and bench/, read statically (ast, nothing imported).

- No import cycle among their modules, counting every import: module level, inside
  functions, relative ones, `importlib.import_module("literal")` calls, and those under
  `if TYPE_CHECKING:` (a type-only circle is still two modules that need each other).
- The processes that never touch tensors (DESIGN.md section 1: api, data worker,
  conductor, the launcher, and everything in shared/) never import torch: no module of
  theirs imports it (at module level or inside a function), and nothing they import at
  module level does, however far down services/ and shared/ the chain goes.
- shared/ imports no service.
- The api's dialects (`services/api/dialects/*/`) import the core only: no dialect imports
  another, and no core module imports a dialect (`app.py` mounts them).

Imports under `if TYPE_CHECKING:` never run: they count for cycles, not for torch.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("services", "shared", "bench")

#: modules (and packages) whose processes never import torch
TORCH_FREE = ("shared", "services.api", "services.data_worker", "services.conductor", "services.launcher")
#: what counts as importing torch: torch itself, or a library that imports it when imported
TORCH = ("torch", "torchaudio", "torchvision", "flashinfer", "triton", "transformers", "safetensors.torch")

#: Known violations of the torch rule, each with its reason; the test fails when one is
#: gone too, so the entry is removed with the fix rather than left to excuse a new one.
#: (module, function holding the torch import) -> why it is still there
KNOWN_TORCH_IMPORTS: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    target: str  # the dotted name imported (an internal module where it resolves to one)
    line: int
    scope: str  # the enclosing function ("Class.method"), "" at module level
    type_only: bool = False  # under `if TYPE_CHECKING:`: never run

    @property
    def in_function(self) -> bool:
        return bool(self.scope)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    out = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            if "__pycache__" not in path.parts:
                out[_module_name(path)] = path
    return out


def _resolve(name: str) -> str:
    """`name` as the internal module it loads (the longest internal prefix), else as is."""
    mods = modules()
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in mods:
            return ".".join(parts[:n])
    return name


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool) -> None:
        self.module, self.is_package = module, is_package
        self.scopes: list[str] = []  # enclosing classes and functions
        self.functions = 0  # how many of them are functions
        self.found: list[Import] = []
        self.type_only = False  # inside `if TYPE_CHECKING:`

    def _add(self, name: str, line: int) -> None:
        self.found.append(Import(_resolve(name), line, ".".join(self.scopes) if self.functions else "",
                                 self.type_only))

    def _scope(self, node, name: str, function: bool) -> None:
        self.scopes.append(name)
        self.functions += function
        self.generic_visit(node)
        self.functions -= function
        self.scopes.pop()

    def visit_FunctionDef(self, node) -> None:
        self._scope(node, node.name, True)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._scope(node, "<lambda>", True)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scope(node, node.name, False)  # a class body runs at import

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            self.type_only = True
            for child in node.body:
                self.visit(child)
            self.type_only = False
            for child in node.orelse:  # the else branch runs
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            package = self.module.split(".")
            if not self.is_package:
                package = package[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        for alias in node.names:
            # `from pkg import sub` loads the submodule pkg.sub where there is one
            sub = f"{base}.{alias.name}"
            self._add(sub if sub in modules() or (_is_torch(sub) and not _is_torch(base)) else base, node.lineno)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        is_import_module = (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
            isinstance(f, ast.Name) and f.id == "import_module")
        if (is_import_module and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)):
            self._add(node.args[0].value, node.lineno)
        self.generic_visit(node)


@cache
def imports_of(module: str) -> tuple[Import, ...]:
    path = modules()[module]
    collector = _Collector(module, path.name == "__init__.py")
    collector.visit(ast.parse(path.read_text(), str(path)))
    return tuple(collector.found)


def _internal(imp: Import) -> bool:
    return imp.target in modules()


def _is_torch(name: str) -> bool:
    return any(name == t or name.startswith(t + ".") for t in TORCH)


def _torch_free(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in TORCH_FREE)


def test_the_walk_sees_every_kind_of_import():
    """The collector itself: relative, function-level, TYPE_CHECKING and import_module."""
    mods = modules()
    assert {"shared.specs.base", "shared.specs.registry", "services.gpu_worker.modeling.registry",
            "services.launcher", "services.api"} <= set(mods)
    code = ("from typing import TYPE_CHECKING\nimport importlib\nfrom . import base\nfrom .registry import x\n"
            "from .. import frames\nif TYPE_CHECKING:\n    import torch\n"
            "def f():\n    import torch.nn\n    importlib.import_module('shared.layout')\n")
    c = _Collector("shared.specs.decoder_lm", False)
    c.visit(ast.parse(code))
    got = {(i.target, i.in_function, i.type_only) for i in c.found}
    assert got == {("typing", False, False), ("importlib", False, False), ("shared.specs.base", False, False),
                   ("shared.specs.registry", False, False), ("shared.frames", False, False),
                   ("torch", False, True), ("torch.nn", True, False), ("shared.layout", True, False)}, got


def _find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """One cycle of `graph` as a path whose last node is its first, else None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert _find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": ["b", "c"], "b": ["c"], "c": []}) is None


def test_no_import_cycle():
    graph = {m: sorted({i.target for i in imports_of(m) if _internal(i) and i.target != m}) for m in modules()}
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _torch_chains(module: str) -> list[tuple[list[str], Import]]:
    """Every way `module` imports torch at run time: (chain of modules ending in torch,
    the torch import). Its own imports count at any level; those of the modules it
    reaches, at module level (what importing them runs)."""
    chains = []
    seen = {module}
    frontier = [[module]]
    while frontier:
        chain = frontier.pop(0)
        for imp in imports_of(chain[-1]):
            if imp.type_only or (imp.in_function and len(chain) > 1):
                continue
            if _is_torch(imp.target):
                chains.append(([*chain, imp.target], imp))
            elif _internal(imp) and imp.target not in seen:
                seen.add(imp.target)
                frontier.append([*chain, imp.target])
    return chains


def test_services_without_tensors_never_import_torch():
    found: dict[tuple[str, str], str] = {}
    for module in modules():
        if _torch_free(module):
            for chain, imp in _torch_chains(module):
                where = f"{chain[-2]}:{imp.line}" + (f" in {imp.scope}()" if imp.scope else "")
                found.setdefault((chain[-2], imp.scope), " -> ".join(chain) + f" ({where})")
    new = {k: v for k, v in found.items() if k not in KNOWN_TORCH_IMPORTS}
    assert not new, "torch imported where it must not be:\n" + "\n".join(sorted(new.values()))
    gone = sorted(set(KNOWN_TORCH_IMPORTS) - set(found))
    assert not gone, f"known torch imports no longer there, drop them from KNOWN_TORCH_IMPORTS: {gone}"


def test_shared_imports_no_service():
    bad = [f"{m}:{i.line} imports {i.target}" for m in modules() if m.startswith("shared")
           for i in imports_of(m) if i.target == "services" or i.target.startswith("services.")]
    assert not bad, bad


#: the api's dialects, each a package under services/api/dialects/
DIALECTS = "services.api.dialects"
#: the api modules above the dialects: they assemble them (routes, `/openapi.json`)
ASSEMBLERS = ("services.api.app", DIALECTS)
#: outside the server: the benches are its clients, and reuse a dialect's encoders (the MP4
#: `bench.image_gen --frames` times on the reference's side) so that both sides encode alike
CLIENTS = ("bench.",)


def _dialect_of(module: str) -> str | None:
    """The dialect package `module` belongs to (`services.api.dialects.openai`), else None."""
    if not module.startswith(DIALECTS + "."):
        return None
    return ".".join(module.split(".")[:4])


def test_a_dialect_imports_the_core_only():
    """A dialect translates into the core's chat request and answers in its own shapes: it
    never imports another dialect, and the core never imports a dialect (only `app.py`,
    which mounts them, and the dialects' package, which lists them)."""
    bad = []
    for module in modules():
        for imp in imports_of(module):
            target = _dialect_of(imp.target) or (imp.target if imp.target == DIALECTS else None)
            if target is None or target == _dialect_of(module):
                continue
            if module not in ASSEMBLERS and not module.startswith(CLIENTS):
                bad.append(f"{module}:{imp.line} imports {imp.target}")
    assert not bad, bad
    assert {"services.api.dialects.openai", "services.api.dialects.messages",
            "services.api.dialects.responses"} <= set(modules())


#: the gpu worker's floors, top to bottom: a module imports its own floor's and those below
WORKER = "services.gpu_worker"
WORKER_FLOORS = {f"{WORKER}.runners": 2, f"{WORKER}.modeling": 1, f"{WORKER}.layers": 0}


def _floor(module: str) -> int | None:
    return next((floor for prefix, floor in WORKER_FLOORS.items()
                 if module == prefix or module.startswith(prefix + ".")), None)


def test_the_worker_floors_import_downwards():
    """Runners (a module per model kind) drive the model families (a folder per kind under
    modeling/), which are built of layers: a family never imports a runner, a layer never
    imports a family or a runner. The engine, scheduler and worker sit above them all: none
    of the three floors imports those."""
    above = {f"{WORKER}.{m}" for m in ("engine", "scheduler", "worker", "build", "outputs")}
    bad = []
    for module in modules():
        mine = _floor(module)
        if mine is None:
            continue
        for imp in imports_of(module):
            theirs = _floor(imp.target)
            if (theirs is not None and theirs > mine) or imp.target in above:
                bad.append(f"{module}:{imp.line} imports {imp.target}")
    assert not bad, bad
    kinds = {m.split(".")[3] for m in modules() if m.startswith(f"{WORKER}.modeling.") and m.count(".") >= 4}
    assert {"decoder", "hybrid", "vision", "speech", "encoder"} <= kinds, kinds
