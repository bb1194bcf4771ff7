"""autopipe/codegen/emit.py: the source text of argument values, calls and statements, and the
body of a forward over a hand-built graph, line by line."""

from __future__ import annotations

import pytest
import torch

from autopipe.codegen.emit import (
    ModuleCall,
    assignment,
    attribute_path,
    black_statement,
    context_managers,
    forward_body,
    literal,
    operator_call,
    scope_label,
    tensor_expression,
    uses_device,
)
from autopipe.ir import Graph, ModelFacts, Node, ParamInfo, Ref, Scope, Size, Unit
from autopipe.ir.codec import encode_tensor

from graphs import SMALL, meta

BLOCK = (Scope("h.0", "h.0", "model.Block"),)


def name_of(ref: Ref) -> str:
    return f"v_{ref.name}"


@pytest.mark.parametrize(
    "value, source",
    [
        (3, "3"),
        (-1, "-1"),
        (True, "True"),
        (None, "None"),
        (0.5, "0.5"),
        (1e20, "1e20"),  # black writes exponents without "+"
        (1e-05, "1e-05"),
        (float("inf"), 'float("inf")'),
        (float("-inf"), 'float("-inf")'),
        (float("nan"), 'float("nan")'),
        ("mean", '"mean"'),
        ('say "hi"', "'say \"hi\"'"),  # repr: black's quotes would need an escape
        (Ref("x"), "v_x"),
        (Size(12, "2*batch + 4"), "2*batch + 4"),
        ([1, (2, Ref("y")), []], "[1, [2, v_y], []]"),  # tuples are written as lists
        ({"dim": [0, 1]}, "{'dim': [0, 1]}"),
        (torch.bfloat16, "torch.bfloat16"),
        (torch.int64, "torch.int64"),
        (torch.device("cuda", 1), "device"),  # the stage's own device
        (torch.strided, "torch.strided"),
        (torch.channels_last, "torch.channels_last"),
        (torch.preserve_format, "torch.preserve_format"),
    ],
)
def test_literal(value, source):
    assert literal(value, name_of) == source


@pytest.mark.parametrize("value", [object(), torch.sparse_coo, 1j])
def test_literal_refuses_what_it_cannot_write(value):
    with pytest.raises(TypeError, match="cannot write .* as source"):
        literal(value, name_of)


def test_operator_call():
    addmm = Node("y", "call", "aten.addmm.default", (Ref("b"), Ref("x"), Ref("w")), {"beta": 0.5})
    assert operator_call(addmm, name_of) == (
        "aten.addmm.default",
        ["v_b", "v_x", "v_w", "beta=0.5"],
    )
    custom = Node("z", "call", "mylib.scale.default", (Ref("x"), Size(8, "seq")), {"out": None})
    assert operator_call(custom, name_of) == (
        "torch.ops.mylib.scale.default",
        ["v_x", "seq", "out=None"],
    )
    getitem = Node("g", "call", "getitem", (Ref("parts"), 1))
    assert operator_call(getitem, name_of) == ("v_parts[1]", [])


def test_assignment_on_one_line():
    assert assignment("y", "aten.relu.default", ["x"], 8) == ["y = aten.relu.default(x)"]
    assert assignment("y", "x[0]", None, 8) == ["y = x[0]"]
    assert assignment("y", "f", [], 8) == ["y = f()"]


def test_assignment_hangs_the_arguments_as_black_does():
    args = ["self_transformer_h_0_attn_c_attn_bias", "view_of_the_hidden_states_input", "t"]
    lines = assignment("out", "aten.addmm.default", args, 8)
    assert lines == [
        "out = aten.addmm.default(",
        "    self_transformer_h_0_attn_c_attn_bias, view_of_the_hidden_states_input, t",
        ")",
    ]
    assert lines == black_statement(f"out = aten.addmm.default({', '.join(args)})", 8)


def test_assignment_one_argument_per_line_as_black_does():
    args = [f"a_rather_long_argument_name_number_{i}_of_the_call" for i in range(3)]
    lines = assignment("out", "aten.cat.default", args, 12)
    assert lines == [
        "out = aten.cat.default(",
        *(f"    {a}," for a in args),
        ")",
    ]
    assert lines == black_statement(f"out = aten.cat.default({', '.join(args)})", 12)


def test_assignment_leaves_escapes_to_black():
    assert assignment("y", "f", ["'a'"], 8) == ['y = f("a")']


def test_assignment_of_a_long_expression():
    long = " + ".join(f"value_number_{i}" for i in range(8))
    assert assignment("y", long, None, 8) == black_statement(f"y = {long}", 8)
    assert len(assignment("y", long, None, 8)) > 1


def test_black_statement():
    assert black_statement("y=f( a,b )", 8) == ["y = f(a, b)"]
    assert black_statement("a, b = self.h[0](x)", 0) == ["a, b = self.h[0](x)"]


@pytest.mark.parametrize(
    "fqn, path",
    [
        ("transformer.h.0.attn.weight", "self.transformer.h[0].attn.weight"),
        ("h.11", "self.h[11]"),
        ("0.1", "self[0][1]"),
        ("blocks.my-block.w", "self.blocks['my-block'].w"),
    ],
)
def test_attribute_path(fqn, path):
    assert attribute_path(fqn) == path


def test_attribute_path_from_another_root():
    assert attribute_path("layers.2.norm", root="model") == "model.layers[2].norm"


def test_context_managers():
    assert context_managers((("grad", False),)) == "torch.no_grad()"
    assert context_managers((("grad", True), ("autocast", "cuda", torch.bfloat16, True))) == (
        "torch.enable_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=True)"
    )
    assert context_managers((("autocast", "cpu", None, False),)) == (
        "torch.autocast(device.type, dtype=None, enabled=False)"
    )
    assert context_managers(()) == ""


