"""Decoding: the bytes of one update message (or a round's batch of them) to SparseUpdates.

:func:`decode` first walks the headers (so truncated or trailing input is named as such and no
payload is touched before its length is known to be present), then checks the CRC, then decodes
and validates each section. Every count is checked against the bytes that must carry it before
anything of that size is allocated, so a short message cannot claim a large allocation. Every
failure is a :class:`~dgc.errors.DecodeError`. The reference reader here names each error; the
fast path of :mod:`dgc.wire.fast` decodes well-formed messages and hands anything unusual back.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Sequence

import torch

from dgc import golomb
from dgc.errors import DecodeError
from dgc.sparse import SparseTensor, SparseUpdate
from dgc.wire.fast import MAX_TEMPLATES, Template, decode_packed, read_headers_fast
from dgc.wire.framing import (
    DIM,
    NAME_LEN,
    NDIM,
    as_view,
    check_crc,
    check_end,
    crc_offset,
    read,
    read_name,
)
from dgc.wire.index_codings import ALL_ID, CODING_NAMES, INDEX_CODINGS, decode_indices
from dgc.wire.layout import PREAMBLE, TENSOR_TAIL, VERSION, TensorRecord
from dgc.wire.value_codings import (
    DTYPES_BY_ID,
    GRID_CODINGS,
    GRID_RICE_CODINGS,
    GRID_RICE_HEAD,
    SIGN_CODED,
    decode_values,
    values_nbytes,
)

#: The largest tensor the format carries (2**62 entries): the bound to pass for bytes that this
#: process wrote itself. Bytes from another party take the size of the model they are for.
MAX_NUMEL = golomb.MAX_NUMEL


def decode(data: bytes | bytearray | memoryview, *, max_numel: int) -> SparseUpdate:
    """The update carried by ``data``, validated.

    Parameters
    ----------
    data
        One whole message as :func:`encode` wrote it, nothing before or after.
    max_numel
        Reject any tensor whose shape claims more entries: the size of the model the message is
        for (a receiver densifies what it decodes), or :data:`MAX_NUMEL` for bytes this process
        wrote itself. Checked from the header, before anything is allocated.

    Raises
    ------
    DecodeError
        With the reason: truncated input, trailing bytes, bad magic, unsupported version or
        flags, bad checksum, unknown coding or dtype id, count above numel, numel above
        ``max_numel`` or the format's limit, indices out of range / repeated / not increasing /
        not canonically coded, NaN or Inf values, duplicate or non-utf-8 tensor names. No other
        exception escapes on bad bytes.
    """
    _check_bound(max_numel)
    return _decode_checked(as_view(data), max_numel, None)


def decode_many(messages: Sequence[bytes | bytearray | memoryview], *,
                max_numel: int) -> list[SparseUpdate | DecodeError]:
    """:func:`decode` of each message, faster for messages that share their structure.

    Returns, in order, each message's update, or the :class:`~dgc.errors.DecodeError` that
    ``decode(message, max_numel=max_numel)`` would raise (same message): one bad message does
    not affect the others. The replies of a round (same model, same codings) differ only in
    counts and lengths; after the first is decoded, the others' headers are read against it
    (one prefix comparison per tensor, see ``Template``) and their updates share its layout.
    """
    _check_bound(max_numel)
    templates: list[Template] = []
    results: list[SparseUpdate | DecodeError] = []
    for data in messages:
        try:
            results.append(_decode_checked(as_view(data), max_numel, templates))
        except DecodeError as e:
            results.append(e)
    return results


def _decode_checked(view: memoryview, max_numel: int | None,
                    templates: list[Template] | None) -> SparseUpdate:
    try:
        return _decode(view, max_numel, templates)
    except DecodeError:
        raise
    except (ValueError, TypeError, IndexError, OverflowError, struct.error, RuntimeError) as e:
        # A check above missed a malformed case: still honour the DecodeError-only contract.
        raise DecodeError(f"malformed update: {type(e).__name__}: {e}") from e


def _read_preamble(data: memoryview) -> tuple[int, int, int]:
    """``(sequence, tensor_count, end)`` after checking the framing; ``end`` is the CRC's offset."""
    flags, sequence, tensor_count = PREAMBLE.open(data)
    if flags != 0:
        raise DecodeError(f"unsupported flags 0x{flags:02x} for version {VERSION} (must be 0)")
    end = crc_offset(data)
    # Each tensor record has at least its fixed fields: a count larger than the bytes can hold
    # is refused before any per-tensor work.
    min_record = NAME_LEN.size + NDIM.size + TENSOR_TAIL.size
    if tensor_count * min_record > end - PREAMBLE.size:
        raise DecodeError(f"truncated input: {tensor_count} tensors cannot fit in "
                          f"{end - PREAMBLE.size} bytes")
    return sequence, tensor_count, end


