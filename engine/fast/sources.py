"""The CUDA sources of engine/fast, read from engine/fast/cuda (package data).

`source(name)` is the text of `cuda/<name>` with every `#include "file"` of a file in that
folder replaced by the file's own text (recursively): what NVRTC, which compiles a kernel
from one string (`mx.fast.cuda_kernel`), needs. nvcc compiles the same files with `-I` that
folder (experiments/check_kernels_nvcc.py).

- `*.cuh`: device functions and macros, placed before a kernel (`mx.fast.cuda_kernel`'s
  `header`);
- `*.cu`: a kernel's body (`source`), or a part of one that another body includes.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

DIR = Path(__file__).with_name("cuda")
_INCLUDE = re.compile(r'^[ \t]*#include "([\w.]+)"[ \t]*\n', re.M)


@functools.lru_cache(maxsize=None)
def source(name: str) -> str:
    """The text of cuda/<name>, its local includes inlined."""
    path = DIR / name
    if path.parent != DIR or not path.is_file():
        raise FileNotFoundError(f"no CUDA source {name!r} in {DIR}")
    return _INCLUDE.sub(lambda m: source(m.group(1)), path.read_text())
