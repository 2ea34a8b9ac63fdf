package org.fedgc.wire;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collection;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;
import java.util.zip.CRC32;

/**
 * The compact update message ({@code FGCK}; {@code dgc.wire.compact}, docs/wire.md section 19):
 * an update about a model both ends hold, each tensor named by its place in the model's tensors
 * sorted by name (the {@link Layout}) and every length a LEB128 varint; what the server sends as
 * its patches under {@code downlink_compact}. Decoding only: phones send the update message.
 *
 * <pre>
 * "FGCK" | version u8 = 1 | layout digest u32 | sequence varint | tensor count varint
 *        | (place gap varint | count varint | index coding u8 | value dtype u8
 *           | index bytes varint | index section | value section) * count
 *        | crc32 u32
 * </pre>
 * The index and value sections are the update message's ({@link WireCodec}), byte for byte,
 * except a Rice-coded grid's head (value dtype 65, 66): {@code scale f32 | span varint | Rice
 * bytes varint}. Stateless and thread-safe.
 */
public final class CompactCodec {
    /** The magic, ASCII "FGCK". */
    public static final byte[] MAGIC = {'F', 'G', 'C', 'K'};
    /** The version this decoder reads. */
    public static final int VERSION = 1;

    private static final int PREAMBLE_BYTES = 9;
    private static final int CRC_BYTES = 4;
    private static final int MAX_VARINT_BYTES = 10;

    private CompactCodec() {
    }

    /**
     * A model's tensors as both ends list them ({@code dgc.wire.compact.layout_of}): names and
     * shapes sorted by name (by Unicode code point, as Python sorts strings). Immutable.
     */
    public static final class Layout {
        private final String[] names;
        private final long[][] shapes;
        private final long digest;

        private Layout(Map<String, long[]> sorted) {
            names = sorted.keySet().toArray(new String[0]);
            shapes = new long[names.length][];
            StringBuilder text = new StringBuilder();
            for (int i = 0; i < names.length; i++) {
                shapes[i] = sorted.get(names[i]).clone();
                text.append(names[i]).append(':');
                for (int d = 0; d < shapes[i].length; d++) {
                    text.append(d == 0 ? "" : ",").append(shapes[i][d]);
                }
                text.append(';');
            }
            CRC32 crc = new CRC32();
            crc.update(text.toString().getBytes(StandardCharsets.UTF_8));
            digest = crc.getValue();
        }

        /** The layout of a model of these tensor shapes ({@code layout_of}). */
        public static Layout of(Map<String, long[]> shapes) {
            Map<String, long[]> sorted = new TreeMap<>(CompactCodec::compareCodePoints);
            sorted.putAll(shapes);
            return new Layout(sorted);
        }

        /**
         * The layout of a compact patch ({@code fedgc.context_patch.patch_layout}) on a model of
         * {@code shapes} whose tensors {@code context} ({@code patch_context}) travel as segments
         * of their ranking: the model's tensors and, per context tensor, its segments
         * {@code NAME#j} of shape {@code (hi - lo,)} ({@link ContextPatch#cuts}).
         *
         * @throws IllegalArgumentException for a context tensor the model lacks
         */
        public static Layout patch(Map<String, long[]> shapes, Collection<String> context) {
            Map<String, long[]> out = new TreeMap<>(CompactCodec::compareCodePoints);
            out.putAll(shapes);
            for (String name : context) {
                long[] shape = shapes.get(name);
                if (shape == null) {
                    throw new IllegalArgumentException("patch_context names '" + name
                            + "', which the model lacks");
                }
                long[] bounds = ContextPatch.cuts(SparseTensor.numelOf(shape));
                for (int j = 0; j + 1 < bounds.length; j++) {
                    out.put(name + ContextPatch.SEPARATOR + j,
                            new long[]{bounds[j + 1] - bounds[j]});
                }
            }
            return new Layout(out);
        }

        /** How many tensors. */
        public int size() {
            return names.length;
        }

        /** The name of the tensor at {@code place}. */
        public String name(int place) {
            return names[place];
        }

