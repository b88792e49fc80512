"""Text a node sent, made safe to show on the operator's terminal: every control character made
visible, so that nothing a node prints can move the cursor, rewrite other nodes' lines, set the
window title or write the clipboard (OSC 52). The CLI's printing helpers (``cli/common.py``) are
the one place that calls it. Pure and stdlib only."""

from __future__ import annotations

import re

# C0 controls except newline (0x0a) and tab (0x09), which keep a text's shape; DEL; the C1
# controls (U+0080..U+009F: U+009B is a one-character CSI, U+009D an OSC, on terminals that
# read them). ESC (0x1b) is among the C0 ones.
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _shown(found: re.Match[str]) -> str:
    """One control character as ``\\xNN``: its code point in two lowercase hex digits."""
    return f"\\x{ord(found.group()):02x}"


def visible(text: str) -> str:
    """``text`` with every control character but newline and tab written as ``\\xNN`` (ESC as
    ``\\x1b``, carriage return as ``\\x0d``). A backslash already in the text is left as it is:
    this is for reading, not for decoding back. Idempotent: what it returns has no control
    character left."""
    return CONTROL.sub(_shown, text)
