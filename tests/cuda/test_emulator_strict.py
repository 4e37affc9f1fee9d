"""The emulator refuses what a GPU refuses about alignment and launch resources.

A load through a typed pointer at an address that is not a multiple of the type's alignment is a
misaligned address on a GPU (a sticky error: the context is lost); a block larger than the kernel's
``__launch_bounds__`` is refused at the launch. The probe kernels here are plain CUDA (they compile
with NVRTC as they are), run on the emulator, and must fail exactly where a GPU would.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from metatp.backends.cuda import kernels as ck
from metatp.backends.cuda.faults import CheckedKernel
from metatp.backends.cuda.launch import module_source
from metatp.ir.errors import DeviceFaultError
from metatp.testing.cuda_emulator import Emulator, launch_bounds
from metatp.testing.emulated_faults import EmulatedCudaError
from metatp.testing.emulated_runtime import EmuRuntime
from support.require import requires

requires_cxx = requires("emulator")

# One load of `width` bytes at buf + offset per thread, through CUDA's types for that width (0: an
# atomicAdd of 0 on the 4-byte word there).
_ALIGN_PROBE = r"""
extern "C" __global__ void __launch_bounds__(64) align_probe(const unsigned char* buf, int offset, int width,
                                                             unsigned* out) {
    const unsigned char* p = buf + offset;
    unsigned v;
    if (width == 16) {
        const uint4 u = *(const uint4*)p;
        v = u.x ^ u.y ^ u.z ^ u.w;
    } else if (width == 8) {
        const uint2 u = *(const uint2*)p;
        v = u.x ^ u.y;
    } else if (width == 4) {
        v = *(const unsigned*)p;
    } else if (width == 0) {         // an atomic on the 4-byte word there (adds 0: reads it)
        v = (unsigned)atomicAdd((int*)p, 0);
    } else {
        v = *(const unsigned short*)p;
    }
    out[threadIdx.x] = v;
}
"""

# The bound through a macro, and the entry's name pasted by one (as the families write them).
_BOUNDS_PROBE = r"""
#define PROBE_NTH (16 * 2)
#define PROBE_KERNEL(tag) \
    extern "C" __global__ void __launch_bounds__(PROBE_NTH, 1) bounds_probe_##tag(int* out) { out[threadIdx.x] = 1; }
PROBE_KERNEL(a)
"""


def _aligned_bytes(n: int) -> np.ndarray:
    """n random bytes starting at a 16-byte aligned address (as a cupy allocation is, and more)."""
    base = np.random.default_rng(0).integers(0, 256, n + 16, dtype=np.uint8)
    start = (-base.ctypes.data) % 16
    return base[start:start + n]


def _expected(buf: np.ndarray, offset: int, width: int) -> int:
    width = width or 4
    words = buf[offset:offset + width].view(np.uint16 if width == 2 else np.uint32)
    return int(np.bitwise_xor.reduce(words.astype(np.uint32)))


@pytest.fixture(scope="module")
def align_probe():
    return Emulator().probe_kernel(_ALIGN_PROBE, "align_probe")


@requires_cxx
@pytest.mark.parametrize("width, offset", [(16, 0), (16, 16), (16, 8), (16, 4), (8, 8), (8, 4), (4, 4), (4, 2),
                                           (4, 18), (2, 2), (2, 1), (0, 8), (0, 2)])
def test_a_load_at_a_misaligned_address_fails_the_launch(align_probe, width, offset):
    buf = _aligned_bytes(64)
    out = np.zeros(32, np.uint32)
    args = (buf, np.int32(offset), np.int32(width), out)
    if offset % (width or 4) == 0:
        align_probe((1,), (32,), args)
        assert (out == _expected(buf, offset, width)).all()
        return
    with pytest.raises(EmulatedCudaError) as caught:
        align_probe((1,), (32,), args)
    e = caught.value
    assert e.status == 716
    text = str(e)
    assert text.startswith("cudaErrorMisalignedAddress: misaligned address (align_probe: ")
    assert f"at address {hex(buf.ctypes.data + offset)}, which needs {width or 4}-byte alignment" in text
    assert "block (0,0,0) thread (0,0,0)" in text
    assert ("atomicAdd((int*)p, 0)" if width == 0 else "*(const ") in text    # the faulting source line


@requires_cxx
def test_a_misaligned_address_is_sticky_through_the_runtime(align_probe):
    """Through the emulated runtime it is a DeviceFaultError naming the kernel, and the device has
    failed: the next launch, even an aligned one, is refused (the real context is lost)."""
    rt = EmuRuntime()
    kernel = CheckedKernel(align_probe, "align_probe", 0, rt.faults)
    buf, out = _aligned_bytes(64), np.zeros(32, np.uint32)
    with pytest.raises(DeviceFaultError, match="align_probe.*misaligned address") as caught:
        kernel((1,), (32,), (buf, np.int32(4), np.int32(16), out))
    assert caught.value.sticky
    with pytest.raises(DeviceFaultError, match="misaligned address"):
        kernel((1,), (32,), (buf, np.int32(0), np.int32(16), out))


@requires_cxx
def test_a_block_above_the_launch_bounds_is_refused():
    k = Emulator().probe_kernel(_BOUNDS_PROBE, "bounds_probe_a")
    assert k.max_threads == 32
    out = np.zeros(64, np.int32)
    k((1,), (32,), (out,))
    assert out[:32].tolist() == [1] * 32
    with pytest.raises(EmulatedCudaError, match=re.escape(
            "cudaErrorLaunchOutOfResources: too many resources requested for launch (bounds_probe_a: a block "
            "of 64 threads, more than its __launch_bounds__(32))")) as caught:
        k((1,), (64,), (out,))
    assert caught.value.status == 701
    assert out[32:].tolist() == [0] * 32
    # a bound it cannot evaluate is refused by name, not taken as "no bound"
    with pytest.raises(ValueError, match=r"odd_probe: __launch_bounds__\(sizeof\(int\) \* 8\)"):
        launch_bounds('extern "C" __global__ void __launch_bounds__(sizeof(int) * 8) odd_probe(int* o) {}')


@requires_cxx
def test_launch_bounds_of_the_families_are_their_entry_points():
    """Every bound read from a family names one of its entry points; the int8 mma tiles are bounded
    by MT_MMQ8_NTH (the constant their 255 registers a thread were sized for)."""
    eps = ck.expected_entry_points()
    for family in ck.FAMILIES:
        bounds = launch_bounds(module_source(family))
        assert set(bounds) <= set(eps[family])
        assert all(0 < b <= 1024 for b in bounds.values())
    mmq = launch_bounds(module_source("mmq"))
    nth = int(re.search(r"#define\s+MT_MMQ8_NTH\s+(\d+)", module_source("mmq")).group(1))
    i8 = [n for n in eps["mmq"] if n.startswith("mmq_i8")]
    assert i8 and all(mmq[n] == nth for n in i8)


@requires_cxx
def test_emulated_views_sit_where_the_runtime_carves_them():
    """EmuRuntime.view is the root's address plus the offset, as cupy's memptr + offset: a view at an
    odd offset is as misaligned here as on the GPU, never realigned by a separate allocation."""
    rt = EmuRuntime()
    root = rt.empty((1024,), np.uint8)
    for offset in (0, 2, 18, 34, 100):
        v = rt.view(root, offset, (4,), (4,), np.float32)
        assert v.ctypes.data == root.ctypes.data + offset
