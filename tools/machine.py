"""The machine a figure was measured on, in one line, for the benchmarks' headers.

Speed figures compare only within one machine: this project's machines differ by 2x in
float32 matmul speed (README, Fine-tuning), and 16-bit math can beat float32 only where the CPU
multiplies 16-bit numbers natively (AMX, AVX-512 BF16 or FP16) or on an accelerator.
"""
import os
import platform
import re
import shutil
import subprocess

# The instructions that decide float32 and 16-bit matmul speed on x86, as /proc/cpuinfo names them.
FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16")


def cpu(cpuinfo_text):
    """(model name, [FEATURES present]) from the text of /proc/cpuinfo."""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo_text, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", cpuinfo_text, re.M)
    present = set(flags.group(1).split()) if flags else set()
    return (model.group(1).strip() if model else platform.processor() or platform.machine(),
            [f for f in FEATURES if f in present])


def gpus():
    """NVIDIA GPUs' names from `nvidia-smi -L`, or [] where there is none."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return re.findall(r"^GPU \d+: (.+?)(?: \(UUID.*)?$", out, re.M)


def describe():
    """This machine's line (`line`): /proc/cpuinfo, the CPU count, `nvidia-smi -L`."""
    try:
        with open("/proc/cpuinfo") as f:
            model, present = cpu(f.read())
    except OSError:  # not Linux: cpu's fallbacks
        model, present = cpu("")
    return line(model, present, os.cpu_count(), gpus())


def line(model, present, cpus, gpu_names):
    """'<CPU model>, <n> CPUs, <FEATURES present> (no <the others>)[, <GPU>...]'."""
    absent = [f for f in FEATURES if f not in present]
    text = f"{model}, {cpus} CPUs"
    if present:
        text += ", " + " ".join(present)
    if absent:
        text += f" (no {', '.join(absent)})"
    return text + "".join(f", {g}" for g in gpu_names)
