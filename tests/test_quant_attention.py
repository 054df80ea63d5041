"""The row-exact attention kernel (``specflow.quant.attention``): softmax attention within
float rounding of a float64 reference, a row's bits independent of the rows beside it and of
the threads, a tree row's bits those of the chain it lies on, and every build's bits the
portable build's."""

from __future__ import annotations

import pytest
import torch

from specflow.quant import kernel
from specflow.quant.attention import attend_rows

NH, KH, D = 6, 2, 16  # three query heads a KV group
L = 64  # cache positions


def cache(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(KH, L, D, generator=g) * 2, torch.randn(KH, L, D, generator=g)


def queries(t: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(t, NH, D, generator=torch.Generator().manual_seed(seed)) * 2


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              visible: list[list[int]], scale: float) -> torch.Tensor:
    """float64 softmax attention of row ``i`` over the key positions ``visible[i]``."""
    out = torch.empty(q.shape, dtype=torch.float64)
    r = NH // KH
    for i, cols in enumerate(visible):
        for h in range(NH):
            k, v = keys[h // r, cols].double(), values[h // r, cols].double()
            p = torch.softmax(k @ q[i, h].double() * scale, 0)
            out[i, h] = p @ v
    return out


def chain(start: int, t: int) -> torch.Tensor:
    return torch.arange(start + 1, start + t + 1, dtype=torch.long)


def test_rows_attend_their_prefix_as_softmax_attention_does():
    keys, values = cache()
    q = queries(5)
    out = attend_rows(q, keys, values, chain(40, 5), None, D**-0.5)
    want = reference(q, keys, values, [list(range(41 + i)) for i in range(5)], D**-0.5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=2e-6, atol=2e-6)


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it_or_the_threads():
    keys, values = cache(2)
    q = queries(9, 3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = attend_rows(q, keys, values, chain(50, 9), None, 0.3)
        torch.set_num_threads(1)
        alone = torch.cat([attend_rows(q[i : i + 1], keys, values, chain(50 + i, 1), None, 0.3)
                           for i in range(9)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone)


def test_a_tree_row_gets_the_bits_of_the_chain_it_lies_on():
    """Rows 20..23 hold a tree: 20 -> {21, 22}, 21 -> 23.  Row 23's path is 20, 21, 23: its
    keys are the prefix then those three, the same keys a chain decoding that path holds."""
    keys, values = cache(4)
    q = queries(4, 5)
    offsets = torch.tensor([0, 1, 3, 5, 8])
    columns = torch.tensor([20, 20, 21, 20, 22, 20, 21, 23])
    tree = attend_rows(q, keys, values, torch.full((4,), 20), (offsets, columns), 0.25)
    path_keys = keys.clone()
    path_values = values.clone()
    path_keys[:, 22] = keys[:, 23]  # decoding the path 20, 21, 23 puts 23 at position 22
    path_values[:, 22] = values[:, 23]
    along = attend_rows(q[[0, 1, 3]], path_keys, path_values, chain(20, 3), None, 0.25)
    assert torch.equal(tree[[0, 1, 3]], along)
    want = reference(q, keys, values, [[*range(20), *columns[offsets[i]:offsets[i + 1]].tolist()]
                                       for i in range(4)], 0.25)
    torch.testing.assert_close(tree.double(), want, rtol=2e-6, atol=2e-6)


def test_scores_far_below_the_maximum_underflow_to_zero_weight():
    keys = torch.zeros(KH, L, D)
    keys[:, 3] = 100.0  # one key scores 100 * 16 * q; the others 0
    values = torch.arange(L, dtype=torch.float32)[None, :, None].expand(KH, L, D).contiguous()
    q = torch.ones(1, NH, D)
    out = attend_rows(q, keys, values, chain(9, 1), None, 1.0)
    assert torch.equal(out, torch.full((1, NH, D), 3.0))


def test_a_head_size_that_is_not_a_multiple_of_8_is_refused():
    keys = torch.zeros(KH, L, 12)
    with pytest.raises(ValueError, match="multiple of 8"):
        attend_rows(torch.zeros(1, NH, 12), keys, keys.clone(), chain(3, 1), None, 1.0)


def test_more_than_64_query_heads_a_kv_head_are_refused():
    keys = torch.zeros(1, L, 8)
    with pytest.raises(ValueError, match="at most 64 a KV head"):
        attend_rows(torch.zeros(1, 65, 8), keys, keys.clone(), chain(3, 1), None, 1.0)
    assert attend_rows(torch.ones(1, 64, 8), keys, keys.clone(), chain(3, 1), None,
                       1.0).shape == (1, 64, 8)


VECTOR_BUILDS = [b for b in ("avx512", "avx2") if b in kernel.runnable_builds()]


@pytest.mark.skipif(not VECTOR_BUILDS, reason="this CPU runs only the portable build")
@pytest.mark.parametrize("build", VECTOR_BUILDS)
@pytest.mark.parametrize(("nh", "kh", "d"), [(NH, KH, D), (14, 2, 24), (27, 3, 8)])
def test_each_vector_build_gives_the_portable_builds_bits(build, nh, kh, d, monkeypatch):
    """The vector builds attend a group's heads together (8 scored, 6 summed at a time;
    columns 16 at a time, then 8): 7 and 9 heads a group and a head of 24 take every
    remainder; a tree's rows too."""
    g = torch.Generator().manual_seed(6)
    keys, values = torch.randn(kh, L, d, generator=g) * 2, torch.randn(kh, L, d, generator=g)
    q = torch.randn(7, nh, d, generator=g) * 2
    offsets = torch.tensor([0, 1, 3, 5, 8, 9, 10, 11])
    columns = torch.tensor([30, 30, 31, 30, 32, 30, 31, 33, 34, 35, 36])
    results = {}
    for name in (build, "portable"):
        loaded = kernel.load_build(name)
        assert loaded.available, loaded.why
        monkeypatch.setattr("specflow.quant.matrix.kernel_status", lambda k=loaded: k)
        results[name] = (attend_rows(q, keys, values, chain(30, 7), None, d**-0.5),
                         attend_rows(q, keys, values, torch.full((7,), 30), (offsets, columns),
                                     d**-0.5))
    for vector, portable in zip(results[build], results["portable"], strict=True):
        assert torch.equal(vector, portable)
