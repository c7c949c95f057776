"""tools/machine.py: the machine line that the benchmarks write with their figures, from
fixed text (never this machine's)."""
from tools.machine import FEATURES, cpu, line

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


def test_the_line_names_what_the_cpu_has_and_lacks_and_the_gpus():
    assert line(*cpu(INTEL), 8, []) == (
        "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz, 8 CPUs, avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16")
    assert line(*cpu(AMD), 2, ["NVIDIA H100 80GB HBM3"]) == (
        "AMD EPYC, 2 CPUs, avx2 (no avx512f, avx512_bf16, avx512_fp16, amx_bf16), NVIDIA H100 80GB HBM3")
    assert line("A CPU", [], 1, []) == "A CPU, 1 CPUs (no " + ", ".join(FEATURES) + ")"
