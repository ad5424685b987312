"""A decode graph bucket's inputs: the host staging (decode_staging.py) and the launch that moves
a staged step into the bucket's region (cukernels/decode_inputs.cu), against a numpy twin."""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.base import DrawnTokens
from sparkd.backend.cuda.decode_staging import STAGED_ID, DecodeLayout, stage_decode_inputs

from .test_graph_capture import decode_meta


def upload_twin(layout, staged, batch, width, region, drawn_ids=None):
    """What the upload launch makes of a bucket's region (uint8 [layout.total], changed in
    place) from a staging slot of a `batch` x `width` step: the per-step words as staged, the
    step's block rows into rows max_blocks wide, each token row with a source >= 0 taking
    drawn_ids[source]. Returns the region's int32 arrays by layout name, in order."""
    words, slot = region.view(np.int32), staged.view(np.int32)
    start, size = layout.block_tables_offset // 4, layout.size
    words[:start] = slot[:start]
    table = words[start : start + size * layout.max_blocks].reshape(size, layout.max_blocks)
    table[:batch, :width] = slot[start : start + batch * width].reshape(batch, width)
    sources = slot[start + batch * width : start + batch * width + size]
    drawn_rows = sources >= 0
    if drawn_rows.any():
        words[:size][drawn_rows] = drawn_ids[sources[drawn_rows]]
    return [region[o : o + 4 * int(np.prod(s))].view(np.int32).reshape(s) for o, s in zip(layout.offsets, layout.shapes)]


# ---- host-only ----

def test_staging_pads_the_rows_and_moves_only_the_steps_block_columns():
    rng = np.random.default_rng(0)
    layout = DecodeLayout.for_bucket(8, 5)
    assert all(offset % 256 == 0 for offset in layout.offsets)
    region = np.zeros(layout.total, np.uint8)  # zeroed at allocation, as the runner does
    host = np.full(layout.staged_bytes(8, 5), 0x7F, np.uint8)  # a slot dirty from earlier steps
    for batch in (6, 3):  # a smaller step after a larger one: what it leaves stale must not matter
        positions, meta = decode_meta(rng, batch)
        tokens = rng.integers(0, 100, batch).astype(np.int32)
        stage_decode_inputs(host, layout, tokens, positions, meta)
        token_ids, pos, seq_lens, slots, tables, _, _ = upload_twin(layout, host, batch, 3, region)
        np.testing.assert_array_equal(token_ids[:batch], tokens)
        np.testing.assert_array_equal(pos[:batch], positions)
        np.testing.assert_array_equal(seq_lens[:batch], meta.seq_lens)
        np.testing.assert_array_equal(slots[:batch], meta.slot_mapping)
        np.testing.assert_array_equal(tables[:batch, :3], meta.block_tables)
        assert (token_ids[batch:] == 0).all() and (pos[batch:] == 0).all()
        assert (seq_lens[batch:] == 1).all() and (slots[batch:] == -1).all()
        assert ((tables >= 0) & (tables < 50)).all()  # stale or zero: always a real block id
    with pytest.raises(ValueError, match="does not fit"):
        stage_decode_inputs(host, DecodeLayout.for_bucket(2, 5), tokens, positions, meta)
    with pytest.raises(ValueError, match="does not fit"):
        stage_decode_inputs(host, DecodeLayout.for_bucket(8, 2), tokens, positions, meta)


def test_staging_names_each_drawn_rows_source_and_keeps_the_others():
    layout = DecodeLayout.for_bucket(8, 5)
    host = np.full(layout.staged_bytes(8, 5), 0x7F, np.uint8)
    positions, meta = decode_meta(np.random.default_rng(5), 4)
    drawn = DrawnTokens(np.array([3, 0], np.int32), np.zeros(6, np.int32), np.array([5, 2], np.int32))
    stage_decode_inputs(host, layout, np.arange(4, dtype=np.int32), positions, meta, drawn=drawn)
    offset = layout.sources_offset(4, 3)
    assert layout.staged_bytes(4, 3) == offset + 4 * 8
    np.testing.assert_array_equal(host[offset : offset + 32].view(np.int32),
                                  [2, STAGED_ID, STAGED_ID, 5] + [STAGED_ID] * 4)


