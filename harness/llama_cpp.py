"""llama.cpp's own tools, from the ``llama-cpp-python`` sdist's vendored tree, cached once.

The tests and benchmarks check our GGUF loading against files written by llama.cpp itself,
and measure us against its server. Nothing of llama.cpp is committed here: the sdist is
downloaded from the package index into a cache folder on first use and
unpacked there; later calls reuse it.

- :func:`source_tree`: the unpacked ``vendor/llama.cpp`` folder;
- :func:`convert_hf_to_gguf`: a Hugging Face folder -> a GGUF file, by llama.cpp's
  ``convert_hf_to_gguf.py`` (run with this interpreter; it imports its own vendored ``gguf``);
- :func:`build_tools`: ``llama-quantize``, ``llama-server``, ``llama-bench`` built with cmake
  for this CPU (or for AVX2 only: ``isa="avx2"``), once per cache folder;
- :func:`quantize`: a GGUF -> another GGUF type (``Q4_K_M``, ``Q4_1``...) by ``llama-quantize``.

``LLM_SUITE_LLAMA_CPP_CACHE`` moves the cache (default ``~/.cache/llm_suite/llama_cpp``).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path
from urllib.parse import urljoin

#: The llama-cpp-python release whose vendored llama.cpp we use (pinned: converter output and
#: tool flags change between releases).
LLAMA_CPP_PYTHON_VERSION = "0.3.36"

#: Seconds allowed for each external step (download, conversion, build).
DOWNLOAD_TIMEOUT_S = 900
CONVERT_TIMEOUT_S = 600
BUILD_TIMEOUT_S = 3600

#: The tools :func:`build_tools` builds (cmake targets; the binaries have the same names).
TOOL_TARGETS: tuple[str, ...] = ("llama-quantize", "llama-server", "llama-bench")

#: The instruction sets a build of the tools can target: this CPU's own (``native``), or AVX2
#: with FMA and F16C and nothing newer (``avx2``: the peer of our kernels forced to AVX2 on a
#: CPU that has AVX-512, as a real AVX2-only CPU would run both).
BUILD_FLAGS: dict[str, list[str]] = {
    "native": ["-DGGML_NATIVE=ON"],
    "avx2": [
        "-DGGML_NATIVE=OFF",
        *(f"-DGGML_{flag}=ON" for flag in ("AVX", "AVX2", "FMA", "F16C", "BMI2")),
        *(f"-DGGML_{flag}=OFF" for flag in ("AVX_VNNI", "AVX512", "AVX512_VNNI", "AVX512_BF16")),
    ],
}


class LlamaCppError(RuntimeError):
    """A llama.cpp step (download, conversion, build, quantization) failed; the message
    carries the command's output tail."""


def cache_dir() -> Path:
    """The folder holding the sdist, its unpacked tree and the builds."""
    default = Path.home() / ".cache" / "llm_suite" / "llama_cpp"
    root = Path(os.environ.get("LLM_SUITE_LLAMA_CPP_CACHE", default))
    return root / LLAMA_CPP_PYTHON_VERSION


def _run(cmd: list[str], timeout_s: int, what: str, cwd: Path | None = None) -> None:
    """Run ``cmd``; LlamaCppError with the output's tail if it fails or times out."""
    try:
        done = subprocess.run(
            cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise LlamaCppError(f"{what} took over {timeout_s} s: {' '.join(cmd)}") from exc
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        raise LlamaCppError(f"{what} failed (exit {done.returncode}): {' '.join(cmd)}\n{tail}")


def _download_sdist(sdist: Path) -> None:
    """Fetch the sdist named by the package index's simple page (no build metadata: ``pip
    download`` would need the package's build backend), checking its sha256."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    page_url = f"{index}/llama-cpp-python/"
    with urllib.request.urlopen(page_url, timeout=60) as page:
        html = page.read().decode()
    links = re.findall(rf'href="([^"]*/{re.escape(sdist.name)}#sha256=([0-9a-f]+))"', html)
    if not links:
        raise LlamaCppError(f"{sdist.name} is not listed on {page_url}")
    url, sha256 = links[0]
    partial = sdist.with_suffix(".partial")
    digest = hashlib.sha256()
    with urllib.request.urlopen(urljoin(page_url, url), timeout=DOWNLOAD_TIMEOUT_S) as response:
        with partial.open("wb") as out:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    if digest.hexdigest() != sha256:
        partial.unlink()
        raise LlamaCppError(f"{sdist.name}: sha256 mismatch with {page_url}")
    partial.rename(sdist)


def source_tree() -> Path:
    """The vendored llama.cpp tree, downloaded and unpacked on first use."""
    root = cache_dir()
    tree = root / "llama.cpp"
    if (tree / "convert_hf_to_gguf.py").is_file():
        return tree
    root.mkdir(parents=True, exist_ok=True)
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
    sdist = root / f"{name}.tar.gz"
    if not sdist.is_file():
        _download_sdist(sdist)
    prefix = f"{name}/vendor/llama.cpp/"
    partial = root / "llama.cpp.partial"
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
        for member in members:
            member.name = member.name.removeprefix(prefix)
        archive.extractall(partial, members=members, filter="data")
    # Renamed only when complete: a killed unpack never passes for a tree.
    partial.rename(tree)
    return tree


def convert_hf_to_gguf(hf_dir: Path, out_file: Path, outtype: str = "f32") -> Path:
    """Write ``out_file`` from the Hugging Face folder ``hf_dir`` with llama.cpp's converter.

    ``outtype``: what the converter writes itself (f32, f16, bf16, q8_0...); other types come
    from :func:`quantize`. The folder needs a tokenizer, as for any real model.
    """
    script = source_tree() / "convert_hf_to_gguf.py"
    cmd = [sys.executable, str(script), str(hf_dir), "--outfile", str(out_file)]
    _run([*cmd, "--outtype", outtype], CONVERT_TIMEOUT_S, "convert_hf_to_gguf.py")
    return out_file


def build_tools(targets: tuple[str, ...] = TOOL_TARGETS, isa: str = "native") -> Path:
    """Build llama.cpp's tools for this CPU, or for ``isa`` (a ``BUILD_FLAGS`` key; cmake,
    Release, no CURL); returns the folder holding the binaries. Built once: later calls find
    them."""
    if isa not in BUILD_FLAGS:
        raise ValueError(f"unknown llama.cpp build {isa!r}; choose from {sorted(BUILD_FLAGS)}")
    tree = source_tree()
    build = cache_dir() / ("build" if isa == "native" else f"build-{isa}")
    bin_dir = build / "bin"
    if all((bin_dir / target).is_file() for target in targets):
        return bin_dir
    configure = ["cmake", "-S", str(tree), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release"]
    configure += ["-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", *BUILD_FLAGS[isa]]
    _run(configure, BUILD_TIMEOUT_S, "cmake configure")
    jobs = str(os.cpu_count() or 2)
    _run(
        ["cmake", "--build", str(build), "-j", jobs, "--target", *targets],
        BUILD_TIMEOUT_S,
        "cmake build",
    )
    return bin_dir


def quantize(src: Path, out_file: Path, quant_type: str) -> Path:
    """``llama-quantize src out_file quant_type`` (e.g. Q4_K_M, Q5_K_M, Q4_0, Q4_1, Q8_0)."""
    binary = build_tools(("llama-quantize",)) / "llama-quantize"
    _run([str(binary), str(src), str(out_file), quant_type], CONVERT_TIMEOUT_S, "llama-quantize")
    return out_file
