package org.fedgc.wire;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.CharBuffer;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.CharsetDecoder;
import java.nio.charset.CharsetEncoder;
import java.nio.charset.CodingErrorAction;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.zip.CRC32;

/**
 * The fedgc wire format, version 1: a {@link SparseUpdate} to bytes and back, byte-identical to
 * the Python reference {@code dgc.encode} / {@code dgc.decode}.
 *
 * <p>{@link #decode} walks every header first (so a short or padded message is reported as
 * such and nothing is allocated for a length that is not present), then checks the CRC-32, then
 * decodes and validates each section; it throws {@link DecodeException} and nothing else for any
 * input. {@link #encode} refuses, with {@link EncodeException}, what a decoder would refuse.
 * The layout and every rule are in {@code android_bridge/WIRE_FORMAT.md}. Stateless and
 * thread-safe; uses only {@code java.util.zip.CRC32}, {@code java.nio} buffers and charsets,
 * which Android has.
 */
public final class WireCodec {
    /** The message magic, ASCII "FGCU". */
    public static final byte[] MAGIC = {'F', 'G', 'C', 'U'};
    /** The version this codec reads and writes. */
    public static final int VERSION = 1;
    /** Bytes of a message with no tensors: the 18-byte preamble and the 4-byte checksum. */
    public static final int EMPTY_MESSAGE_BYTES = 22;

    private static final int PREAMBLE_BYTES = 18;
    private static final int CRC_BYTES = 4;
    /** name_len + ndim + count + index_coding + value_dtype + index_bytes. */
    private static final int MIN_RECORD_BYTES = 2 + 1 + 8 + 1 + 1 + 8;
    /** Largest message a Java byte array can hold on every VM. */
    private static final long MAX_MESSAGE_BYTES = Integer.MAX_VALUE - 8;

    private WireCodec() {
    }

    // ------------------------------------------------------------------------------------------
    // Encoding
    // ------------------------------------------------------------------------------------------

    /** {@code encode(update, IndexCoding.AUTO)}: per tensor the smallest index section. */
    public static byte[] encode(SparseUpdate update) {
        return encode(update, IndexCoding.AUTO);
    }

    /**
     * The wire bytes of {@code update}, tensors in the map's order.
     *
     * @param coding {@link IndexCoding#AUTO} (per tensor the smallest of the codings that can
     *     carry it, ties to all, golomb, bitmap, raw in that order), or one coding for every tensor
     * @throws EncodeException for unsorted, repeated or out-of-range indices, NaN or infinite
     *     values, a name that is not valid Unicode or over 65535 UTF-8 bytes, {@code ALL} on a
     *     sparse tensor, {@code RAW} beyond 2^32 entries, or a message too large for a byte array
     */
    public static byte[] encode(SparseUpdate update, IndexCoding coding) {
        return encode(update, coding, false);
    }

