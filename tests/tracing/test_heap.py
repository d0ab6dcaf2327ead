"""``old_objects_frozen`` (autotp/tracing/heap.py): what it freezes, what it thaws, what it leaves alone."""

from __future__ import annotations

import gc
import weakref

import pytest

from autotp.tracing.heap import old_objects_frozen


class _Node:
    pass


def test_objects_alive_at_the_start_are_frozen_in_the_block_and_thawed_after_it_even_on_an_error():
    assert gc.get_freeze_count() == 0
    with old_objects_frozen():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with old_objects_frozen():  # nested (capture inside a plan): nothing more is frozen
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen, "the inner block thawed the outer one's freeze"
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError):
        with old_objects_frozen():
            raise RuntimeError("in the block")
    assert gc.get_freeze_count() == 0


def test_a_freeze_the_caller_made_is_left_as_it_is():
    gc.freeze()
    try:
        theirs = gc.get_freeze_count()
        with old_objects_frozen():
            assert gc.get_freeze_count() == theirs
        assert gc.get_freeze_count() == theirs, "the block thawed objects its caller froze"
    finally:
        gc.unfreeze()


def test_cycles_made_in_the_block_are_still_collected():
    with old_objects_frozen():
        node = _Node()
        node.self = node  # a cycle: only the collector frees it
        gone = weakref.ref(node)
        del node
        gc.collect()
        assert gone() is None


def test_the_cycles_a_block_leaves_are_collected_at_its_end():
    """A loop of plans must not freeze one plan's garbage into the next: the block collects its own."""
    gc.disable()  # no automatic pass: only the block's own can free the cycle
    try:
        with old_objects_frozen():
            node = _Node()
            node.self = node
            gone = weakref.ref(node)
            del node
        assert gone() is None
    finally:
        gc.enable()
