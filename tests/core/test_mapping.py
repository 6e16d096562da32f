"""release_pages: the resident set shrinks, the data stays readable."""

import numpy as np

from pyml.core.mapping import release_pages


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_released_pages_leave_rss_and_read_back_the_same(tmp_path):
    path = tmp_path / "w.bin"
    expect = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
    expect.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    view = mapped[4096 + 100:].reshape(-1)[: 60 << 20]        # an unaligned view, like a tensor
    before = rss_mib()
    total = int(view.sum(dtype=np.uint64))                    # page it all in
    assert rss_mib() - before > 50
    paged_in = rss_mib()
    released = release_pages(view)
    assert released >= (60 << 20) - 2 * 4096 and released % 4096 == 0
    assert paged_in - rss_mib() > 50
    assert int(view.sum(dtype=np.uint64)) == total            # faulted back in from the file
    assert np.array_equal(np.asarray(view[:1000]), expect[4196:5196])


def test_ordinary_arrays_are_left_alone():
    a = np.ones(1 << 20, np.uint8)
    assert release_pages(a) == 0 and a.sum() == 1 << 20
