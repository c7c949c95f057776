"""tools/profile_xla.py: the XLA operations of a step, timed and put in groups."""
import pytest

from tools.profile_xla import GROUPS, WEIGHTS, group_of, hlo_groups, hlo_weights, op_times, weight_of
from tests.helpers import assert_report, rows, run_tool


def test_groups_follow_the_tensorflow_op():
    assert group_of("MatMul", "while/h3_1/mlp_1/c_fc_1/MatMul") == "block weights"
    assert group_of("MatMul", "gradient_tape/model_1/h0_1/attn_1/c_attn_1/MatMul/MatMul") == "block weights"
    assert group_of("BatchMatMulV2", "while/h1_1/attn_1/MatMul_1") == "attention"
    assert group_of("XlaDotV2", "while/h1_1/attn_1/XlaDotV2_1") == "attention"  # tfgpt2.products' float32
    assert group_of("MatMul", "gradient_tape/model_1/MatMul/MatMul_1") == "output layer"
    assert group_of("RowProduct", "while/h0/attn/c_attn/RowProduct") == "block weights"  # tfgpt2.kernels'
    assert group_of("RowProduct", "while/RowProduct") == "output layer"
    assert group_of("ColumnProduct", "while/h3/mlp/c_fc/ColumnProduct") == "block weights"
    assert group_of("BiasedRowProduct", "while/h3/mlp/c_fc/BiasedRowProduct") == "block weights"
    assert group_of("CachedAttention", "while/h2/attn/CachedAttention") == "attention"
    assert group_of("AssignVariableOp", "adam/AssignVariableOp_12") == "optimizer"
    assert group_of("Tanh", "model_1/h0_1/mlp_1/Tanh") == "other"
    assert group_of("Cumsum", "while/sampling/cond/Cumsum") == "sampling"  # tfgpt2.decoding.step's scope
    assert group_of("Sub", "sampling_1/sub") == "sampling"
    assert group_of("Sub", "while/h0_1/attn_1/resampling/sub") == "other"


def test_a_products_block_weight_follows_the_tensorflow_op():
    assert weight_of("while/h3_1/mlp_1/c_fc_1/MatMul") == "mlp/c_fc"
    assert weight_of("while/h0/attn/c_proj/MatMul") == "attn/c_proj"
    assert weight_of("while/h0_1/mlp/c_proj/XlaDotV2") == "mlp/c_proj"
    assert weight_of("gradient_tape/model_1/h0_1/attn_1/c_attn_1/MatMul/MatMul") == "attn/c_attn"
    assert weight_of("while/h1_1/attn_1/MatMul_1") is None and weight_of("while/MatMul") is None


HLO = """HloModule a_inference_step, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fused_computation.1 (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  ROOT %sub.1 = f32[4]{0} subtract(%param_0, %param_0), metadata={op_type="Sub" op_name="while/sampling/cond_2/sub"}
}

%while_sampling_cond_2_true_12__.7 (arg_tuple.1: (f32[4,16])) -> (s32[4]) {
  %wrapped_reduce-window.3 = f32[4,1,16]{2,1,0} fusion(%a, %b), kind=kLoop, calls=%wrapped_reduce-window_computation.3
}

%while_body_5__.9 (arg_tuple.2: (f32[4,16])) -> (f32[4,16]) {
  %copy.2 = f32[4,16]{1,0} copy(%get-tuple-element.1)
  %dot.4 = f32[4,1,1]{2,1,0} dot(%a, %b), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}
  ROOT %XlaDotV2.1 = f32[4,64]{1,0} dot(%h, %w), metadata={op_type="XlaDotV2" op_name="while/h0_1/mlp_1/c_fc_1/XlaDotV2"}
}

ENTRY %main.10 (Arg_0.1: f32[4]) -> f32[4] {
  ROOT %copy.9 = f32[4]{0} copy(%Arg_0.1)
}
"""


def test_hlo_groups_follow_the_op_or_the_sampling_computation(tmp_path):
    """An instruction takes its TensorFlow op's group; one XLA made (without an op) is in
    "other", but a batched product's (attention) and one in a computation of the sampling's."""
    (tmp_path / "module_0000.a_inference_step.cpu_after_optimizations.txt").write_text(HLO)
    assert hlo_groups(str(tmp_path)) == {
        "param_0": "other", "sub.1": "sampling", "wrapped_reduce-window.3": "sampling", "copy.2": "other",
        "dot.4": "attention", "XlaDotV2.1": "block weights", "copy.9": "other"}
    assert hlo_weights(str(tmp_path)) == {"XlaDotV2.1": "mlp/c_fc"}  # the block weights' products only