def _read_record(data: memoryview, pos: int, end: int, k: int, max_numel: int | None,
                 seen: set[str]) -> tuple[TensorRecord, int]:
    name, pos = read_name(data, pos, end, f"tensor {k} name")
    if name in seen:
        raise DecodeError(f"duplicate tensor name {name!r} (tensor {k})")
    seen.add(name)
    (ndim,) = read(NDIM, data, pos, end, f"tensor {name!r} ndim")
    pos += NDIM.size
    shape = []
    numel = 1
    for _ in range(ndim):
        (dim,) = read(DIM, data, pos, end, f"tensor {name!r} dims")
        pos += DIM.size
        if dim > golomb.MAX_NUMEL:
            raise DecodeError(f"tensor {name!r} has dim {dim}, above the format's limit "
                              f"{golomb.MAX_NUMEL}")
        shape.append(dim)
        numel *= dim  # exact Python int; bounded below since each factor is
    if numel > golomb.MAX_NUMEL:
        raise DecodeError(f"tensor {name!r} shape {tuple(shape)} has {numel} entries, above the "
                          f"format's limit {golomb.MAX_NUMEL}")
    if max_numel is not None and numel > max_numel:
        raise DecodeError(f"tensor {name!r} shape {tuple(shape)} has {numel} entries, above "
                          f"max_numel={max_numel}")
    count, coding, dtype_id, index_bytes = read(TENSOR_TAIL, data, pos, end,
                                                 f"tensor {name!r} count/coding/dtype/length")
    pos += TENSOR_TAIL.size
    if count > numel:
        raise DecodeError(f"tensor {name!r} claims {count} entries, above its numel {numel}")
    if coding not in CODING_NAMES:
        raise DecodeError(f"tensor {name!r} has unknown index coding id {coding}; known: "
                          f"{sorted(CODING_NAMES)}")
    value_coding = dtype_id if dtype_id in GRID_CODINGS else dtype_id & SIGN_CODED
    if dtype_id not in GRID_CODINGS and dtype_id & ~SIGN_CODED not in DTYPES_BY_ID:
        raise DecodeError(f"tensor {name!r} has unknown value dtype id {dtype_id}; known: "
                          f"{sorted(DTYPES_BY_ID)}, sign-coded "
                          f"{sorted(i | SIGN_CODED for i in DTYPES_BY_ID)} and grid-coded "
                          f"{list(GRID_CODINGS)}")
    if coding == INDEX_CODINGS["all"] and (count != numel or index_bytes != 0):
        raise DecodeError(f"tensor {name!r}: coding 'all' needs count == numel and no index "
                          f"bytes, got count {count}, numel {numel}, {index_bytes} index bytes")
    dtype = (torch.float32 if value_coding in GRID_CODINGS
             else DTYPES_BY_ID[dtype_id & ~SIGN_CODED])
    if value_coding in GRID_RICE_CODINGS:
        head = pos + index_bytes
        if head + GRID_RICE_HEAD.size > end:
            raise DecodeError(f"truncated input: tensor {name!r} needs {index_bytes} index bytes "
                              f"and a {GRID_RICE_HEAD.size}-byte grid head at offset {pos}, "
                              f"only {end - pos} left")
        _, _, rice_bytes = GRID_RICE_HEAD.unpack_from(data, head)
        value_bytes = GRID_RICE_HEAD.size + rice_bytes
    else:
        value_bytes = values_nbytes(dtype, count, value_coding)
    if pos + index_bytes + value_bytes > end:
        raise DecodeError(f"truncated input: tensor {name!r} needs {index_bytes} index bytes and "
                          f"{value_bytes} value bytes at offset {pos}, only {end - pos} left")
    record = TensorRecord(name, tuple(shape), numel, count, coding, dtype, pos, index_bytes,
                           pos + index_bytes, value_coding, value_bytes)
    return record, pos + index_bytes + value_bytes


