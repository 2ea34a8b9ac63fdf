package org.fedgc.wire;

/**
 * The index sections of the wire format: Golomb-Rice on gaps, bitmap and raw u32.
 *
 * <p>Bit strings are LSB first: bit {@code k} is bit {@code k % 8} of byte {@code k / 8}.
 * Decoders throw {@link DecodeException} for anything but the canonical encoding, in the order
 * the reference ({@code dgc/golomb.py}) checks, so both name the same reason.
 */
final class IndexSections {
    /** Largest Rice parameter the format allows. */
    static final int MAX_RICE_PARAMETER = 62;

    private static final double LOG_GOLDEN_CONJUGATE = Math.log((Math.sqrt(5.0) - 1.0) / 2.0);

    private IndexSections() {
    }

    // ------------------------------------------------------------------------------------------
    // Golomb-Rice
    // ------------------------------------------------------------------------------------------

    /** Gaps minus one: {@code g[0] = i[0]}, {@code g[j] = i[j] - i[j-1] - 1}. */
    static long[] gapsOf(long[] indices) {
        long[] gaps = new long[indices.length];
        long previous = -1;
        for (int j = 0; j < indices.length; j++) {
            gaps[j] = indices[j] - previous - 1;
            previous = indices[j];
        }
        return gaps;
    }

    /**
     * The starting Rice parameter for uniform indices at density q = count / numel:
     * {@code 1 + floor(log2(log(phi - 1) / log(1 - q)))}, clamped to [0, 62].
     *
     * <p>Only a starting point: {@link #bestRiceParameter} then descends on the exact (convex)
     * cost, whose smallest minimiser does not depend on where the descent starts. So a 1-ulp
     * difference between Java's and C's {@code log} cannot change the encoder's output.
     */
    static int riceParameterEstimate(long count, long numel) {
        if (count <= 0 || count >= numel) {
            return 0;
        }
        double q = (double) count / (double) numel;
        double ratio = LOG_GOLDEN_CONJUGATE / Math.log1p(-q);
        long b = 1 + (long) Math.floor(Math.log(ratio) / Math.log(2.0));
        return (int) Math.min(Math.max(b, 0), MAX_RICE_PARAMETER);
    }

    /** Exact bits of the Golomb-Rice code of {@code gaps} with parameter {@code b}. */
    static long riceCostBits(long[] gaps, int b) {
        long quotients = 0;
        for (long g : gaps) {
            quotients += g >>> b;
        }
        return (long) gaps.length * (b + 1) + quotients;
    }

    /**
     * The Rice parameter of the reference encoder: from the estimate, step down while the cost
     * does not grow, otherwise step up while it strictly shrinks. That is the smallest b in
     * [0, 62] of least cost.
     */
    static int bestRiceParameter(long[] gaps, long numel) {
        if (gaps.length == 0) {
            return 0;
        }
        int b = riceParameterEstimate(gaps.length, numel);
        long cost = riceCostBits(gaps, b);
        boolean movedDown = false;
        while (b > 0) {
            long lower = riceCostBits(gaps, b - 1);
            if (lower > cost) {
                break;
            }
            b -= 1;
            cost = lower;
            movedDown = true;
        }
        if (!movedDown) {
            while (b < MAX_RICE_PARAMETER) {
                long higher = riceCostBits(gaps, b + 1);
                if (higher >= cost) {
                    break;
                }
                b += 1;
                cost = higher;
            }
        }
        return b;
    }

    /** Bytes of a Golomb-Rice section with parameter {@code b}. */
    static long golombSectionBytes(long[] gaps, int b) {
        long unaryBits = gaps.length;
        for (long g : gaps) {
            unaryBits += g >>> b;
        }
        return 1 + ((long) gaps.length * b + 7) / 8 + (unaryBits + 7) / 8;
    }

    /** The Golomb-Rice section: {@code [b][count b-bit remainders][unary quotients]}. */
    static byte[] golombEncode(long[] gaps, int b) {
        int count = gaps.length;
        int remainderBytes = (int) (((long) count * b + 7) / 8);
        long sectionBytes = golombSectionBytes(gaps, b);
        byte[] out = new byte[Math.toIntExact(sectionBytes)];
        out[0] = (byte) b;
        long mask = b == 0 ? 0 : (-1L >>> (64 - b));
        long bit = 8; // bit offset of the remainder part inside the section
        for (long g : gaps) {
            writeBits(out, bit, g & mask, b);
            bit += b;
        }
        // The j-th unary code ends with a one at bit sum_{i<=j}(q_i + 1) - 1 of its part.
        long unaryStart = 8L * (1 + remainderBytes);
        long one = -1;
        for (long g : gaps) {
            one += (g >>> b) + 1;
            long at = unaryStart + one;
            out[(int) (at >>> 3)] |= (byte) (1 << (at & 7));
        }
        return out;
    }

