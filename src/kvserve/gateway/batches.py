"""The deferred lane: OpenAI's Batch API subset, persisted in SQLite, run by
the gateway at the lowest priority whenever the fleet has room.

Input files are JSONL lines `{"custom_id", "method": "POST", "url", "body"}`;
the output file holds `{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error": null}` per line that got a 200, the error
file the others. Accepted work survives a restart: files, batches and each
line's state live in `<state_dir>/gateway.sqlite3`; lines that were being
sent when the gateway stopped are sent again. One connection, used only from
the event loop's thread (each write is its own short transaction).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import sqlite3
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
COMPLETION_WINDOW_S = {"24h": 24 * 3600}
MAX_LINES = 50_000
TERMINAL = ("completed", "failed", "expired", "cancelled")
STATUSES = ("validating", "in_progress", "finalizing", "cancelling", *TERMINAL)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, content BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL, in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER,
    failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    output_file_id TEXT, error_file_id TEXT, errors TEXT, metadata TEXT);
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
    state TEXT NOT NULL, status_code INTEGER, response TEXT, error TEXT,
    PRIMARY KEY (batch_id, line));
CREATE INDEX IF NOT EXISTS pending_lines ON batch_lines (state, batch_id, line);
"""


class BatchError(ValueError):
    """Bad batch input: status, message, the field it concerns."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class RetryLater(Exception):
    """Raised by a dispatch that found no room after all: the line goes back
    to pending and is sent again later."""


@dataclass(frozen=True)
class PendingLine:
    batch_id: str
    line: int
    tenant: str
    endpoint: str
    body: dict


class BatchStore:
    """Files, batches and their lines in SQLite."""

    def __init__(self, state_dir: str | Path, clock: Callable[[], float] = time.time) -> None:
        path = Path(state_dir)
        path.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        self.db = sqlite3.connect(path / "gateway.sqlite3", isolation_level=None)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across a process crash
        self.db.executescript(_SCHEMA)
        # Lines in flight when the gateway stopped never got their answer: send them again.
        self.db.execute("UPDATE batch_lines SET state='pending' WHERE state='running'")

    def close(self) -> None:
        self.db.close()

    def _now(self) -> int:
        return int(self.clock())

    # ---- files -----------------------------------------------------------
    def create_file(self, tenant: str, purpose: str, filename: str, content: bytes) -> dict:
        if purpose not in ("batch", "batch_output"):
            raise BatchError(400, "purpose must be 'batch'", "purpose")
        file_id = "file-" + secrets.token_hex(12)
        self.db.execute("INSERT INTO files VALUES (?,?,?,?,?,?,?)",
                        (file_id, tenant, purpose, filename, len(content), self._now(), content))
        return self.file(tenant, file_id)

    def file(self, tenant: str, file_id: str) -> dict:
        row = self.db.execute("SELECT id, purpose, filename, bytes, created_at FROM files WHERE id=? AND tenant=?",
                              (file_id, tenant)).fetchone()
        if row is None:
            raise BatchError(404, f"no file {file_id!r}", "file_id", "not_found")
        return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
                "filename": row["filename"], "purpose": row["purpose"], "status": "processed"}

    def file_content(self, tenant: str, file_id: str) -> bytes:
        row = self.db.execute("SELECT content FROM files WHERE id=? AND tenant=?", (file_id, tenant)).fetchone()
        if row is None:
            raise BatchError(404, f"no file {file_id!r}", "file_id", "not_found")
        return bytes(row["content"])

    # ---- batches ---------------------------------------------------------
    def create_batch(self, tenant: str, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict | None = None) -> dict:
        if endpoint not in ENDPOINTS:
            raise BatchError(400, f"endpoint must be one of {list(ENDPOINTS)}", "endpoint")
        if completion_window not in COMPLETION_WINDOW_S:
            raise BatchError(400, "completion_window must be '24h'", "completion_window")
        if metadata is not None and not isinstance(metadata, dict):
            raise BatchError(400, "metadata must be an object", "metadata")
        content = self.file_content(tenant, input_file_id)
        lines, errors = _parse_lines(content, endpoint)
        now = self._now()
        batch_id = "batch_" + secrets.token_hex(12)
        status = "failed" if errors else "in_progress"
        with self.db:
            self.db.execute(
                "INSERT INTO batches (id, tenant, endpoint, input_file_id, completion_window, status, created_at, "
                "expires_at, in_progress_at, failed_at, errors, metadata) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (batch_id, tenant, endpoint, input_file_id, completion_window, status, now,
                 now + COMPLETION_WINDOW_S[completion_window], None if errors else now, now if errors else None,
                 json.dumps({"object": "list", "data": errors}) if errors else None,
                 json.dumps(metadata) if metadata is not None else None))
            if not errors:
                self.db.executemany("INSERT INTO batch_lines (batch_id, line, custom_id, body, state) "
                                    "VALUES (?,?,?,?,'pending')",
                                    [(batch_id, i, cid, json.dumps(body)) for i, (cid, body) in enumerate(lines)])
        return self.batch(tenant, batch_id)

    def create_from_request(self, tenant: str, endpoint: str, body: dict, custom_id: str) -> dict:
        """A one-line batch for a request the ladder deferred."""
        line = json.dumps({"custom_id": custom_id, "method": "POST", "url": endpoint, "body": body})
        file = self.create_file(tenant, "batch", f"{custom_id}.jsonl", line.encode() + b"\n")
        return self.create_batch(tenant, file["id"], endpoint, "24h", {"deferred_request": custom_id})

    def batch(self, tenant: str, batch_id: str) -> dict:
        row = self.db.execute("SELECT * FROM batches WHERE id=? AND tenant=?", (batch_id, tenant)).fetchone()
        if row is None:
            raise BatchError(404, f"no batch {batch_id!r}", "batch_id", "not_found")
        counts = self.db.execute(
            "SELECT COUNT(*) AS total, SUM(state='done' AND status_code=200) AS completed, "
            "SUM(state='done' AND (status_code IS NULL OR status_code!=200)) AS failed "
            "FROM batch_lines WHERE batch_id=?", (batch_id,)).fetchone()
        body = {k: row[k] for k in ("id", "endpoint", "input_file_id", "completion_window", "status",
                                    "output_file_id", "error_file_id", "created_at", "in_progress_at",
                                    "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
                                    "cancelling_at", "cancelled_at")}
        body.update(object="batch", errors=json.loads(row["errors"]) if row["errors"] else None,
                    metadata=json.loads(row["metadata"]) if row["metadata"] else None,
                    request_counts={"total": counts["total"] or 0, "completed": counts["completed"] or 0,
                                    "failed": counts["failed"] or 0})
        return body

    def cancel(self, tenant: str, batch_id: str) -> dict:
        batch = self.batch(tenant, batch_id)
        if batch["status"] in ("in_progress", "validating"):
            with self.db:
                self.db.execute("UPDATE batches SET status='cancelling', cancelling_at=? WHERE id=?",
                                (self._now(), batch_id))
                self.db.execute("UPDATE batch_lines SET state='done', error=? WHERE batch_id=? AND state='pending'",
                                (json.dumps({"code": "batch_cancelled", "message": "the batch was cancelled"}),
                                 batch_id))
            self.finish_if_done(batch_id)
        return self.batch(tenant, batch_id)

    def counts_by_status(self) -> dict[str, int]:
        counts = dict.fromkeys(STATUSES, 0)
        for row in self.db.execute("SELECT status, COUNT(*) AS n FROM batches GROUP BY status"):
            counts[row["status"]] = row["n"]
        return counts

    # ---- running ---------------------------------------------------------
    def take_pending(self, limit: int) -> list[PendingLine]:
        """Up to `limit` pending lines, oldest batch first, marked running."""
        self._expire()
        rows = self.db.execute(
            "SELECT l.batch_id, l.line, l.body, b.tenant, b.endpoint FROM batch_lines l JOIN batches b "
            "ON b.id = l.batch_id WHERE l.state='pending' AND b.status='in_progress' "
            "ORDER BY b.created_at, l.batch_id, l.line LIMIT ?", (limit,)).fetchall()
        with self.db:
            self.db.executemany("UPDATE batch_lines SET state='running' WHERE batch_id=? AND line=?",
                                [(r["batch_id"], r["line"]) for r in rows])
        return [PendingLine(r["batch_id"], r["line"], r["tenant"], r["endpoint"], json.loads(r["body"]))
                for r in rows]

    def record_result(self, line: PendingLine, status_code: int | None, response: dict | None,
                      error: dict | None) -> None:
        self.db.execute("UPDATE batch_lines SET state='done', status_code=?, response=?, error=? "
                        "WHERE batch_id=? AND line=?",
                        (status_code, json.dumps(response) if response is not None else None,
                         json.dumps(error) if error is not None else None, line.batch_id, line.line))
        self.finish_if_done(line.batch_id)

    def release(self, line: PendingLine) -> None:
        """Not sent after all (the gateway is stopping): pending again."""
        self.db.execute("UPDATE batch_lines SET state='pending' WHERE batch_id=? AND line=?",
                        (line.batch_id, line.line))

    def finish_if_done(self, batch_id: str) -> None:
        """Write the output and error files once no line is left to run."""
        left = self.db.execute("SELECT COUNT(*) FROM batch_lines WHERE batch_id=? AND state!='done'",
                               (batch_id,)).fetchone()[0]
        row = self.db.execute("SELECT tenant, status FROM batches WHERE id=?", (batch_id,)).fetchone()
        if left or row is None or row["status"] not in ("in_progress", "cancelling", "expiring"):
            return
        now = self._now()
        output, errors = self._result_files(batch_id, row["tenant"])
        final = {"in_progress": "completed", "cancelling": "cancelled", "expiring": "expired"}[row["status"]]
        stamp = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}[final]
        with self.db:
            self.db.execute(f"UPDATE batches SET status=?, finalizing_at=?, {stamp}=?, output_file_id=?, "
                            "error_file_id=? WHERE id=?", (final, now, now, output, errors, batch_id))

    def _result_files(self, batch_id: str, tenant: str) -> tuple[str | None, str | None]:
        out, err = [], []
        for r in self.db.execute("SELECT line, custom_id, status_code, response, error FROM batch_lines "
                                 "WHERE batch_id=? ORDER BY line", (batch_id,)):
            response = None
            if r["status_code"] is not None:
                body = json.loads(r["response"]) if r["response"] else None
                request_id = body.get("id") if isinstance(body, dict) else None
                response = {"status_code": r["status_code"], "request_id": request_id, "body": body}
            entry = {"id": f"batch_req_{batch_id[6:]}_{r['line']}", "custom_id": r["custom_id"],
                     "response": response, "error": json.loads(r["error"]) if r["error"] else None}
            (out if r["status_code"] == 200 else err).append(json.dumps(entry))
        ids = []
        for lines, name in ((out, "output"), (err, "errors")):
            if not lines:
                ids.append(None)
                continue
            content = ("\n".join(lines) + "\n").encode()
            ids.append(self.create_file(tenant, "batch_output", f"{batch_id}_{name}.jsonl", content)["id"])
        return ids[0], ids[1]

    def _expire(self) -> None:
        now = self._now()
        expired = [r["id"] for r in self.db.execute(
            "SELECT id FROM batches WHERE status='in_progress' AND expires_at < ?", (now,))]
        for batch_id in expired:
            with self.db:
                self.db.execute("UPDATE batches SET status='expiring' WHERE id=?", (batch_id,))
                self.db.execute("UPDATE batch_lines SET state='done', error=? WHERE batch_id=? AND state='pending'",
                                (json.dumps({"code": "batch_expired", "message": "the completion window passed"}),
                                 batch_id))
            self.finish_if_done(batch_id)


def _parse_lines(content: bytes, endpoint: str) -> tuple[list[tuple[str, dict]], list[dict]]:
    """(custom_id, body) per line, and the errors in OpenAI's shape."""
    lines, errors, seen = [], [], set()
    try:
        text = content.decode()
    except UnicodeDecodeError:
        return [], [{"code": "invalid_file", "message": "the input file is not UTF-8", "line": None}]
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            entry = json.loads(raw)
        except json.JSONDecodeError:
            errors.append({"code": "invalid_json_line", "message": "not valid JSON", "line": number})
            continue
        problem = _line_problem(entry, endpoint, seen)
        if problem:
            errors.append({"code": "invalid_request", "message": problem, "line": number})
            continue
        seen.add(entry["custom_id"])
        lines.append((entry["custom_id"], entry["body"]))
    if not lines and not errors:
        errors.append({"code": "empty_file", "message": "the input file has no requests", "line": None})
    if len(lines) > MAX_LINES:
        errors.append({"code": "too_many_requests", "message": f"at most {MAX_LINES} requests", "line": None})
    return lines, errors[:100]


