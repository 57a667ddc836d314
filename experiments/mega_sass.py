"""How the one-kernel step's compiled code waits on L2, read from its SASS (no GPU needed).

Compiles the kernel (engine/fast/cuda/mega_step.cu, through experiments/check_kernels_nvcc.py's
wrapper) for a preset's shapes with a local nvcc, disassembles it with `cuobjdump -sass`
(the `nvidia-cuda-cuobjdump` wheel has one: pass --cuobjdump PATH), and reports

- registers and spills (ptxas);
- the batches of L2 reads (`LDG…STRONG.GPU`: `__ldcg` and the flag / counter loads): a batch is
  the loads issued, in the instruction stream, before the first instruction that uses a value
  one of them returned (or a branch). A batch of one is a round trip to L2 on its own; the
  phases' input reads of the default kernel show up as runs of such batches.

    python experiments/mega_sass.py --preset 8b [--env RB=8] [--cuobjdump PATH] [--out FILE.json]
    python experiments/mega_sass.py --report DIR [--cuobjdump PATH]   # every preset x REPORT_ENVS
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import check_kernels_nvcc as CK  # noqa: E402
from experiments import presets as P  # noqa: E402
from experiments._common import md_table  # noqa: E402

def _shape(name: str) -> tuple:
    """(H, NQ, NKV, D, I, L, V) of an experiments/presets.py preset."""
    c = P.PRESETS[name]
    return (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
            c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"])


PRESETS = {name: _shape(name) for name in ("1b", "8b")}


def kernel_source(preset: str, env: dict) -> str:
    """The bf16 float-weight kernel of `preset`, with the settings in `env` (RB: rows a call,
    as check_kernels_nvcc takes them)."""
    return (CK.PRELUDE + "}\n" + CK.inc("mega_device.cuh") + "namespace mlx::core::cu {\n"
            + CK.mega_kernel("k_mega", PRESETS[preset], env) + "}\n")


_REG = re.compile(r"\bR(\d+)\b")


def _dest_regs(ins: str) -> set:
    """Registers a load writes: its first operand, widened by the access size."""
    m = re.match(r"\s*(?:@!?P\d\s+)?(\S+)\s+R(\d+)", ins)
    if not m:
        return set()
    width = 4 if ".128" in m.group(1) else 2 if ".64" in m.group(1) else 1
    return {int(m.group(2)) + k for k in range(width)}


def l2_batches(sass: str) -> list:
    """Sizes of the batches of L2 reads (see the module's doc) in instruction order."""
    lines = [ln.split("*/", 1)[1].split(";")[0] for ln in sass.splitlines()
             if re.match(r"\s*/\*[0-9a-f]{4,}\*/", ln) and "*/" in ln]
    out, pending, size = [], set(), 0
    for ins in lines:
        op = ins.split()[0] if ins.split() else ""
        if op.startswith("@"):
            op = ins.split()[1]
        is_l2 = op.startswith(("LDG", "LD.")) and "STRONG.GPU" in op
        srcs = set(map(int, _REG.findall(ins)))
        if not op.startswith(("ST", "RED", "ATOM")) and not is_l2:
            first = _REG.search(ins.split(op, 1)[1]) if op else None
            if first:                        # (the first register operand is written, not read)
                srcs.discard(int(first.group(1)))
        if size and (srcs & pending or op.startswith(("BRA", "EXIT", "BAR", "RET", "CALL"))):
            out.append(size)
            pending, size = set(), 0
        if is_l2:
            pending |= _dest_regs(ins)
            size += 1
    if size:
        out.append(size)
    return out


def analyse(preset: str, env: dict, cuobjdump: str) -> dict:
    """Compile the kernel of `preset` with `env`, disassemble it, count its batches of L2 reads."""
    with tempfile.TemporaryDirectory() as d:
        cu, cubin = Path(d) / "k.cu", Path(d) / "k.cubin"
        cu.write_text(kernel_source(preset, env))
        r = subprocess.run(CK.nvcc_command(shutil.which("nvcc"), cu, cubin, "-cubin", "-Xptxas", "-v"),
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(r.stdout + r.stderr)
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    regs = re.search(r"Used (\d+) registers", r.stderr + r.stdout)
    spill = re.search(r"(\d+) bytes spill stores", r.stderr + r.stdout)
    batches = l2_batches(sass)
    return {"preset": preset, "env": env, "registers": int(regs.group(1)) if regs else None,
            "spill_bytes": int(spill.group(1)) if spill else None, "l2_read_batches": len(batches),
            "l2_reads": sum(batches), "batches_by_size": dict(sorted(Counter(batches).items()))}


# the kernels a report compares: one row a call, and the batch lane's 8
REPORT_ENVS = ({}, {"RB": "8"})


def report(results: list, out: Path) -> None:
    """sass.md (pandas: one row per kernel) and sass.png (matplotlib: its L2-read batches by size)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    rows = [{"preset": r["preset"], "kernel": " ".join(f"{k}={v}" for k, v in r["env"].items()) or "default",
             "registers": r["registers"], "spill_bytes": r["spill_bytes"], "l2_read_batches": r["l2_read_batches"],
             "single_loads": r["batches_by_size"].get(1, r["batches_by_size"].get("1", 0)),
             "l2_reads": r["l2_reads"]} for r in results]
    df = pd.DataFrame(rows)
    (out / "sass.json").write_text(json.dumps(results, indent=1) + "\n")
    cmd = "python experiments/mega_sass.py --report " + str(out) + " --cuobjdump PATH"
    (out / "sass.md").write_text(
        "# The one-kernel step's SASS: batches of L2 reads\n\n"
        "A batch: the L2 reads (`LDG…STRONG.GPU`) issued before the first instruction that uses one of "
        "their values (or a branch); a single load is a round trip on its own. Static counts (a loop's "
        f"body once). `nvcc -arch=sm_90`, bf16 float weights, one row. Reproduce: `{cmd}`.\n\n"
        + md_table(list(df.columns), df.values.tolist()) + "\n")
    fig, axes = plt.subplots(1, len(df["preset"].unique()), figsize=(11, 4), squeeze=False)
    for ax, (preset, part) in zip(axes[0], df.groupby("preset")):
        ax.barh(part["kernel"], part["single_loads"], label="single loads")
        ax.barh(part["kernel"], part["l2_read_batches"] - part["single_loads"], left=part["single_loads"],
                label="batches of several")
        ax.set_title(f"{preset}: L2-read batches", fontsize=9)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "sass.png", dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="8b")
    ap.add_argument("--env", nargs="*", default=[],
                    help="settings: RB=N (rows a call; default 1)")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "")
    ap.add_argument("--out")
    ap.add_argument("--report", help="compile every preset with each of REPORT_ENVS; sass.md/.png/.json here")
    a = ap.parse_args(argv)
    if shutil.which("nvcc") is None or not a.cuobjdump or not os.access(a.cuobjdump, os.X_OK):
        print("mega_sass: needs nvcc on PATH and an executable cuobjdump (--cuobjdump PATH)", file=sys.stderr)
        return 2
    if a.report:
        results = [analyse(p, dict(e), a.cuobjdump) for p in sorted(PRESETS) for e in REPORT_ENVS]
        report(results, Path(a.report))
        print(f"wrote {a.report}")
        return 0
    env = dict(kv.split("=", 1) for kv in a.env)
    res = analyse(a.preset, env, a.cuobjdump)
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
