"""The quantized kernels' shared library and the Python that calls it agree
on their interface (csrc's KVQ_ABI_VERSION): a stale `_kvq.so`, built before
a kernel's arguments changed, is refused with a clear error instead of being
called with arguments in the wrong places. Not skipped with the kernel tests:
a stale build would otherwise only make those skip."""

import pytest

from kvserve.model import quantized

built = pytest.mark.skipif(not quantized.LIBRARY_PATH.exists(), reason="the kernels are not built (make install)")


@built
def test_the_built_kernels_are_the_version_this_source_calls():
    assert quantized.library_problem() is None
    assert quantized.kernels_available()


@built
def test_a_build_of_another_interface_version_is_refused_with_a_clear_error(monkeypatch):
    monkeypatch.setattr(quantized, "KVQ_ABI_VERSION", quantized.KVQ_ABI_VERSION + 1)
    quantized._library.cache_clear()
    try:
        assert not quantized.kernels_available()
        assert "stale" in quantized.library_problem()
        with pytest.raises(quantized.KernelUnavailable, match="stale .*rebuild them; run `make install`"):
            quantized.require_kernels()
    finally:
        monkeypatch.undo()
        quantized._library.cache_clear()
    assert quantized.kernels_available()
