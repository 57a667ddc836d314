"""Lever framework: tier presets, environment variables, explicit flags, CLI errors."""

import argparse

import pytest

from engine import cli as engine_cli
from engine.levers import (LEVER_NAMES, PRESETS, LeverError, Levers, add_lever_args,
                           levers_from_args, resolve, with_levers)


def _parse(argv, env=None):
    p = argparse.ArgumentParser()
    add_lever_args(p)
    return levers_from_args(p.parse_args(argv), env=env or {})


def test_default_is_l1_with_every_fast_lever_off():
    lv = resolve(env={})
    assert lv == Levers(tier="l1")
    assert not lv.fast_decode


@pytest.mark.parametrize("tier", ["l1", "l2", "l3"])
def test_presets(tier):
    lv = resolve(tier, env={})
    assert lv.tier == tier
    assert {n: getattr(lv, n) for n in PRESETS[tier]} == PRESETS[tier]
    assert lv.fast_decode == (tier == "l3")


def test_env_overrides_preset_and_flag_overrides_env():
    env = {"MLXP_TIER": "l3", "MLXP_COMPILED_DECODE": "0", "MLXP_FORCE_WIRE": "on"}
    lv = resolve(env=env)
    assert lv.tier == "l3" and not lv.compiled_decode and lv.force_wire and lv.perf_kernel
    lv = resolve(env=env, compiled_decode=True, perf_kernel=False)
    assert lv.compiled_decode and not lv.perf_kernel
    assert resolve("l1", env=env).tier == "l1"          # an explicit tier beats MLXP_TIER


def test_cli_flags():
    assert _parse(["--l3"]).tier == "l3"
    lv = _parse(["--tier", "l3", "--no-fused-sdpa"])
    assert lv.compiled_decode and not lv.fused_sdpa
    lv = _parse(["--compiled-decode"], env={"MLXP_COMPILED_DECODE": "0"})
    assert lv.tier == "l1" and lv.compiled_decode and lv.fast_decode
    for name in LEVER_NAMES:
        assert getattr(_parse(["--l3", "--no-" + name.replace("_", "-")]), name) is False


@pytest.mark.parametrize("bad", [dict(tier="l4"), dict(env={"MLXP_PERF_KERNEL": "maybe"}),
                                 dict(turbo=True)])
def test_bad_values_are_clear_errors(bad):
    env = bad.pop("env", {})
    with pytest.raises(LeverError):
        resolve(env=env, **bad)


def test_with_levers_rejects_unknown():
    assert with_levers(Levers(), perf_kernel=True).perf_kernel
    with pytest.raises(LeverError):
        with_levers(Levers(), warp_speed=True)


def test_engine_generate_bad_env_exits_2(monkeypatch, capsys):
    monkeypatch.setenv("MLXP_FUSED_SDPA", "sometimes")
    assert engine_cli.main(["--prompt", "hi", "-m", "2"]) == 2
    assert "MLXP_FUSED_SDPA" in capsys.readouterr().err


def test_fast_batch_lever_is_gone_and_refused_by_name(capsys):
    """The fast runner takes every row of the batch whenever a fast lever is on: there is no
    `fast_batch` lever any more. Naming it is a clear error (spec, flag, keyword), and
    MLXP_FAST_BATCH is no lever variable (it changes nothing)."""
    from engine.levers import parse_spec
    assert "fast_batch" not in LEVER_NAMES
    lv = resolve("l3", env={})
    assert not hasattr(lv, "fast_batch") and not hasattr(lv, "fast_batch_decode")
    assert "fast_batch" not in lv.as_dict() and lv.fast_decode
    with pytest.raises(LeverError, match="fast_batch"):
        parse_spec("l3+fast_batch", env={})
    with pytest.raises(LeverError, match="fast_batch"):
        resolve("l3", env={}, fast_batch=True)
    with pytest.raises(LeverError, match="fast_batch"):
        with_levers(lv, fast_batch=True)
    with pytest.raises(SystemExit) as e:
        _parse(["--l3", "--fast-batch"])
    assert e.value.code == 2 and "--fast-batch" in capsys.readouterr().err
    assert resolve("l3", env={"MLXP_FAST_BATCH": "on"}) == lv