    /** ORs the low {@code width} bits of {@code value} into {@code out} at bit {@code bit}. */
    private static void writeBits(byte[] out, long bit, long value, int width) {
        while (width > 0) {
            int at = (int) (bit >>> 3);
            int shift = (int) (bit & 7);
            int take = Math.min(8 - shift, width);
            out[at] |= (byte) ((value & ((1 << take) - 1)) << shift);
            value >>>= take;
            bit += take;
            width -= take;
        }
    }

    /** The {@code width}-bit LSB-first field at bit {@code bit} of {@code data}. */
    private static long readBits(byte[] data, long bit, int width) {
        long value = 0;
        int done = 0;
        while (done < width) {
            int at = (int) (bit >>> 3);
            int shift = (int) (bit & 7);
            int take = Math.min(8 - shift, width - done);
            long chunk = ((data[at] & 0xFF) >>> shift) & ((1 << take) - 1);
            value |= chunk << done;
            done += take;
            bit += take;
        }
        return value;
    }

    /** Indices from a Golomb-Rice section of {@code length} bytes at {@code start}. */
    static long[] golombDecode(byte[] data, int start, int length, int count, long numel)
            throws DecodeException {
        if (length < 1) {
            throw bad("Golomb-Rice section lacks its parameter byte");
        }
        int b = data[start] & 0xFF;
        if (b > MAX_RICE_PARAMETER) {
            throw bad("Rice parameter " + b + " above the maximum " + MAX_RICE_PARAMETER);
        }
        long remainderBytes = ((long) count * b + 7) / 8;
        if (1 + remainderBytes > length) {
            throw bad("Golomb-Rice section of " + length + " bytes is shorter than its "
                    + remainderBytes + " remainder bytes for " + count + " indices");
        }
        int unaryStart = start + 1 + (int) remainderBytes;
        int unaryBytes = length - 1 - (int) remainderBytes;
        if (count == 0) {
            if (unaryBytes != 0) {
                throw bad(unaryBytes + " unary bytes for zero indices");
            }
            return new long[0];
        }
        if (unaryBytes == 0 || count > 8L * unaryBytes) {
            throw bad(unaryBytes + " unary bytes cannot hold " + count + " codes");
        }
        if (data[unaryStart + unaryBytes - 1] == 0) {
            throw bad("unary part ends with a zero byte (not canonical)");
        }
        int ones = 0;
        for (int k = 0; k < unaryBytes; k++) {
            ones += Integer.bitCount(data[unaryStart + k] & 0xFF);
        }
        if (ones != count) {
            throw bad("unary part holds " + ones + " codes, header says " + count);
        }
        // Quotients from the positions of the ones; bounded before any shift can overflow.
        long[] gaps = new long[count];
        long maxQuotient = (numel - 1) >>> b;
        long previous = -1;
        int j = 0;
        boolean quotientTooLarge = false;
        for (int k = 0; k < unaryBytes; k++) {
            int byteValue = data[unaryStart + k] & 0xFF;
            while (byteValue != 0) {
                int low = Integer.numberOfTrailingZeros(byteValue);
                byteValue &= byteValue - 1;
                long position = 8L * k + low;
                long quotient = position - previous - 1;
                previous = position;
                if (quotient > maxQuotient) {
                    quotientTooLarge = true;
                }
                gaps[j++] = quotient;
            }
        }
        if (quotientTooLarge) {
            throw outOfRange("a gap exceeds the tensor size " + numel);
        }
        if (b > 0) {
            long remainderBits = (long) count * b;
            long paddingStart = 8L * (start + 1) + remainderBits;
            long paddingEnd = 8L * (start + 1 + remainderBytes);
            if (paddingEnd > paddingStart
                    && readBits(data, paddingStart, (int) (paddingEnd - paddingStart)) != 0) {
                throw bad("remainder part has nonzero padding bits");
            }
            long bit = 8L * (start + 1);
            for (int i = 0; i < count; i++) {
                gaps[i] = (gaps[i] << b) | readBits(data, bit, b);
                bit += b;
            }
        }
        for (long g : gaps) {
            if (g >= numel) {
                throw outOfRange("a gap exceeds the tensor size " + numel);
            }
        }
        long[] indices = gaps; // in place: every gap is read before its slot is overwritten
        long index = -1;
        for (int i = 0; i < count; i++) {
            // index < numel <= 2^62 and gap < 2^62 here, so the sum cannot overflow.
            index += gaps[i] + 1;
            if (index >= numel) {
                throw outOfRange("index " + index + " out of range for " + numel + " entries");
            }
            indices[i] = index;
        }
        return indices;
    }

