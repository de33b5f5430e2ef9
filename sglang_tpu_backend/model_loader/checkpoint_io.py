"""Safetensors files without torch: header index, one-tensor reads, writers, test converters.

The reader parses the safetensors header itself (8-byte little-endian length, JSON header,
raw little-endian data, as on the little-endian hosts we run on) so every dtype we meet - bf16
and float8_e4m3fn included - comes back as a numpy array through ml_dtypes, one tensor (or a
range of a tensor's rows) at a time, read straight into its array with positional reads.

The converters at the bottom (per-expert layout, FP8 block quantisation, flat config) build
checkpoint variants for tests; the loader must read all of them to identical params.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import threading
from pathlib import Path
from typing import Any, Mapping

import ml_dtypes
import numpy as np

FP8_BLOCK = 128  # block size of FP8 ``weight_scale_inv`` scales, rows x cols

_ST_TO_NP: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16),
    "U16": np.dtype(np.uint16),
    "I32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32),
    "I64": np.dtype(np.int64),
    "U64": np.dtype(np.uint64),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_NP_TO_ST = {v: k for k, v in _ST_TO_NP.items()}
PICKLE_PATTERNS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")


class CheckpointError(ValueError):
    """A checkpoint directory cannot be loaded; the message is one line naming the cause."""


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: file, dtype code (``"BF16"``...), shape, byte range in the data."""

    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int  # absolute file offset one past the last byte

    @property
    def np_dtype(self) -> np.dtype:
        if self.dtype not in _ST_TO_NP:
            raise CheckpointError(f"tensor {self.name} in {self.path.name}: dtype {self.dtype} not supported")
        return _ST_TO_NP[self.dtype]


