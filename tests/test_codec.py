"""autopipe/ir/codec.py: the JSON codec of the IR's values (node arguments, tensor metadata,
tensor literals) and of a whole graph: round trips of every encodable kind, exact JSON, and the
refusals of values and records it cannot read."""

from __future__ import annotations

import json
import math

import pytest
import torch

from autopipe.errors import ArtifactError
from autopipe.ir import (
    BufferInfo,
    Graph,
    ModelFacts,
    Node,
    ParamInfo,
    Ref,
    Scope,
    Size,
    TensorMeta,
    Unit,
)
from autopipe.ir.codec import (
    UnsupportedValue,
    decode,
    decode_meta,
    decode_tensor,
    encode,
    encode_meta,
    encode_tensor,
)

from graphs import meta

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def through_json(data):
    """``data`` as it comes back from a file: JSON text and back."""
    return json.loads(json.dumps(data, allow_nan=False))


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        False,
        0,
        -3,
        "mean",
        1.5,
        -0.0,
        1e300,
        float("inf"),
        float("-inf"),
        Ref("x"),
        [],
        [1, [2, [Ref("y"), "z"]]],
        {"dim": [0, 1], "keepdim": True, "inner": {"dtype": torch.float16}},
        torch.device("cpu"),
        torch.device("cuda"),
        torch.strided,
        torch.sparse_coo,
        torch.contiguous_format,
        torch.channels_last,
        torch.channels_last_3d,
        torch.preserve_format,
        *DTYPES,
    ],
    ids=repr,
)
def test_round_trip(value):
    decoded = decode(through_json(encode(value)))
    assert decoded == value
    assert type(decoded) is type(value)


def test_round_trip_of_sizes_keeps_their_formulas():
    decoded = decode(through_json(encode([Size(32, "4*batch"), 7])))
    assert decoded == [32, 7]
    assert type(decoded[0]) is Size and decoded[0].formula == "4*batch"
    assert type(decoded[1]) is int


def test_round_trip_of_nan():
    assert math.isnan(decode(through_json(encode(float("nan")))))


def test_tuples_come_back_as_lists_and_devices_without_index():
    assert decode(encode((1, (2, Ref("a"))))) == [1, [2, Ref("a")]]
    assert decode(encode(torch.device("cuda", 1))) == torch.device("cuda")


def test_exact_json_of_a_value():
    value = [
        Ref("x"),
        2,
        0.5,
        float("inf"),
        torch.float16,
        None,
        Size(4, "batch"),
        {"k": (1, torch.device("cpu"))},
        torch.channels_last,
        torch.strided,
    ]
    assert encode(value) == [
        {"ref": "x"},
        2,
        0.5,
        {"float": "inf"},
        {"dtype": "float16"},
        None,
        {"size": [4, "batch"]},
        {"dict": {"k": [1, {"device": "cpu"}]}},
        {"memory_format": "channels_last"},
        {"layout": "strided"},
    ]


@pytest.mark.parametrize(
    "value, message",
    [
        (object(), r"object value <object object at"),
        (slice(0, 2), r"slice value slice\(0, 2, None\)"),
        (1j, r"complex value 1j"),
        (torch.ones(2), r"Tensor value tensor\(\[1., 1.\]\)"),
        ({1, 2}, r"set value \{1, 2\}"),
        ([1, object()], r"object value"),  # inside a container too
    ],
)
def test_encode_refuses_what_the_ir_cannot_hold(value, message):
    with pytest.raises(UnsupportedValue, match=message):
        encode(value)


