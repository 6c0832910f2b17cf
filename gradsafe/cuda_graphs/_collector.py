"""No garbage collection while CUDA graphs are captured.

Freeing a ``CUDAGraph`` destroys its executable graph, which CUDA refuses
while another capture runs, and the refusal invalidates that capture
("operation not permitted when stream is capturing (function reset)", then
"operation failed due to a previous error during capture": seen on an H200
with torch 2.11). Graphed callables sit in reference cycles (a module's
replaced ``forward`` refers to the module), so their graphs are freed by the
cyclic collector, at whatever allocation triggers it. torch collected before
every capture until it made that optional
(``torch.compiler.config.force_cudagraph_gc``).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

from gradsafe._shared.gc_pause import collector_paused

__all__ = ["no_collection_during_capture"]


@contextlib.contextmanager
def no_collection_during_capture() -> Iterator[None]:
    """Collect once now, then keep the cyclic collector off until the block ends."""
    gc.collect()
    with collector_paused():
        yield
