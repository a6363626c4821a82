"""Step traces: an engine's StepRecords as JSON Lines. The first line is a header (schema version, config,
model, creation time); each further line is one StepRecord's `to_dict()`. Every line is flushed as it is
written, so a run that dies leaves a trace that reads up to its last complete step."""

from __future__ import annotations

import importlib.metadata
import json
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from engine.events import EngineSnapshot, StepRecord
from engine.journey import Explainer

if TYPE_CHECKING:  # the engine module pulls in torch and transformers; the trace reader must not
    from engine.llm_engine import LLMEngine

SCHEMA_VERSION = 1
_PACKAGE = "inference-workbench"


def _dumps(obj: dict[str, Any]) -> str:
    # one object per line: compact separators, and no raw newlines (json escapes them inside strings)
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _package_version() -> str | None:
    try:
        return importlib.metadata.version(_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


def trace_header(engine: LLMEngine) -> dict[str, Any]:
    """The header line of a trace of `engine`: schema version, config, model (name and folder), creation time,
    and the engine's state when the trace begins (a replay starts from it: a trace may begin mid-run); a data-
    parallel front end's (DPLBClient) holds its requests and the replicas' summed KV usage, no blocks."""
    snapshot = getattr(engine, "snapshot", None)
    return {
        "schema_version": SCHEMA_VERSION,
        "config": engine.config.to_dict(),
        "model": {"name": engine.config.model, "path": str(engine.model_path)},
        "created": datetime.now(UTC).isoformat(),
        "engine_version": _package_version(),
        "snapshot": snapshot().to_dict() if snapshot is not None else None,
    }


class TraceWriter:
    """An engine subscriber that owns one open trace file: it writes the header when it is built and one
    flushed line per StepRecord it is called with. Use `engine.subscribe(TraceWriter(path, engine))`,
    then `close()` (or use it as a context manager)."""

    def __init__(self, path: str | os.PathLike, engine: LLMEngine) -> None:
        self.path = Path(path)
        self.num_records = 0
        self._file: IO[str] = open(self.path, "w", encoding="utf-8")
        self._write(trace_header(engine))

    def __call__(self, record: StepRecord) -> None:
        self._write(record.to_dict())
        self.num_records += 1

    def _write(self, obj: dict[str, Any]) -> None:
        self._file.write(_dumps(obj) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Trace:
    """A trace read back: its header (a dict) and its StepRecords, in step order."""

    header: dict[str, Any]
    records: list[StepRecord] = field(default_factory=list)

    @property
    def snapshot(self) -> EngineSnapshot | None:
        """The engine's state when the trace began (None in traces written before snapshots existed)."""
        snapshot = self.header.get("snapshot")
        return EngineSnapshot.from_dict(snapshot) if snapshot else None

    def explainer(self) -> Explainer:
        """The journeys of the trace's requests and the lives of its blocks, as the live engine explains them:
        `explainer().explain(request_id)`, `.block_life(block_id)`."""
        return Explainer.from_records(self.records, self.header["config"]["block_size"])


def write_trace(path: str | os.PathLike, header: dict[str, Any], records: list[StepRecord]) -> None:
    """Write a whole trace at once (the same format TraceWriter writes step by step)."""
    lines = [_dumps(header)] + [_dumps(r.to_dict()) for r in records]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


def _parse_line(line: str, lineno: int, path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{lineno}: not a JSON line ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _check_header(header: dict[str, Any], path: Path) -> None:
    version = header.get("schema_version")
    if not isinstance(version, int):
        raise ValueError(f"{path}:1: not a trace header (no integer schema_version)")
    if version > SCHEMA_VERSION:
        raise ValueError(f"{path}: schema_version {version} is newer than this reader ({SCHEMA_VERSION})")


def _record(obj: dict[str, Any], lineno: int, path: Path) -> StepRecord:
    try:
        return StepRecord.from_dict(obj)
    except KeyError as exc:  # an event kind this engine does not know, or a missing field
        raise ValueError(f"{path}:{lineno}: not a StepRecord of this engine (unknown {exc})") from None
    except TypeError as exc:
        raise ValueError(f"{path}:{lineno}: not a StepRecord of this engine ({exc})") from None


def read_trace(path: str | os.PathLike) -> Trace:
    """Read a trace back into a Trace of StepRecords equal to those written. A last line cut short (a run
    that died mid-write) is dropped; anything else malformed raises ValueError naming the line."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    if not text.endswith("\n") and len(lines) > 1:
        try:
            json.loads(lines[-1])  # only a newline missing: the line is whole
        except json.JSONDecodeError:
            lines.pop()
    numbered = [(i, line) for i, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise ValueError(f"{path}: empty, not a trace (no header line)")
    header = _parse_line(numbered[0][1], numbered[0][0], path)
    _check_header(header, path)
    records = [_record(_parse_line(line, i, path), i, path) for i, line in numbered[1:]]
    return Trace(header, records)
