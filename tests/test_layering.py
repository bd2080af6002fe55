"""Layers point down: trainer -> workers -> rollout / models / algorithms -> protocol, single_controller, kernels.

Every import in src/tinyzero, kernels/ and configs/ (installed as tinyzero.kernels and
tinyzero.configs; module level and inside functions: a lazy import is still an arrow) is checked
against LAYERS; an import of a higher layer fails with the file, line and the two layers. Packages
of one layer may import each other, but never in a circle: the package graph has no cycle (the
test names one, with a file and line per arrow). KNOWN_UPWARD lists the arrows that still run up,
each with its reason: the list may only shrink.

Inside tinyzero.rollout, each engine is a folder (native/, vllm/, remote/): an engine imports the
interface and the shared modules beside it, never another engine; only the registry (registry.py)
imports the engines, and nothing else in rollout/ does.

    python tests/test_layering.py        # prints every upward arrow
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "tinyzero"
# the folders installed as packages of tinyzero from outside src/ (pyproject's package-dir)
TOP_LEVEL = {"kernels": ROOT / "kernels", "configs": ROOT / "configs"}

# package (first name below tinyzero) -> layer; a module may import its own layer and the ones below.
LAYERS = {
    "trainer": 5, "demo": 5, "demo_tools": 5, "plot": 5, "config": 5, "configs": 5, "model_merger": 5, "plan": 5,
    "cli": 5,
    "workers": 4,
    "rollout": 3, "models": 3, "algorithms": 3, "agent": 3, "rewards": 3, "data": 3,
    "protocol": 1, "single_controller": 1, "kernels": 1, "distributed": 1, "runtime": 1,
}

# (importing file relative to the repository, imported module) -> why it still runs up
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def _package(module: str) -> str | None:
    """The package below tinyzero an import names (None for other libraries)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "tinyzero" and len(parts) > 1 else None


def source_files() -> list[tuple[str, str, pathlib.Path]]:
    """(path relative to the repository, package below tinyzero, path) of every module checked."""
    files = [(p.relative_to(ROOT).as_posix(), p.relative_to(SRC).as_posix().split("/")[0].removesuffix(".py"), p)
             for p in sorted(SRC.rglob("*.py"))]
    for package, folder in TOP_LEVEL.items():
        files += [(p.relative_to(ROOT).as_posix(), package, p) for p in sorted(folder.rglob("*.py"))]
    return [(rel, own, p) for rel, own, p in files if own in LAYERS]


def imports() -> list[tuple[str, int, str, str, str]]:
    """(file, line, imported module, file's package, imported package) for each import of another package."""
    out = []
    for rel, own, path in source_files():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                other = _package(name)
                if other is None or other == own:
                    continue
                if other not in LAYERS:
                    raise AssertionError(f"{rel}:{node.lineno}: tinyzero.{other} has no layer; add it to LAYERS")
                out.append((rel, node.lineno, name, own, other))
    return out


def upward_imports() -> list[tuple[str, int, str, str, str]]:
    """The imports of a higher layer (KNOWN_UPWARD left out)."""
    return [i for i in imports() if LAYERS[i[4]] > LAYERS[i[3]] and (i[0], i[2]) not in KNOWN_UPWARD]


def package_cycle() -> list[tuple[str, str, str]]:
    """One circle of the package graph as its arrows (package, imported package, "file:line"), or []."""
    arrows: dict[str, dict[str, str]] = {}
    for rel, line, _name, own, other in imports():
        arrows.setdefault(own, {}).setdefault(other, f"{rel}:{line}")
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(arrows.get(node, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for start in sorted(arrows):
        if start not in state and (circle := visit(start)):
            return [(a, b, arrows[a][b]) for a, b in zip(circle, circle[1:])]
    return []


ROLLOUT = SRC / "rollout"
ROLLOUT_REGISTRY = "registry"  # the one module of tinyzero.rollout that imports the engines


def rollout_engines() -> list[str]:
    """The engine folders of tinyzero.rollout (its subpackages)."""
    return sorted(p.parent.name for p in ROLLOUT.glob("*/__init__.py"))


def rollout_engine_arrows() -> list[tuple[str, int, str]]:
    """(file, line, imported module) for each import inside tinyzero.rollout that reaches into an engine
    folder from elsewhere in rollout/ than the registry, or from one engine into another."""
    engines = set(rollout_engines())
    bad = []
    for path in sorted(ROLLOUT.rglob("*.py")):
        parts = path.relative_to(ROLLOUT).with_suffix("").parts
        own = parts[0] if len(parts) > 1 else None  # the engine folder the file is in (None: rollout/ itself)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                target = name.split(".")
                if target[:2] != ["tinyzero", "rollout"] or len(target) < 3 or target[2] not in engines:
                    continue
                if target[2] != own and not (own is None and parts[0] == ROLLOUT_REGISTRY):
                    bad.append((path.relative_to(ROOT).as_posix(), node.lineno, name))
                    break
    return bad


def test_every_package_has_a_layer():
    for path in SRC.iterdir():
        name = path.name.removesuffix(".py")
        if name.startswith("_") or name.startswith("."):
            continue
        assert name in LAYERS, f"tinyzero.{name} has no layer in tests/test_layering.py LAYERS"


def test_imports_point_down():
    bad = upward_imports()
    assert not bad, "upward imports (move the piece down, or import from below):\n" + "\n".join(
        f"  {f}:{line}: {own} (layer {LAYERS[own]}) imports {name} (layer {LAYERS[other]})"
        for f, line, name, own, other in bad)


def test_no_circle_between_packages():
    circle = package_cycle()
    assert not circle, "the packages import each other in a circle (move the shared piece below them):\n" + \
        "\n".join(f"  {a} -> {b}  ({where})" for a, b, where in circle)


def test_every_top_level_package_is_checked():
    """kernels/ and configs/ are checked like src/tinyzero (their files are found and their imports seen)."""
    packages = {own for _rel, own, _path in source_files()}
    assert {"kernels", "configs"} <= packages
    assert any(own == "configs" and other == "config" for _r, _l, _n, own, other in imports())


def test_rollout_engines_import_no_other_engine():
    """Each engine folder of tinyzero.rollout stands alone: it imports no other engine, and the interface and
    the shared modules import none (the registry, which builds them, is the one exception)."""
    assert {"native", "vllm", "remote"} <= set(rollout_engines())
    bad = rollout_engine_arrows()
    assert not bad, "imports of a rollout engine from outside it (move the shared piece up to rollout/):\n" + \
        "\n".join(f"  {f}:{line}: {name}" for f, line, name in bad)


def test_known_upward_arrows_still_exist():
    """An arrow that was removed must leave KNOWN_UPWARD too (the list only shrinks)."""
    for rel, name in KNOWN_UPWARD:
        tree = ast.parse((ROOT / rel).read_text())
        found = any(isinstance(n, ast.ImportFrom) and n.module == name for n in ast.walk(tree))
        assert found, f"{rel} no longer imports {name}: drop it from KNOWN_UPWARD"


if __name__ == "__main__":
    for f, line, name, own, _other in upward_imports():
        print(f"{f}:{line}: {own} -> {name}")
    for a, b, where in package_cycle():
        print(f"circle: {a} -> {b} ({where})")
    for f, line, name in rollout_engine_arrows():
        print(f"{f}:{line}: imports the rollout engine {name}")
