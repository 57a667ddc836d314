"""Shared bits of the training experiments: versioned report directories, CSV /
markdown writing, machine description, model shapes.

Reports go to `reports/<name>/<engine.__version__>/<tag>/`. A run only ever
writes into the directory of the running version; directories of other
versions are never touched.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def version() -> str:
    import engine
    return engine.__version__


def report_dir(name: str, tag: str) -> Path:
    d = REPO / "reports" / name / version() / tag
    d.mkdir(parents=True, exist_ok=True)
    return d


def machine() -> dict:
    import mlx.core as mx
    info = {"mlx": mx.__version__, "device": str(mx.default_device()),
            "python": platform.python_version(), "platform": platform.platform()}
    try:
        if mx.default_device() == mx.gpu:
            di = mx.device_info()
            info["gpu"] = di.get("device_name") or di.get("architecture")
            info["gpu_memory_bytes"] = di.get("memory_size")
    except Exception:
        pass
    return info


def write_csv(path: Path, rows: list, fields: list):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)


def read_csv(path: Path) -> list:
    if not path.exists():
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


def md_table(headers: list, rows: list) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def mega_env() -> dict:
    """The one-kernel step's settings in the environment (MLXP_MEGA_*): what a report records."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("MLXP_MEGA_")}


def dump_json(path: Path, obj):
    path.write_text(json.dumps(obj, indent=2, default=str))


def command(script: str, argv=None) -> str:
    """The command line that reproduces this run of experiments/`script` (argv: main's, or the
    process's own)."""
    return " ".join(["python", f"experiments/{script}", *(argv if argv is not None else sys.argv[1:])])


def write_run(out: Path, script: str, argv, **payload) -> Path:
    """`out`/run.json: the reproducing command, the machine and `payload`; prints its path."""
    out.mkdir(parents=True, exist_ok=True)
    dump_json(out / "run.json", {"command": command(script, argv), "machine": machine(), **payload})
    print(out / "run.json")
    return out / "run.json"


def write_table(out: Path, stem: str, fields: list, rows: list, title: str, intro: str) -> Path:
    """`out`/`stem`.csv (rows' `fields`) and `stem`.md: `# title`, `intro`, the same table."""
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / f"{stem}.csv", rows, fields)
    (out / f"{stem}.md").write_text(f"# {title}\n\n{intro}\n\n"
                                    + md_table(fields, [[r[f] for f in fields] for r in rows]) + "\n")
    return out / f"{stem}.md"


# Model shapes for the experiments (random weights, built in memory).
CPU_SHAPE = dict(model_type="llama", hidden_size=128, num_hidden_layers=8, intermediate_size=256,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1024,
                 rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=65536,
                 tie_word_embeddings=False)


def preset_config(preset: str) -> dict:
    if preset == "cpu":
        return dict(CPU_SHAPE)
    from experiments.presets import PRESETS
    return dict(PRESETS[preset])


def build_pair(cfg: dict, dtype: str, side: str, seed: int = 0):
    """Our model or mlx-lm's for `cfg`, both with the same random weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from engine.models import build
    mx.random.seed(seed)
    ours = build(cfg)
    ours.set_dtype(getattr(mx, dtype))
    mx.eval(ours.parameters())
    if side == "ours":
        return ours
    from mlx_lm.utils import _get_classes
    model_cls, args_cls = _get_classes(cfg)
    ref = model_cls(args_cls.from_dict(cfg))
    ref.set_dtype(getattr(mx, dtype))
    ref.load_weights(list(tree_flatten(ours.parameters())), strict=True)
    del ours
    mx.eval(ref.parameters())
    return ref


def add_one_kernel_flag(ap) -> None:
    """`--one-kernel-4bit` (bench_rows, mega_check): see `apply_one_kernel_flag`."""
    ap.add_argument("--one-kernel-4bit", action="store_true",
                    help="a 4-bit row takes the one kernel whatever its layers' size (the routing's "
                         "bound engine.fast.decode.QMM_ONE_ROW_LAYER_BYTES lifted): to measure both routes")


def apply_one_kernel_flag(args) -> None:
    """With `--one-kernel-4bit`, lift the one-row 4-bit routing's layer bound in this process."""
    if args.one_kernel_4bit:
        import engine.fast.decode as FD
        FD.QMM_ONE_ROW_LAYER_BYTES = float("inf")
