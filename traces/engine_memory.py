"""The device memory an engine's process held outside PyTorch's allocator, in a JSON file beside its
snapshot.

A PyTorch memory snapshot holds what PyTorch's allocator reserved; the engine's process also holds
the CUDA context, cuBLAS/cuDNN handles, the kernels' loaded modules and NCCL buffers, none of which
the snapshot sees. ``poollab gpu serve --snapshot`` measures that figure in the engine's own process
(``cudaMemGetInfo``'s device used less ``torch.cuda.memory_reserved``, at the end of start-up and at
every memory sample while serving) and writes it beside the snapshot: ``NAME.json`` for
``NAME.pickle.gz`` (the layout of ``tests/data/snapshots_h200``, whose files hold the engine's
figures too). ``poollab plan`` reads it: the pool may reserve the device's total less that figure.

Keys this module reads (every one optional, each a whole number of bytes >= 0 when present):

- ``mem_get_info_total_bytes``: the device's memory as ``cudaMemGetInfo`` reports it;
- ``non_torch_startup_bytes``: outside PyTorch's allocator at the end of start-up (warm-up done);
- ``non_torch_serving_max_bytes``: the most outside it at any memory sample while serving;
- ``non_torch_bytes``: what a plan takes (the larger of the two);
- ``kv_block_tokens``, ``kv_padding_blocks``: the engine's KV block (tokens) and the blocks it adds
  to the ``--num-blocks`` it is given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from traces.errors import TraceFormatError, shown

__all__ = ["EngineMemory", "sidecar_path", "read_engine_memory", "write_engine_memory", "INT_KEYS"]

#: The keys read as byte counts (or block counts), with what each means in an error message.
INT_KEYS = {
    "mem_get_info_total_bytes": "the device's memory",
    "non_torch_bytes": "memory outside PyTorch's allocator",
    "non_torch_startup_bytes": "memory outside PyTorch's allocator at start-up's end",
    "non_torch_serving_max_bytes": "memory outside PyTorch's allocator while serving",
    "kv_block_tokens": "the engine's KV block",
    "kv_padding_blocks": "the engine's padding blocks",
}


def sidecar_path(snapshot: str | Path) -> Path:
    """``NAME.json`` beside ``NAME.pickle.gz`` (also ``.pickle``, ``.pkl``, ``.pkl.gz``,
    ``.gz``)."""
    snapshot = Path(snapshot)
    name = snapshot.name
    for suffix in (".pickle.gz", ".pkl.gz", ".pickle", ".pkl", ".gz"):
        if name.endswith(suffix) and len(name) > len(suffix):
            return snapshot.with_name(name[: -len(suffix)] + ".json")
    return snapshot.with_name(name + ".json")


@dataclass(frozen=True)
class EngineMemory:
    """What a snapshot's sidecar says about the device (None: the file does not say)."""

    path: Path
    total_bytes: int | None = None
    non_torch_bytes: int | None = None
    non_torch_startup_bytes: int | None = None
    non_torch_serving_max_bytes: int | None = None
    padding_blocks: int | None = None
    block_tokens: int | None = None

    def describe_non_torch(self) -> str:
        """Where the non-PyTorch figure came from, in words (for a plan's report)."""
        parts = []
        if self.non_torch_startup_bytes is not None:
            parts.append(f"{self.non_torch_startup_bytes / 2**20:,.1f} MiB at start-up's end")
        if self.non_torch_serving_max_bytes is not None:
            parts.append(
                f"{self.non_torch_serving_max_bytes / 2**20:,.1f} MiB at most while serving"
            )
        how = f" ({', '.join(parts)})" if parts else ""
        return f"measured in the engine's process{how}, {self.path.name}"


def read_engine_memory(snapshot: str | Path) -> EngineMemory | None:
    """The sidecar of ``snapshot`` (``sidecar_path``), or None when there is none.

    Raises ``TraceFormatError`` naming the file (and line) when it is no JSON object or a figure in
    it is no whole number of bytes >= 0.
    """
    path = sidecar_path(snapshot)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TraceFormatError(
            path,
            exc.lineno,
            f"not JSON ({exc.msg}); the figures beside a snapshot are a JSON object "
            "(`poollab gpu serve --snapshot` writes one)",
        ) from None
    except UnicodeDecodeError:
        raise TraceFormatError(path, None, "not JSON (not UTF-8 text)") from None
    if not isinstance(data, dict):
        raise TraceFormatError(path, 1, f"not a JSON object but {type(data).__name__}")
    values: dict[str, int | None] = {}
    for key, what in INT_KEYS.items():
        value = data.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0
        ):
            raise TraceFormatError(
                path, None, f"{key} {shown(value)} ({what}) is no whole number of bytes >= 0"
            )
        values[key] = value
    non_torch, larger = values["non_torch_bytes"], _larger_part(values)
    if non_torch is None:  # a file with the parts only: the larger is what the run needed
        non_torch = larger
    elif (
        larger is not None and non_torch != larger
    ):  # an edited file: which figure is meant cannot be told
        raise TraceFormatError(
            path,
            None,
            f"non_torch_bytes {non_torch:,} is not the larger of non_torch_startup_bytes "
            f"and non_torch_serving_max_bytes ({larger:,})",
        )
    total = values["mem_get_info_total_bytes"]
    if total is not None and non_torch is not None and non_torch >= total:
        raise TraceFormatError(
            path,
            None,
            f"non_torch_bytes {non_torch:,} is not below the device's memory ({total:,} B)",
        )
    return EngineMemory(
        path,
        total,
        non_torch,
        values["non_torch_startup_bytes"],
        values["non_torch_serving_max_bytes"],
        values["kv_padding_blocks"],
        values["kv_block_tokens"] or None,
    )


def write_engine_memory(snapshot: str | Path, fields: dict[str, Any]) -> Path:
    """Write ``fields`` (the keys above and any others: the engine's settings, torch's counters) as
    the sidecar of ``snapshot``; ``non_torch_bytes`` is filled in from the parts when missing."""
    fields = dict(fields)
    if fields.get("non_torch_bytes") is None and (larger := _larger_part(fields)) is not None:
        fields["non_torch_bytes"] = larger
    path = sidecar_path(snapshot)
    path.write_text(json.dumps(fields, indent=1) + "\n", encoding="utf-8")
    return path


def _larger_part(figures: dict[str, Any]) -> int | None:
    """The larger of the start-up and serving figures outside PyTorch (None when neither is there):
    what a plan takes, ``non_torch_bytes``."""
    parts = [figures.get(k) for k in ("non_torch_startup_bytes", "non_torch_serving_max_bytes")]
    return max((p for p in parts if p is not None), default=None)
