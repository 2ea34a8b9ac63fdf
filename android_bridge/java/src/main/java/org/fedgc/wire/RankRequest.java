package org.fedgc.wire;

import java.nio.ByteBuffer;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.Map;

/**
 * A round's shared sets ranked by displacement ({@code dgc.shared_rank = displacement}): what the
 * bridge sends as the task's {@code shared_mask} in place of the sets, per tensor only how many
 * entries its set holds ({@code FGCD}; {@code dgc.signs.codec.encode_rank_request}). The phone
 * derives the sets from the model it holds and version 0 ({@link DisplacementRanking#sets}).
 *
 * <pre>
 * "FGCD" | version u8 = 1 | sequence u64 | count u32 | flags u8
 *        | (name_len u16 | name | numel u64 | k u64 [| drawn u64 with flag bit 1]) * count
 *        | crc32 u32
 * </pre>
 * Flag bit 0: version 0 is on the int8 grid ({@code initial_on_grid}); bit 1: each set's
 * {@code drawn} entries are drawn at random ({@code dgc.shared_explore}). Immutable.
 */
public final class RankRequest {
    /** The magic, ASCII "FGCD". */
    public static final byte[] MAGIC = {'F', 'G', 'C', 'D'};
    /** The version this decoder reads. */
    public static final int VERSION = 1;

    private static final int PREAMBLE_BYTES = 17;
    private static final int CRC_BYTES = 4;
    private static final int EXPLORE_BIT = 2;

    private final long sequence;
    private final Map<String, Long> counts;
    private final boolean initialOnGrid;
    private final Map<String, Long> explore;

    private RankRequest(long sequence, Map<String, Long> counts, boolean initialOnGrid,
                        Map<String, Long> explore) {
        this.sequence = sequence;
        this.counts = Collections.unmodifiableMap(counts);
        this.initialOnGrid = initialOnGrid;
        this.explore = Collections.unmodifiableMap(explore);
    }

    /** The round (unsigned 64 bits). */
    public long sequence() {
        return sequence;
    }

    /** Per tensor, in message order, how many entries its set holds (1..numel). */
    public Map<String, Long> counts() {
        return counts;
    }

    /** Whether version 0 is ranked from on the int8 grid ({@code initial_on_grid}). */
    public boolean initialOnGrid() {
        return initialOnGrid;
    }

    /** Per tensor, how many entries of its set are drawn at random; empty when none are. */
    public Map<String, Long> explore() {
        return explore;
    }

    /** Whether {@code data} starts with this kind's magic (a task's shared_mask may be either). */
    public static boolean isRankRequest(byte[] data) {
        return Frames.hasMagic(data, MAGIC);
    }

    /**
     * The request {@code data} holds, checked in the order {@code decode_rank_request} checks:
     * length, magic, version, checksum, flags, then each set (name, header, a name twice, the
     * tensor and its size against {@code numels}, the count, the draw), nothing after the last.
     *
     * @param numels the model's tensors and their entries: every set must be one of them
     * @throws DecodeException naming the bad field; {@code BAD_RANKED_SET} for a set that does
     *     not fit the model, {@code UNSUPPORTED_FLAGS} for a flag beyond bits 0 and 1
     */
    public static RankRequest decode(byte[] data, Map<String, Long> numels)
            throws DecodeException {
        ByteBuffer in = Frames.preamble(data, MAGIC, VERSION, PREAMBLE_BYTES + CRC_BYTES,
                "a rank request", "FGCD (a rank request)");
        long sequence = in.getLong(5);
        long count = in.getInt(13) & 0xFFFFFFFFL;
        int end = data.length - CRC_BYTES;
        Frames.checkCrc(in, data, end);
        int pos = PREAMBLE_BYTES;
        Frames.need(pos, 1, end, "rank request flags");
        int flags = data[pos] & 0xFF;
        pos += 1;
        if ((flags & ~(1 | EXPLORE_BIT)) != 0) {
            throw new DecodeException(DecodeException.Reason.UNSUPPORTED_FLAGS, String.format(
                    "rank request flags 0x%x: only bits 0 and 1 are defined", flags));
        }
        Map<String, Long> counts = new LinkedHashMap<>();
        Map<String, Long> explore = new LinkedHashMap<>();
        for (long t = 0; t < count; t++) {
            Frames.need(pos, 2, end, "ranked set name length");
            int nameLen = in.getShort(pos) & 0xFFFF;
            pos += 2;
            Frames.need(pos, nameLen, end, "ranked set name");
            String name = Frames.name(data, pos, nameLen, "ranked set name");
            pos += nameLen;
            Frames.need(pos, 16, end, "ranked set header of '" + name + "'");
            long numel = in.getLong(pos);
            long k = in.getLong(pos + 8);
            pos += 16;
            if (counts.containsKey(name)) {
                throw new DecodeException(DecodeException.Reason.DUPLICATE_NAME, "ranked set of '"
                        + name + "' appears twice");
            }
            Long expected = numels.get(name);
            if (expected == null || expected != numel) {
                throw new DecodeException(DecodeException.Reason.BAD_RANKED_SET, "ranked set of '"
                        + name + "' is for " + Long.toUnsignedString(numel) + " entries, expected "
                        + expected);
            }
            if (k == 0 || Long.compareUnsigned(k, numel) > 0) {
                throw new DecodeException(DecodeException.Reason.BAD_RANKED_SET, "ranked set of '"
                        + name + "' holds " + Long.toUnsignedString(k) + " of " + numel
                        + " entries; expected 1 to " + numel);
            }
            counts.put(name, k);
            if ((flags & EXPLORE_BIT) != 0) {
                Frames.need(pos, 8, end, "ranked set draw of '" + name + "'");
                long drawn = in.getLong(pos);
                pos += 8;
                if (Long.compareUnsigned(drawn, k) > 0) {
                    throw new DecodeException(DecodeException.Reason.BAD_RANKED_SET,
                            "ranked set of '" + name + "' draws " + Long.toUnsignedString(drawn)
                            + " of its " + k + " entries at random; expected at most " + k);
                }
                explore.put(name, drawn);
            }
        }
        if (pos != end) {
            throw new DecodeException(DecodeException.Reason.TRAILING, "trailing or oversized "
                    + "input: " + (end - pos) + " bytes after the last ranked set");
        }
        return new RankRequest(sequence, counts, (flags & 1) != 0, explore);
    }

    @Override
    public String toString() {
        return "RankRequest(sequence=" + Long.toUnsignedString(sequence) + ", counts=" + counts
                + ", initialOnGrid=" + initialOnGrid + ", explore=" + explore + ")";
    }
}
