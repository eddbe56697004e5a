"""Start-up on a CPU (issue #32 item 4): how long our engine takes to start on an 8B-shaped
Q4_K_M GGUF (about 4.5 GB), the first time (the file repacked, the packed form cached on disk)
and the next (the cache memory-mapped), beside llama.cpp's ``llama-server`` on the same file.

    python -m benchmarks.start_up [--shape 8b|1b|tiny] [--threads 2]
        [--out benchmarks/results/start_up_cpu.json] [--folder DIR] [--llama-cpp/--no-llama-cpp]

Steps:
1. the GGUF is written once, kept in ``--folder`` (default
   ``~/.cache/llm_suite/start_up/<shape>``), straight from random blocks (no dense checkpoint
   first: an 8B bf16 one is 16 GB): ``8b`` is Llama-3.1-8B's shape (hidden 4096, 32 layers,
   32/8 heads, MLP 14336, untied output), ``1b`` llama 1B's (``benchmarks.families.BODY``:
   hidden 2048, 16 layers, MLP 8192, tied), ``tiny`` a smoke run's; the vocabulary is the
   default model's 49,152 tokens, its ``tokenizer.*`` keys copied from a GGUF llama.cpp's own
   converter wrote. Tensor types as ``llama-quantize ... Q4_K_M`` writes them: Q4_K matmuls,
   Q6_K for ``attn_v``/``ffn_down`` in the layers its ``use_more_bits`` picks and for the output
   (the tied embedding table), F32 norms. The blocks hold random codes under small fp16 scales,
   so the model computes finite numbers (``weights_check``: a few rows of each type
   dequantised);
2. ours, each start in a fresh process (``python -m benchmarks.start_up --child ...``) with
   ``LLM_SUITE_CACHE_DIR=<folder>/cache``: ``cold`` with that folder removed first (the GGUF
   repacked, the packed weights and the converted tokenizer cached), then ``warm``;
3. llama.cpp (``--llama-cpp``, the default): ``llama-server -m FILE -t THREADS -c 2048``
   started and ``GET /health`` polled until it answers 200 (it loads the file, memory-mapped,
   and runs its warm-up decode first).

Figures per start:

* ``ready_s``: from the process's launch (interpreter start and imports included) to an engine
  that can take requests (ours: ``LLMEngine(config)`` returned; llama-server: /health 200);
* ``engine_s`` (ours): ``LLMEngine(config)`` alone (model load, KV pool of 2,048 tokens, like
  ``-c 2048``, tokenizer); ``import_s``: the engine's imports; ``generate_s``: a first greedy
  generation of 8 tokens after it, to show it runs (not part of ``ready_s``);
* ``peak_rss_mib``: the process's peak resident memory (ours: ``ru_maxrss``; llama-server:
  ``VmHWM``), and ``rss_after_load_mib``: its RSS once ready. File pages mapped and touched
  count in both, as they do for llama.cpp's mmap;
* ``file_resident_mib``: the GGUF's pages in the OS page cache before the start (``fincore``).
  The page cache is not dropped: the file was just written or read, so these are starts from a
  warm page cache, not from a cold disk.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import run_environment, write_json

REPO_ROOT = Path(__file__).resolve().parents[1]
#: The default model's vocabulary (``benchmarks.gpu_transformers.VOCAB_SIZE``).
VOCAB_SIZE = 49152
#: The KV room of every start: llama-server's ``-c``, and our pool's tokens.
CONTEXT_TOKENS = 2048
BLOCK_SIZE = 16
#: Tokens of the first generation after start-up.
NEW_TOKENS = 8
#: Seconds allowed to one start (ours, cold on 8B, repacks about 4.5 GB).
CHILD_TIMEOUT_S = 1800
LLAMA_SERVER_TIMEOUT_S = 300
#: llama.cpp's file type number of Q4_K_M (``general.file_type``).
FILE_TYPE_Q4_K_M = 15


@dataclass(frozen=True)
class Shape:
    """A llama body."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tied: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES: dict[str, Shape] = {
    "8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, tied=False),
    "1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, tied=True),
    # K-quant rows are multiples of 256; 4 layers so that both layer types of use_more_bits occur.
    "tiny": Shape(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=512, tied=False),
}

# -- the GGUF -------------------------------------------------------------------------------


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama-quantize's choice of the layers whose attn_v and ffn_down get more bits."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