        /** The shape of the tensor at {@code place} (a copy). */
        public long[] shape(int place) {
            return shapes[place].clone();
        }

        /** CRC-32 of {@code name:d0,d1,...;} per tensor, utf-8 ({@code layout_digest}). */
        public long digest() {
            return digest;
        }

        @Override
        public String toString() {
            List<String> parts = new ArrayList<>();
            for (int i = 0; i < names.length; i++) {
                parts.add(names[i] + Arrays.toString(shapes[i]));
            }
            return "Layout" + parts;
        }
    }

    /** Python's order of strings: by code point (Java's compareTo orders UTF-16 units). */
    static int compareCodePoints(String a, String b) {
        int i = 0;
        int j = 0;
        while (i < a.length() && j < b.length()) {
            int x = a.codePointAt(i);
            int y = b.codePointAt(j);
            if (x != y) {
                return Integer.compare(x, y);
            }
            i += Character.charCount(x);
            j += Character.charCount(y);
        }
        return Boolean.compare(i < a.length(), j < b.length());
    }

    /** Whether {@code data} starts with this kind's magic (a patch may be either message). */
    public static boolean isCompact(byte[] data) {
        return Frames.hasMagic(data, MAGIC);
    }

    /** A varint's value (unsigned 64 bits) and the offset after it. */
    private static final class Varint {
        final long value;
        final int next;

        Varint(long value, int next) {
            this.value = value;
            this.next = next;
        }
    }

    /** The canonical LEB128 varint at {@code pos}, no byte past {@code end}, at most a u64. */
    private static Varint varint(byte[] data, int pos, int end, String what)
            throws DecodeException {
        long value = 0;
        for (int i = 0; i < MAX_VARINT_BYTES; i++) {
            if (pos + i >= end) {
                throw Frames.truncated(what + " runs past the checksum at offset " + pos);
            }
            int b = data[pos + i] & 0xFF;
            value |= (long) (b & 0x7F) << (7 * i);
            if ((b & 0x80) == 0) {
                if (i > 0 && b == 0) {
                    throw new DecodeException(DecodeException.Reason.BAD_VARINT, what
                            + " at offset " + pos + " is not a canonical varint");
                }
                if (i == MAX_VARINT_BYTES - 1 && b > 1) {
                    throw new DecodeException(DecodeException.Reason.BAD_VARINT, what
                            + " at offset " + pos + " is above the u64 range");
                }
                return new Varint(value, pos + i + 1);
            }
        }
        throw new DecodeException(DecodeException.Reason.BAD_VARINT, what + " at offset " + pos
                + " is longer than " + MAX_VARINT_BYTES + " bytes");
    }

