"""Which implementation runs a decode-sized GEMM, from measurements: cuBLASLt or the skinny-GEMM
kernel, and which of cuBLASLt's algorithms.

At small M a GEMM only streams its weight. cuBLASLt leaves part of the bandwidth
unused on some shapes (GPU-FACTS.md), and the gemv kernel (kernels/gemv.py) wins
there, but not everywhere: the winner depends on the shape, the dtype, M and the
device. cuBLASLt's own heuristic, too, ranks its algorithms by a model of the device,
and at skinny M its first choice is often not its fastest. So both are measured, not
guessed. `python tools/bench_gemm.py --write-table` times, on the device, the gemv
kernel at every M tile up to 16 and each of the heuristic's first candidates at every
M tile up to 256, for the Llama-3.1-8B shapes and those of a model it is given,
cycling weights through more than twice the L2 so that no figure is cache-inflated,
and writes a `GemmTable`.

At run time `Gemm` looks each product up by (N, K, dtype, M tile): M runs on the
smallest tile >= M, and the tile was measured at its full M. It runs the gemv kernel
where that won, else cuBLASLt with the algorithm measured fastest (an opaque
cublasLtMatmulAlgo_t, which cuBLASLt lets a program store and reuse with the same
library version: the table records the version that measured it, and cuBLASLt checks
the stored algorithm against each product's operands before it is used).
The table comes from (`load_table`), for this device's name and arch:
1. the sparkd cache, where the bench writes it: <cache>/gemm/<device>-<arch>.json,
   next to the kernel cache (SPARKD_CACHE_DIR moves both);
2. the package, where a table measured the same way is checked in:
   sparkd/backend/cuda/gemm_tables/<device>-<arch>.json.
A shape the table lacks, M above the largest tile, or no table at all: cuBLASLt with its
heuristic's first choice.

Why not autotune at load time instead: an honest timing streams more than the
L2 holds (a 4096x4096 bf16 weight is 33 MB of the H200's 60 MB), so it would have
to cycle through the layers' weights for every shape and M tile, adding seconds to
every start for an answer that changes only with the device or the libraries.
Measured once per device, it costs nothing at start, and the table records what
measured it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..dtypes import DType
from .compiler import cache_dir
from .kernels import gemv

log = logging.getLogger("sparkd.cuda.gemm")

GEMV, CUBLASLT = "gemv", "cublaslt"
PACKAGED_DIR = Path(__file__).resolve().parent / "gemm_tables"
_HEADER_FIELDS = ("device", "arch", "command", "measured_at", "copy_rate", "cublaslt_version")
# M tiles at which only cuBLASLt's algorithms are measured, beyond gemv's (1 to 16): the decode
# batch buckets (graphs.default_buckets) up to 256 run on them.
CUBLASLT_M_TILES = (32, 64, 128, 256)
M_TILES = (*gemv.M_TILES, *CUBLASLT_M_TILES)


def table_m_tile(m: int) -> int | None:
    """The measured M tile that stands for m rows of x: the smallest >= m; None above the largest."""
    return next((tile for tile in M_TILES if tile >= m), None)


@dataclass(frozen=True)
class ShapeKey:
    n: int
    k: int
    dtype: str  # DType name of x and the weight
    m_tile: int


@dataclass(frozen=True)
class Measurement:
    """Bytes moved per second by each implementation, as fractions of the copy rate: cuBLASLt
    with `algo`, and the gemv kernel (0.0 at M tiles it does not run)."""

    cublaslt: float
    gemv: float = 0.0
    algo: str = ""  # hex of the cublasLtMatmulAlgo_t measured fastest; "": the heuristic's first choice

    @property
    def winner(self) -> str:
        return GEMV if self.gemv > self.cublaslt else CUBLASLT


@dataclass
class GemmTable:
    """Measurements of one device; `entries` holds every shape and M tile measured."""

    device: str = ""
    arch: str = ""
    command: str = ""  # what measured it, to measure again
    measured_at: str = ""
    copy_rate: float = 0.0  # bytes/s (read + written), the unit of the fractions
    entries: dict[ShapeKey, Measurement] = field(default_factory=dict)
    cublaslt_version: int = 0  # cublasLtGetVersion() of the library whose algorithms were measured

    def pick(self, n: int, k: int, dtype: DType, m: int) -> str:
        """GEMV or CUBLASLT for out [m, n] = x [m, k] @ W [n, k]^T in `dtype`."""
        if not 1 <= m <= gemv.MAX_M:
            return CUBLASLT
        entry = self.entries.get(ShapeKey(n, k, dtype.name, table_m_tile(m)))
        return entry.winner if entry is not None else CUBLASLT

    def cublaslt_algo(self, n: int, k: int, dtype: DType, m: int) -> bytes | None:
        """The cuBLASLt algorithm measured fastest for this product at m's tile; None where the
        heuristic's first choice was (or nothing was measured)."""
        tile = table_m_tile(m) if m >= 1 else None
        entry = self.entries.get(ShapeKey(n, k, dtype.name, tile)) if tile is not None else None
        return bytes.fromhex(entry.algo) if entry is not None and entry.algo else None

    def to_json(self) -> str:
        """One entry a line, so that a checked-in table diffs shape by shape."""
        header = [f'"{name}": {json.dumps(getattr(self, name))}' for name in _HEADER_FIELDS]
        rows = [json.dumps({**asdict(key), **asdict(value)}) for key, value in sorted(self.entries.items(), key=_order)]
        entries = '"entries": [\n    ' + ",\n    ".join(rows) + "\n  ]"
        return "{\n  " + ",\n  ".join([*header, entries]) + "\n}\n"

    @classmethod
    def from_json(cls, text: str) -> GemmTable:
        data = json.loads(text)
        entries = {ShapeKey(int(row["n"]), int(row["k"]), str(row["dtype"]), int(row["m_tile"])):
                   Measurement(float(row["cublaslt"]), float(row.get("gemv", 0.0)), str(row.get("algo", "")))
                   for row in data["entries"]}
        return cls(str(data["device"]), str(data["arch"]), str(data["command"]), str(data["measured_at"]),
                   float(data["copy_rate"]), entries, int(data.get("cublaslt_version", 0)))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, delete=False) as tmp:
            tmp.write(self.to_json())
        os.replace(tmp.name, path)