def tensor_plan(shape: Shape) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, (rows, columns) or (n,), type name) of every tensor, as Q4_K_M lays them out."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    plan = [("token_embd.weight", (VOCAB_SIZE, h), "Q6_K" if shape.tied else "Q4_K")]
    for i in range(shape.layers):
        more = "Q6_K" if use_more_bits(i, shape.layers) else "Q4_K"
        blk = f"blk.{i}"
        plan += [
            (f"{blk}.attn_norm.weight", (h,), "F32"),
            (f"{blk}.attn_q.weight", (h, h), "Q4_K"),
            (f"{blk}.attn_k.weight", (kv, h), "Q4_K"),
            (f"{blk}.attn_v.weight", (kv, h), more),
            (f"{blk}.attn_output.weight", (h, h), "Q4_K"),
            (f"{blk}.ffn_norm.weight", (h,), "F32"),
            (f"{blk}.ffn_gate.weight", (shape.intermediate, h), "Q4_K"),
            (f"{blk}.ffn_up.weight", (shape.intermediate, h), "Q4_K"),
            (f"{blk}.ffn_down.weight", (h, shape.intermediate), more),
        ]
    plan.append(("output_norm.weight", (h,), "F32"))
    if not shape.tied:
        plan.append(("output.weight", (VOCAB_SIZE, h), "Q6_K"))
    return plan


def random_blocks(rng: np.random.Generator, rows: int, cols: int, type_name: str) -> np.ndarray:
    """``rows`` x ``cols`` weights of ``type_name`` (Q4_K or Q6_K) as bytes (rows, row bytes):
    random codes and sub-block scales under fp16 super-block scales sized so that the weights
    are about 0.03 in size (each block's scale varies by +-50%)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    num_blocks = rows * cols // block
    data = rng.integers(0, 256, (num_blocks, size), dtype=np.uint8)
    halves = data.view(np.float16)  # (blocks, size / 2): the fp16 fields

    def scales(base: float) -> np.ndarray:
        return (base * rng.uniform(0.5, 1.5, num_blocks)).astype(np.float16)

    if type_name == "Q4_K":  # d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        # w = d * sc * q - dmin * m, sc, m in 0..63, q in 0..15: mean ~0 when dmin ~ 7.5 d.
        halves[:, 0] = scales(1e-4)
        halves[:, 1] = scales(7.5e-4)
    else:  # Q6_K: 128 ql, 64 qh, 16 int8 scales, d; w = d * scale * (q - 32)
        halves[:, -1] = scales(2e-5)
    return data.reshape(rows, cols // block * size)


def tokenizer_fields(work: Path) -> list[tuple[str, Any, Any, Any]]:
    """(key, value, GGUF value type, array item type or None) of every ``tokenizer.*`` key of a
    GGUF that llama.cpp's converter writes from a tiny random llama with the default model's
    tokenizer files (in ``work``)."""
    import torch
    from gguf import GGUFReader, GGUFValueType

    from benchmarks.families import build_checkpoint
    from benchmarks.gpu import DEFAULT_TOKENIZER
    from benchmarks.real_size import TOKENIZER_FILES
    from harness import llama_cpp

    folder = work / "llama"
    build_checkpoint("llama", folder, torch.float32, [1], "tiny")
    for name in (*TOKENIZER_FILES, "chat_template.jinja"):
        if (DEFAULT_TOKENIZER / name).is_file():
            shutil.copy(DEFAULT_TOKENIZER / name, folder / name)
    source = llama_cpp.convert_hf_to_gguf(folder, work / "tokenizer.gguf", outtype="f32")
    fields = []
    for key, field in GGUFReader(source).fields.items():
        if key.startswith("tokenizer."):
            array = field.types[0] == GGUFValueType.ARRAY
            fields.append(
                (key, field.contents(), field.types[0], field.types[-1] if array else None)
            )
    return fields


def write_gguf(shape_name: str, path: Path) -> None:
    """Write the Q4_K_M-typed random GGUF of ``shape_name`` to ``path`` (via a ``.partial``
    file, renamed when complete)."""
    import gguf

    shape = SHAPES[shape_name]
    partial = path.with_name(path.name + ".partial")
    with tempfile.TemporaryDirectory(prefix="start-up-") as work:
        tokenizer = tokenizer_fields(Path(work))
    writer = gguf.GGUFWriter(partial, "llama")
    writer.add_type("model")
    writer.add_name(f"start-up {shape_name}")
    writer.add_block_count(shape.layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_file_type(FILE_TYPE_Q4_K_M)
    writer.add_vocab_size(VOCAB_SIZE)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value, value_type, item_type in tokenizer:
        writer.add_key_value(key, value, value_type, sub_type=item_type)
    plan = tensor_plan(shape)
    for name, dims, type_name in plan:
        if type_name == "F32":
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * dims[0])
        else:
            qtype = gguf.GGMLQuantizationType[type_name]
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            rows, cols = dims
            byte_shape = (rows, cols // block * size)
            writer.add_tensor_info(
                name, byte_shape, np.dtype(np.uint8), rows * byte_shape[1], qtype
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, (_name, dims, type_name) in enumerate(plan):
        # One tensor at a time (the largest, the 8B output, is 165 MB): memory stays low.
        if type_name == "F32":
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
        else:
            rng = np.random.default_rng(index)
            writer.write_tensor_data(random_blocks(rng, *dims, type_name))
    writer.close()
    partial.rename(path)


def weights_check(path: Path, rows: int = 32) -> list[dict[str, Any]]:
    """The first ``rows`` rows of the first tensor of each kind and type (``attn_v`` Q4_K and
    Q6_K...), dequantised: finite, and their mean |w| and standard deviation."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    checks, seen = [], set()
    for tensor in GGUFReader(path).tensors:
        kind = (tensor.name.split(".")[-2], tensor.tensor_type)
        if tensor.tensor_type == GGMLQuantizationType.F32 or kind in seen:
            continue
        seen.add(kind)
        values = dequantize(np.asarray(tensor.data[:rows]), tensor.tensor_type)
        checks.append(
            {
                "tensor": tensor.name,
                "type": tensor.tensor_type.name,
                "finite": bool(np.isfinite(values).all()),
                "mean_abs": round(float(np.abs(values).mean()), 4),
                "std": round(float(values.std()), 4),
            }
        )
    return checks


