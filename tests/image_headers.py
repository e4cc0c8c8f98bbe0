"""Minimal image files of a given size, as the token counter reads them (headers only:
the pixel data is never decoded, so none is written)."""

from __future__ import annotations

import base64
import struct
import zlib


def png(width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk + _crc(chunk)


def jpeg(width: int, height: int, exif_bytes: int = 0) -> bytes:
    """SOI, an APP1 (EXIF) segment of about `exif_bytes`, then the SOF0 frame header."""
    out = b"\xff\xd8"
    while exif_bytes > 0:
        size = min(exif_bytes, 0xFFFF - 2)
        out += b"\xff\xe1" + struct.pack(">H", size + 2) + b"\0" * size
        exif_bytes -= size
    sof = struct.pack(">BHHB", 8, height, width, 3) + b"\x01\x22\x00\x02\x11\x01\x03\x11\x01"
    return out + b"\xff\xc0" + struct.pack(">H", len(sof) + 2) + sof + b"\xff\xd9"


def gif(width: int, height: int) -> bytes:
    return b"GIF89a" + struct.pack("<HH", width, height) + b"\x00\x00\x00;"


def webp(width: int, height: int) -> bytes:
    """A lossy (VP8) WebP header."""
    frame = b"\x9d\x01\x2a" + struct.pack("<HH", width, height)
    vp8 = b"VP8 " + struct.pack("<I", 10) + b"\x00\x00\x00" + frame
    return b"RIFF" + struct.pack("<I", 4 + len(vp8)) + b"WEBP" + vp8


def data_url(image: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(image).decode()


def _crc(chunk: bytes) -> bytes:
    return struct.pack(">I", zlib.crc32(chunk))
