"""Keeping large freed buffers in the Python process for reuse.

A large call copies each tensor a few times on its way through protobuf and
grpcio (bytes, the serialized message, gRPC's slices, the received bytes).
glibc serves blocks of 32 MB and more with mmap and gives them back to the
kernel on free, so every such copy page-faults fresh memory, and page faults
are slow (most of all on virtual machines): an Attend call moving 32 MB took
157 ms from Python against 48 ms with the freed blocks kept, on a 2-core VM.
"""
import ctypes
import ctypes.util
import os

# From glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# Blocks up to this size come from the heap and are reused once freed, and
# up to this much free memory at the top of the heap is kept. Larger blocks
# are mapped and unmapped as before.
RETAINED_BYTES = 1 << 30

_done = False


def keep_large_buffers():
    """Makes glibc keep freed blocks up to RETAINED_BYTES for reuse.

    Affects the whole process: it keeps up to RETAINED_BYTES of freed memory
    resident instead of returning it, as tcmalloc and jemalloc do. Returns
    True if the setting was applied; False where it does not apply (not
    glibc) or was already chosen through GLIBC_TUNABLES, which it respects.
    Idempotent and safe to call from any thread.
    """
    global _done
    if _done:
        return True
    if "malloc.mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # present only in glibc
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    _done = bool(mallopt(_M_MMAP_THRESHOLD, RETAINED_BYTES) and
                 mallopt(_M_TRIM_THRESHOLD, RETAINED_BYTES))
    return _done