def test_uses_device():
    plain = Node("a", "call", "aten.relu.default", (Ref("x"),))
    nested = Node("b", "call", "aten.ones.default", ([2, 3],), {"options": [torch.device("cpu")]})
    in_dict = Node("c", "call", "mylib.f.default", ({"where": torch.device("cpu")},))
    autocast = Node("d", "call", "aten.mm.default", (), context=(("autocast", "cpu", None, True),))
    no_grad = Node("e", "call", "aten.mm.default", (), context=(("grad", False),))
    assert not uses_device([plain, no_grad])
    assert uses_device([plain, nested])
    assert uses_device([in_dict])
    assert uses_device([autocast])


@pytest.mark.parametrize(
    "tensor, source",
    [
        (torch.full((2, 3), 1.5), "torch.full([2, 3], 1.5, dtype=torch.float32)"),
        (torch.full((2,), float("-inf")), 'torch.full([2], float("-inf"), dtype=torch.float32)'),
        (torch.tensor(7), "torch.full([], 7, dtype=torch.int64)"),
        (torch.ones(2, 2, dtype=torch.bool), "torch.full([2, 2], True, dtype=torch.bool)"),
        (
            torch.arange(2, 8).reshape(2, 3),
            "torch.arange(2, 8, dtype=torch.int64).reshape([2, 3])",
        ),
        (
            torch.tensor([[1.0, 2.0], [4.0, 8.0]], dtype=torch.float16),
            "torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=torch.float16).reshape([2, 2])",
        ),
        (  # floats are never written as arange: their values are written
            torch.tensor([0.0, 1.0, 2.0]),
            "torch.tensor([0.0, 1.0, 2.0], dtype=torch.float32).reshape([3])",
        ),
        (
            torch.tensor([3, 1, 2], dtype=torch.int32),
            "torch.tensor([3, 1, 2], dtype=torch.int32).reshape([3])",
        ),
        (torch.zeros(0), "torch.tensor([], dtype=torch.float32).reshape([0])"),
    ],
)
def test_tensor_expression(tensor, source):
    assert tensor_expression(encode_tensor(tensor)) == source
    rebuilt = eval(source, {"torch": torch})
    assert rebuilt.dtype == tensor.dtype and torch.equal(rebuilt, tensor)


@pytest.mark.xfail(
    strict=True,
    raises=NotImplementedError,
    reason="bug: a bool tensor of mixed values tries torch.arange(dtype=torch.bool)",
)
def test_tensor_expression_of_a_bool_mask():
    mask = torch.tensor([[True, False], [True, True]])
    assert tensor_expression(encode_tensor(mask)) == (
        "torch.tensor([True, False, True, True], dtype=torch.bool).reshape([2, 2])"
    )


def forward_nodes() -> list[Node]:
    """x @ w in block h.0, its relu under no_grad, then x added back twice in the model."""
    return [
        Node("mm", "call", "aten.mm.default", (Ref("x"), Ref("w")), scope=BLOCK, unit=0),
        Node(
            "relu",
            "call",
            "aten.relu.default",
            (Ref("mm"),),
            scope=BLOCK,
            context=(("grad", False),),
            unit=0,
        ),
        Node("add", "call", "aten.add.Tensor", (Ref("relu"), Ref("x")), {"alpha": 2}, unit=1),
    ]


def forward_graph():
    nodes = [
        Node("x", "input", meta=meta(SMALL)),
        Node("w", "param", "h.0.w", meta=meta((4, 4), requires_grad=True)),
        *forward_nodes(),
    ]
    return Graph(
        nodes,
        inputs=["x"],
        outputs=["add"],
        signature=["x"],
        params={"h.0.w": ParamInfo(("h.0.w",), (4, 4), torch.float32, True, "model.Block")},
        buffers={},
        constants={},
        model=ModelFacts.from_json({"class": "Net"}, ""),
        units=[Unit(0, "h.0", ["mm", "relu"]), Unit(1, "add", ["add"])],
    )


def test_forward_body():
    graph = forward_graph()
    calls = [graph[name] for name in ("mm", "relu", "add")]
    items = [*calls, ModuleCall("h.1 (Block)", ("y",), "self.h[1]", ("add",))]
    lines = forward_body(graph, items, lambda r: r.name, lambda n: scope_label(n, "Net"))
    assert lines == [
        "# h.0 (Block)",
        "mm = aten.mm.default(x, w)",
        "with torch.no_grad():",
        "    # h.0 (Block)",
        "    relu = aten.relu.default(mm)",
        "# Net (model)",
        "add = aten.add.Tensor(relu, x, alpha=2)",
        "# h.1 (Block)",
        "y = self.h[1](add)",
    ]


def test_forward_body_names_targets_and_groups_labels():
    graph = forward_graph()
    same_mode = [graph["mm"], graph["add"]]
    lines = forward_body(
        graph, same_mode, name_of, lambda n: "one label", base=8, target=lambda s: f"t_{s}"
    )
    assert lines == [
        "# one label",
        "t_mm = aten.mm.default(v_x, v_w)",
        "t_add = aten.add.Tensor(v_relu, v_x, alpha=2)",
    ]


def test_module_call_with_several_targets():
    call = ModuleCall("h.2 (Block)", ("a", "b"), "self.h[2]", ("x", "mask"))
    assert call.statement(8) == ["a, b = self.h[2](x, mask)"]
    assert ModuleCall("h.3 (Block)", (), "self.h[3]", ("x",)).statement(8) == ["self.h[3](x)"]
