"""The CUDA side stream's protocol on the host, with streams and events that only log what they
are asked (`Lanes`: fork, side work on the side lane, join), and the memory pool's hold: a block
freed between fork and join reaches no allocation before the main stream waits for the side."""

from __future__ import annotations

import pytest

from sparkd.backend.cuda import side_stream
from sparkd.backend.cuda.driver import CudaError
from sparkd.backend.cuda.memory import MemoryPool
from sparkd.backend.cuda.side_stream import Lane, Lanes

BLOCK = 512


class LoggingStream:
    """Logs the waits asked of it; `on_wait` runs at each."""

    def __init__(self, name: str, log: list[str]):
        self.name, self.log, self.on_wait = name, log, None

    def wait_event(self, event: "LoggingEvent") -> None:
        self.log.append(f"{self.name} waits for {event.recorded_on}")
        if self.on_wait is not None:
            self.on_wait()


class LoggingEvent:
    """Logs its records; refuses them while `invalidated` is set, as a capture an error invalidated does."""

    invalidated = False

    def __init__(self):
        self.recorded_on = None

    def record(self, stream: LoggingStream) -> None:
        if LoggingEvent.invalidated:
            raise CudaError(901, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "cuEventRecord")
        self.recorded_on = stream.name
        stream.log.append(f"{stream.name} records")


class PoolOnly:
    """The allocator as Lanes sees it: its active pool."""

    def __init__(self):
        self.pool = MemoryPool("test")


FORK = ["main records", "side waits for main"]
JOIN = ["side records", "main waits for side"]


@pytest.fixture
def lanes(monkeypatch):
    monkeypatch.setattr(side_stream, "Event", LoggingEvent)
    monkeypatch.setattr(LoggingEvent, "invalidated", False)
    log = []
    main, side = LoggingStream("main", log), LoggingStream("side", log)
    lanes = Lanes(PoolOnly(), Lane(main, "main gemm"), Lane(side, "side gemm"))
    lanes.log = log
    return lanes


def on_lane(lanes, what):
    lanes.log.append(f"{what} on {lanes.current.stream.name}")


def test_side_work_is_enqueued_on_the_side_lane_between_fork_and_block_then_joined(lanes):
    with lanes.beside(lambda: on_lane(lanes, "work") or "out") as branch:
        on_lane(lanes, "block")
        with pytest.raises(RuntimeError, match="after its with-block"):
            branch.result
    assert branch.result == "out"
    assert lanes.log == [*FORK, "work on side", "block on main", *JOIN]
    assert lanes.current.gemm == "main gemm"


def test_blocks_freed_inside_a_branch_are_held_until_the_main_stream_waits_for_the_side(lanes):
    pool = lanes.allocator.pool
    pool.add_new(BLOCK)
    pool.give_back(0x1000, BLOCK)  # free before the fork: its users precede the fork's event

    def work():
        ptr = pool.take(BLOCK)
        pool.give_back(ptr, BLOCK)  # the side work's tensor dies at once; its kernel may still run
        return ptr

    seen_at_join = []
    lanes.main.stream.on_wait = lambda: seen_at_join.append(pool.take(BLOCK))
    with lanes.beside(work) as branch:
        assert pool.take(BLOCK) is None  # main-stream work beside the side cannot have it
    assert branch.result == 0x1000
    assert seen_at_join == [None]  # when the main stream is asked to wait for the side: still held
    assert pool.take(BLOCK) == 0x1000


def test_a_failure_in_the_work_or_the_block_still_joins_and_frees(lanes):
    pool = lanes.allocator.pool

    def failing_work():
        pool.add_new(BLOCK)
        pool.give_back(0x2000, BLOCK)
        raise ValueError("work failed")

    with pytest.raises(ValueError, match="work failed"):
        with lanes.beside(failing_work):
            pytest.fail("the block must not run when the work failed")
    assert lanes.log == [*FORK, *JOIN] and lanes.current is lanes.main
    assert pool.take(BLOCK) == 0x2000
    lanes.log.clear()
    with pytest.raises(KeyError):
        with lanes.beside(lambda: None):
            raise KeyError("block failed")
    assert lanes.log == [*FORK, *JOIN]


def test_a_join_an_invalidated_capture_refuses_lets_the_first_error_through(lanes):
    def invalidating_work():
        LoggingEvent.invalidated = True
        raise CudaError(900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "cuStreamSynchronize")

    with pytest.raises(CudaError, match="UNSUPPORTED"):
        with lanes.beside(invalidating_work):
            pass
    assert lanes.current is lanes.main
    LoggingEvent.invalidated = False
    with pytest.raises(CudaError, match="INVALIDATED"):
        with lanes.beside(lambda: None):
            LoggingEvent.invalidated = True  # the join is refused with no error in flight: that raises


def test_side_work_may_not_fork_again_nor_touch_the_host(lanes):
    def forking_work():
        with lanes.beside(lambda: None):
            pass

    with pytest.raises(RuntimeError, match="Ops.beside inside side work"):
        with lanes.beside(forking_work):
            pass
    with pytest.raises(RuntimeError, match="an upload inside side work"):
        with lanes.beside(lambda: lanes.require_main("an upload")):
            pass
    lanes.require_main("an upload")  # on the main lane again


def test_holds_nest_and_release_with_the_outermost():
    pool = MemoryPool("test")
    pool.add_new(BLOCK)
    with pool.holding_frees():
        with pool.holding_frees():
            pool.give_back(0x3000, BLOCK)
        assert pool.take(BLOCK) is None and pool.drain() == []
    assert pool.in_use_bytes == 0 and pool.take(BLOCK) == 0x3000
