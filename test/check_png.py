"""Reads PNG files with Python's zlib and struct alone (no code shared with the writer) and checks that each is a
whole, valid greyscale image of the given size: the signature, every chunk's CRC-32, IHDR's fields, the pixel rows
inflated to exactly the expected length with known filter bytes. With two or more files, also that the first and the
last differ in their pixels (the GAN's samples changed between epochs).

    python3 check_png.py WIDTH HEIGHT FILE...
"""
import struct
import sys
import zlib


def read_png(path, width, height):
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise SystemExit(f"{path}: not a PNG file (signature {data[:8]!r})")
    at, chunks = 8, []
    while at < len(data):
        if at + 8 > len(data):
            raise SystemExit(f"{path}: truncated chunk header at byte {at}")
        (length,) = struct.unpack(">I", data[at:at + 4])
        kind = data[at + 4:at + 8]
        body = data[at + 8:at + 8 + length]
        if len(body) != length or at + 12 + length > len(data):
            raise SystemExit(f"{path}: chunk {kind!r} is truncated")
        (crc,) = struct.unpack(">I", data[at + 8 + length:at + 12 + length])
        if zlib.crc32(kind + body) & 0xFFFFFFFF != crc:
            raise SystemExit(f"{path}: chunk {kind!r} has a wrong CRC")
        chunks.append((kind, body))
        at += 12 + length
    kinds = [k for k, _ in chunks]
    if kinds[0] != b"IHDR" or kinds[-1] != b"IEND" or b"IDAT" not in kinds:
        raise SystemExit(f"{path}: chunks {kinds} are not IHDR ... IDAT ... IEND")
    w, h, depth, colour, compression, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    if (w, h) != (width, height):
        raise SystemExit(f"{path}: {w} x {h} pixels, expected {width} x {height}")
    if (depth, colour, compression, filt, interlace) != (8, 0, 0, 0, 0):
        raise SystemExit(f"{path}: not 8-bit greyscale without interlace ({depth}, {colour}, {interlace})")
    raw = zlib.decompress(b"".join(b for k, b in chunks if k == b"IDAT"))
    if len(raw) != height * (width + 1):
        raise SystemExit(f"{path}: {len(raw)} bytes of rows, expected {height * (width + 1)}")
    rows = [raw[r * (width + 1):(r + 1) * (width + 1)] for r in range(height)]
    if any(row[0] > 4 for row in rows):
        raise SystemExit(f"{path}: a row has an unknown filter byte")
    if any(row[0] != 0 for row in rows):
        raise SystemExit(f"{path}: rows use filters this checker does not undo")
    return b"".join(row[1:] for row in rows)


def main():
    width, height, files = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    if not files:
        raise SystemExit("check_png.py: no files given")
    pixels = [read_png(p, width, height) for p in files]
    for p, px in zip(files, pixels):
        print(f"{p}: a valid {width} x {height} greyscale PNG, pixel values {min(px)} to {max(px)}")
        if min(px) == max(px):
            raise SystemExit(f"{p}: every pixel is {px[0]}: the image shows nothing")
    if len(files) > 1:
        changed = sum(a != b for a, b in zip(pixels[0], pixels[-1]))
        print(f"{changed} of {width * height} pixels changed from {files[0]} to {files[-1]}")
        if changed == 0:
            raise SystemExit("the samples did not change between epochs")
    print("images ok")


main()