def _header_entries(header: dict, where: str):
    """(name, dtype name, shape, begin, end) of each tensor of a parsed safetensors header
    (offsets relative to the data after it); CheckpointError prefixed by ``where`` for an
    entry that is malformed."""
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            shape = tuple(int(x) for x in info["shape"])
            dtype = str(info["dtype"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{where}corrupt safetensors header entry for tensor {name}") from None
        yield name, dtype, shape, begin, end


def read_header(path: str | Path) -> dict[str, TensorEntry]:
    """Parse one ``.safetensors`` file's header into {name: TensorEntry}; reads no tensor data."""
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        size = path.stat().st_size
        if n > size - 8:
            raise CheckpointError(f"{path}: not a safetensors file (header length {n} > file size)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    base = 8 + n
    entries = {}
    for name, dtype, shape, begin, end in _header_entries(header, f"{path}: "):
        if base + end > size:
            raise CheckpointError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
        entries[name] = TensorEntry(name, path, dtype, shape, base + begin, base + end)
    return entries


class ReadCounter:
    """Bytes of tensor data this process has read from checkpoint files (thread-safe);
    ``thread_bytes``: of which the calling thread read."""

    def __init__(self):
        self._lock = threading.Lock()
        self._local = threading.local()
        self.bytes = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.bytes += n
        self._local.bytes = self.thread_bytes + n

    @property
    def thread_bytes(self) -> int:
        return getattr(self._local, "bytes", 0)


BYTES_READ = ReadCounter()  # every read_tensor / read_rows of this process
_READ_BYTES = 64 << 20  # the largest single positional read


def _check_size(entry: TensorEntry) -> np.dtype:
    dt = entry.np_dtype
    if math.prod(entry.shape) * dt.itemsize != entry.end - entry.begin:
        raise CheckpointError(
            f"tensor {entry.name} in {entry.path.name}: {entry.end - entry.begin} bytes do not hold "
            f"{entry.dtype}{list(entry.shape)}"
        )
    return dt


def _copy_out(entry: TensorEntry, begin: int, out: np.ndarray) -> np.ndarray:
    """Fill ``out`` with the file's bytes from ``begin`` on: positional reads straight into
    ``out``. No memory map: copying out of one faults the file in page by page, about half
    the rate of large reads for a layer of 4 MiB expert tensors read cold
    (``benchmarks/bench_load.py``); nothing of the file stays mapped here either way."""
    n = out.nbytes
    if n:
        dst = memoryview(out.reshape(-1).view(np.uint8))
        try:
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                done = 0
                while done < n:
                    k = os.preadv(fd, [dst[done:done + _READ_BYTES]], begin + done)
                    if k <= 0:
                        raise OSError(f"the file ends {n - done} bytes early")
                    done += k
            finally:
                os.close(fd)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"tensor {entry.name} in {entry.path.name}: read failed ({e})") from None
        BYTES_READ.add(n)
    return out


def read_tensor(entry: TensorEntry) -> np.ndarray:
    """Read one tensor's bytes into a fresh numpy array of its dtype and shape."""
    dt = _check_size(entry)
    return _copy_out(entry, entry.begin, np.empty(entry.shape, dt))


def read_into(entry: TensorEntry, out: np.ndarray) -> np.ndarray:
    """Read one tensor's bytes straight into ``out`` (C-contiguous, of its dtype and shape)."""
    dt = _check_size(entry)
    if out.dtype != dt or out.shape != entry.shape or not out.flags.c_contiguous:
        raise ValueError(f"tensor {entry.name}: cannot read {entry.dtype}{list(entry.shape)} into "
                         f"{out.dtype}{list(out.shape)} (contiguous: {out.flags.c_contiguous})")
    return _copy_out(entry, entry.begin, out)


def prefetch(entry: TensorEntry, lo: int = 0, hi: int | None = None) -> None:
    """Ask the kernel to start reading rows ``lo:hi`` (default: all) of a tensor into the page
    cache in the background (``posix_fadvise(WILLNEED)``); a later read then finds them there."""
    hi = entry.shape[0] if hi is None and entry.shape else (hi or 1)
    row = (entry.end - entry.begin) // max(entry.shape[0], 1) if entry.shape else entry.end - entry.begin
    fd = os.open(entry.path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, entry.begin + lo * row, (hi - lo) * row, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


def read_rows(entry: TensorEntry, lo: int, hi: int, out: np.ndarray | None = None) -> np.ndarray:
    """Rows ``lo:hi`` of a tensor's first axis (shape ``[hi - lo, *shape[1:]]``): only their
    bytes are read from the file, into ``out`` when given (C-contiguous, of the stored dtype
    and that shape), else into a fresh array."""
    dt = _check_size(entry)
    if not entry.shape or not 0 <= lo <= hi <= entry.shape[0]:
        raise ValueError(f"rows {lo}:{hi} out of range for {entry.name} {list(entry.shape)}")
    shape = (hi - lo, *entry.shape[1:])
    if out is None:
        out = np.empty(shape, dt)
    elif out.dtype != dt or out.shape != shape or not out.flags.c_contiguous:
        raise ValueError(f"tensor {entry.name}: cannot read rows {lo}:{hi} into {out.dtype}"
                         f"{list(out.shape)} (contiguous: {out.flags.c_contiguous})")
    row = math.prod(entry.shape[1:]) * dt.itemsize
    return _copy_out(entry, entry.begin + lo * row, out)


def index_checkpoint(checkpoint_dir: str | Path) -> dict[str, TensorEntry]:
    """Index every tensor of a safetensors checkpoint directory (sharded or not).

    Refuses pickle-only directories (``pytorch_model*.bin``, ``*.pt``, ...) without opening them.
    """
    d = Path(checkpoint_dir)
    if not d.is_dir():
        raise CheckpointError(f"checkpoint directory {d} does not exist")
    files = sorted(d.glob("*.safetensors"))
    index_path = d / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: invalid index file ({e!r})") from None
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (d / s).is_file()]
        if missing:
            raise CheckpointError(f"{index_path} lists shard files missing from {d}: {', '.join(missing[:5])}")
        files = [d / s for s in shards]
    if not files:
        pickles = sorted({p.name for pat in PICKLE_PATTERNS for p in d.glob(pat)})
        if pickles:
            raise CheckpointError(
                f"checkpoint directory {d} holds only pickle checkpoints ({', '.join(pickles[:3])}); "
                "pickle files are not loaded for safety (unpickling can run arbitrary code) - convert "
                "them to safetensors first, e.g. model.save_pretrained(out_dir) with transformers or "
                "safetensors.torch.save_file(state_dict, 'model.safetensors')"
            )
        raise CheckpointError(f"no *.safetensors weight files in checkpoint directory {d}")
    entries: dict[str, TensorEntry] = {}
    for path in files:
        for name, e in read_header(path).items():
            if name in entries:
                raise CheckpointError(f"tensor {name} appears in both {entries[name].path.name} and {path.name}")
            entries[name] = e
    return entries


def read_safetensors_bytes(data: bytes) -> dict[str, np.ndarray]:
    """The tensors of one safetensors file held in memory (``safetensors_bytes``' output, or
    ``safetensors.torch.save``'s), as numpy arrays (bf16 / fp8 through ml_dtypes) that view
    ``data``. Raises CheckpointError naming what is malformed."""
    if len(data) < 8:
        raise CheckpointError("not a safetensors payload (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise CheckpointError(f"not a safetensors payload (header length {n} > {len(data) - 8} bytes)")
    try:
        header = json.loads(data[8:8 + n])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError("corrupt safetensors header (not a JSON object)")
    out, body = {}, memoryview(data)[8 + n:]
    for name, dtype, shape, begin, end in _header_entries(header, ""):
        if dtype not in _ST_TO_NP:
            raise CheckpointError(f"tensor {name}: dtype {dtype} not supported")
        dtype = _ST_TO_NP[dtype]
        if not 0 <= begin <= end <= len(body) or end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"tensor {name}: data_offsets [{begin}, {end}] do not hold "
                                  f"{dtype}{list(shape)} in a {len(body)}-byte body")
        out[name] = np.frombuffer(body[begin:end], dtype.newbyteorder("<")).astype(
            dtype, copy=False).reshape(shape)
    return out


# Writers ---------------------------------------------------------------------------------
def safetensors_bytes(tensors: Mapping[str, np.ndarray], metadata: dict | None = None) -> bytes:
    """One safetensors file, in memory, of numpy arrays (bf16/fp8 via ml_dtypes allowed)."""
    import io

    buf = io.BytesIO()
    _write_safetensors(buf, tensors, metadata)
    return buf.getvalue()


def write_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray], metadata: dict | None = None) -> None:
    """Write numpy arrays (bf16/fp8 via ml_dtypes allowed) to one ``.safetensors`` file."""
    with open(path, "wb") as f:
        _write_safetensors(f, tensors, metadata)