    /**
     * The wire bytes of {@code update}; with {@code gridCoding}, a float32 tensor whose values
     * all sit on a power-of-two int8 grid (at least two of them) goes grid-coded (value dtype
     * 64, or 65 when its Rice-coded section is smaller; WIRE_FORMAT.md section 5), byte for byte
     * {@code dgc.encode(update, index_coding, grid_coding=True)}: what a phone sends under
     * {@code dgc.value_levels} and {@code dgc.shared_values = grid}.
     *
     * @throws EncodeException as {@link #encode(SparseUpdate, IndexCoding)}
     */
    public static byte[] encode(SparseUpdate update, IndexCoding coding, boolean gridCoding) {
        if (update == null || coding == null) {
            throw new EncodeException("encode takes a SparseUpdate and an IndexCoding, got null");
        }
        List<byte[]> names = new ArrayList<>();
        List<byte[]> sections = new ArrayList<>();
        List<IndexCoding> codings = new ArrayList<>();
        List<GridValues.Section> grids = new ArrayList<>();
        long total = EMPTY_MESSAGE_BYTES;
        CharsetEncoder utf8 = StandardCharsets.UTF_8.newEncoder()
                .onMalformedInput(CodingErrorAction.REPORT)
                .onUnmappableCharacter(CodingErrorAction.REPORT);
        for (Map.Entry<String, SparseTensor> e : update.tensors().entrySet()) {
            String name = e.getKey();
            SparseTensor t = e.getValue();
            byte[] nameUtf8 = encodeName(utf8, name);
            long[] indices = checkTensor(name, t);
            IndexCoding chosen;
            byte[] section;
            if (coding == IndexCoding.AUTO) {
                Choice c = chooseAuto(indices, t.numel());
                chosen = c.coding;
                section = encodeIndices(name, indices, t.numel(), chosen, c.riceParameter);
            } else {
                checkExplicit(name, t, coding);
                chosen = coding;
                section = encodeIndices(name, indices, t.numel(), chosen, -1);
            }
            names.add(nameUtf8);
            sections.add(section);
            codings.add(chosen);
            GridValues.Section grid = gridCoding && t.dtype() == ValueDtype.FLOAT32
                    ? GridValues.section(t.float32Bits()) : null;
            grids.add(grid);
            total += 2 + nameUtf8.length + 1 + 8L * t.shape().length + 18 + section.length
                    + (grid != null ? grid.bytes.length : (long) t.nnz() * t.dtype().sizeBytes);
            if (total > MAX_MESSAGE_BYTES) {
                throw new EncodeException("update needs more than " + MAX_MESSAGE_BYTES
                        + " bytes (at tensor '" + name + "'), beyond a Java byte array");
            }
        }
        ByteBuffer out = ByteBuffer.allocate((int) total).order(ByteOrder.LITTLE_ENDIAN);
        out.put(MAGIC).put((byte) VERSION).put((byte) 0).putLong(update.sequence())
                .putInt(update.tensors().size());
        int k = 0;
        for (SparseTensor t : update.tensors().values()) {
            byte[] nameUtf8 = names.get(k);
            byte[] section = sections.get(k);
            long[] shape = t.shape();
            out.putShort((short) nameUtf8.length).put(nameUtf8).put((byte) shape.length);
            for (long d : shape) {
                out.putLong(d);
            }
            GridValues.Section grid = grids.get(k);
            out.putLong(t.nnz()).put((byte) codings.get(k).wireId)
                    .put((byte) (grid != null ? grid.dtypeId : t.dtype().wireId))
                    .putLong(section.length).put(section);
            if (grid != null) {
                out.put(grid.bytes);
                k++;
                continue;
            }
            for (int i = 0; i < t.nnz(); i++) {
                if (t.dtype() == ValueDtype.FLOAT32) {
                    out.putInt(t.rawBits(i));
                } else {
                    out.putShort((short) t.rawBits(i));
                }
            }
            k++;
        }
        CRC32 crc = new CRC32();
        crc.update(out.array(), 0, out.position());
        out.putInt((int) crc.getValue());
        return out.array();
    }

    /** The UTF-8 bytes of a tensor name, refusing unpaired surrogates and over-long names. */
    private static byte[] encodeName(CharsetEncoder utf8, String name) {
        byte[] bytes;
        try {
            ByteBuffer b = utf8.reset().encode(CharBuffer.wrap(name));
            bytes = new byte[b.remaining()];
            b.get(bytes);
        } catch (CharacterCodingException ex) {
            throw new EncodeException("tensor name '" + name + "' is not valid Unicode (unpaired"
                    + " surrogate); names are carried as UTF-8");
        }
        if (bytes.length > 0xFFFF) {
            throw new EncodeException("tensor name of " + bytes.length
                    + " utf-8 bytes; the format allows 65535");
        }
        return bytes;
    }

    /** The tensor's indices after checking what a decoder would check. */
    private static long[] checkTensor(String name, SparseTensor t) {
        long[] indices = t.indices();
        long numel = t.numel();
        for (int j = 1; j < indices.length; j++) {
            if (indices[j] <= indices[j - 1]) {
                throw new EncodeException("tensor '" + name + "': index " + indices[j]
                        + " at position " + j + " does not increase on " + indices[j - 1]
                        + "; indices must be sorted and unique");
            }
        }
        if (indices.length > 0 && (indices[0] < 0 || indices[indices.length - 1] >= numel)) {
            throw new EncodeException("tensor '" + name + "': indices span [" + indices[0] + ", "
                    + indices[indices.length - 1] + "], outside [0, " + numel + ") for shape "
                    + java.util.Arrays.toString(t.shape()));
        }
        for (int i = 0; i < t.nnz(); i++) {
            if (!t.dtype().isFinite(t.rawBits(i))) {
                throw new EncodeException("tensor '" + name + "' value " + i + " is NaN or Inf"
                        + " (raw bits 0x" + Integer.toHexString(t.rawBits(i))
                        + "); the format only carries finite values");
            }
        }
        return indices;
    }