    /**
     * The update of a compact message about a model of {@code layout}, every tensor with its
     * layout shape, validated as {@code decode_compact} validates, in its order: length, magic,
     * version, checksum, the layout's digest, the tensor count, then per tensor its place, its
     * header, its values, its indices; nothing after the last.
     *
     * @param maxNumel refuse a layout tensor of more entries (the receiver's bound)
     * @throws DecodeException naming the first rule that fails: {@code WRONG_LAYOUT} (another
     *     model), {@code BAD_PLACE}, {@code BAD_VARINT}, and the update message's reasons
     */
    public static SparseUpdate decode(byte[] data, Layout layout, long maxNumel)
            throws DecodeException {
        ByteBuffer in = Frames.preamble(data, MAGIC, VERSION, PREAMBLE_BYTES + CRC_BYTES,
                "a message", "FGCK (a compact update)");
        long digest = in.getInt(5) & 0xFFFFFFFFL;
        int end = data.length - CRC_BYTES;
        Frames.checkCrc(in, data, end);
        if (digest != layout.digest()) {
            throw new DecodeException(DecodeException.Reason.WRONG_LAYOUT, String.format(
                    "a compact update about another model: layout digest 0x%08x, this model's "
                    + "is 0x%08x", digest, layout.digest()));
        }
        Varint v = varint(data, PREAMBLE_BYTES, end, "sequence");
        long sequence = v.value;
        v = varint(data, v.next, end, "tensor count");
        long count = v.value;
        int pos = v.next;
        if (Long.compareUnsigned(count, layout.size()) > 0) {
            throw new DecodeException(DecodeException.Reason.BAD_PLACE, Long.toUnsignedString(
                    count) + " tensors for a model of " + layout.size());
        }
        Map<String, SparseTensor> tensors = new LinkedHashMap<>();
        int place = -1;
        for (long t = 0; t < count; t++) {
            v = varint(data, pos, end, "tensor place");
            pos = v.next;
            if (Long.compareUnsigned(v.value, layout.size() - 1L - place) >= 0) {
                throw new DecodeException(DecodeException.Reason.BAD_PLACE, "tensor place "
                        + (place + 1) + " + " + Long.toUnsignedString(v.value) + " beyond the "
                        + "model's " + layout.size() + " tensors");
            }
            place += (int) v.value + 1;
            String name = layout.names[place];
            long[] shape = layout.shapes[place];
            long numel;
            try {
                numel = SparseTensor.numelOf(shape);
            } catch (IllegalArgumentException e) {
                numel = -1;  // beyond the format's 2^62
            }
            if (numel < 0 || numel > maxNumel) {
                throw new DecodeException(DecodeException.Reason.TOO_LARGE, "tensor '" + name
                        + "' of shape " + Arrays.toString(shape) + " has "
                        + (numel < 0 ? "more than 2^62" : Long.toString(numel))
                        + " entries, above max_numel=" + maxNumel);
            }
            WireCodec.Record r = new WireCodec.Record();
            byte[][] rebuilt = new byte[1][];
            pos = readTensor(data, pos, end, name, numel, shape, r, rebuilt);
            // Values first, as decode_compact: their section bounds the count before an 'all'
            // section allocates the tensor's entries. A Rice-coded grid's values are read from
            // its head rebuilt in the update message's form.
            WireCodec.Values values = WireCodec.values(rebuilt[0] != null ? rebuilt[0] : data, r);
            long[] indices = WireCodec.decodeIndices(data, r);
            tensors.put(name, values.wrap(r, indices));
        }
        if (pos != end) {
            throw new DecodeException(DecodeException.Reason.TRAILING, "trailing or oversized "
                    + "input: " + (end - pos) + " bytes after the last tensor");
        }
        return new SparseUpdate(tensors, sequence);
    }

