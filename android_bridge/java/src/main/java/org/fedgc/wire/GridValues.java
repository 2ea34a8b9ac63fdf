package org.fedgc.wire;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.LinkedHashMap;
import java.util.Map;

/**
 * Values on a power-of-two grid: the rounding a phone does on the host under {@code dgc_sets}
 * ({@code dgc.signs.client.on_grid}, {@code values_on_grid}, {@code take_values}) and the
 * grid-coded value section the wire carries them in (value dtype 64-65, WIRE_FORMAT.md
 * section 5; {@code dgc.wire.value_codings.grid_section}), bit for bit as the Python side.
 *
 * <p>{@link #onGrid} rounds a tensor's values to {@code q * 2^e}: {@code 2^e} the power of two
 * nearest {@code mean(|v|) / levels} ({@code round(log2(...))}, half to even, {@code e} clipped
 * to [-126, 120]), {@code q = round(v / 2^e)} (half to even, as torch) clipped to +-127, no
 * negative zero. The mean is summed in double here and in float32 by torch: the two can differ
 * in the last bit, which changes {@code e} only when {@code log2(mean / levels)} lies within
 * about 1e-7 of half an integer. Stateless; plain Java (no Android classes).
 */
public final class GridValues {
    /** A grid step is 2^e with e in [-126, 120]: every int8 multiple is exact and finite. */
    public static final int MIN_EXPONENT = -126;
    /** The largest grid exponent. */
    public static final int MAX_EXPONENT = 120;

    private static final double SQRT2 = Math.sqrt(2.0);
    /** sqrt(2) - SQRT2: what the double SQRT2 leaves out. */
    private static final double SQRT2_LOW = -9.667293313452913e-17;
    private static final double LN2 = Math.log(2.0);
    /** Scale (f32), span (u64) and Golomb-Rice bytes (u64) before a Rice-coded grid section. */
    private static final int RICE_HEAD = 20;

    private GridValues() {
    }

    /**
     * The grid exponent {@code on_grid} uses: {@code round(log2(mean / levels))} with Python's
     * {@code round} (half to even) of C's {@code log2}, clipped to [-126, 120].
     *
     * <p>Java has no {@code log2}: the rounding is decided against sqrt(2) exactly. The mantissa
     * {@code m} of {@code r = mean / levels} in [1, 2) rounds down below sqrt(2), up above it,
     * and where {@code log2(r)} is within half an ulp of {@code n + 0.5} (a double log2 returns
     * exactly {@code n + 0.5} there, which Python rounds to the even neighbour), to the even one.
     *
     * @throws IllegalArgumentException for a mean that is not positive and finite or levels
     *     that are not
     */
    public static int exponent(double mean, double levels) {
        if (!(mean > 0 && mean < Double.POSITIVE_INFINITY)
                || !(levels > 0 && levels < Double.POSITIVE_INFINITY)) {
            throw new IllegalArgumentException("grid exponent of mean " + mean + " and levels "
                    + levels + ": both must be finite and above 0");
        }
        double r = mean / levels;
        if (r < 0x1p-300 || Double.isInfinite(r)) {  // far outside [2^-126, 2^120]
            return r < 1 ? MIN_EXPONENT : MAX_EXPONENT;
        }
        int n = Math.getExponent(r);
        double m = Math.scalb(r, -n);  // exact, in [1, 2)
        // log2(m) - 1/2 = log2(m / sqrt2) ~ (m - sqrt2) / (sqrt2 ln 2), to ~1e-32 here
        double distance = ((m - SQRT2) - SQRT2_LOW) / (SQRT2 * LN2);
        double half = n + 0.5;
        int rounded;
        if (Math.abs(distance) < Math.ulp(half) / 2) {
            rounded = (n & 1) == 0 ? n : n + 1;  // log2 gives n + 0.5: Python rounds to even
        } else {
            rounded = distance < 0 ? n : n + 1;
        }
        return Math.min(Math.max(rounded, MIN_EXPONENT), MAX_EXPONENT);
    }

