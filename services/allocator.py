"""Large freed buffers go back to the system, in the processes that relay clients' bytes.

glibc's malloc serves a request of at least its mmap threshold (128 KiB at first) with its own mapping,
unmapped on free; but each time such a block is freed it raises the threshold to that block's size (up to
32 MiB), so after one 16 MiB upload every later buffer of that size comes from the heap and stays in the
process once freed. The orchestrator and the HTTP gateway handle many such buffers (input images, upload
chunks, refused messages), so they fix the threshold, which turns that adjustment off
(`mallopt(M_MMAP_THRESHOLD)`, the same as MALLOC_MMAP_THRESHOLD_ in the environment). The stages do not:
torch allocates and frees tensors of every size there, and a mapping per tensor would cost page faults on
every step. Elsewhere than glibc, nothing is changed and the function says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 256 << 10


def return_large_buffers_to_the_system(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fixes glibc's mmap threshold at `threshold` bytes; False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        logger.info("the C library (%s) has no mallopt: freed buffers stay with the allocator", name)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))
