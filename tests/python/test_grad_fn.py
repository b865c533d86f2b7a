"""Tensor.grad_fn as PyTorch users read it (issue 50): the node's name(), next_functions
down to AccumulateGrad (with .variable) and None for leaves."""

import numpy as np

import tally


def test_grad_fn_walks_the_graph():
    a = tally.tensor(np.ones((2, 2)), requires_grad=True)
    b = tally.tensor(np.ones((2, 2)))
    assert a.grad_fn is None and b.grad_fn is None
    y = (a * b).sum()
    assert "Sum" in y.grad_fn.name()
    (mul, nr), = y.grad_fn.next_functions
    assert "Mul" in mul.name() and nr == 0
    names = [None if f is None else f.name() for f, _ in mul.next_functions]
    assert names[0] == "AccumulateGrad"
    assert names[1] is None  # b needs no gradient
    assert mul.next_functions[0][0].variable is a or np.array_equal(
        mul.next_functions[0][0].variable.numpy(), a.numpy())
    assert "Backward" in repr(y.grad_fn)
    with tally.no_grad():
        assert (a * 2).grad_fn is None
