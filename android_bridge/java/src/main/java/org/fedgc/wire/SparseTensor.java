package org.fedgc.wire;

import java.util.Arrays;

/**
 * One tensor of an update: value {@code i} belongs at row-major flat position {@code indices[i]}.
 *
 * <p>Values are kept as raw bit patterns so that nothing is lost or rounded on the way through
 * the codec: float32 as {@code int} bits ({@link Float#floatToRawIntBits}), float16 and bfloat16
 * as {@code short} bits. {@link #value(int)} and {@link #valuesAsFloat()} convert to float.
 *
 * <p>The constructor checks the structure (shape, lengths); the order and range of the indices
 * and the finiteness of the values are checked by {@link WireCodec#encode} (which refuses what a
 * decoder would refuse) and guaranteed for every tensor {@link WireCodec#decode} returns.
 * Instances are immutable: the arrays are copied in and out.
 */
public final class SparseTensor {
    /** Largest dim and numel the format allows (2^62). */
    public static final long MAX_NUMEL = 1L << 62;

    private final long[] shape;
    private final long numel;
    private final long[] indices;
    private final ValueDtype dtype;
    private final int[] bits32;   // FLOAT32 only
    private final short[] bits16; // FLOAT16 and BFLOAT16 only

    private SparseTensor(long[] shape, long[] indices, ValueDtype dtype, int[] bits32,
                         short[] bits16, boolean copy) {
        if (shape == null || indices == null || dtype == null) {
            throw new IllegalArgumentException("shape, indices and dtype must not be null");
        }
        this.numel = numelOf(shape);
        int valueCount = bits32 != null ? bits32.length : bits16.length;
        if (valueCount != indices.length) {
            throw new IllegalArgumentException(valueCount + " values for " + indices.length
                    + " indices; there must be one value per index");
        }
        this.shape = copy ? shape.clone() : shape;
        this.indices = copy ? indices.clone() : indices;
        this.dtype = dtype;
        this.bits32 = bits32 == null ? null : (copy ? bits32.clone() : bits32);
        this.bits16 = bits16 == null ? null : (copy ? bits16.clone() : bits16);
    }

    /** A float32 tensor from float values (their raw bits are kept). */
    public static SparseTensor ofFloat32(long[] shape, long[] indices, float[] values) {
        int[] bits = new int[values.length];
        for (int i = 0; i < values.length; i++) {
            bits[i] = Float.floatToRawIntBits(values[i]);
        }
        return new SparseTensor(shape, indices, ValueDtype.FLOAT32, bits, null, true);
    }

    /** A float32 tensor from raw binary32 bit patterns. */
    public static SparseTensor ofFloat32Bits(long[] shape, long[] indices, int[] bits) {
        return new SparseTensor(shape, indices, ValueDtype.FLOAT32, bits, null, true);
    }

    /** A float16 or bfloat16 tensor from raw 16-bit patterns. */
    public static SparseTensor ofBits16(long[] shape, long[] indices, ValueDtype dtype,
                                        short[] bits) {
        if (dtype == ValueDtype.FLOAT32) {
            throw new IllegalArgumentException("ofBits16 takes FLOAT16 or BFLOAT16, got FLOAT32"
                    + " (use ofFloat32Bits)");
        }
        return new SparseTensor(shape, indices, dtype, null, bits, true);
    }

    /**
     * A tensor of any dtype from float values, rounded to nearest-even for the 16-bit dtypes
     * (as torch's {@code .to(torch.float16 / torch.bfloat16)} does).
     */
    public static SparseTensor ofFloats(long[] shape, long[] indices, ValueDtype dtype,
                                        float[] values) {
        if (dtype == ValueDtype.FLOAT32) {
            return ofFloat32(shape, indices, values);
        }
        short[] bits = new short[values.length];
        for (int i = 0; i < values.length; i++) {
            bits[i] = dtype == ValueDtype.FLOAT16 ? HalfFloats.floatToFloat16(values[i])
                    : HalfFloats.floatToBfloat16(values[i]);
        }
        return new SparseTensor(shape, indices, dtype, null, bits, false);
    }

    /** Values given as unsigned raw patterns in ints (16-bit patterns in the low half). */
    public static SparseTensor ofRawBits(long[] shape, long[] indices, ValueDtype dtype,
                                         int[] bits) {
        if (dtype == ValueDtype.FLOAT32) {
            return ofFloat32Bits(shape, indices, bits);
        }
        short[] narrow = new short[bits.length];
        for (int i = 0; i < bits.length; i++) {
            if ((bits[i] & 0xFFFF0000) != 0) {
                throw new IllegalArgumentException("value " + i + " raw bits 0x"
                        + Integer.toHexString(bits[i]) + " do not fit the 16 bits of " + dtype);
            }
            narrow[i] = (short) bits[i];
        }
        return new SparseTensor(shape, indices, dtype, null, narrow, false);
    }

