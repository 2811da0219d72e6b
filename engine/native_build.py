"""How engine/native.py's C library is built: the system's C compiler (`cc`, or `$CC`) for this
CPU (-march=native) into `$XDG_CACHE_HOME/tandem/native/<hash>.so` (default ~/.cache), keyed by
the source, the flags, the compiler and the CPU's flags; written to a temporary file and
renamed, so workers starting together never load half a file.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

from engine.linear import cpu_flags

CSRC = Path(__file__).parent / "csrc"
_C_FILES = (
    "decode.c",
    "attention.c",
    "linear_i8.c",
    "linear_q4.c",
    "prefill_attention.c",
    "prefill_attention_i8.c",
    "decode_layers.c",
)
SOURCES = tuple(CSRC / name for name in _C_FILES)
HEADERS = tuple(sorted(CSRC.glob("*.h")))  # all of them in the build's key: no list to forget one in
# -fno-trapping-math lets the exp and min/max loops vectorize; -ffp-contract=off: no fused
# multiply-adds, so RoPE rounds as torch's separate ops do
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-fPIC")


def library_path(cache_dir: Path, compiler: str, flags: tuple[str, ...] = FLAGS) -> Path:
    """Where the library built by `compiler` with `flags` for this source and CPU lives."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    h = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        h.update(source.read_bytes())
    for part in (" ".join(flags), version, " ".join(sorted(cpu_flags()))):
        h.update(part.encode())
    return cache_dir / f"decode-{h.hexdigest()[:16]}.so"


def build(cache_dir: Path, compiler: str, flags: tuple[str, ...] = FLAGS) -> Path:
    """The library, compiled unless already there. Raises OSError or CalledProcessError. (Other
    flags than FLAGS: tests, e.g. the plain loops of a CPU without AVX-512.)"""
    path = library_path(cache_dir, compiler, flags)
    if path.exists():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        cmd = [compiler, *flags, "-shared", "-o", tmp, *map(str, SOURCES), "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def cache_dir() -> Path:
    """`$XDG_CACHE_HOME/tandem/native` (default ~/.cache)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tandem" / "native"
