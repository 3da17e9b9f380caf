"""Writing a receipt folder: ``receipt.json``, ``report.html``, ``report.md``, all or nothing.

NOTE [atomic receipt folder]
Everything is rendered in memory first (a rendering error leaves the folder untouched),
then each file is written to a temp file in the same folder and fsynced, and only when all
three exist are they renamed over the old ones, ``receipt.json`` last: it is the source of
truth, and the reports are derived from it. A crash between two renames can leave a new
report beside the old receipt, never a half-written file; each report names the sha256 of
the receipt it was rendered from, so a mismatched pair is visible, and ``remat check`` renders
both again from the receipt and compares them with these files (NOTE [reports checked against the
receipt] in remat/workflow/check.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .._io import replace_into, stage_bytes
from .model import Receipt
from .render import render_html, render_markdown

RECEIPT_FILE = "receipt.json"
HTML_FILE = "report.html"
MD_FILE = "report.md"


@dataclass(frozen=True, kw_only=True)
class ReceiptFiles:
    receipt: Path
    html: Path
    markdown: Path
    digest: str          # sha256 of receipt.json's bytes


def receipt_bytes(receipt: Receipt) -> bytes:
    return (json.dumps(receipt.to_json(), indent=1, allow_nan=False) + "\n").encode("utf-8")


def write_receipt(receipt: Receipt, out_dir: Path | str) -> ReceiptFiles:
    """Render and write the receipt folder (NOTE [atomic receipt folder])."""
    data = receipt_bytes(receipt)
    # round trip through the loader: never publish a receipt `remat check` would refuse; the reports are
    # rendered from what it loads, as `remat check` renders them (NOTE [reports checked against the receipt]
    # in remat/workflow/check.py), so a figure the JSON rounds reads the same in both
    loaded = Receipt.loads(data)
    return write_folder(out_dir, data, lambda: render_html(loaded), lambda: render_markdown(loaded))


def write_folder(out_dir: Path | str, data: bytes, html: Callable[[], str], markdown: Callable[[], str]) -> ReceiptFiles:
    """``receipt.json`` (``data``), ``report.html`` and ``report.md`` into ``out_dir``, atomically (NOTE [atomic receipt folder])."""
    out = Path(out_dir)
    digest = hashlib.sha256(data).hexdigest()
    reports = stamped_reports(digest, html(), markdown())
    staged: list[tuple[Path, Path]] = []
    try:
        for name, payload in ((HTML_FILE, reports[HTML_FILE].encode("utf-8")),
                              (MD_FILE, reports[MD_FILE].encode("utf-8")), (RECEIPT_FILE, data)):
            staged.append((stage_bytes(out, name, payload), out / name))
        for tmp, final in staged:      # receipt.json last
            replace_into(tmp, final)
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
    return ReceiptFiles(receipt=out / RECEIPT_FILE, html=out / HTML_FILE, markdown=out / MD_FILE, digest=digest)


def stamped_reports(digest: str, html: str, markdown: str) -> dict[str, str]:
    """{file name: text}: the reports as written beside the receipt whose bytes have sha256 ``digest``
    (``remat check`` renders them again and compares: NOTE [reports checked against the receipt] in
    remat/workflow/check.py)."""
    stamp = f"receipt.json sha256 {digest}"
    return {HTML_FILE: html.replace("</body>", f'<p class="muted">{stamp}</p></body>', 1),
            MD_FILE: markdown + f"\n<sub>{stamp}</sub>\n"}