def _order(item: tuple[ShapeKey, Measurement]) -> tuple:
    key = item[0]
    return key.dtype, key.n, key.k, key.m_tile


def table_file_name(device: str, arch: str) -> str:
    """"NVIDIA H200", "sm_90" -> "nvidia-h200-sm_90.json"."""
    return f"{re.sub(r'[^a-z0-9]+', '-', device.lower()).strip('-')}-{arch}.json"


def cache_table_path(device: str, arch: str) -> Path:
    """Where the bench writes this device's table: next to the kernel cache."""
    return cache_dir().parent / "gemm" / table_file_name(device, arch)


def read_table(path: Path) -> GemmTable | None:
    """The table at `path`; None when there is none or it cannot be read (logged)."""
    try:
        return GemmTable.from_json(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("ignoring the unreadable GEMM table %s: %s", path, err)
        return None


def load_table(device: str, arch: str) -> GemmTable:
    """This device's measured table (the cache's, else the package's), or an empty one: cuBLASLt everywhere."""
    name = table_file_name(device, arch)
    for path in (cache_table_path(device, arch), PACKAGED_DIR / name):
        table = read_table(path)
        if table is not None:
            winners = sum(entry.winner == GEMV for entry in table.entries.values())
            algos = sum(bool(entry.algo) for entry in table.entries.values())
            log.info("GEMM table %s: gemv wins %d of %d measured shapes and M tiles, a measured cuBLASLt "
                     "algorithm beats the heuristic's choice at %d", path, winners, len(table.entries), algos)
            return table
    log.info("no measured GEMM table for %s (%s): cuBLASLt runs every GEMM; "
             "`python tools/bench_gemm.py --write-table` measures one", device, arch)
    return GemmTable(device, arch)
