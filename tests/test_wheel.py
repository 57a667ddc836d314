"""The wheel is the product: building it from this checkout gives engine, server, train and
starter with every module and data file they hold (server/static's pages, anything else
that is not Python), and the console scripts; experiments/ and parity/ run from a checkout
and are not in it."""

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("engine", "server", "train", "starter")
LAB = ("experiments", "parity")
JUNK = ("__pycache__", "*.pyc", "*.egg-info", "build")


def _builds_without_isolation() -> bool:
    """This environment can build the wheel itself (setuptools with bdist_wheel: its own
    from setuptools 70.1, or the `wheel` package), with no index to fetch them from."""
    if importlib.util.find_spec("setuptools") is None:
        return False
    return (importlib.util.find_spec("wheel") is not None
            or importlib.util.find_spec("setuptools.command.bdist_wheel") is not None)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel `pip wheel` builds from a copy of the checkout (the top-level files and
    the package folders, the lab's included; never the checkout itself, whose build/
    could hold files of an older build)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for p in ROOT.iterdir():
        if p.is_file():
            shutil.copy2(p, src / p.name)
    for name in PRODUCT + LAB:
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns(*JUNK))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp / "out"),
           str(src)]
    if _builds_without_isolation():
        cmd.insert(4, "--no-build-isolation")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (whl,) = (tmp / "out").glob("mlx_parity-*.whl")
    with zipfile.ZipFile(whl) as z:
        return whl.name, set(z.namelist()), z.read(next(
            n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt"))).decode()


def _source_files(name: str) -> set:
    """Every file of package folder `name` in the checkout (not caches)."""
    base = ROOT / name
    return {str(p.relative_to(ROOT)).replace("\\", "/") for p in base.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


def test_wheel_holds_the_product_and_not_the_lab(wheel):
    name, files, _ = wheel
    top = {f.split("/")[0] for f in files}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert top - dist_info == set(PRODUCT), name
    for lab in LAB:
        assert not any(f.startswith(lab + "/") for f in files), lab


@pytest.mark.parametrize("package", PRODUCT)
def test_every_module_and_data_file_is_in_the_wheel(wheel, package):
    _, files, _ = wheel
    want = _source_files(package)
    assert f"{package}/__init__.py" in want
    assert want - files == set(), f"{package}: not in the wheel"
    assert {f for f in files if f.startswith(package + "/")} == want


def test_data_files_and_console_scripts(wheel):
    _, files, entry_points = wheel
    assert "server/static/chat.html" in files
    assert {f for f in files if f.startswith("engine/distributed/")} >= {
        "engine/distributed/__init__.py", "engine/distributed/leader.py",
        "engine/distributed/follower.py"}
    for script in ("engine-generate = engine.cli:main", "engine-serve = server.cli:main",
                   "engine-train = train.cli:main", "engine-convert = engine.convert:main"):
        assert script in entry_points


def test_the_product_never_imports_the_lab():
    """An installed wheel has no parity/ or experiments/: no module of the product may
    import them."""
    import ast
    bad = []
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom)
                         and node.level == 0 else [])
                bad += [f"{path.relative_to(ROOT)}: {n}" for n in names
                        if n.split(".")[0] in LAB]
    assert bad == []