    /**
     * {@code values} on the power-of-two grid whose step is nearest {@code mean(|values|) /
     * levels} (see the class comment): {@code q * step} in float32, {@code |q| <= 127}, without
     * negative zeros; all zeros when the mean is 0 (or not finite).
     *
     * @throws IllegalArgumentException for levels that are not positive and finite
     */
    public static float[] onGrid(float[] values, double levels) {
        if (!(levels > 0 && levels < Double.POSITIVE_INFINITY)) {
            throw new IllegalArgumentException("grid levels must be finite and above 0, got "
                    + levels);
        }
        float[] out = new float[values.length];
        double sum = 0;
        for (float v : values) {
            sum += Math.abs(v);
        }
        float mean = values.length == 0 ? 0f : (float) (sum / values.length);
        if (!(mean > 0 && mean < Float.POSITIVE_INFINITY)) {
            return out;
        }
        float step = Math.scalb(1.0f, exponent(mean, levels));
        for (int i = 0; i < values.length; i++) {
            // v / step is exact for a power-of-two step (up to overflow, then clipped)
            float q = (float) Math.rint(values[i] / step);
            q = Math.min(Math.max(q, -127f), 127f);
            out[i] = q * step + 0.0f;  // + 0.0f turns -0.0 into 0.0
        }
        return out;
    }

    /**
     * {@code dgc.value_levels}: the values of {@code update} (float32) on the grid per tensor
     * ({@link #onGrid}), and the rounding ({@code value - rounded}), which goes back into the
     * residual: {@code [rounded update, error]}, both float32 on the same indices.
     */
    public static SparseUpdate[] valuesOnGrid(SparseUpdate update, double levels) {
        Map<String, SparseTensor> rounded = new LinkedHashMap<>();
        Map<String, SparseTensor> error = new LinkedHashMap<>();
        for (Map.Entry<String, SparseTensor> e : update.tensors().entrySet()) {
            SparseTensor t = e.getValue();
            float[] values = t.valuesAsFloat();
            float[] grid = onGrid(values, levels);
            float[] left = new float[values.length];
            for (int i = 0; i < values.length; i++) {
                left[i] = values[i] - grid[i];
            }
            long[] indices = t.indices();
            rounded.put(e.getKey(), SparseTensor.ofFloat32(t.shape(), indices, grid));
            error.put(e.getKey(), SparseTensor.ofFloat32(t.shape(), indices, left));
        }
        return new SparseUpdate[]{new SparseUpdate(rounded, update.sequence()),
                new SparseUpdate(error, update.sequence())};
    }

    /**
     * {@code dgc.signs.client.take_values} on one tensor: the residual at {@code set} (sorted
     * flat indices) on the grid ({@link #onGrid}) is what is sent; {@code residual} keeps the
     * rounding ({@code v[set] -= sent}, in place). Returns the values sent, in set order.
     *
     * @throws IllegalArgumentException for an index outside the residual (nothing changed)
     */
    public static float[] takeValues(float[] residual, long[] set, double levels) {
        float[] at = new float[set.length];
        for (int j = 0; j < set.length; j++) {
            if (set[j] < 0 || set[j] >= residual.length) {
                throw new IllegalArgumentException("shared set index " + set[j] + " at position "
                        + j + " falls outside [0, " + residual.length + ")");
            }
            at[j] = residual[(int) set[j]];
        }
        float[] sent = onGrid(at, levels);
        for (int j = 0; j < set.length; j++) {
            residual[(int) set[j]] = at[j] - sent[j];
        }
        return sent;
    }

