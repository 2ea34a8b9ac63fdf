package org.fedgc.wire;

import java.util.Arrays;

/**
 * One tensor of a {@code signs} payload (docs/wire.md section 14): every entry is {@code +scale}
 * or {@code -scale}, one sign bit each (bit {@code j} of the packed bytes, least significant
 * first, set for {@code -scale}). Immutable.
 */
public final class SignsTensor {
    private final long[] shape;
    private final long numel;
    private final float scale;
    private final byte[] signs;

    /**
     * A tensor of {@code shape} whose entries are {@code -scale} where a bit of {@code signs} is
     * set, {@code +scale} elsewhere.
     *
     * @param signs {@code ceil(numel / 8)} bytes, padding bits after the last entry zero (copied)
     * @throws IllegalArgumentException for a negative dim, a scale that is negative, NaN or
     *     infinite, or sign bytes of the wrong length or with padding bits set
     */
    public SignsTensor(long[] shape, float scale, byte[] signs) {
        this.shape = shape.clone();
        long n = 1;
        for (long d : this.shape) {
            if (d < 0) {
                throw new IllegalArgumentException("dims must be >= 0, got " + d);
            }
            n = Math.multiplyExact(n, d);
        }
        this.numel = n;
        int bits = Float.floatToRawIntBits(scale);
        if ((bits & 0x7F800000) == 0x7F800000 || bits < 0) {
            throw new IllegalArgumentException("scale must be finite with its sign bit clear, got "
                    + scale);
        }
        this.scale = scale;
        if (signs.length != (numel + 7) / 8) {
            throw new IllegalArgumentException(numel + " entries need " + (numel + 7) / 8
                    + " sign bytes, got " + signs.length);
        }
        if (numel % 8 != 0 && (signs[signs.length - 1] & 0xFF) >>> (int) (numel % 8) != 0) {
            throw new IllegalArgumentException("padding bits after the last sign must be zero");
        }
        this.signs = signs.clone();
    }

    /** A tensor of the signs of {@code values} (bit set for a negative value, -0.0 included). */
    public static SignsTensor ofSigns(long[] shape, float scale, float[] values) {
        byte[] packed = new byte[(values.length + 7) / 8];
        for (int j = 0; j < values.length; j++) {
            if (Float.floatToRawIntBits(values[j]) < 0) {
                packed[j >>> 3] |= (byte) (1 << (j & 7));
            }
        }
        return new SignsTensor(shape, scale, packed);
    }

    /** The dims (a copy). */
    public long[] shape() {
        return shape.clone();
    }

    /** Entries of the tensor. */
    public long numel() {
        return numel;
    }

    /** The magnitude of every entry. */
    public float scale() {
        return scale;
    }

    /** The packed sign bits (a copy). */
    public byte[] signs() {
        return signs.clone();
    }

    /** Whether entry {@code j} is {@code -scale}. */
    public boolean negative(long j) {
        return (signs[(int) (j >>> 3)] & (1 << (j & 7))) != 0;
    }

    /** Entry {@code j}: the scale's bits, with the sign bit set when it is negative. */
    public float value(long j) {
        int bits = Float.floatToRawIntBits(scale);
        return Float.intBitsToFloat(negative(j) ? bits | 0x80000000 : bits);
    }

    @Override
    public boolean equals(Object o) {
        if (!(o instanceof SignsTensor)) {
            return false;
        }
        SignsTensor t = (SignsTensor) o;
        return Arrays.equals(shape, t.shape)
                && Float.floatToRawIntBits(scale) == Float.floatToRawIntBits(t.scale)
                && Arrays.equals(signs, t.signs);
    }

    @Override
    public int hashCode() {
        return 31 * (31 * Arrays.hashCode(shape) + Float.floatToRawIntBits(scale))
                + Arrays.hashCode(signs);
    }

    @Override
    public String toString() {
        return "SignsTensor(shape=" + Arrays.toString(shape) + ", scale=" + scale + ")";
    }
}