    private static void checkExplicit(String name, SparseTensor t, IndexCoding coding) {
        if (coding == IndexCoding.ALL && t.nnz() != t.numel()) {
            throw new EncodeException("tensor '" + name + "': index coding ALL needs every entry,"
                    + " got " + t.nnz() + " of " + t.numel());
        }
        if (coding == IndexCoding.RAW && t.numel() > (1L << 32)) {
            throw new EncodeException("tensor '" + name + "': index coding RAW carries u32"
                    + " indices, the tensor has " + t.numel() + " entries");
        }
    }

    /** An index coding and, for Golomb-Rice, the parameter already computed. */
    private static final class Choice {
        final IndexCoding coding;
        final int riceParameter;

        Choice(IndexCoding coding, int riceParameter) {
            this.coding = coding;
            this.riceParameter = riceParameter;
        }
    }

    /**
     * The auto choice: ALL when every entry is carried, otherwise the smallest section of
     * GOLOMB, BITMAP, RAW (RAW only up to 2^32 entries); ties go to the first in that order.
     */
    private static Choice chooseAuto(long[] indices, long numel) {
        if (indices.length == numel) {
            return new Choice(IndexCoding.ALL, -1);
        }
        long[] gaps = IndexSections.gapsOf(indices);
        int b = IndexSections.bestRiceParameter(gaps, numel);
        IndexCoding best = IndexCoding.GOLOMB;
        long bestBytes = IndexSections.golombSectionBytes(gaps, b);
        long bitmapBytes = IndexSections.bitmapBytes(numel);
        if (bitmapBytes < bestBytes) {
            best = IndexCoding.BITMAP;
            bestBytes = bitmapBytes;
        }
        if (numel <= (1L << 32) && 4L * indices.length < bestBytes) {
            best = IndexCoding.RAW;
        }
        return new Choice(best, b);
    }

    private static byte[] encodeIndices(String name, long[] indices, long numel,
                                        IndexCoding coding, int riceParameter) {
        long bytes;
        switch (coding) {
            case ALL:
                return new byte[0];
            case RAW:
                bytes = 4L * indices.length;
                break;
            case BITMAP:
                bytes = IndexSections.bitmapBytes(numel);
                break;
            default:
                bytes = -1; // computed below, once b is known
        }
        if (bytes > MAX_MESSAGE_BYTES) {
            throw new EncodeException("tensor '" + name + "': a " + coding + " index section of "
                    + bytes + " bytes does not fit a Java byte array");
        }
        if (coding == IndexCoding.RAW) {
            return IndexSections.rawEncode(indices);
        }
        if (coding == IndexCoding.BITMAP) {
            return IndexSections.bitmapEncode(indices, numel);
        }
        long[] gaps = IndexSections.gapsOf(indices);
        int b = riceParameter >= 0 ? riceParameter : IndexSections.bestRiceParameter(gaps, numel);
        long golombBytes = IndexSections.golombSectionBytes(gaps, b);
        if (golombBytes > MAX_MESSAGE_BYTES) {
            throw new EncodeException("tensor '" + name + "': a GOLOMB index section of "
                    + golombBytes + " bytes does not fit a Java byte array");
        }
        return IndexSections.golombEncode(gaps, b);
    }

    // ------------------------------------------------------------------------------------------
    // Decoding
    // ------------------------------------------------------------------------------------------

    /** One tensor's header, and where its sections lie, from the structural pass (also built
     *  by {@link CompactCodec} for a compact message's tensors). */
    static final class Record {
        String name;
        long[] shape;
        long numel;
        int count;
        IndexCoding coding;
        ValueDtype dtype;
        int indexStart;
        int indexBytes;
        int valuesStart;
        /** Sign-coded values: the scale, then one sign bit per value (value dtype 128 + id). */
        boolean signed;
        /** Grid-coded values: a power-of-two float32 scale, then one int8 per value (id 64),
         * or the int8s Rice-coded (id 65). */
        boolean grid;
        boolean gridRice;
        /** A Rice-coded grid of values none of which is zero (id 66): q folded without a 0. */
        boolean gridNonzero;
        int valuesLength;
    }

    /** Set in the value dtype byte of a sign-coded tensor (docs/wire.md, section 5). */
    public static final int SIGN_CODED = 0x80;

    /** The value dtype id of a grid-coded float32 tensor (docs/wire.md, section 5). */
    public static final int GRID_CODED = 0x40;

