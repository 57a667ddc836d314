"""engine.fast.config.FastConfig: the fast path's settings, resolved once with the levers
(preset < environment < flag), validated with errors that name the setting; the one place
that reads them is engine.levers."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from engine.fast.config import KERNELS, FastConfig, FastConfigError
from engine.levers import LeverError, parse_spec, resolve, with_levers

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_environment_then_flag():
    assert resolve("l3", env={}).fast == FastConfig()
    env = {"MLXP_MEGA_QKNORM": "0", "MLXP_MEGA_PROF": "1", "MLXP_DISABLE_KERNELS": "attention"}
    lv = resolve("l3", env=env)
    assert lv.fast.qk_norm is False and lv.fast.prof and lv.fast.disabled == {"attention"}
    # an explicit value beats the environment
    assert resolve("l3", env=env, fast=FastConfig(prof=False)).fast == FastConfig(prof=False)
    # with no fast lever on, the environment's settings are not read (nor checked)
    assert resolve("l1", env={**env, "MLXP_MEGA_PROF": "x"}).fast == FastConfig()
    # a fast lever switched on by a flag reads them
    assert resolve("l1", env=env, perf_kernel=True).fast.qk_norm is False


def test_bad_values_name_the_setting():
    for name, value in (("MLXP_MEGA_PROF", "yes"), ("MLXP_MEGA_QKNORM", "off"),
                        ("MLXP_DISABLE_KERNELS", "gemv,qgemv")):
        with pytest.raises(LeverError, match=name):
            resolve("l3", env={name: value})
    for bad in (dict(prof=1), dict(qk_norm=None),
                dict(disabled={"warp"})):
        with pytest.raises(FastConfigError, match=next(iter(bad))):
            FastConfig(**bad)


def test_frozen_hashable_and_reported():
    a, b = FastConfig(disabled={"gemv"}), FastConfig(disabled=frozenset({"gemv"}))
    assert a == b and hash(a) == hash(b) and isinstance(a.disabled, frozenset)
    with pytest.raises(Exception):
        a.prof = True
    lv = with_levers(resolve("l3", env={}), fast=a)
    assert lv.as_dict()["fast"] == {"prof": False, "qk_norm": True, "disabled": ["gemv"]}
    assert {lv: 1}[with_levers(resolve("l3", env={}), fast=b)] == 1    # (decoders are kept per levers)
    assert set(KERNELS) >= a.disabled


def test_parse_spec_takes_the_fast_settings_from_env():
    assert parse_spec("l3", env={"MLXP_MEGA_PROF": "1"}).fast.prof is True
    assert parse_spec("l1+merged_proj", env={"MLXP_MEGA_PROF": "1"}).fast == FastConfig()


def test_nothing_in_engine_fast_reads_the_environment():
    """os.environ / os.getenv appear nowhere in engine/fast: its settings arrive as a FastConfig."""
    for path in sorted((ROOT / "engine" / "fast").rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not {"environ", "getenv"} & names, path


def test_levers_does_not_import_the_kernels():
    """engine.levers needs only engine.fast.config: no cycle with engine.fast.mega (which
    imports engine.levers)."""
    code = ("import sys, engine.levers; "
            "print(sorted(m for m in sys.modules if m.startswith('engine.fast')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         check=True).stdout
    assert out.strip() == "['engine.fast', 'engine.fast.config']", out
    # nor inside a function (the cycle the CLI's check of the kernel settings used to make)
    tree = ast.parse((ROOT / "engine" / "levers.py").read_text())
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert mods <= {"__future__", "dataclasses", "typing", "fast.config"}, mods