    /**
     * The uplink bytes of what the sets sent as grid values
     * ({@code dgc.signs.codec.encode_values}): an update message whose tensor {@code name} is
     * the flat vector of the values at that set (shape {@code [k]}, every entry: index coding
     * all), grid-coded; byte for byte Python's.
     */
    public static byte[] encodeValues(Map<String, float[]> sent, long sequence) {
        Map<String, SparseTensor> flat = new LinkedHashMap<>();
        for (Map.Entry<String, float[]> e : sent.entrySet()) {
            float[] v = e.getValue();
            long[] indices = new long[v.length];
            for (int i = 0; i < v.length; i++) {
                indices[i] = i;
            }
            flat.put(e.getKey(), SparseTensor.ofFloat32(new long[]{v.length}, indices, v));
        }
        return WireCodec.encode(new SparseUpdate(flat, sequence), IndexCoding.AUTO, true);
    }

    /** A grid-coded value section and its value dtype id (64 or 65). */
    static final class Section {
        final int dtypeId;
        final byte[] bytes;

        Section(int dtypeId, byte[] bytes) {
            this.dtypeId = dtypeId;
            this.bytes = bytes;
        }
    }

    /**
     * The grid-coded section of float32 values (raw bits), as {@code grid_section}: null unless
     * there are at least two values, all {@code q * 2^e} with int8 {@code q} and e in
     * [-126, 120] (no negative zero). The scale is the coarsest such power of two; the section
     * is a byte per value (64), or the zigzagged {@code q} as the gaps of a Golomb-Rice section
     * (65) when that is smaller.
     */
    static Section section(int[] bits) {
        int n = bits.length;
        if (n < 2) {
            return null;
        }
        float peak = 0f;
        for (int b : bits) {
            peak = Math.max(peak, Math.abs(Float.intBitsToFloat(b)));
        }
        // frexp(peak)[1] - 7: peak < 2^(exponent + 7)
        int exponent = peak > 0 ? Math.getExponent((double) peak) + 1 - 7 : 0;
        if (exponent < MIN_EXPONENT || exponent > MAX_EXPONENT || Float.isNaN(peak)
                || Float.isInfinite(peak)) {
            return null;
        }
        float scale = Math.scalb(1.0f, exponent);
        int[] q = new int[n];
        int low = 0;
        for (int i = 0; i < n; i++) {
            float v = Float.intBitsToFloat(bits[i]);
            float r = (float) Math.rint(v / scale);
            if (r > 127f || r < -128f) {
                return null;
            }
            q[i] = (int) r;
            // What a decoder computes, bit for bit (this also turns away -0.0)
            if (Float.floatToRawIntBits(q[i] * scale) != bits[i]) {
                return null;
            }
            low |= q[i] & -q[i];
        }
        if (low != 0) {  // the common trailing zero bits of the q: coarsen the scale
            int shift = Math.min(Integer.numberOfTrailingZeros(low), MAX_EXPONENT - exponent);
            if (shift > 0) {
                for (int i = 0; i < n; i++) {
                    q[i] >>= shift;
                }
                exponent += shift;
                scale = Math.scalb(1.0f, exponent);
            }
        }
        ByteBuffer plain = ByteBuffer.allocate(4 + n).order(ByteOrder.LITTLE_ENDIAN);
        plain.putFloat(scale);
        long[] zigzag = new long[n];
        long span = 0;
        for (int i = 0; i < n; i++) {
            plain.put((byte) q[i]);
            zigzag[i] = q[i] >= 0 ? 2L * q[i] : -2L * q[i] - 1;  // the gaps of the positions
            span += zigzag[i] + 1;
        }
        int b = IndexSections.bestRiceParameter(zigzag, span);
        long riceBytes = IndexSections.golombSectionBytes(zigzag, b);
        if (RICE_HEAD + riceBytes < 4 + n) {
            byte[] rice = IndexSections.golombEncode(zigzag, b);
            ByteBuffer out = ByteBuffer.allocate(RICE_HEAD + rice.length)
                    .order(ByteOrder.LITTLE_ENDIAN);
            out.putFloat(scale).putLong(span).putLong(rice.length).put(rice);
            return new Section(WireCodec.GRID_RICE_CODED, out.array());
        }
        return new Section(WireCodec.GRID_CODED, plain.array());
    }
}
