"""Device tensors for host-side launcher tests: a pointer that is never dereferenced, so
the checks a launcher makes before it loads a kernel run with no GPU; an allocator of such
tensors; and a device that is not a Hopper, for the launchers of sm_90-only kernels."""

from __future__ import annotations

from sparkd.backend.cuda.tensor import DeviceTensor
from sparkd.backend.dtypes import DType


def fake_tensor(shape, dtype="bfloat16", ptr=0x10000, strides=None) -> DeviceTensor:
    return DeviceTensor(ptr, shape, DType.parse(dtype), strides)


class Sm120Device:
    """What `current_device()` says of a Blackwell GPU: the arch and SM count a launcher reads."""

    arch, sm_count = "sm_120", 188


class H200Device:
    """What `current_device()` says of an H200: the numbers the decode attention plan reads."""

    arch, sm_count, max_shared_per_block_optin = "sm_90", 132, 232448


class FakeAllocator:
    """Hands out consecutive addresses, as DeviceAllocator.empty does real memory."""

    def __init__(self):
        self.next_ptr = 0x100000
        self.allocations = []

    def empty(self, shape, dtype) -> DeviceTensor:
        tensor = fake_tensor(shape, dtype.name, ptr=self.next_ptr)
        self.next_ptr += 256 * (-(-tensor.nbytes // 256))
        self.allocations.append(tensor)
        return tensor
