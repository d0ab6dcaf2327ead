"""The cyclic garbage collector kept off the objects that exist before a trace or a plan starts.

A trace of a 70B-shape model, or a plan of it, makes hundreds of thousands of small objects; each
of the collector's full passes then walks every object of the process (torch's and transformers'
own, the model's), not only the new ones: a tenth to a fifth of a second each on the machine the
benchmarks quote, and the number of passes grows with the model's depth. Inside :func:`old_objects_frozen`
the objects alive at its start are frozen (``gc.freeze``): the passes walk only what the block
makes, and still collect its cycles. They are unfrozen at its end, as they were.

A process that froze objects itself (``gc.get_freeze_count()`` above 0) is left as it is: the block
then freezes and unfreezes nothing, so it never thaws what its caller froze. Nested blocks, and
blocks on other threads at the same time, freeze nothing more than the outermost one did. At its
end the block collects the cycles it made (a full pass, over its own objects only, since the old
ones are still frozen), so a loop of plans (the mesh and pipeline searches) does not freeze the
garbage of one plan into the next. One case it cannot tell apart: a ``gc.freeze()`` another thread
makes while a block runs is thawed with the block's own at its end.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

__all__ = ["old_objects_frozen"]

_lock = threading.Lock()
_holders = 0  # blocks running now that rely on the freeze their first one made


@contextlib.contextmanager
def old_objects_frozen() -> Iterator[None]:
    """Run the block with the objects alive at its start out of the collector's passes."""
    global _holders
    with _lock:
        mine = _holders > 0 or gc.get_freeze_count() == 0
        if mine:
            if _holders == 0:
                gc.freeze()
            _holders += 1
    try:
        yield
    finally:
        if mine:
            with _lock:
                _holders -= 1
                if _holders == 0:
                    # the block's cycles collected while the old objects are still out of reach (a pass
                    # over the block's objects alone): left for later, the next block would freeze them
                    gc.collect()
                    gc.unfreeze()