    /**
     * The header of the tensor at {@code pos} into {@code r}, checked as {@code _read_tensor}
     * checks it, and the offset after the tensor; a Rice-coded grid's value section, its head
     * rebuilt in the update message's form, into {@code rebuilt[0]} ({@code r} then points
     * there).
     */
    private static int readTensor(byte[] data, int pos, int end, String name, long numel,
                                  long[] shape, WireCodec.Record r, byte[][] rebuilt)
            throws DecodeException {
        String what = "tensor '" + name + "'";
        Varint v = varint(data, pos, end, what + " count");
        long count = v.value;
        pos = v.next;
        if (pos + 2 > end) {
            throw Frames.truncated(what + " codings at offset " + pos);
        }
        int codingId = data[pos] & 0xFF;
        int dtypeId = data[pos + 1] & 0xFF;
        pos += 2;
        v = varint(data, pos, end, what + " index length");
        long indexBytes = v.value;
        pos = v.next;
        if (Long.compareUnsigned(count, numel) > 0) {
            throw new DecodeException(DecodeException.Reason.COUNT_ABOVE_NUMEL, what + " claims "
                    + Long.toUnsignedString(count) + " entries, above its numel " + numel);
        }
        IndexCoding coding = IndexCoding.fromWireId(codingId);
        if (coding == null) {
            throw new DecodeException(DecodeException.Reason.UNKNOWN_CODING, what
                    + " has unknown index coding id " + codingId + "; known: [0, 1, 2, 3]");
        }
        boolean gridRice = dtypeId == WireCodec.GRID_RICE_CODED
                || dtypeId == WireCodec.GRID_NONZERO_CODED;
        boolean grid = dtypeId == WireCodec.GRID_CODED || gridRice;
        boolean signed = !grid && (dtypeId & WireCodec.SIGN_CODED) != 0;
        ValueDtype dtype = grid ? ValueDtype.FLOAT32
                : ValueDtype.fromWireId(dtypeId & ~WireCodec.SIGN_CODED);
        if (dtype == null) {
            throw new DecodeException(DecodeException.Reason.UNKNOWN_DTYPE, what
                    + " has unknown value dtype id " + dtypeId);
        }
        if (coding == IndexCoding.ALL && (count != numel || indexBytes != 0)) {
            throw new DecodeException(DecodeException.Reason.BAD_INDEX_SECTION, what
                    + ": coding 'all' needs count == numel and no index bytes, got count "
                    + count + ", numel " + numel + ", " + Long.toUnsignedString(indexBytes)
                    + " index bytes");
        }
        if (Long.compareUnsigned(indexBytes, end - pos) > 0) {
            throw Frames.truncated(what + " needs " + Long.toUnsignedString(indexBytes)
                    + " index bytes at offset " + pos + ", only " + (end - pos) + " left");
        }
        int indexStart = pos;
        pos += (int) indexBytes;
        int valuesStart = pos;
        int valuesLength;
        int next;
        if (gridRice) {
            if (pos + 4 > end) {
                throw Frames.truncated(what + " grid scale at offset " + pos);
            }
            v = varint(data, pos + 4, end, what + " grid span");
            long span = v.value;
            v = varint(data, v.next, end, what + " grid length");
            long riceBytes = v.value;
            int at = v.next;
            if (Long.compareUnsigned(span, SparseTensor.MAX_NUMEL) > 0
                    || Long.compareUnsigned(riceBytes, end - at) > 0) {
                throw Frames.truncated(what + " needs " + Long.toUnsignedString(riceBytes)
                        + " grid bytes at offset " + at + ", only " + (end - at) + " left");
            }
            if (count > Integer.MAX_VALUE - 8) {  // past what the Rice bytes hold, in practice
                throw new DecodeException(DecodeException.Reason.BAD_VALUE_SECTION, what
                        + ": grid-coded values (Rice) claim " + count + " values, more than a "
                        + "Java array holds");
            }
            ByteBuffer head = ByteBuffer.allocate(WireCodec.GRID_RICE_HEAD + (int) riceBytes)
                    .order(ByteOrder.LITTLE_ENDIAN);
            head.put(data, pos, 4).putLong(span).putLong(riceBytes).put(data, at, (int) riceBytes);
            rebuilt[0] = head.array();
            valuesStart = 0;
            valuesLength = head.capacity();
            next = at + (int) riceBytes;
        } else {
            long left = end - pos;
            boolean fits = signed ? dtype.sizeBytes + (count + 7) / 8 <= left
                    : grid ? 4 + count <= left : count <= left / dtype.sizeBytes;
            if (!fits) {
                throw Frames.truncated(what + " needs the values of " + count + " entries at "
                        + "offset " + pos + ", only " + left + " left");
            }
            if (count > Integer.MAX_VALUE - 8) {  // sign bits fit, the decoded arrays would not
                throw new DecodeException(DecodeException.Reason.TOO_LARGE, what + " carries "
                        + count + " sign-coded values, more than a Java array holds");
            }
            valuesLength = (int) (signed ? dtype.sizeBytes + (count + 7) / 8
                    : grid ? 4 + count : count * dtype.sizeBytes);
            next = pos + valuesLength;
        }
        r.name = name;
        r.shape = shape.clone();
        r.numel = numel;
        r.count = (int) count;
        r.coding = coding;
        r.dtype = dtype;
        r.indexStart = indexStart;
        r.indexBytes = (int) indexBytes;
        r.valuesStart = valuesStart;
        r.signed = signed;
        r.grid = grid;
        r.gridRice = gridRice;
        r.gridNonzero = dtypeId == WireCodec.GRID_NONZERO_CODED;
        r.valuesLength = valuesLength;
        return next;
    }
}
