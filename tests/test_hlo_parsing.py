"""The StableHLO / HLO text parsers, on recorded texts of every replica-group syntax."""

import pathlib

import pytest

from reprules._report import _hlo

DATA = pathlib.Path(__file__).parent / "data"
MESH = {"data": 4, "model": 2}


def _read(name):
    return (DATA / name).read_text()


@pytest.mark.parametrize(
    "text, ids",
    [
        ("{{0,1},{2,3}}", ((0, 1), (2, 3))),
        ("{}", ()),
        ("[2,2]<=[4]", ((0, 1), (2, 3))),
        ("[4,2]<=[8]", ((0, 1), (2, 3), (4, 5), (6, 7))),
        ("[2,4]<=[4,2]T(1,0)", ((0, 2, 4, 6), (1, 3, 5, 7))),
        ("[1,8]<=[8]", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        ("dense<[[0, 2], [1, 3]]> : tensor<2x2xi64>", ((0, 2), (1, 3))),
        ("dense<0> : tensor<1x1xi64>", ((0,),)),
    ],
    ids=["explicit", "empty", "iota", "iota-8", "iota-transposed", "iota-one-group", "stablehlo-dense",
         "stablehlo-splat"],
)
def test_replica_group_syntaxes(text, ids):
    assert _hlo.parse_groups(text).ids == ids


@pytest.mark.parametrize(
    "text, axes",
    [
        ("{{0,1},{2,3},{4,5},{6,7}}", ("model",)),
        ("[2,4]<=[4,2]T(1,0)", ("data",)),
        ("{}", ("data", "model")),
        ("{{0,1,2,3,4,5,6,7}}", ("data", "model")),
        ("mesh['data'=4,'model'=2] {'model'}", ("model",)),
        # XLA's own mesh, as JAX 0.10's multi-process compile prints a combined all-reduce
        ("mesh['axis_0'=4,'axis_1'=1,'axis_2'=1,'axis_3'=2] {'axis_0'}", ("data",)),
        ("mesh['axis_0'=4,'axis_1'=1,'axis_2'=1,'axis_3'=2] {'axis_3'}", ("model",)),
        ("mesh['axis_0'=4,'axis_1'=2] {'axis_0','axis_1'}", ("data", "model")),
        ('#stablehlo.replica_group_mesh_axes<mesh = @mesh_0, axes = [#stablehlo.axis_ref<name = "data">]>',
         ("data",)),
    ],
)
def test_groups_map_back_to_mesh_axes(text, axes):
    assert _hlo.groups_to_axes(_hlo.parse_groups(text), MESH) == axes


def test_groups_matching_no_axes_give_none():
    assert _hlo.groups_to_axes(_hlo.parse_groups("{{0,3},{1,2},{4,7},{5,6}}"), MESH) is None
    assert _hlo.groups_to_axes(_hlo.parse_groups("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}"), MESH) is None
    assert _hlo.groups_to_axes(_hlo.parse_groups("mesh['axis_0'=4] {'axis_0'}"), MESH) is None  # 4 of 8


def test_collective_permute_pairs_map_to_the_axis_they_cross():
    groups = _hlo.parse_groups("{{0,2},{2,4},{4,6},{6,0}}", pairs=True)
    assert _hlo.groups_to_axes(groups, MESH) == ("data",)


def test_unknown_syntax_is_an_error():
    with pytest.raises(ValueError, match="unrecognised replica groups"):
        _hlo.parse_groups("<<nonsense>>")


def test_hlo_explicit_groups_with_source_metadata():
    (c,) = _hlo.parse_hlo(_read("hlo_0.4.28_explicit_groups.txt"))
    assert (c.kind, c.dtype, c.shapes) == ("all-reduce", "f32", ((2, 128),))
    assert _hlo.groups_to_axes(c.groups, MESH) == ("model",)
    assert c.op_name.startswith("jit(<lambda>)/jit(main)/transpose(jvp(jit(shmap_body)))/psum")
    assert c.source == "/work/probe/issue21855.py:18"


def test_hlo_mesh_groups_and_stack_frame_tables():
    (c,) = _hlo.parse_hlo(_read("hlo_0.12_mesh_groups.txt"))
    assert c.groups.axes == ("model",)
    assert c.op_name == "jit(<lambda>)/transpose(jvp())/shard_map/psum"
    assert c.source == "/work/probe/issue21855.py:18"  # via stack_frame_id -> StackFrames -> FileLocations


def test_hlo_async_pairs_counted_once_and_tuples_kept():
    found = _hlo.parse_hlo(_read("hlo_async_and_iota.txt"))
    kinds = [c.kind for c in found]
    assert kinds == ["all-reduce", "all-reduce", "all-gather", "collective-permute", "reduce-scatter",
                     "all-to-all", "all-reduce"]
    start, combined, gather, permute, scatter, a2a, everyone = found
    assert start.is_async and start.source == "/work/probe/train.py:42"
    assert _hlo.groups_to_axes(start.groups, MESH) == ("model",)
    assert combined.shapes == ((128, 64), (64,)) and _hlo.groups_to_axes(combined.groups, MESH) == ("data",)
    assert gather.is_async and gather.dtype == "bf16" and gather.shapes == ((16, 16),)
    assert _hlo.groups_to_axes(gather.groups, MESH) == ("data",)
    assert permute.is_async and permute.shapes == ((2, 128),)
    assert _hlo.groups_to_axes(permute.groups, MESH) == ("data",)
    assert scatter.group_size == 2
    assert _hlo.groups_to_axes(a2a.groups, MESH) == ("data", "model")
    assert _hlo.groups_to_axes(everyone.groups, MESH) == ("data", "model")
    assert _hlo.nbytes("bf16", gather.shapes) == 512


def test_stablehlo_dense_groups_and_debug_locations():
    (c,) = _hlo.parse_stablehlo(_read("stablehlo_0.4.28_dense_groups.mlir"))
    assert (c.kind, c.level, c.dtype, c.shapes) == ("all-reduce", "stablehlo", "f32", ((2, 128),))
    assert _hlo.groups_to_axes(c.groups, MESH) == ("model",)
    assert c.op_name == "jit(<lambda>)/jit(main)/transpose(jvp(jit(shmap_body)))/psum"
    assert c.source == "/work/probe/issue21855.py:18"


def test_stablehlo_mesh_axes_groups():
    (c,) = _hlo.parse_stablehlo(_read("stablehlo_0.12_mesh_axes.mlir"))
    assert c.groups.axes == ("model",) and c.shapes == ((2, 128),)
    assert c.source == "/work/probe/issue21855.py:18"


def test_stablehlo_without_locations_and_other_kinds():
    text = """
    %0 = "stablehlo.all_gather"(%arg0) <{all_gather_dim = 0 : i64, channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, replica_groups = dense<[[0, 2, 4, 6], [1, 3, 5, 7]]> : tensor<2x4xi64>, use_global_device_ids}> : (tensor<2x128xbf16>) -> tensor<8x128xbf16>
    %1 = "stablehlo.collective_permute"(%arg0) <{channel_handle = #stablehlo.channel_handle<handle = 2, type = 1>, source_target_pairs = dense<[[0, 1], [1, 0], [2, 3], [3, 2], [4, 5], [5, 4], [6, 7], [7, 6]]> : tensor<8x2xi64>}> : (tensor<2x128xf32>) -> tensor<2x128xf32>
    %2 = "stablehlo.reduce_scatter"(%arg1) <{channel_handle = #stablehlo.channel_handle<handle = 3, type = 1>, replica_groups = dense<[[0, 1], [2, 3], [4, 5], [6, 7]]> : tensor<4x2xi64>, scatter_dimension = 0 : i64, use_global_device_ids}> ({
    ^bb0(%a: tensor<i32>, %b: tensor<i32>):
      %s = stablehlo.add %a, %b : tensor<i32>
      stablehlo.return %s : tensor<i32>
    }) : (tensor<4x8xi32>) -> tensor<2x8xi32>
    """
    gather, permute, scatter = _hlo.parse_stablehlo(text)
    assert (gather.kind, gather.dtype, gather.shapes) == ("all-gather", "bf16", ((8, 128),))
    assert _hlo.groups_to_axes(gather.groups, MESH) == ("data",)
    assert permute.kind == "collective-permute" and _hlo.groups_to_axes(permute.groups, MESH) == ("model",)
    assert (scatter.kind, scatter.dtype, scatter.shapes) == ("reduce-scatter", "s32", ((2, 8),))
    assert scatter.group_size == 2
