"""Property test: any sequence of map / unmap / batch calls leaves every driver in exactly the
state a simple model predicts, refusals change nothing, and the data written through one
mapping of a handle is what every other mapping of it reads."""

from __future__ import annotations

import ctypes as C

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xllm_vmm.vmm import CopyKind, VmmError, open_driver
from tests._hyp import examples

PAGES, HANDLES = 8, 4

op = st.one_of(
    st.tuples(st.just("map"), st.integers(0, PAGES - 1), st.integers(0, HANDLES - 1)),
    st.tuples(st.just("unmap"), st.integers(0, PAGES - 1)),
    st.tuples(st.just("map_batch"), st.lists(st.tuples(st.integers(0, PAGES - 1), st.integers(0, HANDLES - 1)),
                                              max_size=4)),
    st.tuples(st.just("unmap_batch"), st.lists(st.integers(0, PAGES - 1), max_size=4)),
)


def _check(d, va, g, model, handles):
    for page in range(PAGES):
        buf = C.create_string_buffer(1)
        if page in model:
            d.copy(C.addressof(buf), va + page * g + 7, 1, CopyKind.D2H)
            assert buf.raw == bytes([model[page] + 1])  # each handle holds its own marker byte
        else:
            try:
                d.copy(C.addressof(buf), va + page * g, 1, CopyKind.D2H)
            except VmmError:
                pass
            else:
                raise AssertionError(f"page {page} reads although the model says it is unmapped")


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, max_size=12), acl=st.booleans())
def test_driver_state_follows_the_model(ops, acl):
    d = open_driver("acl", library="emulation") if acl else open_driver("host")
    try:
        g = d.granularity
        va = d.reserve(PAGES * g)
        handles = d.create_handles(HANDLES, g)
        # give every handle a marker byte through a temporary mapping
        for i, h in enumerate(handles):
            d.map(va, h)
            b = C.create_string_buffer(bytes([i + 1]))
            d.copy(va + 7, C.addressof(b), 1, CopyKind.H2D)
            d.unmap(va)
        model: dict[int, int] = {}  # page -> handle index
        for o in ops:
            if o[0] == "map":
                _, page, hi = o
                ok = page not in model
                try:
                    d.map(va + page * g, handles[hi])
                    assert ok
                    model[page] = hi
                except VmmError:
                    assert not ok
            elif o[0] == "unmap":
                _, page = o
                ok = page in model
                try:
                    d.unmap(va + page * g)
                    assert ok
                    del model[page]
                except VmmError:
                    assert not ok
            elif o[0] == "map_batch":
                pairs = o[1]
                pages = [p for p, _ in pairs]
                ok = len(set(pages)) == len(pages) and not any(p in model for p in pages)
                try:
                    d.map_batch([va + p * g for p in pages], [handles[h] for _, h in pairs])
                    assert ok
                    model.update(dict(pairs))
                except VmmError:
                    assert not ok
            else:
                pages = o[1]
                ok = len(set(pages)) == len(pages) and all(p in model for p in pages)
                try:
                    d.unmap_batch([va + p * g for p in pages])
                    assert ok
                    for p in pages:
                        del model[p]
                except VmmError:
                    assert not ok
            _check(d, va, g, model, handles)
    finally:
        d.close()
