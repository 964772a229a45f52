#!/usr/bin/env python3
"""tests/make_fixtures.py: cross-checks of dtrain's file formats against Python.

  check [--arange] FILE.safetensors
      Reads a safetensors file with a small pure-Python reader that applies the rules of
      the reference implementation (header length, JSON object, dtype/shape/data_offsets,
      offsets tiling the data section), then loads every tensor into PyTorch with
      torch.frombuffer when torch is importable (it is optional; the `safetensors` package
      is not needed). With --arange, tensors of numel n must hold 0, 1, ..., n-1
      (mod 256 for U8). Exit status 0 when everything holds.
      Typical use, with the C test writing the file:
          DTR_ST_EXPORT=/tmp/arange.safetensors build/test_safetensors
          python3 tests/make_fixtures.py check --arange /tmp/arange.safetensors

  write FILE.safetensors
      Writes a file the way the reference Python writer lays it out (__metadata__, keys
      sorted, header padded with spaces to a multiple of 8) with the same arange tensors,
      for reading on the C side.
"""
import json
import struct
import sys

DTYPES = {"F32": ("<f", 4), "F16": ("<e", 2), "BF16": (None, 2), "I32": ("<i", 4), "U8": ("<B", 1)}


def fail(msg):
    print("make_fixtures: " + msg, file=sys.stderr)
    sys.exit(1)


def read_safetensors(path):
    """Returns [(name, dtype, shape, bytes)] in file order, validating like the reference."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        fail(f"{path}: shorter than 8 bytes")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > 100_000_000 or n > len(blob) - 8:
        fail(f"{path}: bad header length {n}")
    raw = blob[8:8 + n]
    if raw[:1] != b"{":
        fail(f"{path}: header does not start with '{{'")
    header = json.loads(raw.decode("utf-8"),
                        object_pairs_hook=lambda kv: dict(kv) if len(set(k for k, _ in kv)) == len(kv)
                        else fail(f"{path}: duplicate keys"))
    data = blob[8 + n:]
    out, spans = [], []
    for name, e in header.items():
        if name == "__metadata__":
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in e.items()):
                fail(f"{path}: __metadata__ must map strings to strings")
            continue
        if set(e) != {"dtype", "shape", "data_offsets"}:
            fail(f"{path}: {name}: fields {sorted(e)}")
        dt, shape, (b, end) = e["dtype"], e["shape"], e["data_offsets"]
        if dt not in DTYPES:
            fail(f"{path}: {name}: dtype {dt}")
        numel = 1
        for d in shape:
            if not isinstance(d, int) or d < 0:
                fail(f"{path}: {name}: bad dim {d!r}")
            numel *= d
        if end - b != numel * DTYPES[dt][1] or b > end or end > len(data):
            fail(f"{path}: {name}: bad data_offsets [{b}, {end}]")
        spans.append((b, end, name))
        out.append((name, dt, list(shape), data[b:end]))
    pos = 0
    for b, end, name in sorted(spans):
        if b != pos:
            fail(f"{path}: {name}: offsets do not tile the data section at {pos}")
        pos = end
    if pos != len(data):
        fail(f"{path}: {len(data) - pos} bytes left over")
    return out


def values(dt, raw):
    if dt == "BF16":
        return [struct.unpack("<f", b"\x00\x00" + raw[i:i + 2])[0] for i in range(0, len(raw), 2)]
    fmt, size = DTYPES[dt]
    return [struct.unpack(fmt, raw[i:i + size])[0] for i in range(0, len(raw), size)]


def check(path, arange):
    tensors = read_safetensors(path)
    try:
        import torch
        tmap = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I32": torch.int32, "U8": torch.uint8}
    except ImportError:
        torch = None
        print("make_fixtures: torch not importable; pure-Python check only")
    for name, dt, shape, raw in tensors:
        vals = values(dt, raw)
        if arange:
            want = [(i % 256 if dt == "U8" else i) for i in range(len(vals))]
            if name == "scalar":
                want = [7.5]
            if vals != want:
                fail(f"{path}: {name}: values {vals[:8]}... are not 0, 1, 2, ...")
        line = f"{name:10s} {dt:5s} {str(shape):12s} python ok"
        if torch is not None:
            numel = 1
            for d in shape:
                numel *= d
            t = (torch.frombuffer(bytearray(raw), dtype=tmap[dt]) if raw
                 else torch.empty(0, dtype=tmap[dt])).reshape(shape)
            tv = t.float().flatten().tolist()
            if tv != [float(v) for v in vals] or t.numel() != numel:
                fail(f"{path}: {name}: torch sees {tv[:8]}, Python {vals[:8]}")
            line += f", torch {tuple(t.shape)} {t.dtype} sum={t.float().sum().item():g}"
        print(line)
    print(f"make_fixtures: {path}: {len(tensors)} tensors OK")


def write(path):
    def pack(dt, n):
        if dt == "BF16":
            return b"".join(struct.pack("<f", float(i))[2:] for i in range(n))
        fmt = DTYPES[dt][0]
        return b"".join(struct.pack(fmt, (i % 256) if dt == "U8" else i) for i in range(n))
    tensors = {dt.lower(): (dt, [2, 3, 4], pack(dt, 24)) for dt in DTYPES}
    header, off, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name in sorted(tensors):
        dt, shape, raw = tensors[name]
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        blobs.append(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    print(f"make_fixtures: wrote {path}")


def main(argv):
    if len(argv) >= 2 and argv[0] == "check":
        arange = "--arange" in argv
        for p in [a for a in argv[1:] if a != "--arange"]:
            check(p, arange)
    elif len(argv) == 2 and argv[0] == "write":
        write(argv[1])
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