def _line_problem(entry: object, endpoint: str, seen: set[str]) -> str | None:
    if not isinstance(entry, dict):
        return "each line must be a JSON object"
    custom_id = entry.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "custom_id must be a non-empty string"
    if custom_id in seen:
        return f"custom_id {custom_id!r} is not unique"
    if entry.get("method") != "POST":
        return "method must be POST"
    if entry.get("url") != endpoint:
        return f"url must be the batch's endpoint {endpoint}"
    if not isinstance(entry.get("body"), dict):
        return "body must be a JSON object"
    return None


# (status code, response body or None, error or None) of one line.
Dispatch = Callable[[PendingLine], Awaitable[tuple[int | None, dict | None, dict | None]]]


class BatchRunner:
    """Sends pending lines while the fleet has room, `concurrency` at a time."""

    def __init__(self, store: BatchStore, dispatch: Dispatch, has_room: Callable[[], bool],
                 concurrency: int, poll_s: float = 0.2) -> None:
        self.store = store
        self.dispatch = dispatch
        self.has_room = has_room
        self.concurrency = concurrency
        self.poll_s = poll_s
        self._running: set[asyncio.Task] = set()

    async def run(self) -> None:
        try:
            while True:
                free = self.concurrency - len(self._running)
                if free > 0 and self.has_room():
                    for line in self.store.take_pending(free):
                        task = asyncio.create_task(self._one(line))
                        self._running.add(task)
                        task.add_done_callback(self._running.discard)
                await asyncio.sleep(self.poll_s)
        finally:
            for task in list(self._running):
                task.cancel()

    async def _one(self, line: PendingLine) -> None:
        try:
            await self._send(line)
        except RetryLater:
            await asyncio.sleep(self.poll_s)  # the slot stays taken a moment: no spinning on a full fleet

    async def _send(self, line: PendingLine) -> None:
        try:
            status, body, error = await self.dispatch(line)
        except (asyncio.CancelledError, RetryLater):
            self.store.release(line)
            raise
        except Exception as exc:  # the line fails, the runner goes on
            log.exception("batch %s line %d failed", line.batch_id, line.line)
            status, body, error = None, None, {"code": "gateway_error", "message": str(exc)}
        self.store.record_result(line, status, body, error)
