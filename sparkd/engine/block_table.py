"""Block tables that persist across steps, so a decode step copies no block ids.

Each running request owns a row of a [rows, max_blocks] int32 array; a step
only appends the blocks a request gained and gathers its rows in batch order
with one fancy-index. Rows are released when a request is preempted (its
blocks are gone) and swept from finished requests when rows run out.
"""

from __future__ import annotations

import numpy as np

from .request import Request


class PersistentBlockTable:
    def __init__(self, num_rows: int, max_blocks_per_seq: int):
        self.table = np.zeros((num_rows, max_blocks_per_seq), np.int32)
        self._num_blocks = [0] * num_rows  # filled entries per row (a list: read per sequence per step)
        self._row_of: dict[str, int] = {}
        self._owner: list[Request | None] = [None] * num_rows
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def release(self, request: Request) -> None:
        row = self._row_of.pop(request.request_id, None)
        if row is not None:
            self._owner[row] = None
            self._free_rows.append(row)

    def row(self, request: Request, block_ids: list[int]) -> int:
        """The request's row, updated to `block_ids` (which only grow while it runs)."""
        row = self._row_of.get(request.request_id)
        if row is None or self._owner[row] is not request:
            row = self._assign(request)
        known = self._num_blocks[row]
        if known != len(block_ids):
            self.table[row, known:len(block_ids)] = block_ids[known:]
            self._num_blocks[row] = len(block_ids)
        return row

    def _assign(self, request: Request) -> int:
        self.release(request)
        if not self._free_rows:
            for owner in self._owner:
                if owner is not None and owner.is_finished:
                    self.release(owner)
        if not self._free_rows:
            raise RuntimeError("more running requests than block-table rows")
        row = self._free_rows.pop()
        self._row_of[request.request_id] = row
        self._owner[row] = request
        self._num_blocks[row] = 0
        return row