    /** Package-private: wraps arrays the decoder allocated, without copying. */
    static SparseTensor wrap(long[] shape, long[] indices, ValueDtype dtype, int[] bits32,
                             short[] bits16) {
        return new SparseTensor(shape, indices, dtype, bits32, bits16, false);
    }

    /**
     * The number of entries of a shape; throws when a dim is negative or above 2^62, or the
     * product is above 2^62 (a zero dim makes it 0, whatever the others are).
     */
    public static long numelOf(long[] shape) {
        if (shape.length > 255) {
            throw new IllegalArgumentException("shape has " + shape.length
                    + " dims, the format allows 255");
        }
        boolean zero = false;
        boolean over = false;
        long numel = 1;
        for (long d : shape) {
            if (d < 0 || d > MAX_NUMEL) {
                throw new IllegalArgumentException("dim " + d + " outside [0, 2^62] in shape "
                        + Arrays.toString(shape));
            }
            if (d == 0) {
                zero = true;
            } else if (!over) {
                // Exact for positive operands, and needs no Math.multiplyHigh (Android API 31+).
                over = numel > MAX_NUMEL / d;
                numel *= d;
            }
        }
        if (zero) {
            return 0;
        }
        if (over) {
            throw new IllegalArgumentException("shape " + Arrays.toString(shape)
                    + " has more than 2^62 entries, the format's limit");
        }
        return numel;
    }

    /** The dense shape (a copy). */
    public long[] shape() {
        return shape.clone();
    }

    /** Entries of the dense tensor (1 for the scalar shape {@code []}). */
    public long numel() {
        return numel;
    }

    /** Entries carried. */
    public int nnz() {
        return indices.length;
    }

    /** Whether every entry is carried. */
    public boolean isDense() {
        return indices.length == numel;
    }

    /** The flat indices (a copy). */
    public long[] indices() {
        return indices.clone();
    }

    /** The flat index of entry {@code i}. */
    public long index(int i) {
        return indices[i];
    }

    /** The dtype the values are carried in. */
    public ValueDtype dtype() {
        return dtype;
    }

    /** Raw bits of value {@code i}, zero-extended (16-bit dtypes in the low half). */
    public int rawBits(int i) {
        return bits32 != null ? bits32[i] : bits16[i] & 0xFFFF;
    }

    /** Raw binary32 patterns (a copy); only for FLOAT32. */
    public int[] float32Bits() {
        if (bits32 == null) {
            throw new IllegalStateException("tensor values are " + dtype + ", not FLOAT32");
        }
        return bits32.clone();
    }

    /** Raw 16-bit patterns (a copy); only for FLOAT16 and BFLOAT16. */
    public short[] bits16() {
        if (bits16 == null) {
            throw new IllegalStateException("tensor values are FLOAT32, not a 16-bit dtype");
        }
        return bits16.clone();
    }

    /** Value {@code i} as a float (exact: every float16 and bfloat16 value is a float). */
    public float value(int i) {
        switch (dtype) {
            case FLOAT32: return Float.intBitsToFloat(bits32[i]);
            case FLOAT16: return HalfFloats.float16ToFloat(bits16[i]);
            default: return HalfFloats.bfloat16ToFloat(bits16[i]);
        }
    }

    /** Every value as a float. */
    public float[] valuesAsFloat() {
        float[] out = new float[indices.length];
        for (int i = 0; i < out.length; i++) {
            out[i] = value(i);
        }
        return out;
    }

    /**
     * The dense tensor as a row-major float array, zeros where nothing was sent.
     *
     * @throws IllegalStateException when numel does not fit a Java array
     */
    public float[] toDense() {
        if (numel > Integer.MAX_VALUE - 8) {
            throw new IllegalStateException("tensor of " + numel
                    + " entries does not fit a Java array");
        }
        float[] out = new float[(int) numel];
        for (int i = 0; i < indices.length; i++) {
            out[(int) indices[i]] = value(i);
        }
        return out;
    }

    @Override
    public boolean equals(Object o) {
        if (!(o instanceof SparseTensor)) {
            return false;
        }
        SparseTensor t = (SparseTensor) o;
        return dtype == t.dtype && Arrays.equals(shape, t.shape) && Arrays.equals(indices, t.indices)
                && Arrays.equals(bits32, t.bits32) && Arrays.equals(bits16, t.bits16);
    }

    @Override
    public int hashCode() {
        return 31 * (31 * Arrays.hashCode(shape) + Arrays.hashCode(indices)) + dtype.hashCode();
    }

    @Override
    public String toString() {
        return "SparseTensor(shape=" + Arrays.toString(shape) + ", nnz=" + indices.length
                + ", dtype=" + dtype + ")";
    }
}