@pytest.mark.xfail(strict=True, raises=KeyError, reason="bug: an unknown layout is a KeyError")
def test_encode_refuses_other_layouts():
    with pytest.raises(UnsupportedValue):
        encode(torch.sparse_csr)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"blob": 1}, "unknown encoded value {'blob': 1}"),
        ([1, {"blob": 1}], "unknown encoded value {'blob': 1}"),
        ({"ref": "a", "float": "inf"}, "malformed encoded value"),
        ({"size": [3]}, r"malformed size {'size': \[3\]}: \[planned size, formula\] expected"),
        ({"size": ["3", "batch"]}, "malformed size"),
        ({"dtype": "float128"}, "unknown dtype 'float128' in artefact"),
        ({"device": "warp-drive"}, "unknown device 'warp-drive' in artefact"),
    ],
)
def test_decode_refuses_unknown_values(data, message):
    with pytest.raises(ArtifactError, match=message):
        decode(data)


# -- tensor metadata -------------------------------------------------------------------------
def test_tensor_meta_json():
    static = TensorMeta((2, 3), torch.bfloat16, (3, 1), True)
    assert static.to_json() == {
        "shape": [2, 3],
        "dtype": "bfloat16",
        "stride": [3, 1],
        "requires_grad": True,
    }
    dynamic = TensorMeta((8, 3), torch.float32, (1, 8), False, ("batch", "3"))
    assert dynamic.to_json() == {
        "shape": [8, 3],
        "dtype": "float32",
        "stride": [1, 8],
        "requires_grad": False,
        "sizes": ["batch", "3"],
    }
    for value in (static, dynamic):
        assert TensorMeta.from_json(through_json(value.to_json())) == value


def test_node_meta_json():
    pair = (meta((2,)), None)
    assert encode_meta(pair) == {"tuple": [meta((2,)).to_json(), None]}
    assert decode_meta(through_json(encode_meta(pair))) == pair
    assert encode_meta(None) is None and decode_meta(None) is None


# -- tensor literals -------------------------------------------------------------------------
def test_exact_json_of_tensors():
    floats = torch.tensor([[1.5, float("inf")], [float("nan"), -2.0]])
    assert encode_tensor(floats) == {
        "shape": [2, 2],
        "dtype": "float32",
        "data": [1.5, {"float": "inf"}, {"float": "nan"}, -2.0],
    }
    assert encode_tensor(torch.tensor([True, False])) == {
        "shape": [2],
        "dtype": "bool",
        "data": [True, False],
    }
    assert encode_tensor(torch.tensor(3, dtype=torch.int8)) == {
        "shape": [],
        "dtype": "int8",
        "data": [3],
    }
    assert encode_tensor(torch.tensor([0.1], dtype=torch.bfloat16))["data"] == [0.10009765625]


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor([[0.1, -2.5e-8], [3e30, float("-inf")]], dtype=torch.float32),
        torch.tensor([0.1, 1 / 3, 1e-300], dtype=torch.float64),
        torch.tensor([0.1, 65504.0, float("inf")], dtype=torch.float16),
        torch.tensor([0.1, 1e38, -3.0], dtype=torch.bfloat16),
        torch.tensor([-(2**63), 2**63 - 1, 0], dtype=torch.int64),
        torch.tensor([[-(2**31)], [7]], dtype=torch.int32),
        torch.tensor([-32768, 32767], dtype=torch.int16),
        torch.tensor([-128, 127], dtype=torch.int8),
        torch.tensor([0, 255], dtype=torch.uint8),
        torch.tensor([[True, False, True]]),
        torch.zeros(0, 3),
        torch.arange(24.0).reshape(2, 3, 4),
    ],
    ids=lambda t: str(t.dtype),
)
def test_tensor_round_trip(tensor):
    decoded = decode_tensor(through_json(encode_tensor(tensor)))
    assert decoded.dtype == tensor.dtype and decoded.shape == tensor.shape
    assert torch.equal(decoded, tensor)


def test_tensor_round_trip_of_nan():
    tensor = torch.tensor([float("nan"), 1.0], dtype=torch.float16)
    decoded = decode_tensor(through_json(encode_tensor(tensor)))
    torch.testing.assert_close(decoded, tensor, rtol=0, atol=0, equal_nan=True)