    /** The value dtype id of a grid-coded tensor whose int8s are Rice-coded (section 5). */
    public static final int GRID_RICE_CODED = 0x41;

    /** The value dtype id of a Rice-coded grid whose values are none of them zero, folded
     *  without a code for 0 (docs/wire.md, section 5; {@code nonzero_grid}). */
    public static final int GRID_NONZERO_CODED = 0x42;

    /** Scale (f32), span (u64) and Golomb-Rice bytes (u64) before a Rice-coded grid section. */
    static final int GRID_RICE_HEAD = 20;

    /** {@code decode(data, Long.MAX_VALUE)}: any numel the format allows (up to 2^62). */
    public static SparseUpdate decode(byte[] data) throws DecodeException {
        return decode(data, Long.MAX_VALUE);
    }

    /**
     * The update carried by {@code data}, validated; {@code data} must be exactly one message.
     *
     * @param maxNumel the largest tensor (in entries) the caller accepts; a receiver that
     *     densifies updates bounds what it will have to allocate with it
     * @throws DecodeException with the {@link DecodeException.Reason} of the first rule that
     *     fails, in the order of WIRE_FORMAT.md section 6
     */
    public static SparseUpdate decode(byte[] data, long maxNumel) throws DecodeException {
        Structure s = readStructure(data, maxNumel);
        Map<String, SparseTensor> tensors = new LinkedHashMap<>();
        for (Record r : s.records) {
            long[] indices = decodeIndices(data, r);
            tensors.put(r.name, values(data, r).wrap(r, indices));
        }
        return new SparseUpdate(tensors, s.sequence);
    }

    /** A tensor's values as raw bits: float32's, or float16's and bfloat16's. */
    static final class Values {
        final int[] bits32;
        final short[] bits16;

        Values(int[] bits32, short[] bits16) {
            this.bits32 = bits32;
            this.bits16 = bits16;
        }

        SparseTensor wrap(Record r, long[] indices) {
            return SparseTensor.wrap(r.shape, indices, r.grid ? ValueDtype.FLOAT32 : r.dtype,
                    bits32, bits16);
        }
    }

    /**
     * The values of the tensor of {@code r}, checked as {@code decode_values} checks them: plain
     * (finite), sign-coded or grid-coded (canonical).
     */
    static Values values(byte[] data, Record r) throws DecodeException {
        if (r.signed) {
            return decodeSigns(data, r);
        }
        if (r.grid) {
            return new Values(decodeGrid(data, r), null);
        }
        int[] bits32 = null;
        short[] bits16 = null;
        ByteBuffer values = ByteBuffer.wrap(data, r.valuesStart, r.count * r.dtype.sizeBytes)
                .order(ByteOrder.LITTLE_ENDIAN);
        if (r.dtype == ValueDtype.FLOAT32) {
            bits32 = new int[r.count];
            values.asIntBuffer().get(bits32);
        } else {
            bits16 = new short[r.count];
            values.asShortBuffer().get(bits16);
        }
        for (int i = 0; i < r.count; i++) {
            int raw = bits32 != null ? bits32[i] : bits16[i] & 0xFFFF;
            if (!r.dtype.isFinite(raw)) {
                throw new DecodeException(DecodeException.Reason.NON_FINITE_VALUE, "tensor '"
                        + r.name + "': value " + i + " is NaN or Inf (raw bits 0x"
                        + Integer.toHexString(raw) + "); only finite values are valid");
            }
        }
        return new Values(bits32, bits16);
    }

    /**
     * A grid-coded tensor: value {@code j} is {@code q_j * scale} (exact in float32), with
     * {@code q_j} the j-th signed byte. Rejects a scale that is not 2^e, e in [-126, 120].
     */
    private static int[] decodeGrid(byte[] data, Record r) throws DecodeException {
        int scaleBits = ByteBuffer.wrap(data).order(ByteOrder.LITTLE_ENDIAN).getInt(r.valuesStart);
        int exponent = (scaleBits >>> 23) & 0xFF;  // biased: 2^e has exponent e + 127
        if ((scaleBits & 0x807FFFFF) != 0 || exponent < 1 || exponent > 127 + 120) {
            throw new DecodeException(DecodeException.Reason.BAD_VALUE_SECTION, "tensor '"
                    + r.name + "': grid-coded scale " + Float.intBitsToFloat(scaleBits)
                    + " is not a power of two 2**e with e in [-126, 120]");
        }
        float scale = Float.intBitsToFloat(scaleBits);
        int[] q = new int[r.count];
        if (r.gridRice) {
            riceGrid(data, r, q);
        } else {
            for (int i = 0; i < r.count; i++) {
                q[i] = data[r.valuesStart + 4 + i];
            }
        }
        int[] bits32 = new int[r.count];
        for (int i = 0; i < r.count; i++) {
            // exact: |q| <= 128 and a power-of-two scale; q = 0 gives +0.0f (scale > 0)
            bits32[i] = Float.floatToRawIntBits(q[i] * scale);
        }
        return bits32;
    }