def _read_records(data: memoryview, end: int, tensor_count: int,
                  max_numel: int | None) -> list[TensorRecord]:
    """Every tensor header, step by step: the reference reader, whose error is the one raised."""
    records = []
    seen: set[str] = set()
    pos = PREAMBLE.size
    for k in range(tensor_count):
        record, pos = _read_record(data, pos, end, k, max_numel, seen)
        records.append(record)
    check_end(data, pos, end)
    return records


def read_structure(data: memoryview, max_numel: int | None) -> tuple[int, list[TensorRecord]]:
    """The sequence and every tensor header, after the framing and the checksum are verified."""
    sequence, tensor_count, end = _read_preamble(data)
    records = _read_records(data, end, tensor_count, max_numel)
    check_crc(data, end)
    return sequence, records


def _decode(data: memoryview, max_numel: int | None,
            templates: list[Template] | None = None) -> SparseUpdate:
    # The fast readers return None on anything unusual; the reference ones then run on the same
    # bytes and raise the error (or decode a valid message the fast ones do not cover).
    sequence, tensor_count, end = _read_preamble(data)
    headers = layout = None
    if templates:
        for template in templates:
            headers = template.read(data, end, tensor_count)
            if headers is not None:
                layout = template.layout
                break
    if headers is None:
        headers = read_headers_fast(data, end, tensor_count, max_numel)
    if headers is None:
        records = _read_records(data, end, tensor_count, max_numel)
        check_crc(data, end)
        return SparseUpdate(decode_tensors(data, records), sequence)
    check_crc(data, end)
    packed = decode_packed(data, headers, layout)
    if packed is None:
        records = _read_records(data, end, tensor_count, max_numel)
        return SparseUpdate(decode_tensors(data, records), sequence)
    if templates is not None and layout is None and len(templates) < MAX_TEMPLATES:
        templates.append(Template(data, headers, packed.layout))
    return SparseUpdate.from_packed(packed, sequence)


def decode_tensors(data: memoryview, records: list[TensorRecord]) -> dict[str, SparseTensor]:
    """Every tensor, one after the other: the reference decoder, whose error is the one raised."""
    tensors = {}
    for r in records:
        if r.coding == ALL_ID:
            # An 'all' section allocates numel indices and cannot be wrong: decode the values
            # first, whose section bounds the count before anything count-sized is allocated
            # (a Rice-coded grid section's length does not fix its count: its decoder checks).
            values = decode_values(data, r)
            indices = torch.from_numpy(decode_indices(data, r))
        else:
            indices = torch.from_numpy(decode_indices(data, r))
            values = decode_values(data, r)
        tensors[r.name] = SparseTensor(indices, values, r.shape)
    return tensors


def tensor_codings(data: bytes | bytearray | memoryview) -> dict[str, str]:
    """The index coding each tensor of a message is stored with, by name, in message order.

    Reads only the headers (after verifying framing and checksum); a diagnostic for benchmarks,
    tests and other-language codecs. Raises :class:`~dgc.errors.DecodeError` like :func:`decode`.
    """
    view = as_view(data)
    try:
        _, records = read_structure(view, None)
    except (ValueError, TypeError, IndexError, OverflowError, struct.error) as e:
        if isinstance(e, DecodeError):
            raise
        raise DecodeError(f"malformed update: {type(e).__name__}: {e}") from e
    return {r.name: CODING_NAMES[r.coding] for r in records}


def _check_bound(max_numel: object) -> None:
    if isinstance(max_numel, bool) or not isinstance(max_numel, int) or max_numel < 0:
        raise ValueError(f"max_numel must be a non-negative int, got {max_numel!r}")


def max_numel_of(shapes: Iterable[Sequence[int]]) -> int:
    """The ``max_numel`` for messages about a model with these tensor shapes: its largest
    tensor's entries."""
    return max((math.prod(shape) for shape in shapes), default=0)


def max_numel_of_message(data: bytes | bytearray | memoryview) -> int:
    """The ``max_numel`` for messages about the model that ``data`` (an update message, such
    as a dense model) carries: its largest tensor's entries, read from the headers alone."""
    _, records = read_structure(as_view(data), None)
    return max_numel_of(r.shape for r in records)