def test_a_hybrid_layout_stages_state_slots_with_padding_rows_on_the_spare_slot():
    """A hybrid model's bucket keeps state_slots among the per-step arrays (one copy still moves
    them all) and a snapshot_start after the constants; the dense arrays keep their offsets."""
    rng = np.random.default_rng(4)
    dense, hybrid = DecodeLayout.for_bucket(8, 5), DecodeLayout.for_bucket(8, 5, with_state=True)
    assert hybrid.per_step_names == ("token_ids", "positions", "seq_lens", "slot_mapping", "state_slots")
    assert hybrid.names[-1] == "snapshot_start" and hybrid.shapes[-1] == (9,)
    assert all(dense.offset(n) == hybrid.offset(n) for n in dense.per_step_names)
    host = np.full(hybrid.staged_bytes(8, 5), 0x7F, np.uint8)
    positions, meta = decode_meta(rng, 3)
    meta.state_slots = np.array([5, 0, 2], np.int32)
    stage_decode_inputs(host, hybrid, rng.integers(0, 100, 3).astype(np.int32), positions, meta, padding_state_slot=9)
    offset = hybrid.offset("state_slots")
    np.testing.assert_array_equal(host[offset:offset + 32].view(np.int32), [5, 0, 2, 9, 9, 9, 9, 9])


# ---- on the device ----

@pytest.mark.gpu
@pytest.mark.parametrize("size, max_blocks, batch, width, num_drawn, drawn_in", [
    (1, 517, 1, 9, 1, "device"),        # batch 1 at a Llama max_model_len, its id drawn by the last step
    (4, 3, 3, 3, 0, None),              # no drawn ids
    (8, 5, 5, 2, 7, "download slot"),   # drawn ids read through a mapped pinned slot
    (64, 129, 61, 40, 64, "download slot"),  # several blocks of threads; the token rows in the first
    (256, 7, 256, 7, 300, "device"),    # token rows spanning two blocks of threads, every row drawn
])
def test_the_upload_launch_matches_its_numpy_twin(gpu, size, max_blocks, batch, width, num_drawn, drawn_in):
    from sparkd.backend.cuda.kernels.decode_inputs import upload_decode_step
    from sparkd.backend.cuda.tensor import DeviceTensor
    from sparkd.backend.cuda.transfer import DownloadRing, PinnedBuffer
    from sparkd.backend.dtypes import DType

    rng = np.random.default_rng(size + width)
    layout = DecodeLayout.for_bucket(size, max_blocks)
    region = rng.integers(0, 1 << 20, layout.total // 4).astype(np.int32).view(np.uint8)  # stale words
    device_region = gpu.upload(region.view(np.int32))
    slot = PinnedBuffer(layout.staged_bytes(batch, width))
    slot.array[:] = 0x7F  # dirty from earlier steps
    positions, meta = decode_meta(rng, batch, max_blocks=width)
    tokens = rng.integers(0, 100, batch).astype(np.int32)
    drawn_ids, drawn, ids = rng.integers(0, 1 << 17, num_drawn).astype(np.int32), None, None
    if num_drawn:
        rows = rng.choice(batch, size=min(batch, num_drawn), replace=False).astype(np.int32)
        if drawn_in == "device":
            ids = gpu.upload(drawn_ids)
        else:
            mapped, _ = DownloadRing(num_slots=1).take(drawn_ids.nbytes)  # as a sampler leaves its ids
            mapped.owner.array[: drawn_ids.nbytes] = drawn_ids.view(np.uint8)
            ids = DeviceTensor(mapped.ptr, (num_drawn,), DType.int32, None, mapped.owner)
        drawn = DrawnTokens(rows, ids, rng.integers(0, num_drawn, len(rows)).astype(np.int32))
    stage_decode_inputs(slot.array, layout, tokens, positions, meta, drawn=drawn)
    upload_decode_step(device_region, slot.device_ptr, layout.block_tables_offset // 4, size, max_blocks, batch,
                       width, ids, gpu.stream)
    twin = region.copy()
    token_ids = upload_twin(layout, slot.array, batch, width, twin, drawn_ids)[0]
    np.testing.assert_array_equal(gpu.download(device_region).view(np.uint8), twin)
    if drawn is not None:
        np.testing.assert_array_equal(token_ids[drawn.rows], drawn_ids[drawn.drawn_rows])


@pytest.mark.gpu
def test_the_upload_launch_refuses_a_step_that_does_not_fit(gpu):
    from sparkd.backend.cuda.kernels.decode_inputs import upload_decode_step
    from sparkd.backend.dtypes import DType

    layout = DecodeLayout.for_bucket(4, 3)
    region = gpu.empty((layout.total // 4,), DType.int32)
    with pytest.raises(ValueError, match="does not fit"):
        upload_decode_step(region, 0, layout.block_tables_offset // 4, 4, 3, 5, 3, None, gpu.stream)
    with pytest.raises(ValueError, match="smaller"):
        upload_decode_step(region.narrow(0, 10), 0, layout.block_tables_offset // 4, 4, 3, 2, 3, None, gpu.stream)