    /**
     * The int8s of a Rice-coded grid section into {@code q}: the zigzagged values are the gaps
     * of a Golomb-Rice section over a span of at most 256 per value, which must end exactly at
     * its last position; each gap at most 255.
     */
    private static void riceGrid(byte[] data, Record r, int[] q) throws DecodeException {
        ByteBuffer in = ByteBuffer.wrap(data).order(ByteOrder.LITTLE_ENDIAN);
        long span = in.getLong(r.valuesStart + 4);
        if (Long.compareUnsigned(span, Math.min(256L * r.count, SparseTensor.MAX_NUMEL)) > 0) {
            throw new DecodeException(DecodeException.Reason.BAD_VALUE_SECTION, "tensor '"
                    + r.name + "': grid-coded values (Rice) claim a span of "
                    + Long.toUnsignedString(span) + ", above 256 per value");
        }
        long[] positions;
        try {
            positions = IndexSections.golombDecode(data, r.valuesStart + GRID_RICE_HEAD,
                    r.valuesLength - GRID_RICE_HEAD, r.count, span);
        } catch (DecodeException e) {
            throw new DecodeException(DecodeException.Reason.BAD_VALUE_SECTION, "tensor '"
                    + r.name + "': grid-coded values (Rice): " + e.getMessage());
        }
        long previous = -1;
        long maxZ = 0;
        boolean canonical = (r.count == 0 ? 0 : positions[r.count - 1] + 1) == span;
        for (int i = 0; i < r.count && canonical; i++) {
            long z = positions[i] - previous - 1;
            previous = positions[i];
            canonical = z <= 255;
            // un-zigzag (0, -1, 1 <- 0, 1, 2), or un-fold without a 0 (1, -1, 2 <- 0, 1, 2)
            q[i] = r.gridNonzero ? ((z & 1) != 0 ? (int) -(z >>> 1) - 1 : (int) (z >>> 1) + 1)
                    : (int) ((z >>> 1) ^ -(z & 1));
            maxZ = Math.max(maxZ, z);
        }
        if (!canonical) {
            throw new DecodeException(DecodeException.Reason.BAD_VALUE_SECTION, "tensor '"
                    + r.name + "': grid-coded values (Rice) are not canonical: a span other "
                    + "than the gaps' or a value beyond int8");
        }
        if (r.gridNonzero && maxZ > 253) {
            throw new DecodeException(DecodeException.Reason.BAD_VALUE_SECTION, "tensor '"
                    + r.name + "': grid-coded non-zero values (Rice) hold a folded value "
                    + maxZ + " above 253 (|q| <= 127)");
        }
    }

    /**
     * A sign-coded tensor: every value is the scale with its sign bit set or not. Rejects a
     * scale that is NaN, infinite, zero or negative, and nonzero padding after the last sign.
     */
    private static Values decodeSigns(byte[] data, Record r) throws DecodeException {
        ByteBuffer in = ByteBuffer.wrap(data).order(ByteOrder.LITTLE_ENDIAN);
        boolean wide = r.dtype == ValueDtype.FLOAT32;
        int scale = wide ? in.getInt(r.valuesStart) : in.getShort(r.valuesStart) & 0xFFFF;
        int signBit = wide ? 0x80000000 : 0x8000;
        if (!r.dtype.isFinite(scale)) {
            throw new DecodeException(DecodeException.Reason.NON_FINITE_VALUE, "tensor '"
                    + r.name + "': sign-coded scale is NaN or Inf (raw bits 0x"
                    + Integer.toHexString(scale) + "); only finite values are valid");
        }
        if ((scale & signBit) != 0 || scale == 0) {
            throw new DecodeException(DecodeException.Reason.BAD_VALUE_SECTION, "tensor '"
                    + r.name + "': sign-coded scale must be above zero, got raw bits 0x"
                    + Integer.toHexString(scale));
        }
        int signs = r.valuesStart + r.dtype.sizeBytes;
        int tail = r.count % 8;
        if (tail != 0 && ((data[signs + r.count / 8] & 0xFF) >>> tail) != 0) {
            throw new DecodeException(DecodeException.Reason.BAD_VALUE_SECTION, "tensor '"
                    + r.name + "': nonzero padding after the last sign bit");
        }
        int[] bits32 = wide ? new int[r.count] : null;
        short[] bits16 = wide ? null : new short[r.count];
        for (int i = 0; i < r.count; i++) {
            boolean negative = ((data[signs + (i >>> 3)] >>> (i & 7)) & 1) != 0;
            int raw = negative ? scale | signBit : scale;
            if (wide) {
                bits32[i] = raw;
            } else {
                bits16[i] = (short) raw;
            }
        }
        return new Values(bits32, bits16);
    }

