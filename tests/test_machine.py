"""tools/machine.py: the machine line that the benchmarks write with their figures."""
import os

from tools.machine import FEATURES, cpu, describe

INTEL = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse avx avx2 fma avx512f avx512bw avx512_bf16 avx512_fp16 amx_tile amx_bf16 amx_int8
"""
AMD = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse avx avx2 fma
"""


def test_cpu_names_the_model_and_the_matmul_instructions():
    assert cpu(INTEL) == ("Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz",
                          ["avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16"])
    assert cpu(AMD) == ("AMD EPYC", ["avx2"])


def test_describe_says_what_this_machine_lacks():
    with open("/proc/cpuinfo") as f:
        model, present = cpu(f.read())
    line = describe()
    assert line.startswith(f"{model}, {os.cpu_count()} CPUs, "), line
    has, _, lacks = line.partition(" (no ")
    has = has.split(", ")[2] if len(has.split(", ")) > 2 else ""  # the features, before any GPU
    lacks = lacks.partition(")")[0].split(", ")
    for feature in FEATURES:
        assert (feature in has.split()) == (feature in present) != (feature in lacks), line
