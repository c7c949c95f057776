"""tools/profile_xla.py: the XLA operations of a step, timed and put in groups."""
import re
import subprocess
import sys

import pytest

from benchmarks.profile_xla import GROUPS, group_of, op_times
from conftest import ROOT


def test_groups_follow_the_tensorflow_op():
    assert group_of("MatMul", "while/h3_1/mlp_1/c_fc_1/MatMul") == "block weights"
    assert group_of("MatMul", "gradient_tape/model_1/h0_1/attn_1/c_attn_1/MatMul/MatMul") == "block weights"
    assert group_of("BatchMatMulV2", "while/h1_1/attn_1/MatMul_1") == "attention"
    assert group_of("MatMul", "gradient_tape/model_1/MatMul/MatMul_1") == "output layer"
    assert group_of("AssignVariableOp", "adam/AssignVariableOp_12") == "optimizer"
    assert group_of("Tanh", "model_1/h0_1/mlp_1/Tanh") == "other"


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


def profile(model_dir, *args):
    """The tool's group table, {group: ms}, and the ms it could not place."""
    out = subprocess.run([sys.executable, "benchmarks/profile_xla.py", "--model_dir", model_dir, *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    table = dict(re.findall(r"^\| ([a-z ]+) \| ([\d.]+) \| \d+% \|$", out.stdout, re.M))
    assert set(table) == set(GROUPS), out.stdout
    unmatched = float(re.search(r"\(([\d.]+) ms not found", out.stdout).group(1))
    return {k: float(v) for k, v in table.items()}, unmatched


def test_profile_of_generation_finds_each_product(tiny_dir):
    groups, unmatched = profile(tiny_dir, "generate", "--batch", "2", "--length", "24")
    assert groups["block weights"] > 0 and groups["attention"] > 0 and groups["output layer"] > 0
    assert groups["optimizer"] == 0
    assert unmatched < 0.1 * sum(groups.values())  # the HLO dump names the operations the profiler saw


@pytest.mark.slow
def test_profile_of_training_finds_the_update(tiny_dir):
    groups, unmatched = profile(tiny_dir, "train", "--batch", "2", "--length", "16", "--steps", "2")
    assert all(groups[g] > 0 for g in GROUPS)
    assert unmatched < 0.1 * sum(groups.values())
