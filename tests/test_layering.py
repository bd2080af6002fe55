"""Layers point down: trainer -> workers -> rollout / models / algorithms -> protocol, single_controller, kernels.

Every import in src/tinyzero (module level and inside functions: a lazy import is still an arrow)
is checked against LAYERS; an import of a higher layer fails with the file, line and the two
layers. Packages of one layer may import each other (rollout uses models, models' LoRA uses
rollout's weight streamer). KNOWN_UPWARD lists the arrows that still run up, each with its reason:
the list may only shrink.

    python tests/test_layering.py        # prints every upward arrow
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "tinyzero"

# package (first name below tinyzero) -> layer; a module may import its own layer and the ones below.
LAYERS = {
    "trainer": 5, "demo": 5, "demo_tools": 5, "plot": 5, "config": 5, "configs": 5, "model_merger": 5, "plan": 5,
    "workers": 4,
    "rollout": 3, "models": 3, "algorithms": 3, "agent": 3, "rewards": 3, "data": 3,
    "protocol": 1, "single_controller": 1, "kernels": 1, "distributed": 1, "runtime": 1,
}

# (importing file relative to src/tinyzero, imported module) -> why it still runs up
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def _package(module: str) -> str | None:
    """The package below tinyzero an import names (None for other libraries)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "tinyzero" and len(parts) > 1 else None


def upward_imports() -> list[tuple[str, int, str, str, str]]:
    """(file, line, imported module, file's package, imported package) for each import of a higher layer."""
    out = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        own = rel.split("/")[0].removesuffix(".py")
        if own not in LAYERS:
            continue
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
                if LAYERS[other] > LAYERS[own] and (rel, name) not in KNOWN_UPWARD:
                    out.append((rel, node.lineno, name, own, other))
    return out


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


def test_known_upward_arrows_still_exist():
    """An arrow that was removed must leave KNOWN_UPWARD too (the list only shrinks)."""
    for rel, name in KNOWN_UPWARD:
        tree = ast.parse((SRC / rel).read_text())
        found = any(isinstance(n, ast.ImportFrom) and n.module == name for n in ast.walk(tree))
        assert found, f"{rel} no longer imports {name}: drop it from KNOWN_UPWARD"


if __name__ == "__main__":
    for f, line, name, own, _other in upward_imports():
        print(f"{f}:{line}: {own} -> {name}")