def test_op_times_counts_xla_operations_on_any_thread(tmp_path):
    """XLA runs a whole program on the calling thread when the cores are busy: its operations
    count there too, a loop's body apart from the loop, and the runtime's own events not."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    space = xplane_pb2.XSpace()
    plane = space.planes.add(name="/host:CPU")
    plane.stat_metadata[1].name = "hlo_op"
    for i, name in enumerate(["while.9", "dot.3", "BlockUntilReady", "fusion.2"], 1):
        plane.event_metadata[i].name = name
    events = {"python": [(1, 0, 10), (2, 2, 5), (3, 0, 20)], "tf_numa_-1_Eigen/1": [(4, 30, 4)]}
    for line_name, line_events in events.items():
        line = plane.lines.add(name=line_name)
        for metadata_id, start_us, duration_us in line_events:
            event = line.events.add(metadata_id=metadata_id, offset_ps=start_us * 10**6,
                                    duration_ps=duration_us * 10**6)
            if metadata_id != 3:
                event.stats.add(metadata_id=1, str_value=plane.event_metadata[metadata_id].name)
    (tmp_path / "host.xplane.pb").write_bytes(space.SerializeToString())
    times = {name: round(seconds * 1e6, 6) for name, seconds in op_times(str(tmp_path)).items()}
    assert times == {"while.9": 5, "dot.3": 5, "fusion.2": 4}


def profile(tmp_path, model_dir, *args):
    """The tool's report, checked against its Markdown, for `args`."""
    done = run_tool("profile_xla.py", "--model_dir", model_dir, *args, "--report", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    data = assert_report(str(tmp_path), f"profile-{args[0]}", "profile_xla.py")
    groups, operations = rows(data, 0), rows(data, 1)
    assert [g["group"] for g in groups] == list(GROUPS)
    settings = data["settings"]
    # the groups add up to the operations' time, their shares to one, the longest operations come first
    assert sum(g["ms"] for g in groups) == pytest.approx(settings["operations_ms"])
    assert sum(g["share"] for g in groups) == pytest.approx(1)
    assert 0 <= settings["unmatched_ms"] <= settings["operations_ms"] and settings["wall_ms"] > 0
    assert 0 < len(operations) <= 12 and all(o["group"] in GROUPS for o in operations)
    assert [o["ms"] for o in operations] == sorted((o["ms"] for o in operations), reverse=True)
    return data


@pytest.mark.slow  # a fresh TensorFlow process
def test_profile_of_generation(tiny_dir, tmp_path):
    data = profile(tmp_path, tiny_dir, "generate", "--batch", "2", "--length", "24")
    assert data["title"] == "Where the time goes: generate" and data["settings"]["length"] == 24
    groups = {g["group"]: g["ms"] for g in rows(data, 0)}
    assert groups["sampling"] > 0 and groups["output layer"] > 0 and groups["optimizer"] == 0
    # each of a block's four products, at each of the tiny model's layers, adding up to their group
    weights = rows(data, 2)
    assert [w["weight"] for w in weights] == list(WEIGHTS) and all(w["ms"] > 0 for w in weights)
    assert sum(w["ms"] for w in weights) == pytest.approx(groups["block weights"])


@pytest.mark.slow
def test_profile_of_training(tiny_dir, tmp_path):
    data = profile(tmp_path, tiny_dir, "train", "--batch", "2", "--length", "16", "--steps", "2")
    assert data["settings"]["mode"] == "train" and "2 Adam steps on 2 x 16 tokens" in data["notes"][0]
    groups = {g["group"]: g["ms"] for g in rows(data, 0)}
    assert groups["optimizer"] > 0 and groups["sampling"] == 0


@pytest.mark.slow
def test_profile_of_a_server_decode_call(tiny_dir, tmp_path):
    data = profile(tmp_path, tiny_dir, "serve", "--batch", "2", "--max_batch", "4", "--window", "64",
                   "--steps", "2", "--dtype", "bfloat16")
    settings, groups = data["settings"], {g["group"]: g["ms"] for g in rows(data, 0)}
    assert (settings["dtype"], settings["window"], settings["max_batch"]) == ("bfloat16", 64, 4)
    assert "2 decode calls of 2 of 4 slots over 64 positions" in data["notes"][0]
    # the slots' programs name their products as the model does: each group a step has is found
    assert groups["block weights"] > 0 and groups["attention"] > 0 and groups["output layer"] > 0
    assert groups["sampling"] > 0 and groups["optimizer"] == 0


@pytest.mark.parametrize("argv, message", [
    (["serve", "--batch", "5", "--max_batch", "4"], "--batch 5 must be 1 to --max_batch 4"),
    (["train", "--dtype", "bfloat16"], "train profiles float32 weights"),
])
def test_bad_arguments_are_refused_by_name(argv, message, capsys):
    from tools.profile_xla import main
    with pytest.raises(SystemExit) as exit:
        main(["--model_dir", "nowhere", *argv])
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_a_window_not_of_whole_blocks_is_refused(tiny_dir):
    import argparse
    from tfgpt2 import load_model
    from tools.profile_xla import serve_run
    args = argparse.Namespace(batch=1, max_batch=1, window=40, steps=1)
    with pytest.raises(SystemExit, match="--window 40: a step's window is whole blocks .* at most n_ctx=64"):
        serve_run(load_model(tiny_dir), args)
