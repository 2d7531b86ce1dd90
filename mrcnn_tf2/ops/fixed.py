"""Weights that stay fixed for the life of a traced function: what is computed from them alone, once.

Inference on loaded weights calls one traced function for every image, and each call would prepare the same
kernels again from the variables (a batch norm folded into its conv's kernel, Winograd's transform of a 3x3
kernel; docs/PERFORMANCE.md has their share of a step). A function traced under `fixed_weights` computes each
`once(fn, *weights)` when it is traced, from the weights' values then, and captures the result as a constant of
every call. Training, and evaluation of a model in training, trace without it: their weights change between
calls.
"""

import contextlib
import threading

import tensorflow as tf

_STATE = threading.local()


@contextlib.contextmanager
def fixed_weights():
    """Within it, functions traced (on this thread) compute `once`'s values at trace time: the weights must
    not change for as long as such a function is called."""
    outer = getattr(_STATE, "fixed", False)
    _STATE.fixed = True
    try:
        yield
    finally:
        _STATE.fixed = outer


def _value_now(weight):
    """A variable as it is, the eager tensor behind `weight` (itself, or a traced function's capture of one,
    through nested functions), or None where the value is known only when the function runs."""
    if not isinstance(weight, tf.Tensor):
        return weight  # a variable (tf.Variable or keras.Variable)
    while not isinstance(weight, tf.__internal__.EagerTensor):
        captures = getattr(weight.graph, "captures", ())
        weight = next((external for external, internal in captures if internal is weight), None)
        if weight is None or weight.dtype == tf.resource:
            return None
    return weight


def once(fn, *weights):
    """fn(*weights), the tensor it returns computed once where it can be.

    Args:
      fn: a function of the weights alone (no other tensor of the trace), returning one tensor.
      *weights: variables, or tensors computed from variables by `once`.

    Returns:
      While a function is traced under `fixed_weights` and every weight's value is known then: fn's result
      computed now, an eager tensor (the function captures it where an op uses it). Otherwise fn(*weights),
      ops of the graph (or eager ops, when not tracing).
    """
    if not getattr(_STATE, "fixed", False) or tf.executing_eagerly():
        return fn(*weights)
    values = [_value_now(weight) for weight in weights]
    if any(value is None for value in values):
        return fn(*weights)
    with tf.init_scope():
        return fn(*values)
