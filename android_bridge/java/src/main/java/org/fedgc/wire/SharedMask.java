package org.fedgc.wire;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.CharBuffer;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.CodingErrorAction;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.zip.CRC32;

/**
 * A round's shared index sets as the server sends them in a task's {@code shared_mask}
 * ({@code FGCM}; {@code dgc.signs.codec.encode_mask} and {@code decode_mask}, docs/wire.md
 * section 11): per tensor its set of entries, Golomb-Rice coded as an update's index section.
 *
 * <pre>
 * "FGCM" | version u8 = 1 | sequence u64 | count u32
 *        | (name_len u16 | name | numel u64 | k u64 | section_bytes u64 | Golomb-Rice section)
 *          * count
 *        | crc32 u32
 * </pre>
 * The other kind a {@code shared_mask} may be is a rank request ({@link RankRequest},
 * {@code FGCD}); {@link #isSharedMask} and {@link RankRequest#isRankRequest} tell them apart.
 * Immutable (the sets' arrays are the decoder's own: do not change them).
 */
public final class SharedMask {
    /** The magic, ASCII "FGCM". */
    public static final byte[] MAGIC = {'F', 'G', 'C', 'M'};
    /** The version this codec reads and writes. */
    public static final int VERSION = 1;

    private static final int PREAMBLE_BYTES = 17;
    private static final int CRC_BYTES = 4;
    /** numel, k, section bytes. */
    private static final int SET_HEADER_BYTES = 24;

    private final long sequence;
    private final Map<String, long[]> sets;

    private SharedMask(long sequence, Map<String, long[]> sets) {
        this.sequence = sequence;
        this.sets = Collections.unmodifiableMap(sets);
    }

    /** The round (unsigned 64 bits). */
    public long sequence() {
        return sequence;
    }

    /** Per tensor, in message order, its set: sorted, unique flat indices below its numel. */
    public Map<String, long[]> sets() {
        return sets;
    }

    /** Whether {@code data} starts with this kind's magic. */
    public static boolean isSharedMask(byte[] data) {
        return Frames.hasMagic(data, MAGIC);
    }

    /**
     * The sets {@code data} holds, checked in the order {@code decode_mask} checks: length,
     * magic, version, checksum, then each set (name, header, a name twice, the tensor and its
     * size against {@code numels}, the count and the section against the tensor and the
     * message, the section itself), nothing after the last.
     *
     * @param numels the model's tensors and their entries: every set must be one of them
     * @throws DecodeException naming the bad field: {@code BAD_INDEX_SET} for a set that does
     *     not fit the model or the message, the index sections' reasons
     *     ({@code BAD_INDEX_SECTION}, {@code INDEX_OUT_OF_RANGE}) for a section that is not a
     *     canonical Golomb-Rice coding of sorted indices below the tensor's numel
     */
    public static SharedMask decode(byte[] data, Map<String, Long> numels)
            throws DecodeException {
        ByteBuffer in = Frames.preamble(data, MAGIC, VERSION, PREAMBLE_BYTES + CRC_BYTES,
                "a message", "FGCM (shared index sets)");
        long sequence = in.getLong(5);
        long count = in.getInt(13) & 0xFFFFFFFFL;
        int end = data.length - CRC_BYTES;
        Frames.checkCrc(in, data, end);
        int pos = PREAMBLE_BYTES;
        Map<String, long[]> sets = new LinkedHashMap<>();
        for (long t = 0; t < count; t++) {
            Frames.need(pos, 2, end, "index set name length");
            int nameLen = in.getShort(pos) & 0xFFFF;
            pos += 2;
            Frames.need(pos, nameLen, end, "index set name");
            String name = Frames.name(data, pos, nameLen, "index set name");
            pos += nameLen;
            Frames.need(pos, SET_HEADER_BYTES, end, "index set header of '" + name + "'");
            long numel = in.getLong(pos);
            long k = in.getLong(pos + 8);
            long nbytes = in.getLong(pos + 16);
            pos += SET_HEADER_BYTES;
            if (sets.containsKey(name)) {
                throw new DecodeException(DecodeException.Reason.DUPLICATE_NAME, "index set of '"
                        + name + "' appears twice");
            }
            Long expected = numels.get(name);
            if (expected == null || expected != numel) {
                throw new DecodeException(DecodeException.Reason.BAD_INDEX_SET, "index set of '"
                        + name + "' is for " + Long.toUnsignedString(numel) + " entries, expected "
                        + expected);
            }
            if (Long.compareUnsigned(k, numel) > 0 || Long.compareUnsigned(nbytes, end - pos) > 0) {
                throw new DecodeException(DecodeException.Reason.BAD_INDEX_SET, "index set of '"
                        + name + "' claims " + Long.toUnsignedString(k) + " of " + numel
                        + " entries in " + Long.toUnsignedString(nbytes) + " bytes, past the end "
                        + "of the message");
            }
            if (k > Integer.MAX_VALUE - 8) {  // more codes than the section has bits, in practice
                throw new DecodeException(DecodeException.Reason.BAD_INDEX_SECTION, "index set of '"
                        + name + "': " + nbytes + " bytes cannot hold " + k + " codes (more "
                        + "indices than a Java array holds)");
            }
            try {
                sets.put(name, IndexSections.golombDecode(data, pos, (int) nbytes, (int) k, numel));
            } catch (DecodeException e) {
                throw new DecodeException(e.reason(), "index set of '" + name + "': "
                        + e.getMessage());
            }
            pos += (int) nbytes;
        }
        if (pos != end) {
            throw new DecodeException(DecodeException.Reason.TRAILING, "trailing or oversized "
                    + "input: " + (end - pos) + " bytes after the last index set");
        }
        return new SharedMask(sequence, sets);
    }

