"""torch modules a stage calls whole.

``torch.export`` cannot trace some ``torch.nn`` modules: an RNN (``nn.LSTM``, ``nn.GRU``,
``nn.RNN``) over a ``PackedSequence``, whose packed data has as many rows as the batch has
tokens, and any module a user names with ``--keep-whole``. autopipe keeps such a module as one
call: the generated stage holds a real instance at the module's original name (its parameters
keep their names) and calls it, through :func:`run_over_packed` for a packed sequence or
:func:`tensors_of` otherwise. The compiler's interpreter runs the same functions, so profiles
and generated code agree.

A packed sequence is carried between operators and stages as its padded tensor (sorted by
length, longest first, as ``pack_padded_sequence`` sorts it), its lengths and the sorting
permutation: tensors of fixed shapes. On fake or meta tensors (the dry run, autopipe's profiles)
there are no lengths to pack by, so the RNN runs over the whole padded batch, which gives the
packed run's shapes and an upper bound of its cost.

Shared by the compiler and train.py; needs only torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

__all__ = ["has_values", "hidden_of", "run_over_packed", "tensors_of"]

#: the hidden state an RNN call is given: none, one tensor (RNN, GRU) or (h, c) (LSTM)
Hidden = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None


def has_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds values (not a fake or meta tensor)."""
    return not (tensor.is_meta or is_fake(tensor))


def tensors_of(value: Any) -> tuple[torch.Tensor, ...]:
    """The tensors of a module's result, in order (nested tuples and lists flattened)."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)):
        return tuple(t for item in value for t in tensors_of(item))
    raise TypeError(
        f"a module kept whole returned a {type(value).__name__}; autopipe keeps modules whose "
        "results are tensors or tuples of tensors"
    )


def run_over_packed(
    rnn: nn.RNNBase,
    padded: torch.Tensor,
    lengths: torch.Tensor,
    sorted_indices: torch.Tensor | None,
    hidden: Hidden,
    batch_first: bool,
) -> tuple[torch.Tensor, ...]:
    """Run ``rnn`` over the packed sequence ``padded`` holds, as the model does, and return its
    output padded again (zeros after each sequence's end, the same layout and length as
    ``padded``), then its final hidden state's tensors.

    ``padded`` is sorted by ``lengths``, longest first; ``sorted_indices`` is the permutation
    that sorted it (None when the model's batch came sorted), which the RNN applies to
    ``hidden`` and undoes on its final state, as it does for the model's ``PackedSequence``.
    """
    time = 1 if batch_first else 0
    if not has_values(padded):
        # no lengths to pack by: the whole padded batch, with the packed run's shapes
        swap = rnn.batch_first != batch_first
        output, final = rnn(padded.transpose(0, 1) if swap else padded, hidden)
        return (output.transpose(0, 1) if swap else output, *tensors_of(final))
    if padded.is_cuda:
        rnn.flatten_parameters()  # cuDNN wants the weights in one block; a no-op once they are
    packed = pack_padded_sequence(padded, lengths.cpu(), batch_first=batch_first)
    packed = PackedSequence(packed.data, packed.batch_sizes, sorted_indices)
    output, final = rnn(packed, hidden)
    result, _ = pad_packed_sequence(
        PackedSequence(output.data, output.batch_sizes),
        batch_first=batch_first,
        total_length=padded.size(time),
    )
    return (result, *tensors_of(final))


def hidden_of(tensors: Sequence[torch.Tensor], count: int) -> Hidden:
    """The hidden-state argument of an RNN call from its ``count`` tensors (0, 1 or 2)."""
    if count == 0:
        return None
    if count == 1:
        return tensors[0]
    return (tensors[0], tensors[1])
