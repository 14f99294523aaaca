"""The cache entry file format, written from its description in src/cache/disk_cache.h and nothing
else, so the CLI tests can build entries the library must accept or reject (a wrong key echo
with a valid checksum, another format version) without trusting the code under test.

Layout, little-endian: "RJITCACH", u32 format, 64-byte key echo, u32 spec length, spec JSON,
u64 payload length, SHA-256 of every other byte of the file, payload.
"""
import hashlib
import struct

MAGIC = b"RJITCACH"
FORMAT = 1


def serialize(key_hex, spec_json, payload, format_version=FORMAT):
    assert len(key_hex) == 64
    spec = spec_json.encode()
    head = MAGIC + struct.pack("<I", format_version) + key_hex.encode() + struct.pack("<I", len(spec)) + spec
    head += struct.pack("<Q", len(payload))
    checksum = hashlib.sha256(head + payload).digest()
    return head + checksum + payload


def parse(data):
    """(format, key_hex, spec_json, payload) of a well-formed entry; raises ValueError otherwise."""
    if data[:8] != MAGIC:
        raise ValueError("bad magic")
    (format_version,) = struct.unpack_from("<I", data, 8)
    key_hex = data[12:76].decode()
    (spec_length,) = struct.unpack_from("<I", data, 76)
    spec = data[80:80 + spec_length].decode()
    (payload_length,) = struct.unpack_from("<Q", data, 80 + spec_length)
    checksum_at = 88 + spec_length
    payload = data[checksum_at + 32:]
    if len(payload) != payload_length:
        raise ValueError("length mismatch")
    if hashlib.sha256(data[:checksum_at] + payload).digest() != data[checksum_at:checksum_at + 32]:
        raise ValueError("checksum mismatch")
    return format_version, key_hex, spec, payload
