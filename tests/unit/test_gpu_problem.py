"""Why a CUDA image sees no GPU, in words a user can act on: the guard's message names it (a container
started without --gpus has no libcuda.so.1; the driver's cuInit says the rest)."""
from __future__ import annotations

from pathlib import Path

import pytest

from builder.runtime import fingerprint, guard
from builder.runtime.errors import GuardError
from builder.runtime.hostinfo import HostFacts, gpu_problem


class FakeDriver:
    def __init__(self, code):
        self.code = code

    def cuInit(self, flags):  # noqa: N802 (the driver API's name)
        assert flags == 0
        return self.code


def loader(code):
    def load(name):
        assert name == "libcuda.so.1"
        return FakeDriver(code)
    return load


def no_driver(name):
    raise OSError(f"{name}: cannot open shared object file: No such file or directory")


def test_a_container_without_the_driver_is_told_to_start_with_gpus():
    assert gpu_problem("13.0", load=no_driver) == (
        "no NVIDIA driver in this container (libcuda.so.1 not found): start it with --gpus all on a host with the "
        "NVIDIA driver and the NVIDIA container toolkit")


@pytest.mark.parametrize(("code", "words"), [
    (35, "the NVIDIA driver is older than this image's CUDA needs (CUDA_ERROR_INSUFFICIENT_DRIVER)"),
    (100, "no GPU is visible to this container (CUDA_ERROR_NO_DEVICE): check --gpus and NVIDIA_VISIBLE_DEVICES"),
    (999, "failed to initialise (CUDA_ERROR_UNKNOWN)"),
    (46, "cuInit failed with CUresult 46"),
    (0, "initialised, but torch found no usable GPU"),
])
def test_the_drivers_answer_is_named(code, words):
    assert words in gpu_problem("13.0", load=loader(code))


def test_a_cpu_build_is_said_to_be_one_without_looking_for_a_driver():
    assert gpu_problem(None, load=no_driver) == "this image's torch is a CPU build"
    assert gpu_problem("", load=loader(0)) == "this image's torch is a CPU build"


def test_a_driver_that_cannot_be_called_is_reported_not_raised():
    class Broken:
        def cuInit(self, flags):  # noqa: N802
            raise AttributeError("cuInit")
    assert gpu_problem("13.0", load=lambda name: Broken()) == "the NVIDIA driver's cuInit could not be called " \
                                                               "(AttributeError)"


def cuda_engine(out: Path, torch: str, cuda: str, sm: str = "90", gpu_name: str = "NVIDIA H200") -> Path:
    """An engine dir as a torch-aot compile on that GPU writes it, with a dummy artifact (the guard hashes it)."""
    (out / "engine").mkdir(parents=True)
    (out / "engine" / "model.pt2").write_bytes(b"an engine compiled on " + gpu_name.encode())
    files = fingerprint.file_hashes(out / "engine")
    fingerprint.write(out, {
        "backend": "torch-aot", "backend_version": torch, "torch": torch, "cuda": cuda, "tensorrt": None,
        "device": "cuda", "target_sm": sm, "gpu_name": gpu_name, "driver": "580.65.06", "engine_files": files,
        "engine_sha256": files["model.pt2"], "artifact": "model.pt2", "model_digest": "0" * 64,
        "compile_seconds": 1.0, "image": None, "params": {"device": "cuda", "precision": "bf16"}})
    return out


def test_the_guard_says_why_there_is_no_gpu(tmp_path):
    out = cuda_engine(tmp_path / "out", "2.13.0+cu130", "13.0")
    facts = HostFacts(torch="2.13.0+cu130", cuda="13.0", tensorrt=None, sm=None, gpu_name=None, driver=None,
                      gpu_problem=gpu_problem("13.0", load=no_driver))
    with pytest.raises(GuardError) as exc:
        guard.check(out, facts)
    assert exc.value.exit_code == 3
    assert str(exc.value).startswith("engine built for sm_90 (NVIDIA H200) but this host has no usable CUDA GPU "
                                     "(no NVIDIA driver in this container (libcuda.so.1 not found): start it with "
                                     "--gpus all")