# -- a whole graph ---------------------------------------------------------------------------
LINEAR = (Scope("lin", "lin", "torch.nn.modules.linear.Linear"),)
BATCH = {"min": 2, "max": 8, "planned": 8, "sources": [["x", 0]]}


def small_graph() -> Graph:
    """A graph holding every kind of record: a dynamic input, a tied parameter, a non-persistent
    buffer with its value, a constant with an infinity, scopes, keyword arguments, a size, a
    tuple value and its getitem, an autocast mode."""
    dynamic = TensorMeta((8, 4), torch.float32, (4, 1), True, ("batch", "4"))
    nodes = [
        Node("x", "input", meta=TensorMeta((8, 4), torch.float32, (4, 1), False, ("batch", "4"))),
        Node("w", "param", "lin.weight", meta=meta((4, 4), requires_grad=True)),
        Node("buf", "buffer", "pos", meta=meta((4,))),
        Node("c", "constant", "c", meta=meta((4,))),
        Node("mm", "call", "aten.mm.default", (Ref("x"), Ref("w")), meta=dynamic, scope=LINEAR),
        Node("shift", "call", "aten.add.Tensor", (Ref("buf"), Ref("c")), meta=meta((4,))),
        Node(
            "add",
            "call",
            "aten.add.Tensor",
            (Ref("mm"), Ref("shift")),
            {"alpha": 2},
            meta=dynamic,
            scope=LINEAR,
        ),
        Node(
            "flat",
            "call",
            "aten.view.default",
            (Ref("add"), [Size(32, "4*batch")]),
            meta=TensorMeta((32,), torch.float32, (1,), True, ("4*batch",)),
            unit=1,
        ),
        Node(
            "parts",
            "call",
            "aten.split.Tensor",
            (Ref("flat"), 16),
            meta=(meta((16,), True), meta((16,), True)),
            context=(("autocast", "cpu", torch.bfloat16, False),),
            unit=1,
        ),
        Node("first", "call", "getitem", (Ref("parts"), 0), meta=meta((16,), True), unit=1),
        Node(
            "out",
            "call",
            "aten.mul.Tensor",
            (Ref("first"), float("-inf")),
            meta=meta((16,), True),
            unit=1,
        ),
    ]
    for node in nodes[4:7]:
        node.unit = 0
    return Graph(
        nodes,
        inputs=["x"],
        outputs=["out"],
        signature=["x"],
        params={
            "lin.weight": ParamInfo(
                ("lin.weight", "head.weight"),
                (4, 4),
                torch.float32,
                True,
                "torch.nn.modules.linear.Linear",
            )
        },
        buffers={
            "pos": BufferInfo(
                ("pos",), (4,), torch.float32, False, "Net", encode_tensor(torch.arange(4.0))
            )
        },
        constants={"c": encode_tensor(torch.tensor([0.5, float("-inf"), 2.0, 3.0]))},
        model=ModelFacts.from_json({"class": "Net", "symbols": {"batch": BATCH}}, ""),
        units=[
            Unit(0, "lin", ["mm", "shift", "add"]),
            Unit(1, "tail", ["flat", "parts", "first", "out"]),
        ],
    )