    /**
     * The bytes of these sets, byte for byte {@code encode_mask(sets, numels, sequence)}: each
     * set Golomb-Rice coded with the least-cost parameter, the sets in the map's order.
     *
     * @throws IllegalArgumentException for a set whose tensor {@code numels} lacks, indices not
     *     sorted and unique in [0, numel), or a name not valid Unicode or over 65535 utf-8 bytes
     */
    public static byte[] encode(Map<String, long[]> sets, Map<String, Long> numels,
                                long sequence) {
        List<byte[]> parts = new ArrayList<>();
        long total = PREAMBLE_BYTES + CRC_BYTES;
        for (Map.Entry<String, long[]> e : sets.entrySet()) {
            String name = e.getKey();
            long[] set = e.getValue();
            Long numel = numels.get(name);
            if (numel == null) {
                throw new IllegalArgumentException("index set of '" + name + "', a tensor the "
                        + "model lacks");
            }
            for (int j = 0; j < set.length; j++) {
                if (set[j] < (j == 0 ? 0 : set[j - 1] + 1) || set[j] >= numel) {
                    throw new IllegalArgumentException("index set of '" + name + "': index "
                            + set[j] + " at position " + j + " is not sorted, unique and in [0, "
                            + numel + ")");
                }
            }
            byte[] raw;
            try {  // strict, as Python's str.encode: no unpaired surrogate
                ByteBuffer b = StandardCharsets.UTF_8.newEncoder()
                        .onMalformedInput(CodingErrorAction.REPORT)
                        .onUnmappableCharacter(CodingErrorAction.REPORT)
                        .encode(CharBuffer.wrap(name));
                raw = new byte[b.remaining()];
                b.get(raw);
            } catch (CharacterCodingException ex) {
                throw new IllegalArgumentException("index set name '" + name + "' is not valid "
                        + "Unicode (unpaired surrogate)");
            }
            if (raw.length > 0xFFFF) {
                throw new IllegalArgumentException("index set name of " + raw.length
                        + " utf-8 bytes; the format allows 65535");
            }
            long[] gaps = IndexSections.gapsOf(set);
            byte[] section = IndexSections.golombEncode(gaps,
                    IndexSections.bestRiceParameter(gaps, numel));
            ByteBuffer head = ByteBuffer.allocate(2 + raw.length + SET_HEADER_BYTES)
                    .order(ByteOrder.LITTLE_ENDIAN);
            head.putShort((short) raw.length).put(raw).putLong(numel).putLong(set.length)
                    .putLong(section.length);
            parts.add(head.array());
            parts.add(section);
            total += head.capacity() + section.length;
        }
        ByteBuffer out = ByteBuffer.allocate(Math.toIntExact(total)).order(ByteOrder.LITTLE_ENDIAN);
        out.put(MAGIC).put((byte) VERSION).putLong(sequence).putInt(sets.size());
        for (byte[] part : parts) {
            out.put(part);
        }
        CRC32 crc = new CRC32();
        crc.update(out.array(), 0, out.position());
        out.putInt((int) crc.getValue());
        return out.array();
    }

    @Override
    public String toString() {
        StringBuilder sb = new StringBuilder("SharedMask(sequence=")
                .append(Long.toUnsignedString(sequence));
        for (Map.Entry<String, long[]> e : sets.entrySet()) {
            sb.append(", ").append(e.getKey()).append(": ").append(e.getValue().length);
        }
        return sb.append(")").toString();
    }
}