def ensure_gguf(shape_name: str, folder: Path) -> Path:
    """The shape's GGUF in ``folder``, written on first use."""
    path = folder / f"llama-{shape_name}-Q4_K_M.gguf"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        print(f"writing {path}", flush=True)
        start = time.perf_counter()
        write_gguf(shape_name, path)
        size = path.stat().st_size / 2**30
        print(f"wrote {size:.2f} GiB in {time.perf_counter() - start:.0f} s", flush=True)
    return path


# -- measurements ---------------------------------------------------------------------------


def rss_mib() -> float:
    """This process's resident memory now (MiB)."""
    try:
        import psutil

        return round(psutil.Process().memory_info().rss / 2**20, 1)
    except ImportError:
        return proc_status_mib(os.getpid(), "VmRSS")


def proc_status_mib(pid: int, key: str) -> float:
    """A ``/proc/PID/status`` memory line (``VmRSS``, ``VmHWM``) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise KeyError(key)


def file_resident_mib(path: Path) -> float | None:
    """The file's pages in the OS page cache (``fincore``), or None without the tool."""
    if shutil.which("fincore") is None:
        return None
    done = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    return round(int(done.stdout.split()[0]) / 2**20, 1) if done.returncode == 0 else None


def folder_mib(folder: Path) -> float:
    """The bytes of the files under ``folder`` (MiB)."""
    total = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    return round(total / 2**20, 1)


def engine_config(gguf: Path, threads: int) -> Any:
    """Our engine's configuration for the file: bf16, CPU, the fused kernels, the tokenizer
    from the GGUF itself, a KV pool of ``CONTEXT_TOKENS`` tokens and no swap pool."""
    from server.continuous_batching.engine_config import EngineConfig

    return EngineConfig.model_validate(
        {
            "model_loading_config": {
                "model_name_or_path": str(gguf),
                "torch_dtype": "bfloat16",
                "device": "cpu",
                "num_threads": threads,
            },
            "cache_config": {
                "num_blocks": CONTEXT_TOKENS // BLOCK_SIZE,
                "block_size": BLOCK_SIZE,
                "num_blocks_cpu": 0,
            },
        }
    )


def child(gguf: Path, threads: int, launched: float) -> dict[str, Any]:
    """One start of ours (in a fresh process): the engine built, then 8 greedy tokens."""
    start = time.perf_counter()
    from protocol.generation import GenerationConfig
    from server.continuous_batching.engine import LLMEngine

    import_s = time.perf_counter() - start
    config = engine_config(gguf, threads)
    start = time.perf_counter()
    engine = LLMEngine(config)
    engine_s = time.perf_counter() - start
    ready_s = time.time() - launched
    after_load = rss_mib()
    prompt = [100 + 97 * i for i in range(8)]
    generation = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    start = time.perf_counter()
    (deltas,) = engine.generate([prompt], [generation])
    generate_s = time.perf_counter() - start
    logprobs = [lp.logprob for d in deltas for lp in d.logprobs or []]
    return {
        "ready_s": round(ready_s, 2),
        "import_s": round(import_s, 2),
        "engine_s": round(engine_s, 2),
        "generate_s": round(generate_s, 2),
        "new_tokens": sum(d.num_new_tokens for d in deltas),
        "logprobs_finite": bool(logprobs) and all(math.isfinite(x) for x in logprobs),
        "rss_after_load_mib": after_load,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "weights": engine.runner.model.weight_format,
    }


