"""cyclic_gc_paused: the collector off inside, as it was after."""

from __future__ import annotations

import gc

import pytest

from kvserve.gc_pause import cyclic_gc_paused


def test_gc_pause_restores_the_collector_as_it_was():
    assert gc.isenabled()
    with pytest.raises(KeyError):
        with cyclic_gc_paused():
            assert not gc.isenabled()
            raise KeyError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with cyclic_gc_paused():
            pass
        assert not gc.isenabled()  # a caller's own pause stays
    finally:
        gc.enable()