    /**
     * The index coding each tensor is stored with, by name, in message order. Reads only the
     * headers (after verifying framing and checksum), like Python's {@code tensor_codings}.
     */
    public static Map<String, IndexCoding> tensorCodings(byte[] data) throws DecodeException {
        Map<String, IndexCoding> out = new LinkedHashMap<>();
        for (Record r : readStructure(data, Long.MAX_VALUE).records) {
            out.put(r.name, r.coding);
        }
        return out;
    }

    private static final class Structure {
        long sequence;
        List<Record> records = new ArrayList<>();
    }

    private static Structure readStructure(byte[] data, long maxNumel) throws DecodeException {
        if (data == null) {
            throw new DecodeException(DecodeException.Reason.TRUNCATED, "decode takes a byte[],"
                    + " got null");
        }
        int size = data.length;
        if (size < EMPTY_MESSAGE_BYTES) {
            throw truncated(size + " bytes, a message has at least " + EMPTY_MESSAGE_BYTES);
        }
        ByteBuffer in = ByteBuffer.wrap(data).order(ByteOrder.LITTLE_ENDIAN);
        for (int i = 0; i < MAGIC.length; i++) {
            if (data[i] != MAGIC[i]) {
                throw new DecodeException(DecodeException.Reason.BAD_MAGIC, "bad magic "
                        + hex(data, 0, 4) + ", expected 46474355 (\"FGCU\")");
            }
        }
        int version = data[4] & 0xFF;
        if (version != VERSION) {
            throw new DecodeException(DecodeException.Reason.UNSUPPORTED_VERSION,
                    "unsupported version " + version + ", this decoder reads " + VERSION);
        }
        int flags = data[5] & 0xFF;
        if (flags != 0) {
            throw new DecodeException(DecodeException.Reason.UNSUPPORTED_FLAGS,
                    "unsupported flags 0x" + Integer.toHexString(flags) + " for version "
                    + VERSION + " (must be 0)");
        }
        Structure s = new Structure();
        s.sequence = in.getLong(6);
        long tensorCount = in.getInt(14) & 0xFFFFFFFFL;
        int end = size - CRC_BYTES;
        if (tensorCount * MIN_RECORD_BYTES > end - PREAMBLE_BYTES) {
            throw truncated(tensorCount + " tensors cannot fit in " + (end - PREAMBLE_BYTES)
                    + " bytes");
        }
        CharsetDecoder utf8 = StandardCharsets.UTF_8.newDecoder()
                .onMalformedInput(CodingErrorAction.REPORT)
                .onUnmappableCharacter(CodingErrorAction.REPORT);
        Set<String> seen = new HashSet<>();
        int pos = PREAMBLE_BYTES;
        for (int k = 0; k < tensorCount; k++) {
            Record r = new Record();
            pos = readRecord(in, pos, end, k, maxNumel, seen, utf8, r);
            s.records.add(r);
        }
        if (pos != end) {
            throw new DecodeException(DecodeException.Reason.TRAILING, "trailing or oversized"
                    + " input: " + (end - pos) + " bytes after the last tensor (message is "
                    + size + " bytes, its tensors end at " + (pos + CRC_BYTES) + ")");
        }
        long stored = in.getInt(end) & 0xFFFFFFFFL;
        CRC32 crc = new CRC32();
        crc.update(data, 0, end);
        if (stored != crc.getValue()) {
            throw new DecodeException(DecodeException.Reason.BAD_CHECKSUM, String.format(
                    "bad checksum: stored 0x%08x, computed 0x%08x", stored, crc.getValue()));
        }
        return s;
    }