    // ------------------------------------------------------------------------------------------
    // Bitmap and raw u32
    // ------------------------------------------------------------------------------------------

    /** Bytes of a bitmap section: one bit per entry. */
    static long bitmapBytes(long numel) {
        return (numel + 7) / 8;
    }

    /** The bitmap section: bit {@code i} is one exactly when {@code i} is an index. */
    static byte[] bitmapEncode(long[] indices, long numel) {
        byte[] out = new byte[Math.toIntExact(bitmapBytes(numel))];
        for (long i : indices) {
            out[(int) (i >>> 3)] |= (byte) (1 << (i & 7));
        }
        return out;
    }

    /** Indices from a bitmap section of exactly ceil(numel / 8) bytes holding count ones. */
    static long[] bitmapDecode(byte[] data, int start, int length, int count, long numel)
            throws DecodeException {
        long expected = bitmapBytes(numel);
        if (length != expected) {
            throw bad("bitmap of " + length + " bytes, expected " + expected + " for " + numel
                    + " entries");
        }
        int paddingBits = (int) (8 * expected - numel);
        if (paddingBits > 0
                && ((data[start + length - 1] & 0xFF) >>> (8 - paddingBits)) != 0) {
            throw bad("bitmap has nonzero padding bits");
        }
        int ones = 0;
        for (int k = 0; k < length; k++) {
            ones += Integer.bitCount(data[start + k] & 0xFF);
        }
        if (ones != count) {
            throw bad("bitmap holds " + ones + " indices, header says " + count);
        }
        long[] indices = new long[count];
        int j = 0;
        for (int k = 0; k < length; k++) {
            int byteValue = data[start + k] & 0xFF;
            while (byteValue != 0) {
                indices[j++] = 8L * k + Integer.numberOfTrailingZeros(byteValue);
                byteValue &= byteValue - 1;
            }
        }
        return indices;
    }

    /** The raw section: each index as a little-endian u32. */
    static byte[] rawEncode(long[] indices) {
        byte[] out = new byte[Math.multiplyExact(4, indices.length)];
        for (int j = 0; j < indices.length; j++) {
            long i = indices[j];
            out[4 * j] = (byte) i;
            out[4 * j + 1] = (byte) (i >>> 8);
            out[4 * j + 2] = (byte) (i >>> 16);
            out[4 * j + 3] = (byte) (i >>> 24);
        }
        return out;
    }

    /** Indices from a raw section; strictly increasing and below numel. */
    static long[] rawDecode(byte[] data, int start, int length, int count, long numel)
            throws DecodeException {
        if (length != 4L * count) {
            throw bad("raw section of " + length + " bytes, expected " + 4L * count + " for "
                    + count + " indices");
        }
        long[] indices = new long[count];
        for (int j = 0; j < count; j++) {
            int p = start + 4 * j;
            indices[j] = (data[p] & 0xFFL) | (data[p + 1] & 0xFFL) << 8
                    | (data[p + 2] & 0xFFL) << 16 | (data[p + 3] & 0xFFL) << 24;
        }
        for (int j = 1; j < count; j++) {
            if (indices[j] <= indices[j - 1]) {
                throw new DecodeException(DecodeException.Reason.INDEX_NOT_INCREASING,
                        "raw index " + indices[j] + " at position " + j + " does not increase on "
                        + indices[j - 1] + " (repeated or unsorted)");
            }
        }
        if (count > 0 && indices[count - 1] >= numel) {
            throw outOfRange("raw index " + indices[count - 1] + " out of range for " + numel
                    + " entries");
        }
        return indices;
    }

    private static DecodeException bad(String message) {
        return new DecodeException(DecodeException.Reason.BAD_INDEX_SECTION, message);
    }

    private static DecodeException outOfRange(String message) {
        return new DecodeException(DecodeException.Reason.INDEX_OUT_OF_RANGE, message);
    }
}
