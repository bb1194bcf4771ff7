"""The operators tensor parallelism shards, and where each takes its operands: the one table the
region pass, the sharding plan, the cost model and code generation read positions from."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EMBEDDING", "LINEAR", "ADDMM", "MM", "PROJECTIONS", "WEIGHTED", "WeightedOperator"]


@dataclass(frozen=True)
class WeightedOperator:
    """An ATen operator reading a weight: the argument positions of its input, its weight and
    its bias (None: it takes none), and the weight's dimension of output features."""

    target: str
    input_at: int
    weight_at: int
    bias_at: int | None
    out_dim: int

    def operands(self) -> int:
        """The fewest arguments a call of it passes to name its input and weight."""
        return max(self.input_at, self.weight_at) + 1


#: ``linear(x, weight[out, in], bias)``
LINEAR = WeightedOperator("aten.linear.default", input_at=0, weight_at=1, bias_at=2, out_dim=0)
#: ``addmm(bias, x, weight[in, out])`` (a Conv1D's product: GPT-2's projections)
ADDMM = WeightedOperator("aten.addmm.default", input_at=1, weight_at=2, bias_at=0, out_dim=1)
#: ``mm(x, weight[in, out])``
MM = WeightedOperator("aten.mm.default", input_at=0, weight_at=1, bias_at=None, out_dim=1)
#: ``embedding(weight[rows, features], ids)``
EMBEDDING = WeightedOperator(
    "aten.embedding.default", input_at=1, weight_at=0, bias_at=None, out_dim=1
)
#: the projections (a product of an input and a weight), by target
PROJECTIONS = {op.target: op for op in (LINEAR, ADDMM, MM)}
#: every operator reading a weight that tensor parallelism shards, by target
WEIGHTED = PROJECTIONS | {EMBEDDING.target: EMBEDDING}
