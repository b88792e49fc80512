"""SHA-256 without ``hashlib``: ``hashlib`` loads OpenSSL's libcrypto (``_hashlib``), and
``meshkit env`` and ``meshkit run`` need only one digest each (the derived master port, the job
id) on every node at every start. CPython's own SHA-256 module gives the same digests."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:  # the same object to a type checker
    from hashlib import sha256 as _sha256
else:
    try:  # CPython 3.12+ keeps it in _sha2, earlier ones in _sha256; others have hashlib only
        from _sha2 import sha256 as _sha256
    except ImportError:
        try:
            from _sha256 import sha256 as _sha256
        except ImportError:
            from hashlib import sha256 as _sha256


def sha256(data: bytes) -> bytes:
    return _sha256(data).digest()


def sha256_hex(data: bytes) -> str:
    return _sha256(data).hexdigest()