def _write_safetensors(f, tensors: Mapping[str, np.ndarray], metadata: dict | None) -> None:
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _NP_TO_ST:
            raise ValueError(f"tensor {name}: dtype {a.dtype} cannot be written to safetensors")
        header[name] = {"dtype": _NP_TO_ST[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for a in arrays:
        f.write(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())


def write_checkpoint(
    out_dir: str | Path,
    tensors: Mapping[str, np.ndarray],
    config: dict,
    *,
    tokenizer_from: str | Path | None = None,
    shards: int = 1,
) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (or ``shards`` files plus the index json).

    ``tokenizer_from``: a directory whose tokenizer files are copied beside the weights.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    names = sorted(tensors)
    if shards <= 1:
        write_safetensors(out / "model.safetensors", tensors)
    else:
        weight_map = {}
        for i in range(shards):
            part = names[i::shards]
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            write_safetensors(out / fname, {n: tensors[n] for n in part})
            weight_map.update({n: fname for n in part})
        total = int(sum(np.asarray(t).nbytes for t in tensors.values()))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if tokenizer_from is not None:
        copy_tokenizer_files(tokenizer_from, out)
    return out


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "generation_config.json")


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> None:
    for name in TOKENIZER_FILES:
        p = Path(src) / name
        if p.is_file():
            (Path(dst) / name).write_bytes(p.read_bytes())


def read_checkpoint(checkpoint_dir: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a (small) checkpoint as numpy arrays. For tests and converters."""
    return {n: read_tensor(e) for n, e in index_checkpoint(checkpoint_dir).items()}


# Converters (tests) ----------------------------------------------------------------------
def fused_to_per_expert(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``mlp.experts.gate_up_proj [E,2I,H]`` / ``down_proj [E,H,I]`` -> ``experts.N.*.weight``."""
    out: dict[str, np.ndarray] = {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            stem = name[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{stem}{e}.gate_proj.weight"] = np.ascontiguousarray(t[e, :inter])
                out[f"{stem}{e}.up_proj.weight"] = np.ascontiguousarray(t[e, inter:])
        elif name.endswith("mlp.experts.down_proj"):
            stem = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{stem}{e}.down_proj.weight"] = np.ascontiguousarray(t[e])
        else:
            out[name] = t
    return out


def quantize_fp8_block(w: np.ndarray, block: int = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Block-quantise a 2-D [out, in] weight: (fp8 e4m3 [out, in], f32 scale_inv [ceil(out/b), ceil(in/b)]).

    ``dequantise(q, s)[i, j] = q[i, j] * s[i // b, j // b]``.
    """
    w = np.asarray(w, np.float32)
    rows, cols = w.shape
    nr, nc = -(-rows // block), -(-cols // block)
    padded = np.zeros((nr * block, nc * block), np.float32)
    padded[:rows, :cols] = w
    blocks = padded.reshape(nr, block, nc, block)
    amax = np.abs(blocks).max(axis=(1, 3))  # f32[nr, nc]
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    q = (blocks / scale[:, None, :, None]).reshape(nr * block, nc * block)[:rows, :cols]
    return q.astype(ml_dtypes.float8_e4m3fn), scale


def dequantize_fp8_block(q: np.ndarray, scale_inv: np.ndarray, block: int = FP8_BLOCK) -> np.ndarray:
    """Inverse of quantize_fp8_block, in f32: ``q * scale_inv`` broadcast over 128x128 blocks."""
    rows, cols = q.shape
    expanded = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), block, 0), block, 1)
    return q.astype(np.float32) * expanded[:rows, :cols]


def quantize_checkpoint_fp8(
    tensors: Mapping[str, np.ndarray], predicate=None
) -> dict[str, np.ndarray]:
    """FP8-quantise 2-D ``*.weight`` tensors (experts and linears) like DeepSeek/Qwen FP8 releases.

    ``predicate(name) -> bool`` picks which ``.weight`` tensors to quantise (default: every 2-D
    projection except embeddings, lm_head, routers and shared-expert gates). Fused expert
    tensors are split to per-expert first.
    """
    def default(name: str) -> bool:
        skip = ("embed_tokens", "lm_head", "mlp.gate.weight", "shared_expert_gate", "norm")
        return not any(s in name for s in skip)

    predicate = predicate or default
    out: dict[str, np.ndarray] = {}
    for name, t in fused_to_per_expert(tensors).items():
        if name.endswith(".weight") and t.ndim == 2 and predicate(name):
            out[name], out[name + "_scale_inv"] = quantize_fp8_block(t)
        else:
            out[name] = t
    return out


def dequantized_reference(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Replace every ``(w, w_scale_inv)`` pair by its f32 dequantisation (reference for tests)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        out[name] = t if scale is None else dequantize_fp8_block(t, scale)
    return out


def nested_to_flat(
    tensors: Mapping[str, np.ndarray], config: dict
) -> tuple[dict[str, np.ndarray], dict]:
    """A ``qwen3_5_moe`` checkpoint (nested ``text_config``, prefix ``model.language_model.``)
    as the text-only ``qwen3_5_moe_text`` form (flat config, prefix ``model.``)."""
    flat = {**config["text_config"], "model_type": "qwen3_5_moe_text",
            "architectures": ["Qwen3_5MoeForCausalLM"]}
    for key in ("tie_word_embeddings", "dtype"):
        if key in config and key not in flat:
            flat[key] = config[key]
    renamed = {}
    for name, t in tensors.items():
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        elif name.startswith("model.visual."):
            continue
        renamed[name] = t
    return renamed, flat


def atomic_replace_dir(tmp: Path, final: Path) -> Path:
    """Rename a fully written ``tmp`` directory to ``final``; if another process won, keep theirs."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return final
