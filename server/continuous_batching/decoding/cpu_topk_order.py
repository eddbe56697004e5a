"""``torch.topk``'s choice and order on a CPU, exact ties included, in plain Python.

Beam search picks its running beams and its finished hypotheses with ``torch.topk`` over a few
dozen scores; the beam bookkeeping does it in plain Python (see
:mod:`server.continuous_batching.decoding.beam_search`). Which of two exactly equal scores wins
is not a detail there: with bfloat16 logits, two tokens often get the very same log-prob, and
the winner becomes a different beam, so a different answer. To keep the beams transformers
chooses on a CPU, this module reproduces what torch's CPU kernel does (``topk_impl_loop`` in
``aten/src/ATen/native/TopKImpl.h``): it puts the ``(value, index)`` pairs through libstdc++'s
``std::nth_element`` and then ``std::sort`` of the first ``k - 1`` (or ``std::partial_sort``
when ``64 * k <= n``), largest first, NaN above everything. Those algorithms are not stable, and
their tie order is what they leave, which the functions below follow step by step (introselect
and introsort with median-of-three pivots, insertion sort below 16 elements, heap select and
heap sort past the depth limit), as libstdc++'s ``bits/stl_algo.h`` and ``bits/stl_heap.h``
write them. Torch's CUDA kernel breaks ties its own way.
"""

from __future__ import annotations

__all__ = ["topk_indices"]

#: A (value, position) pair, the element type of torch's CPU topk queue.
_Pair = tuple[float, int]

#: libstdc++'s ``_S_threshold``: introsort leaves ranges this short to insertion sort.
_THRESHOLD = 16


def topk_indices(values: list[float], k: int) -> list[int]:
    """Positions of the ``k`` largest ``values``, largest first, as ``torch.topk(t, k)[1]``
    returns them for a 1-D float CPU tensor ``t`` of ``values`` (``sorted=True``)."""
    queue = [(value, index) for index, value in enumerate(values)]
    n = len(queue)
    if not 0 <= k <= n:
        raise ValueError(f"k={k} out of range for {n} values")
    if k == 0:
        return []
    if k * 64 <= n:
        _partial_sort(queue, 0, k, n)
    else:
        _nth_element(queue, 0, k - 1, n)
        _sort(queue, 0, k - 1)  # torch sorts the first k - 1; the k-th is in place already
    return [index for _, index in queue[:k]]


def _before(x: _Pair, y: _Pair) -> bool:
    """torch's comparator for ``largest``: ``x`` goes first if NaN (and ``y`` is not) or larger."""
    a, b = x[0], y[0]
    return (a != a and b == b) or a > b


def _lg(n: int) -> int:
    """``std::__lg``: floor(log2(n)) for n > 0."""
    return n.bit_length() - 1


def _nth_element(q: list[_Pair], first: int, nth: int, last: int) -> None:
    """``std::nth_element`` (``__introselect``)."""
    if first == last or nth == last:
        return
    depth_limit = 2 * _lg(last - first)
    while last - first > 3:
        if depth_limit == 0:
            _heap_select(q, first, nth + 1, last)
            q[first], q[nth] = q[nth], q[first]  # the nth element in its final place
            return
        depth_limit -= 1
        cut = _unguarded_partition_pivot(q, first, last)
        if cut <= nth:
            first = cut
        else:
            last = cut
    _insertion_sort(q, first, last)


def _sort(q: list[_Pair], first: int, last: int) -> None:
    """``std::sort``: introsort, then a final insertion sort."""
    if first == last:
        return
    _introsort_loop(q, first, last, 2 * _lg(last - first))
    if last - first > _THRESHOLD:
        _insertion_sort(q, first, first + _THRESHOLD)
        for i in range(first + _THRESHOLD, last):
            _unguarded_linear_insert(q, i)
    else:
        _insertion_sort(q, first, last)


def _introsort_loop(q: list[_Pair], first: int, last: int, depth_limit: int) -> None:
    while last - first > _THRESHOLD:
        if depth_limit == 0:
            _partial_sort(q, first, last, last)  # heap sort
            return
        depth_limit -= 1
        cut = _unguarded_partition_pivot(q, first, last)
        _introsort_loop(q, cut, last, depth_limit)
        last = cut


def _unguarded_partition_pivot(q: list[_Pair], first: int, last: int) -> int:
    mid = first + (last - first) // 2
    _move_median_to_first(q, first, first + 1, mid, last - 1)
    return _unguarded_partition(q, first + 1, last, first)


def _move_median_to_first(q: list[_Pair], result: int, a: int, b: int, c: int) -> None:
    # libstdc++'s two branches (a before b, or not) are one with a and b swapped: the same
    # comparisons in the same order, so the same median, ties included.
    low, high = (a, b) if _before(q[a], q[b]) else (b, a)
    if _before(q[high], q[c]):
        chosen = high
    elif _before(q[low], q[c]):
        chosen = c
    else:
        chosen = low
    q[result], q[chosen] = q[chosen], q[result]


def _unguarded_partition(q: list[_Pair], first: int, last: int, pivot: int) -> int:
    while True:
        while _before(q[first], q[pivot]):
            first += 1
        last -= 1
        while _before(q[pivot], q[last]):
            last -= 1
        if not first < last:
            return first
        q[first], q[last] = q[last], q[first]
        first += 1


def _insertion_sort(q: list[_Pair], first: int, last: int) -> None:
    if first == last:
        return
    for i in range(first + 1, last):
        if _before(q[i], q[first]):
            value = q[i]
            q[first + 1 : i + 1] = q[first:i]  # std::move_backward
            q[first] = value
        else:
            _unguarded_linear_insert(q, i)


def _unguarded_linear_insert(q: list[_Pair], last: int) -> None:
    value = q[last]
    previous = last - 1
    while _before(value, q[previous]):
        q[last] = q[previous]
        last = previous
        previous -= 1
    q[last] = value


def _partial_sort(q: list[_Pair], first: int, middle: int, last: int) -> None:
    """``std::partial_sort``: heap select, then heap sort of the selected range."""
    _heap_select(q, first, middle, last)
    while middle - first > 1:  # std::__sort_heap
        middle -= 1
        _pop_heap(q, first, middle, middle)


def _heap_select(q: list[_Pair], first: int, middle: int, last: int) -> None:
    _make_heap(q, first, middle)
    for i in range(middle, last):
        if _before(q[i], q[first]):
            _pop_heap(q, first, middle, i)


def _make_heap(q: list[_Pair], first: int, last: int) -> None:
    length = last - first
    if length < 2:
        return
    parent = (length - 2) // 2
    while True:
        _adjust_heap(q, first, parent, length, q[first + parent])
        if parent == 0:
            return
        parent -= 1


def _pop_heap(q: list[_Pair], first: int, last: int, result: int) -> None:
    value = q[result]
    q[result] = q[first]
    _adjust_heap(q, first, 0, last - first, value)


def _adjust_heap(q: list[_Pair], first: int, hole: int, length: int, value: _Pair) -> None:
    top = hole
    child = hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if _before(q[first + child], q[first + child - 1]):
            child -= 1
        q[first + hole] = q[first + child]
        hole = child
    if length % 2 == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        q[first + hole] = q[first + child - 1]
        hole = child - 1
    # std::__push_heap
    parent = (hole - 1) // 2
    while hole > top and _before(q[first + parent], value):
        q[first + hole] = q[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    q[first + hole] = value