def start_ours(gguf: Path, folder: Path, threads: int, cold: bool) -> dict[str, Any]:
    """One start of ours in a fresh process (``cold``: the load cache removed first)."""
    cache = folder / "cache"
    if cold:
        shutil.rmtree(cache, ignore_errors=True)
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "LLM_SUITE_CACHE_DIR": str(cache), "PYTHONPATH": python_path}
    row: dict[str, Any] = {"system": "ours", "start": "cold" if cold else "warm"}
    row["file_resident_mib"] = file_resident_mib(gguf)
    launched = time.time()
    cmd = [sys.executable, "-m", "benchmarks.start_up", "--child", str(gguf)]
    cmd += ["--threads", str(threads), "--launched", repr(launched)]
    start = time.perf_counter()
    done = subprocess.run(
        cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S
    )
    row["process_s"] = round(time.perf_counter() - start, 2)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        row["error"] = f"exit {done.returncode}: " + (done.stdout + done.stderr)[-4000:]
        return row
    row.update(json.loads(lines[-1]))
    row["cache_mib"] = folder_mib(cache) if cache.is_dir() else 0.0
    return row


def start_llama_server(gguf: Path, threads: int) -> dict[str, Any]:
    """llama-server on the file: seconds until /health answers 200, and its memory."""
    from harness import llama_cpp
    from harness.network import free_port

    binary = llama_cpp.build_tools(("llama-server",)) / "llama-server"
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "--port", str(port)]
    cmd += ["-c", str(CONTEXT_TOKENS)]
    row: dict[str, Any] = {"system": "llama-server", "file_resident_mib": file_resident_mib(gguf)}
    with tempfile.TemporaryFile() as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            error = wait_healthy(proc, port, start)
            if error:
                log.seek(0)
                row["error"] = error + ": " + log.read().decode(errors="replace")[-4000:]
                return row
            row["ready_s"] = round(time.perf_counter() - start, 2)
            row["rss_after_load_mib"] = proc_status_mib(proc.pid, "VmRSS")
            row["peak_rss_mib"] = proc_status_mib(proc.pid, "VmHWM")
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return row


def wait_healthy(proc: subprocess.Popen[bytes], port: int, start: float) -> str | None:
    """Poll ``GET /health`` until 200; the reason it never came (exit, timeout), else None."""
    url = f"http://127.0.0.1:{port}/health"
    while time.perf_counter() - start < LLAMA_SERVER_TIMEOUT_S:
        if proc.poll() is not None:
            return f"llama-server exited ({proc.returncode})"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return None
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet, or 503 while loading
        time.sleep(0.05)
    return f"no /health 200 within {LLAMA_SERVER_TIMEOUT_S} s"


# -- driver ---------------------------------------------------------------------------------


def table(file_mib: float, rows: list[dict[str, Any]]) -> str:
    """The figures as a small Markdown table."""
    lines = [
        f"file: {file_mib:,.0f} MiB",
        "| start | ready s | engine s | peak RSS MiB | RSS after load MiB | cache MiB |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = f"{r['system']} {r.get('start', '')}".strip()
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'].splitlines()[-1][:80]} |||||")
            continue
        lines.append(
            f"| {name} | {r['ready_s']} | {r.get('engine_s', '-')} | {r['peak_rss_mib']:,.0f} "
            f"| {r['rss_after_load_mib']:,.0f} | {r.get('cache_mib', '-')} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="8b")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "benchmarks/results/start_up_cpu.json"
    )
    parser.add_argument("--folder", type=Path, default=None, help="where the GGUF is kept")
    parser.add_argument("--llama-cpp", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--launched", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.folder is None:
        args.folder = Path.home() / ".cache" / "llm_suite" / "start_up" / args.shape
    return args


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Build the file if needed, start each system on it, print the table, write ``--out``."""
    args = parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args.threads, args.launched or time.time())))
        return None
    gguf = ensure_gguf(args.shape, args.folder)
    file_mib = round(gguf.stat().st_size / 2**20, 1)
    checks = weights_check(gguf)
    print(json.dumps({"file": str(gguf), "file_mib": file_mib, "weights_check": checks}))
    rows = []
    for cold in (True, False):
        rows.append(start_ours(gguf, args.folder, args.threads, cold))
        print(json.dumps(rows[-1]), flush=True)
    if args.llama_cpp:
        rows.append(start_llama_server(gguf, args.threads))
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "config": {"shape": args.shape, "threads": args.threads, "llama_cpp": args.llama_cpp},
        "file": {
            "path": str(gguf),
            "mib": file_mib,
            "shape": dataclasses.asdict(SHAPES[args.shape]),
        },
        "weights_check": checks,
        "page_cache": "not dropped: the file's pages were resident before each start "
        "(file_resident_mib)",
        "environment": run_environment(),
        "results": rows,
    }
    write_json(result, args.out)
    print(table(file_mib, rows), flush=True)
    print(f"wrote {args.out}", flush=True)
    return result


if __name__ == "__main__":
    main()
