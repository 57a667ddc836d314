"""The server uses the engine only through its public API: `from engine import NAME` with NAME in
`engine.__all__` -- never a submodule (`engine.step.core`, `engine.kv.quant`, ...), never a
private name. So the engine's layout can change under it without touching the server."""
import ast
from pathlib import Path

import engine

SERVER = Path(__file__).resolve().parents[2] / "server"


def engine_imports(src: str):
    """(line, what) for every import of the engine in `src`."""
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and (
                node.module == "engine" or node.module.startswith("engine.")):
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "engine" or a.name.startswith("engine."):
                    yield node.lineno, a.name, None


def violations(src: str) -> list:
    bad = []
    for line, module, names in engine_imports(src):
        if module != "engine":
            bad.append((line, f"reaches into {module}"))
        elif names is not None:
            bad += [(line, f"engine.{n} is not public") for n in names
                    if n.startswith("_") and n != "__version__" or
                    n not in engine.__all__ and n != "__version__"]
    return bad


def test_server_imports_only_the_public_api():
    found = {}
    for p in sorted(SERVER.rglob("*.py")):
        v = violations(p.read_text())
        if v:
            found[str(p.relative_to(SERVER.parent))] = v
    assert found == {}


def test_every_public_name_resolves():
    for name in engine.__all__:
        assert getattr(engine, name) is not None, name


def test_the_check_catches_deep_and_private_imports():
    assert violations("from engine.step.core import Engine\n")
    assert violations("import engine.kv.quant\n")
    assert violations("from engine import _private\n")
    assert violations("from engine import not_exported_name\n")
    assert violations("def f():\n    from engine.levers import Levers\n")
    assert not violations("from engine import Engine, SamplingParams, __version__\n")
