"""`engine-train -c FILE`: mlx-lm's LoRA config file (YAML, keys named like the flags).

`read_config(path, dests)` returns {argparse dest: value} for the keys of an
`mlx_lm.lora --config` file, to be used as the parser's defaults (flags given on the
command line win, as in mlx-lm). mlx-lm's nested keys map onto our flags:
`lora_parameters: {rank, scale, dropout, keys}` -> --rank/--scale/--dropout/--lora-keys,
`optimizer_config: {<optimizer>: {weight_decay, momentum}}` -> --weight-decay/--momentum,
`grad_accumulation_steps` -> --grad-accumulation. A key this trainer cannot honour
(`lr_schedule`, `hf_dataset`, DoRA / full fine-tuning, other optimiser settings, ...)
is a `ConfigError` naming it; an unknown key names the closest known one.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

# YAML 1.1 reads "1e-5" as a string; mlx-lm adds this resolver so it is a float
_FLOAT = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)

RENAMED = {"grad_accumulation_steps": "grad_accumulation"}
# accepted and not needing anything from us
IGNORED = {"trust_remote_code", "project_name", "config"}
UNSUPPORTED = {
    "lr_schedule": "learning-rate schedules are not implemented (constant --learning-rate)",
    "hf_dataset": "Hugging Face datasets are not loaded; point --data at a directory with "
                  "train.jsonl, valid.jsonl [test.jsonl]",
    "wandb": "experiment trackers are not supported",
}
OPTIMIZER_KEYS = {"adamw": ("weight_decay",), "sgd": ("weight_decay", "momentum"), "adam": ()}


class ConfigError(ValueError):
    """The config file cannot be used (one line, naming the key)."""


def _loader():
    import yaml

    class Loader(yaml.SafeLoader):
        pass
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
    return Loader


def _load(path: Path) -> dict:
    import yaml

    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), _loader())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of option names to values")
    return data


def _nested(path: Path, data: dict, out: dict) -> None:
    lora = data.pop("lora_parameters", None) or {}
    if not isinstance(lora, dict):
        raise ConfigError(f"{path}: lora_parameters must be a mapping")
    for k, v in lora.items():
        if k not in ("rank", "scale", "dropout", "keys"):
            raise ConfigError(f"{path}: lora_parameters.{k} is not supported (rank, scale, "
                              "dropout, keys)")
        out[k] = ",".join(v) if k == "keys" and isinstance(v, list) else v
    opt_cfg = data.pop("optimizer_config", None) or {}
    if not isinstance(opt_cfg, dict):
        raise ConfigError(f"{path}: optimizer_config must be a mapping")
    chosen = out.get("optimizer", "adam")
    for name, settings in opt_cfg.items():
        if name != chosen or not settings:
            continue            # (mlx-lm keeps a block per optimizer; only the chosen one counts)
        for k, v in settings.items():
            if k not in OPTIMIZER_KEYS.get(name, ()):
                raise ConfigError(f"{path}: optimizer_config.{name}.{k} is not supported")
            out[k] = v


def read_config(path, dests: set) -> dict:
    """{dest: value} from an mlx-lm LoRA config file; `dests` are the parser's dests."""
    path = Path(path)
    data = dict(_load(path))
    out: dict = {}
    if "optimizer" in data:
        out["optimizer"] = data["optimizer"]
    _nested(path, data, out)
    for key, value in data.items():
        if key in IGNORED:
            continue
        if key in UNSUPPORTED:
            if value in (None, False, "", {}, []):
                continue
            raise ConfigError(f"{path}: {key} is not supported: {UNSUPPORTED[key]}")
        dest = RENAMED.get(key, key)
        if dest not in dests:
            close = difflib.get_close_matches(dest, sorted(dests), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"{path}: unknown option {key!r}{hint}")
        out[dest] = value
    return out
