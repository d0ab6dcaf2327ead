"""``old_objects_frozen`` (autotp/tracing/heap.py): what it freezes, what it thaws, what it leaves alone."""

from __future__ import annotations

import gc
import weakref

import pytest

from autotp.tracing.heap import old_objects_frozen


class _Node:
    pass


def _frozen(obj) -> bool:
    """Whether ``obj`` (a tracked container) is out of the collector's generations: frozen. (The count of
    frozen objects is no test: a frozen object that dies by its reference count leaves it.)"""
    return not any(o is obj for o in gc.get_objects())


def test_objects_alive_at_the_start_are_frozen_in_the_block_and_thawed_after_it_even_on_an_error():
    assert gc.get_freeze_count() == 0
    old = []
    with old_objects_frozen():
        assert gc.get_freeze_count() > 0 and _frozen(old)
        since = []  # made after the outer block froze
        with old_objects_frozen():  # nested (capture inside a plan): nothing more is frozen
            assert not _frozen(since)
        assert _frozen(old), "the inner block thawed the outer one's freeze"
    assert gc.get_freeze_count() == 0 and not _frozen(old)
    with pytest.raises(RuntimeError):
        with old_objects_frozen():
            raise RuntimeError("in the block")
    assert gc.get_freeze_count() == 0


def test_a_freeze_the_caller_made_is_left_as_it_is():
    old = []
    gc.freeze()
    try:
        since = []  # made after the caller froze
        with old_objects_frozen():
            assert not _frozen(since), "the block froze more on top of its caller's freeze"
        assert _frozen(old), "the block thawed objects its caller froze"
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