    private static int readRecord(ByteBuffer in, int pos, int end, int k, long maxNumel,
                                  Set<String> seen, CharsetDecoder utf8, Record r)
            throws DecodeException {
        need(pos, 2, end, "tensor " + k + " name length");
        int nameLen = in.getShort(pos) & 0xFFFF;
        pos += 2;
        if ((long) pos + nameLen > end) {
            throw truncated("tensor " + k + " name of " + nameLen + " bytes at offset " + pos);
        }
        String name;
        try {
            name = utf8.reset().decode(ByteBuffer.wrap(in.array(), pos, nameLen)).toString();
        } catch (CharacterCodingException ex) {
            throw new DecodeException(DecodeException.Reason.BAD_UTF8, "tensor " + k
                    + " name is not valid utf-8: " + hex(in.array(), pos, nameLen));
        }
        pos += nameLen;
        if (!seen.add(name)) {
            throw new DecodeException(DecodeException.Reason.DUPLICATE_NAME,
                    "duplicate tensor name '" + name + "' (tensor " + k + ")");
        }
        need(pos, 1, end, "tensor '" + name + "' ndim");
        int ndim = in.get(pos) & 0xFF;
        pos += 1;
        long[] shape = new long[ndim];
        boolean zero = false;
        boolean over = false;
        long numel = 1;
        for (int d = 0; d < ndim; d++) {
            need(pos, 8, end, "tensor '" + name + "' dims");
            long dim = in.getLong(pos);
            pos += 8;
            if (Long.compareUnsigned(dim, SparseTensor.MAX_NUMEL) > 0) {
                throw new DecodeException(DecodeException.Reason.TOO_LARGE, "tensor '" + name
                        + "' has dim " + Long.toUnsignedString(dim)
                        + ", above the format's limit 2^62");
            }
            shape[d] = dim;
            // The exact product is what counts: a zero dim makes it 0 whatever came before.
            if (dim == 0) {
                zero = true;
            } else if (!over) {
                // Exact for positive operands, and needs no Math.multiplyHigh (Android API 31+).
                over = numel > SparseTensor.MAX_NUMEL / dim;
                numel *= dim;
            }
        }
        if (zero) {
            numel = 0;
        } else if (over) {
            throw new DecodeException(DecodeException.Reason.TOO_LARGE, "tensor '" + name
                    + "' shape " + java.util.Arrays.toString(shape)
                    + " has more than 2^62 entries, the format's limit");
        }
        if (numel > maxNumel) {
            throw new DecodeException(DecodeException.Reason.TOO_LARGE, "tensor '" + name
                    + "' shape " + java.util.Arrays.toString(shape) + " has " + numel
                    + " entries, above maxNumel=" + maxNumel);
        }
        need(pos, 18, end, "tensor '" + name + "' count/coding/dtype/length");
        long count = in.getLong(pos);
        int codingId = in.get(pos + 8) & 0xFF;
        int dtypeId = in.get(pos + 9) & 0xFF;
        long indexBytes = in.getLong(pos + 10);
        pos += 18;
        if (Long.compareUnsigned(count, numel) > 0) {
            throw new DecodeException(DecodeException.Reason.COUNT_ABOVE_NUMEL, "tensor '" + name
                    + "' claims " + Long.toUnsignedString(count) + " entries, above its numel "
                    + numel);
        }
        IndexCoding coding = IndexCoding.fromWireId(codingId);
        if (coding == null) {
            throw new DecodeException(DecodeException.Reason.UNKNOWN_CODING, "tensor '" + name
                    + "' has unknown index coding id " + codingId + "; known: [0, 1, 2, 3]");
        }
        boolean gridRice = dtypeId == GRID_RICE_CODED || dtypeId == GRID_NONZERO_CODED;
        boolean grid = dtypeId == GRID_CODED || gridRice;
        boolean signed = (dtypeId & SIGN_CODED) != 0;
        ValueDtype dtype = grid ? ValueDtype.FLOAT32 : ValueDtype.fromWireId(dtypeId & ~SIGN_CODED);
        if (dtype == null) {
            throw new DecodeException(DecodeException.Reason.UNKNOWN_DTYPE, "tensor '" + name
                    + "' has unknown value dtype id " + dtypeId + "; known: [0, 1, 2], "
                    + "sign-coded [128, 129, 130] and grid-coded [64, 65, 66]");
        }
        if (coding == IndexCoding.ALL && (count != numel || indexBytes != 0)) {
            throw new DecodeException(DecodeException.Reason.BAD_INDEX_SECTION, "tensor '" + name
                    + "': coding 'all' needs count == numel and no index bytes, got count "
                    + count + ", numel " + numel + ", " + Long.toUnsignedString(indexBytes)
                    + " index bytes");
        }
        // Compared without forming index_bytes + count * size, which could overflow a long
        // (count <= numel <= 2^62, so the sign- and grid-coded lengths cannot).
        long left = end - pos;
        long riceBytes = 0;
        if (gridRice && Long.compareUnsigned(indexBytes, left) <= 0
                && left - indexBytes >= GRID_RICE_HEAD) {
            riceBytes = in.getLong(pos + (int) indexBytes + 12);  // `in` is little-endian
        }
        if (Long.compareUnsigned(indexBytes, left) > 0
                || (signed ? dtype.sizeBytes + (count + 7) / 8 > left - indexBytes
                    : gridRice ? left - indexBytes < GRID_RICE_HEAD || Long.compareUnsigned(
                            riceBytes, left - indexBytes - GRID_RICE_HEAD) > 0
                    : grid ? 4 + count > left - indexBytes
                           : count > (left - indexBytes) / dtype.sizeBytes)) {
            throw truncated("tensor '" + name + "' needs " + Long.toUnsignedString(indexBytes)
                    + " index bytes and " + count + (signed ? " sign-coded values"
                    : grid ? " grid-coded values" : " values of " + dtype.sizeBytes + " bytes")
                    + " at offset " + pos + ", only " + left + " left");
        }
        if (count > Integer.MAX_VALUE - 8) {  // sign bits fit, the decoded arrays would not
            throw new DecodeException(DecodeException.Reason.TOO_LARGE, "tensor '" + name
                    + "' carries " + count + " sign-coded values, more than a Java array holds");
        }
        r.name = name;
        r.shape = shape;
        r.numel = numel;
        r.count = (int) count; // plain: count * size <= left < 2^31; sign-coded: checked above
        r.coding = coding;
        r.dtype = dtype;
        r.indexStart = pos;
        r.indexBytes = (int) indexBytes;
        r.valuesStart = pos + (int) indexBytes;
        r.signed = signed;
        r.grid = grid;
        r.gridRice = gridRice;
        r.gridNonzero = dtypeId == GRID_NONZERO_CODED;
        r.valuesLength = signed ? dtype.sizeBytes + (r.count + 7) / 8
                : gridRice ? GRID_RICE_HEAD + (int) riceBytes
                : grid ? 4 + r.count : r.count * dtype.sizeBytes;
        return r.valuesStart + r.valuesLength;
    }

