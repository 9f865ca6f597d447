"""kernels/cutlass_fp8.py without a GPU: the CUDA source builds for sm_90a with nvcc and the pip CUTLASS headers, the
library loads and answers its workspace query; missing pieces are one clear error. Its math runs on the device
(tests/test_gpu.py: test_cutlass_fp8_grouped_gemm_matches_reference_math and the FP8 path tests)."""
import ctypes
import shutil

import pytest

from moecompile.core import settings
from moecompile.kernels import cutlass_fp8


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_cutlass_library_builds_and_answers_its_workspace_query():
    """nvcc compiles CUTLASS's grouped blockwise GEMM (host and sm_90a device code) into the runtime's build cache,
    keyed by the source, the command and nvcc's version: about a minute on 2 cores the first time a source or
    compiler is seen, a load afterwards. The library then answers its workspace query."""
    cutlass_fp8.library.cache_clear()
    try:
        lib = cutlass_fp8.library(None, settings.cache_dir(), settings.cuda_home())
        needed = ctypes.c_size_t(0)
        nulls = [None] * 7
        # workspace None: only the size is computed (per-expert argument arrays, regrouped scales, CUTLASS's own)
        code = lib.moecompile_fp8_blockwise_grouped(8, 28672, 4096, 8192, 132, *nulls, 0, None, ctypes.byref(needed))
        assert code == 0
        assert needed.value >= 8192 * (4096 // 128) * 4  # at least the regrouped activation scales
    finally:
        cutlass_fp8.library.cache_clear()


def test_build_writes_the_library_whole_or_not_at_all(tmp_path, monkeypatch):
    """build() compiles into a temporary folder and renames: only the finished file appears, a failure leaves none."""
    def fake_command(output, cuda_home=None):
        return ["sh", "-c", f"printf lib > '{output}'"]

    monkeypatch.setattr(cutlass_fp8, "build_command", fake_command)
    assert cutlass_fp8.build(tmp_path / "lib.so").read_text() == "lib"
    assert [p.name for p in tmp_path.iterdir()] == ["lib.so"]  # the temporary build folder is gone
    monkeypatch.setattr(cutlass_fp8, "build_command", lambda output, cuda_home=None: ["sh", "-c", "exit 3"])
    with pytest.raises(cutlass_fp8.CutlassUnavailable, match="failed"):
        cutlass_fp8.build(tmp_path / "other.so")
    assert [p.name for p in tmp_path.iterdir()] == ["lib.so"]


def test_missing_headers_or_compiler_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(cutlass_fp8.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(cutlass_fp8.CutlassUnavailable, match="pip install nvidia-cutlass"):
        cutlass_fp8.build_command(tmp_path / "lib.so")
    monkeypatch.undo()
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(cutlass_fp8.shutil, "which", lambda name: None)
    with pytest.raises(cutlass_fp8.CutlassUnavailable, match="nvcc not found"):
        cutlass_fp8.build_command(tmp_path / "lib.so", settings.cuda_home())
    monkeypatch.setenv("MOECOMPILE_CUTLASS_LIB", str(tmp_path / "missing.so"))
    cutlass_fp8.library.cache_clear()
    try:
        with pytest.raises(cutlass_fp8.CutlassUnavailable, match="does not exist"):
            cutlass_fp8.library(settings.cutlass_lib(), settings.cache_dir(), settings.cuda_home())
    finally:
        cutlass_fp8.library.cache_clear()


def test_weight_scales_are_the_checkpoint_blocks_transposed():
    import torch

    scale_inv = torch.rand(3, 4, 5)  # [E, N/128, K/128]
    got = cutlass_fp8.weight_scales(torch.empty(0), scale_inv)
    assert got.shape == (3, 5, 4) and got.is_contiguous() and torch.equal(got, scale_inv.transpose(1, 2))
    assert cutlass_fp8.supported(4096, 14336, 256) and not cutlass_fp8.supported(4096, 192)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_a_failed_build_is_one_clear_error_and_leaves_no_file(tmp_path, monkeypatch):
    broken = tmp_path / "broken.cu"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cutlass_fp8, "SOURCE", broken)
    with pytest.raises(cutlass_fp8.CutlassUnavailable, match="building broken.cu failed: .*error"):
        cutlass_fp8.build(tmp_path / "out" / "lib.so")
    assert list((tmp_path / "out").iterdir()) == []
