"""The named layout (``autotp/layout.py``): a mesh's axes with their roles, names and sizes, the one
place that names them."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from autotp.layout import AXIS_NAMES, DataAxis, Layout, plain_axis_names
from autotp.mesh import MeshSpec

ROOT = Path(__file__).resolve().parents[1] / "autotp"


def _mesh(shape, names):
    """What ``mesh_problem`` reads of a DeviceMesh: its shape and axis names."""
    return SimpleNamespace(mesh=torch.empty(shape), mesh_dim_names=names)


@pytest.mark.parametrize("layout,shape,names,text", [
    (Layout(tp=8), (8,), ("tp",), "pp 1 x dp 1 x tp 8"),
    (Layout(pp=4, tp=2), (4, 2), ("pp", "tp"), "pp 4 x dp 1 x tp 2"),
    (Layout(pp=4, dp=2, tp=8, zero=1), (4, 2, 8), ("pp", "dp", "tp"), "pp 4 x dp 2 (ZeRO 1) x tp 8"),
    # replicas without stages run as one stage: the pipeline axis is there, of size 1
    (Layout(dp=8, zero=3), (1, 8, 1), ("pp", "dp", "tp"), "pp 1 x dp 8 (ZeRO 3) x tp 1"),
])
def test_a_layout_knows_its_mesh_and_prints_itself(layout, shape, names, text):
    assert (layout.mesh_shape, layout.axis_names, str(layout)) == (shape, names, text)
    assert layout.devices == int(torch.tensor(shape).prod())
    assert layout.planned_axes == ("tp",)  # the ILP plans the tensor axis; the data axis holds replicas
    assert layout.replica_axes == (("dp",) if layout.dp > 1 else ())
    assert layout.data == (DataAxis("dp", layout.dp, layout.zero) if layout.dp > 1 else None)
    assert layout.plain == (layout.pp == layout.dp == 1)
    assert layout.mesh_problem(_mesh(shape, names)) == ""
    wrong = layout.mesh_problem(_mesh((layout.devices,), ("x",)))
    assert f"a mesh of shape {shape} with axes named {names}" in wrong and "given shape" in wrong, wrong


def test_sub_meshes_are_taken_by_role():
    mesh = type("Mesh", (), {"__getitem__": lambda self, name: name})()  # a DeviceMesh's sub-mesh by axis name
    layout = Layout(pp=2, dp=2, tp=2)
    assert [layout.sub_mesh(mesh, r) for r in ("pipeline", "data", "tensor")] == ["pp", "dp", "tp"]
    assert Layout(pp=2, tp=2).sub_mesh(mesh, "data") is None
    with pytest.raises(ValueError, match=r"role 'replica': expected one of \('pipeline', 'data', 'expert', "
                                         r"'context', 'tensor'\)"):
        layout.sub_mesh(mesh, "replica")


@pytest.mark.parametrize("fields,message", [
    (dict(tp=0), r"tp=0; expected a positive int, the tensor axis's number of ranks"),
    (dict(pp=2.0), r"pp=2.0; expected a positive int"),
    (dict(dp=2, zero=2), r"zero=2; expected one of \(0, 1, 3\)"),
    (dict(zero=1), r"zero=1 shards over the data axis, and dp is 1"),
])
def test_bad_layouts_are_refused_saying_what_was_given(fields, message):
    with pytest.raises(ValueError, match=message):
        Layout(**fields)


def test_a_context_axis_sits_between_the_expert_and_the_tensor_axes_and_is_planned():
    layout = Layout(dp=2, tp=4, ep=2, cp=2)
    assert str(layout) == "pp 1 x dp 2 (ZeRO 0) x ep 2 x cp 2 x tp 4" and layout.devices == 32
    assert layout.mesh_shape == (1, 2, 2, 2, 4) and layout.axis_names == ("pp", "dp", "ep", "cp", "tp")
    assert layout.planned_axes == ("ep", "cp", "tp") and layout.planned_shape == (2, 2, 4)
    assert Layout(cp=4).planned_axes == ("cp",) and Layout(cp=4).mesh_shape == (1, 4, 1) and not Layout(cp=4).plain


def test_an_expert_axis_sits_between_the_data_and_the_tensor_axes_and_is_planned():
    layout = Layout(pp=2, dp=2, ep=4, tp=1, zero=1)
    assert layout.mesh_shape == (2, 2, 4, 1) and layout.axis_names == ("pp", "dp", "ep", "tp")
    assert layout.planned_axes == ("ep",) and layout.planned_shape == (4,) and layout.replica_axes == ("dp",)
    assert Layout(ep=2, tp=4).planned_axes == ("ep", "tp") and Layout(ep=2, tp=4).planned_shape == (2, 4)
    assert not Layout(ep=2).plain


def test_a_plain_mesh_s_default_names_are_the_layout_s():
    """A plain mesh's axes are all planned by the ILP: its default names come from the layout."""
    assert MeshSpec.of((8,)).axis_names == plain_axis_names(1) == (AXIS_NAMES["tensor"],)
    assert MeshSpec.of((2, 4)).axis_names == plain_axis_names(2)
    assert MeshSpec.of((2, 2, 2)).axis_names == plain_axis_names(3) == ("axis0", "axis1", "axis2")


def test_no_axis_name_is_written_outside_the_layout():
    """The axis names are the layout's: no module of the package spells one as a string of its own."""
    names = set(AXIS_NAMES.values())
    found = [f"{p.relative_to(ROOT)}:{n.lineno} {n.value!r}" for p in sorted(ROOT.rglob("*.py")) if p.name != "layout.py"
             for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Constant) and n.value in names]
    assert found == []