def test_exact_json_of_graph_records():
    data = small_graph().to_json()
    assert data["scopes"] == [[["lin", "lin", "torch.nn.modules.linear.Linear"]]]
    assert data["units"] == [
        {"label": "lin", "nodes": ["mm", "shift", "add"]},
        {"label": "tail", "nodes": ["flat", "parts", "first", "out"]},
    ]
    records = {r["name"]: r for r in data["nodes"]}
    assert records["x"] == {
        "name": "x",
        "kind": "input",
        "meta": {
            "shape": [8, 4],
            "dtype": "float32",
            "stride": [4, 1],
            "requires_grad": False,
            "sizes": ["batch", "4"],
        },
    }
    assert records["add"] == {
        "name": "add",
        "kind": "call",
        "target": "aten.add.Tensor",
        "args": [{"ref": "mm"}, {"ref": "shift"}],
        "kwargs": {"alpha": 2},
        "meta": {
            "shape": [8, 4],
            "dtype": "float32",
            "stride": [4, 1],
            "requires_grad": True,
            "sizes": ["batch", "4"],
        },
        "scope": 0,
        "unit": 0,
    }
    assert records["flat"]["args"] == [{"ref": "add"}, [{"size": [32, "4*batch"]}]]
    assert records["parts"]["context"] == [["autocast", "cpu", {"dtype": "bfloat16"}, False]]
    assert records["parts"]["meta"] == {"tuple": [meta((16,), True).to_json()] * 2}
    assert records["out"]["args"] == [{"ref": "first"}, {"float": "-inf"}]
    assert data["params"] == [
        {
            "names": ["lin.weight", "head.weight"],
            "shape": [4, 4],
            "dtype": "float32",
            "requires_grad": True,
            "owner": "torch.nn.modules.linear.Linear",
        }
    ]
    assert data["buffers"][0]["value"] == {
        "shape": [4],
        "dtype": "float32",
        "data": [0.0, 1.0, 2.0, 3.0],
    }
    assert data["model"] == {"class": "Net", "symbols": {"batch": BATCH}}


def test_graph_round_trip():
    graph = small_graph()
    graph.lint()
    read = Graph.from_json(through_json(graph.to_json()))
    assert list(read.dag.nodes) == list(graph.dag.nodes)
    for name in graph.dag.nodes:
        assert read[name] == graph[name], name
    size = read["flat"].args[1][0]
    assert type(size) is Size and size.formula == "4*batch"
    assert read.inputs == graph.inputs and read.outputs == graph.outputs
    assert read.signature == graph.signature
    assert read.params == graph.params and read.buffers == graph.buffers
    assert read.constants == graph.constants
    assert read.model == graph.model
    assert read.units == graph.units
    assert sorted(read.dag.edges) == sorted(graph.dag.edges)
    text = graph.json_text()
    assert read.json_text() == text
    assert Graph.from_json(through_json(read.to_json())).json_text() == text  # twice: a fixpoint


def test_branch_graphs_are_values():
    """A ``torch.cond`` branch is a graph inside an argument: ``{"graph": ...}``."""
    branch = Graph(
        [
            Node("a", "input", meta=meta((2,))),
            Node("r", "call", "aten.relu.default", (Ref("a"),), meta=meta((2,)), unit=0),
        ],
        inputs=["a"],
        outputs=["r"],
        signature=["a"],
        params={},
        buffers={},
        constants={},
        model=ModelFacts.of_subgraph("Branch"),
        units=[Unit(0, "r", ["r"])],
    )
    data = encode([branch])
    assert data == [{"graph": branch.to_json()}]
    (read,) = decode(through_json(data))
    assert isinstance(read, Graph) and read.json_text() == branch.json_text()


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda d: d["nodes"][-1].update(args=[{"ref": "first"}, {"blob": 1}]),
            "the graph artefact is invalid: unknown encoded value {'blob': 1}; "
            "write it again with `autopipe trace`",
        ),
        (
            lambda d: d["nodes"][-1].update(args=[{"ref": "ghost"}, 2.0]),
            "invalid: node 'out' reads unknown node 'ghost'",
        ),
        (lambda d: d.pop("nodes"), r"malformed \(a field 'nodes' is missing\)"),
        (lambda d: d["params"][0].update(dtype="float128"), "unknown dtype 'float128'"),
        (
            lambda d: d["nodes"][0]["meta"].update(shape="8"),
            "invalid: shape is '8', which is not a list",
        ),
    ],
)
def test_graph_refusals(edit, message):
    data = through_json(small_graph().to_json())
    edit(data)
    with pytest.raises(ArtifactError, match=message):
        Graph.from_json(data)