    static long[] decodeIndices(byte[] data, Record r) throws DecodeException {
        try {
            switch (r.coding) {
                case ALL: {
                    long[] all = new long[r.count];
                    for (int i = 0; i < all.length; i++) {
                        all[i] = i;
                    }
                    return all;
                }
                case RAW:
                    return IndexSections.rawDecode(data, r.indexStart, r.indexBytes, r.count,
                            r.numel);
                case BITMAP:
                    return IndexSections.bitmapDecode(data, r.indexStart, r.indexBytes, r.count,
                            r.numel);
                default:
                    return IndexSections.golombDecode(data, r.indexStart, r.indexBytes, r.count,
                            r.numel);
            }
        } catch (DecodeException e) {
            throw new DecodeException(e.reason(), "tensor '" + r.name + "' ("
                    + r.coding.pythonName() + " indices): " + e.getMessage());
        }
    }

    private static void need(int pos, int bytes, int end, String what) throws DecodeException {
        if ((long) pos + bytes > end) {
            throw truncated(what + " needs " + bytes + " bytes at offset " + pos + ", only "
                    + Math.max(end - pos, 0) + " left before the checksum");
        }
    }

    private static DecodeException truncated(String detail) {
        return new DecodeException(DecodeException.Reason.TRUNCATED, "truncated input: " + detail);
    }

    private static String hex(byte[] data, int start, int length) {
        StringBuilder sb = new StringBuilder();
        for (int i = start; i < start + length; i++) {
            sb.append(String.format("%02x", data[i] & 0xFF));
        }
        return sb.toString();
    }
}
